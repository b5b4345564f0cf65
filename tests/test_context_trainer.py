"""``teacher.context`` in the trainer (SPEC 6.7): the identity context is today's run for every loss family; the
self-teacher (the student's frozen starting weights); off-policy KD written under the teacher's prompt; the pipelined
step; a cross-tokenizer teacher; the evaluation (no held-out answer in a prompt; ``eval.prompts: teacher``); and the
refusals before any model loads."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from opdistill.errors import ConfigError, DataError
from opdistill.runs.files import read_metrics
from opdistill.train import load_config, run_training
from opdistill.train.assemble import check_run
from tests.trainer_helpers import make_bpe_model_dir, tiny_config_dict


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("ctx")


def _steps(run_dir, key="distillation/loss") -> list[tuple]:
    return [(r[key], r["train/grad_norm"]) for r in read_metrics(run_dir) if key in r]


def _run(tmp: Path, name: str, base: dict, **sections) -> Path:
    c = json.loads(json.dumps(base))
    c["run_dir"] = str(tmp / name)
    for k, v in sections.items():
        c[k] = {**c.get(k, {}), **v} if isinstance(v, dict) and isinstance(c.get(k), dict) else v
    run_training(load_config(base=c), quiet=True)
    return tmp / name


FAMILIES = {
    "tail_forward": {"loss_mode": "topk", "support": "tail", "divergence": "forward", "topk": 4},
    "truncated": {"loss_mode": "topk", "support": "truncated", "divergence": "forward", "topk": 4},
    "renormalized_jsd": {"loss_mode": "topk", "support": "renormalized", "divergence": "jsd", "topk": 4},
    "union_reverse": {"loss_mode": "topk", "support": "union", "divergence": "reverse", "topk": 4},
    "sampled_k3": {"loss_mode": "sampled", "estimator": "k3"},
    "sampled_k1_pg": {"loss_mode": "sampled", "estimator": "k1", "use_policy_gradient": True},
    "full_reverse": {"loss_mode": "full", "divergence": "reverse"},
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_identity_context_is_todays_run_for_every_loss_family(tmp, family):
    """``teacher.context: {}`` (x' = x): two steps' losses and gradient norms equal the run without a context (1e-6),
    and so does the evaluation's teacher-KL."""
    base = tiny_config_dict(tmp, steps=2, checkpoint={"every": 0, "save_final": False},
                            eval={"every": 0, "num_prompts": 3, "batch_size": 4})
    base["loss"] = FAMILIES[family]
    plain = _run(tmp, f"{family}_plain", base)
    ident = _run(tmp, f"{family}_ident", base, teacher={"context": {}})
    a, b = _steps(plain), _steps(ident)
    assert len(a) == 2
    for (la, ga), (lb, gb) in zip(a, b):
        assert lb == pytest.approx(la, rel=1e-6, abs=1e-9) and gb == pytest.approx(ga, rel=1e-6, abs=1e-9)
    ea = [r["eval/teacher_kl"] for r in read_metrics(plain) if "eval/teacher_kl" in r]
    eb = [r["eval/teacher_kl"] for r in read_metrics(ident) if "eval/teacher_kl" in r]
    assert len(ea) == 2 and eb == pytest.approx(ea, rel=1e-6)


def test_the_self_teacher_is_the_frozen_starting_student(tmp):
    """``model.teacher: self`` without LoRA: a frozen copy of the student's starting weights. With the identity
    context step 1's loss is 0 (teacher = student), later steps' are not (the student moved, the teacher did not);
    with worked examples before the question the teacher differs from step 1 on."""
    base = tiny_config_dict(tmp, steps=3, checkpoint={"every": 0, "save_final": False},
                            eval={"every": 0, "num_prompts": 0, "batch_size": 4})
    base["model"]["teacher"] = "self"
    ident = _steps(_run(tmp, "self_ident", base, teacher={"context": {}}))
    assert abs(ident[0][0]) < 1e-7 and ident[1][0] > 1e-5 and ident[2][0] > 1e-5
    shots = _steps(_run(tmp, "self_shots", base, teacher={"context": {"examples": 2}}))
    assert shots[0][0] > 1e-6 > 10 * abs(ident[0][0])


def _spy_collector(monkeypatch):
    """Record the rows each training step's teacher is asked to score, and the prompts each rollout decodes from."""
    from opdistill.engines import vllm as engines
    from opdistill.train.steps import collect

    seen = {"rows": [], "decoded": []}
    ask, generate = collect.Collector.ask, engines.EngineSet.generate_rollouts

    def spy_ask(self, batch):
        seen["rows"].append(batch.rows)
        return ask(self, batch)

    def spy_generate(self, model, tok, prompts, **kw):
        seen["decoded"].append([list(p) for p in prompts])
        return generate(self, model, tok, prompts, **kw)

    monkeypatch.setattr(collect.Collector, "ask", spy_ask)
    monkeypatch.setattr(engines.EngineSet, "generate_rollouts", spy_generate)
    return seen


def test_off_policy_kd_is_written_under_the_teachers_prompt(tmp, monkeypatch):
    """train.method off_policy with a context: the teacher writes under its own prompt (the worked examples before
    the question), and the rows trained on hold the student's own prompt before what it wrote."""
    from opdistill.data import render_prompt
    from opdistill.models import load_tokenizer

    seen = _spy_collector(monkeypatch)
    base = tiny_config_dict(tmp, method="off_policy", steps=1, checkpoint={"every": 0, "save_final": False},
                            eval={"every": 0, "num_prompts": 0, "batch_size": 4})
    _run(tmp, "off_ctx", base, teacher={"context": {"examples": 2}})
    tok = load_tokenizer(base["model"]["student"])
    (rows,), (decoded,) = seen["rows"], seen["decoded"]
    for b in range(rows.num_rows):
        x = render_prompt(tok, rows.prompts[b])
        x_t = render_prompt(tok, rows.teacher_prompts[b])
        assert len(x_t) > len(x) and x_t in decoded  # the writer decoded from the teacher's prompt
        start = int(rows.response_mask[b].nonzero()[0])
        assert rows.input_ids[b, :start].tolist() == x  # the row: the student's prompt, then the response


def test_pipelined_step_with_a_context(tmp):
    """train.max_staleness 1: step 1's batch comes from the same weights as the sequential run's, and its teacher
    scored it under the same prompts: the same step-1 loss."""
    base = tiny_config_dict(tmp, steps=2, checkpoint={"every": 0, "save_final": False},
                            eval={"every": 0, "num_prompts": 0, "batch_size": 4})
    ctx = {"context": {"examples": 2, "template": "{prompt}"}}
    seq = _steps(_run(tmp, "pipe_s0", base, teacher=ctx))
    s1 = _steps(_run(tmp, "pipe_s1", base, teacher=ctx, train={"max_staleness": 1},
                     rollout={"correction": "tis", "tis_cap": 2.0}))
    assert len(s1) == 2 and s1[0][0] == pytest.approx(seq[0][0], rel=1e-6)
    plain = _steps(_run(tmp, "pipe_plain", base))
    assert plain[0][0] != pytest.approx(seq[0][0], rel=1e-3)  # the context changed what the teacher said


def test_a_cross_tokenizer_teacher_scores_under_the_context(tmp):
    """xtok.mode bpm: the cross-tokenizer teacher renders the teacher's prompt through its own chat template. With
    the student's own tokenizer on both sides it is the same-tokenizer context run (1e-6); with a BPE teacher the
    run trains and maps."""
    base = tiny_config_dict(tmp, steps=2, checkpoint={"every": 0, "save_final": False},
                            eval={"every": 0, "num_prompts": 0, "batch_size": 4})
    ctx = {"context": {"examples": 2}}
    same = _steps(_run(tmp, "xtok_ctx_plain", base, teacher=ctx))
    mapped = _steps(_run(tmp, "xtok_ctx_same", base, teacher=ctx, xtok={"mode": "bpm", "teacher_topk": 4}))
    for (la, ga), (lb, gb) in zip(same, mapped):
        assert lb == pytest.approx(la, rel=1e-6) and gb == pytest.approx(ga, rel=1e-5)
    bpe = dict(base, model={**base["model"], "teacher": make_bpe_model_dir(tmp / "teacher_bpe")})
    run = _run(tmp, "xtok_ctx_bpe", bpe, teacher=ctx, xtok={"mode": "bpm", "teacher_topk": 64})
    steps = [r for r in read_metrics(run) if "distillation/loss" in r]
    assert len(steps) == 2 and all(0 < r["xtok/exact_frac"] <= 1 for r in steps)


def _heldout_dataset(tmp: Path) -> tuple[Path, list]:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "hint": f"{a}+{b}+0={a + b}"}
            for a in range(1, 9) for b in range(1, 4)]
    path = tmp / "sums.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


def test_no_held_out_answer_enters_a_teacher_prompt(tmp, monkeypatch):
    """A dataset whose held-out file (data.eval_path) shares rows with the training file (warned), worked examples
    drawn from the training rows and the row's hint in the teacher's prompt: the shared rows are drawable training
    questions, yet no teacher prompt shows a held-out question as an example, and the evaluation has no teacher (it
    would read the held-out hints): accuracy is measured, teacher metrics are not."""
    path, rows = _heldout_dataset(tmp)
    held_path = tmp / "held.jsonl"
    held_path.write_text("".join(json.dumps(r) + "\n" for r in rows[::2]))  # half the training rows, held out too
    seen = _spy_collector(monkeypatch)
    base = tiny_config_dict(tmp, steps=2, checkpoint={"every": 0, "save_final": False},
                            eval={"every": 0, "num_prompts": 5, "batch_size": 4})
    base["data"] = {"task": "dataset", "path": str(path), "answer_field": "answer", "eval_path": str(held_path),
                    "prompts_per_step": 3}
    ctx = {"context": {"examples": 8, "template": "{prompt}{hint}", "hint_field": "hint"}}
    with pytest.warns(UserWarning, match="also appear in the training rows"):
        run = _run(tmp, "heldout_ctx", base, teacher=ctx)
    held = {r["prompt"] for r in rows[::2]}
    assert held and len(seen["rows"]) == 2
    for step_rows in seen["rows"]:
        for x in step_rows.teacher_prompts:
            examples = [m["content"] for m in x[:-1] if m["role"] == "user"]
            assert len(examples) == 8 and not held & set(examples)
    evals = [r for r in read_metrics(run) if "eval/greedy_acc" in r]
    assert len(evals) == 2 and not any(k.startswith("eval/teacher") for r in evals for k in r)


def test_eval_prompts_teacher_decodes_the_held_out_problems_under_the_context(tmp, monkeypatch):
    """``eval.prompts: teacher``: the student decodes each held-out problem from the teacher's prompt (the
    few-shot student, what a self-teacher scores from); no teacher metrics."""
    from opdistill.train.steps import evaluate

    seen = []
    original = evaluate.generate_rollouts
    monkeypatch.setattr(evaluate, "generate_rollouts", lambda m, tok, prompts, **kw: (
        seen.append([list(p) for p in prompts]), original(m, tok, prompts, **kw))[1])
    base = tiny_config_dict(tmp, steps=0, checkpoint={"every": 0, "save_final": False},
                            eval={"every": 0, "num_prompts": 3, "batch_size": 4})
    for name, prompts in (("eval_student", "student"), ("eval_teacher", "teacher")):
        run = _run(tmp, name, base, teacher={"context": {"examples": 2}}, eval={**base["eval"], "prompts": prompts})
        (ev,) = [r for r in read_metrics(run) if "eval/greedy_acc" in r]
        assert ("eval/teacher_kl" in ev) == (prompts == "student")
    student, teacher = seen[0], seen[2]  # greedy then sampled per evaluation
    assert len(student) == len(teacher) == 3 and all(len(t) > len(s) for s, t in zip(student, teacher))


@pytest.mark.parametrize("over, message", [
    ({"train": {"method": "rl"}, "rollout": {"n": 2}}, r"^teacher.context: expected null with train.method rl "),
    ({"teacher": {"context": {"hint_field": "h", "template": "{prompt}{hint}"}}},
     r"^teacher.context.hint_field: expected null with data.task carry_add "),
    ({"teacher": {"context": {"examples": 2, "examples_path": "x.jsonl"}}},
     r"^teacher.context.examples: expected 0 with teacher.context.examples_path "),
    ({"eval": {"prompts": "teacher"}, "teacher": {"context": None}}, r"^eval.prompts: expected student without teacher.context "),
    ({"eval": {"prompts": "teacher"}, "teacher": {"context": {"template": "{prompt}={answer}"}}},
     r"^eval.prompts: expected student when teacher.context.template reads \{answer\} or \{hint\} "),
    ({"teacher": {"context": {"tempalte": "{prompt}"}}}, r"^teacher.context.tempalte: unknown key "),
    ({"model": {"teacher": "self"}, "teacher": {"engine": "vllm"}},
     r"^teacher.engine: expected hf with model.teacher self "),
])
def test_config_refusals(tmp, over, message):
    base = tiny_config_dict(tmp)
    base.setdefault("teacher", {})["context"] = {"examples": 1}
    for k, v in over.items():
        base[k] = {**base.get(k, {}), **v}
    with pytest.raises(ConfigError, match=message):
        load_config(base=base)


def test_refusals_before_any_model_loads(tmp):
    """``opdistill check`` (no weight read) refuses a teacher prompt longer than the teacher's positions, a hint column
    the dataset lacks, a row whose hint is missing, and an examples file holding a held-out problem."""
    path, rows = _heldout_dataset(tmp)
    base = tiny_config_dict(tmp)
    base["teacher"] = {"context": {"examples": 40}}
    base["data"] = {"task": "carry_add", "task_args": {"min_digits": 4, "max_digits": 5}, "prompts_per_step": 2}
    with pytest.raises(ConfigError, match=r"^teacher.context: the teacher's prompt reaches \d+ tokens \(model.teacher's "
                                          r"tokenizer\), and with 12 for rollout.max_new_tokens that is more than its "
                                          r"256 positions; "):
        check_run(load_config(base=base))
    data = {"task": "dataset", "path": str(path), "answer_field": "answer", "eval_fraction": 0.25}
    hint = {"context": {"template": "{prompt}{hint}", "hint_field": "steps"}}
    with pytest.raises(ConfigError, match=r"^teacher.context.hint_field: 'steps' is not a column of "):
        check_run(load_config(base={**base, "data": data, "teacher": hint}))
    bad = tmp / "holes.jsonl"
    bad.write_text("".join(json.dumps(dict(r, hint=None) if i == 4 else r) + "\n" for i, r in enumerate(rows)))
    with pytest.raises(DataError, match=rf"^{bad}:5: 'hint' is null \(teacher.context.hint_field; every row needs it\)"):
        check_run(load_config(base={**base, "data": {**data, "path": str(bad)},
                                    "teacher": {"context": {"template": "{prompt}{hint}", "hint_field": "hint"}}}))
    from opdistill.train.assemble import build_task

    held = build_task(load_config(base={**base, "data": data, "teacher": {}})).eval_rows[0].prompt
    shots = tmp / "shots.jsonl"
    shots.write_text(json.dumps({"prompt": held, "response": "x"}) + "\n")
    with pytest.raises(DataError, match=rf"^{shots}:1: this example's prompt is a held-out problem "):
        check_run(load_config(base={**base, "data": data, "teacher": {"context": {"examples_path": str(shots)}}}))


def test_an_evaluation_without_a_teacher_leaves_the_training_teacher_open(tmp):
    """A context reading each row's answer gives the evaluation no teacher; the evaluation teacher it drops may share
    the training teacher's state (a cross-tokenizer teacher's copy in another mode; a server's client), so it is
    dropped, not closed."""
    from opdistill.models import load_model, load_tokenizer
    from opdistill.teachers import TeacherContext, build_teacher

    base = tiny_config_dict(tmp)
    base["teacher"] = {"context": {"template": "{prompt}{answer}"}}
    base["xtok"] = {"mode": "sampled"}
    base["loss"] = {"loss_mode": "sampled", "estimator": "k3"}
    cfg = load_config(base=base)
    tok = load_tokenizer(base["model"]["student"])
    teachers = build_teacher(cfg, TeacherContext(tokenizer=tok, models={"model.teacher": load_model(
        base["model"]["teacher"])}, resolve=str))
    assert teachers.eval is None and not teachers.train.inner._closed[0]
    teachers.close()
    assert teachers.train.inner._closed[0]
