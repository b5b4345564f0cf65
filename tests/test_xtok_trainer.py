"""Cross-tokenizer teachers in the trainer (SPEC 6.6): with the same tokenizer the run's losses are the
same-tokenizer run's; routed teachers of two tokenizers in one run; the evaluation; masked positions leave the step
and are counted."""
import json
import math
from pathlib import Path

import pytest
import torch

from opdistill.runs.files import read_metrics
from opdistill.train import load_config, run_training
from tests.trainer_helpers import make_bpe_model_dir, tiny_config_dict


def _bpe_teacher(path: Path) -> str:
    return make_bpe_model_dir(path)


def _steps(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "distillation/loss" in r]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("xtok")


def test_same_tokenizer_through_the_mapping_gives_the_same_run(tmp):
    """xtok.mode bpm with a teacher of the student's own tokenizer (teacher_topk = the loss's K): the mapping is the
    identity and the run's per-step losses and gradient norms are the plain run's."""
    base = tiny_config_dict(tmp, steps=3, checkpoint={"every": 0, "save_final": False})
    runs = {}
    for name, extra in (("plain", {}), ("mapped", {"xtok": {"mode": "bpm", "teacher_topk": 4}})):
        c = json.loads(json.dumps(base))
        c["run_dir"] = str(tmp / name)
        c.update(extra)
        run_training(load_config(base=c), quiet=True)
        runs[name] = _steps(tmp / name)
    for a, b in zip(runs["plain"], runs["mapped"]):
        assert b["distillation/loss"] == pytest.approx(a["distillation/loss"], rel=1e-6)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)
        assert b["xtok/exact_frac"] == 1.0 and b["xtok/masked_frac"] == 0.0
        # the residual (the teacher's mass outside its top-K_T and its own token) is part of the loss's rest bucket
        assert 0 < b["xtok/residual_mass"] <= 1 - a["distillation/teacher_mass"] + 1e-6
    assert len(runs["plain"]) == 3


def test_routed_teachers_with_two_tokenizers_in_one_run(tmp):
    """Two routed teachers, one with the student's character tokenizer and one with a byte-level BPE: both map, the
    run trains, and the step metrics carry the cross-tokenizer counts and each teacher's group."""
    c = tiny_config_dict(tmp, steps=2, checkpoint={"every": 0, "save_final": False})
    c["run_dir"] = str(tmp / "routed")
    c["model"]["teacher"] = None
    c["data"] = {"task": "mix", "prompts_per_step": 4, "task_args": {"tasks": {
        "short": {"task": "carry_add", "min_digits": 1, "max_digits": 1},
        "long": {"task": "carry_add", "min_digits": 2, "max_digits": 2}}}}
    c["teachers"] = [{"name": "chars", "path": str(tmp / "teacher")},
                     {"name": "bpe", "path": _bpe_teacher(tmp / "teacher_bpe")}]
    c["routing"] = {"table": {"short": "chars", "long": "bpe"}}
    c["xtok"] = {"mode": "bpm", "teacher_topk": 290}
    c["eval"] = dict(c["eval"], num_prompts=0)
    run_training(load_config(base=c), quiet=True)
    steps = _steps(tmp / "routed")
    assert len(steps) == 2
    for s in steps:
        assert 0 < s["xtok/exact_frac"] <= 1 and s["xtok/masked_frac"] == 0.0
        assert torch.isfinite(torch.tensor(s["distillation/loss"]))
        assert s["teacher/chars/loss"] >= 0 and s["teacher/bpe/loss"] >= 0 and s["teacher/bpe/token_frac"] > 0


def test_a_bpe_teacher_is_refused_without_xtok_and_evaluated_with_it(tmp):
    from opdistill.errors import IncompatibleModelsError

    c = tiny_config_dict(tmp, steps=1, checkpoint={"every": 0, "save_final": False})
    c["run_dir"] = str(tmp / "bpe_off")
    c["model"]["teacher"] = _bpe_teacher(tmp / "teacher_bpe")
    with pytest.raises(IncompatibleModelsError, match=r"xtok.mode bpm, docs/cross_tokenizer.md\)$"):
        run_training(load_config(base=c), quiet=True)
    c["run_dir"] = str(tmp / "bpe_sampled")
    c["xtok"] = {"mode": "sampled"}
    c["loss"] = {"loss_mode": "sampled"}
    c["eval"] = dict(c["eval"], every=1, num_prompts=4)
    run_training(load_config(base=c), quiet=True)
    rows = read_metrics(c["run_dir"])
    step = [r for r in rows if "distillation/loss" in r][0]
    # the fallback: only positions where both tokenizations have a boundary at the token's start and end
    assert step["xtok/masked_frac"] == pytest.approx(1 - step["xtok/exact_frac"])
    assert 0 < step["xtok/masked_frac"] < 1
    assert step["train/response_tokens"] < step["train/generated_tokens"]  # the masked ones left the step
    evals = [r for r in rows if "eval/teacher_kl" in r]
    assert evals and all(torch.isfinite(torch.tensor(r["eval/teacher_kl"])) for r in evals)


def test_a_served_teacher_with_another_tokenizer_gives_the_in_process_numbers(tmp):
    """teacher.url with xtok.mode bpm: the client fetches the server's tokenizer (GET /v1/tokenizer), tokenizes each
    response the teacher's way, and maps the answer: the in-process cross-tokenizer run's numbers, bit for bit. A
    server whose max K is below xtok.teacher_topk is refused naming the key."""
    from opdistill.teachers import TeacherServiceError
    from tests.server_helpers import free_port
    from tests.test_teacher_service import start_server, stop

    bpe = _bpe_teacher(tmp / "teacher_bpe")
    c = tiny_config_dict(tmp, steps=2, checkpoint={"every": 0, "save_final": False})
    c["model"]["teacher"] = bpe
    c["xtok"] = {"mode": "bpm", "teacher_topk": 64}
    c["eval"] = dict(c["eval"], every=2, num_prompts=3)
    c["run_dir"] = str(tmp / "xtok_local")
    run_training(load_config(base=c), quiet=True)
    want = read_metrics(tmp / "xtok_local")
    port = free_port()
    proc = start_server(bpe, port)
    try:
        url = f"http://127.0.0.1:{port}"
        served = dict(c, run_dir=str(tmp / "xtok_served"), teacher={"url": url, "overlap": True})
        run_training(load_config(base=served), quiet=True)
        got = read_metrics(tmp / "xtok_served")
        keys = [k for k in want[1] if k.startswith(("distillation/", "xtok/", "train/grad_norm", "eval/teacher"))]
        assert keys and [{k: r.get(k) for k in keys} for r in got] == [{k: r.get(k) for k in keys} for r in want]
        too_many = dict(served, run_dir=str(tmp / "xtok_served_k"), xtok={"mode": "bpm", "teacher_topk": 200})
        with pytest.raises(TeacherServiceError, match=r"^teacher.url: xtok.teacher_topk=200 is above the server's "
                                                      r"max K 64; lower xtok.teacher_topk"):
            run_training(load_config(base=too_many), quiet=True)
    finally:
        stop(proc)


def test_pipelined_step_with_a_cross_tokenizer_teacher(tmp):
    """train.max_staleness 1 (the rows and scores made ahead in a background thread): the mask and the counts come
    with each step's batch, as in the plain step (the fallback's masked tokens leave the step there too)."""
    c = tiny_config_dict(tmp, steps=3, checkpoint={"every": 0, "save_final": False})
    c["run_dir"] = str(tmp / "xtok_s1")
    c["model"]["teacher"] = _bpe_teacher(tmp / "teacher_bpe")
    c["xtok"] = {"mode": "sampled"}
    c["loss"] = {"loss_mode": "sampled"}
    c["train"] = dict(c["train"], max_staleness=1)
    c["rollout"] = dict(c["rollout"], correction="tis", tis_cap=2.0)
    c["eval"] = dict(c["eval"], num_prompts=0)
    run_training(load_config(base=c), quiet=True)
    steps = _steps(tmp / "xtok_s1")
    assert [s["train/staleness"] for s in steps] == [0.0, 1.0, 1.0]
    for s in steps:
        assert 0 < s["xtok/masked_frac"] < 1 and s["xtok/masked_frac"] == pytest.approx(1 - s["xtok/exact_frac"])
        assert s["train/response_tokens"] < s["train/generated_tokens"]



def test_the_evaluation_leaves_out_tokens_the_mapped_teacher_gives_no_probability(tmp):
    """A cross-tokenizer teacher's mapped probability of the student's sampled token can be 0 (its top-K_T writes
    the prefix, none of it the token's bytes: Gemma-3-270M's top-64 teaching SmolLM2 in issue 33, on 83 of 150
    problems). The evaluation's teacher-KL leaves those tokens out, as the sampled-token training signal does (SPEC
    6.6): it was +inf, logged as null, and the per-problem file could not be read back by compare. Expected: the
    evaluation of the same scores with those positions masked by the teacher."""
    import dataclasses

    from opdistill.data import PromptSource
    from opdistill.runs.values import values_from_json, values_to_json
    from opdistill.teachers import LocalTeacher
    from opdistill.train.loop import build_task, load_models
    from opdistill.train.steps.evaluate import evaluate_values

    cfg = load_config(base=tiny_config_dict(tmp))
    tok, student, teacher = load_models(cfg)
    task = build_task(cfg)
    problems = PromptSource(task, 0, 0).held_out(3)

    class Unmapped(LocalTeacher):  # every third scored position: probability 0, or no signal at all
        def __init__(self, model, zero_as_mask):
            super().__init__(model)
            self.zero_as_mask = zero_as_mask

        def score(self, rows, request):
            out = super().score(rows, request)
            zero = torch.zeros_like(out.sampled_logprobs, dtype=torch.bool)
            zero.view(-1)[::3] = True
            if self.zero_as_mask:
                return dataclasses.replace(out, mask=~zero)
            return dataclasses.replace(out, mask=torch.ones_like(zero),
                                       sampled_logprobs=out.sampled_logprobs.masked_fill(zero, float("-inf")))

    kw = dict(max_new_tokens=12, topk=4, batch_size=2, seed=5, num_samples=2)
    got = evaluate_values(student, tok, task, problems, teacher=Unmapped(teacher, False), **kw)
    want = evaluate_values(student, tok, task, problems, teacher=Unmapped(teacher, True), **kw)
    assert values_to_json(got) == values_to_json(want)
    assert all(math.isfinite(x) for x in values_to_json(got)["k1_sum"])
    values_from_json(values_to_json(got))  # compare reads it back
