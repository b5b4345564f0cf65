"""Multi-teacher routing (issue 13 item 4): ``teachers`` + ``routing`` on a ``data.task: mix`` of two tasks.

Two tiny random teachers (different seeds) on two carry_add tasks (1-digit and 2-digit operands). Expectations come
from the definitions: each step's rows are captured with the student's weights before the update, every row is scored
by ITS teacher in float64 (log-softmax of the teacher's logits, top-K), and the step's loss is SPEC 3.1's tail forward
KL aggregated once over the whole step (tests/reference.py ``distillation_reference``); the per-teacher numbers are
the same definitions restricted to the teacher's rows (its loss share = its token sum / the step's tokens).
The served teacher (a real ``opdistill serve-teacher`` on a free port) must give the in-process run's numbers bit for
bit, with the overlap of requests and the student's forward on or off.
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from opdistill.data import MixedTask, PromptSource
from opdistill.errors import ConfigError, IncompatibleModelsError
from opdistill.metrics import MetricSums
from opdistill.models import load_model, load_tokenizer
from opdistill.train import load_config, run_training
from opdistill.train import loop as loop_module
from opdistill.runs.files import read_metrics
from opdistill import TeacherScores
from opdistill import TeacherTopK
from tests.reference import distillation_reference
from tests.trainer_helpers import make_model_dir, tiny_config_dict

K = 4
TASKS = {"short": {"task": "carry_add", "min_digits": 1, "max_digits": 1},
         "long": {"task": "carry_add", "min_digits": 2, "max_digits": 2}}


def _config(tmp: Path, run: str, *, teachers=None, steps=2, prompts=3, **routing) -> dict:
    c = tiny_config_dict(tmp, steps=steps)  # writes tmp/teacher (seed 1) and tmp/student
    second = tmp / "teacher2"
    if not second.exists():
        make_model_dir(second, hidden=32, layers=2, seed=7)
    c["run_dir"] = str(tmp / run)
    c["model"]["teacher"] = None
    c["data"] = {"task": "mix", "task_args": {"tasks": TASKS}, "prompts_per_step": prompts}
    c["eval"] = dict(c["eval"], num_prompts=0)
    c["checkpoint"] = {"every": 0, "save_final": False}
    c["teachers"] = teachers or [{"name": "small", "path": str(tmp / "teacher")},
                                 {"name": "big", "path": str(second)}]
    c["routing"] = {"table": {"short": "small", "long": "big"}, **routing}
    return c


def _capture_steps(monkeypatch) -> list:
    """Every train_step call: (student weights before the update, the step's rows)."""
    seen = []
    real = loop_module.train_step

    def spy(model, optimizer, data, **kw):
        seen.append((copy.deepcopy(model.state_dict()), data.input_ids.clone(), data.attention_mask.clone(),
                     data.response_mask.clone()))
        return real(model, optimizer, data, **kw)

    monkeypatch.setattr(loop_module, "train_step", spy)
    return seen


def _row_task(tok, ids, am, rm) -> str:
    """The task of a row from its prompt text: 1-digit operands are 'short', 2-digit ones 'long'."""
    prompt = tok.decode(ids[(am.bool() & ~rm.bool())].tolist(), skip_special_tokens=True)
    first = prompt.split("+")[0].strip()
    return {1: "short", 2: "long"}[len(first)]


def _reference(tmp: Path, captured) -> list[dict]:
    """Per step: the step's loss and per-teacher numbers from the definitions (float64, each row its own teacher)."""
    tok = load_tokenizer(str(tmp / "student"))
    teachers = {"short": load_model(str(tmp / "teacher")).double(), "long": load_model(str(tmp / "teacher2")).double()}
    name_of = {"short": "small", "long": "big"}
    out = []
    for state, ids, am, rm in captured:
        student = load_model(str(tmp / "student"))
        student.load_state_dict(state)
        student.double()
        with torch.no_grad():
            z = student(input_ids=ids, attention_mask=am).logits.double()
        mask = torch.zeros_like(rm, dtype=torch.bool)
        mask[:, :-1] = rm[:, 1:].bool()  # logits at t predict token t+1
        B, S = ids.shape
        t_ids = torch.zeros(B, S, K, dtype=torch.long)
        t_lp = torch.zeros(B, S, K, dtype=torch.float64)
        tasks = [_row_task(tok, ids[b], am[b], rm[b]) for b in range(B)]
        for b, task in enumerate(tasks):
            with torch.no_grad():
                logits = teachers[task](input_ids=ids[b:b + 1], attention_mask=am[b:b + 1]).logits[0].double()
            lp, top = torch.log_softmax(logits, -1).topk(K, -1)
            t_ids[b], t_lp[b] = top, lp
        loss, m = distillation_reference(z, mask, (t_ids, t_lp), support="tail", divergence="forward", topk=K)
        n = int(mask.sum())
        row = {"distillation/loss": float(loss)}
        for task, name in name_of.items():
            sel = torch.tensor([t == task for t in tasks])[:, None] & mask
            nj = int(sel.sum())
            row[f"teacher/{name}/token_frac"] = nj / n
            if nj:
                lj, mj = distillation_reference(z, sel, (t_ids, t_lp), support="tail", divergence="forward", topk=K)
                row[f"teacher/{name}/loss"] = float(lj) * nj / n  # its share of the one aggregated loss
                for key in ("divergence", "teacher_mass", "student_mass", "overlap_ratio"):
                    row[f"teacher/{name}/{key}"] = mj[f"distillation/{key}"]
            else:
                row[f"teacher/{name}/loss"] = 0.0
        out.append(row)
    return out


def _step_rows(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "train/grad_norm" in r]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("multi")


@pytest.fixture(scope="module")
def in_process(tmp):
    """The two-teacher run, both teachers in process: its metrics rows and its captured steps."""
    mp = pytest.MonkeyPatch()
    try:
        captured = _capture_steps(mp)
        run_training(load_config(base=_config(tmp, "both_local")), quiet=True)
    finally:
        mp.undo()
    return _step_rows(tmp / "both_local"), captured


def test_two_teachers_on_two_tasks_match_the_hand_assembled_loss(tmp, in_process):
    rows, captured = in_process
    ref = _reference(tmp, captured)
    assert [r["step"] for r in rows] == [1, 2] and len(ref) == 2
    both = False
    for got, want in zip(rows, ref):
        for key, value in want.items():
            # the trainer in fp32, the definition in float64: fp32 log-probs (|log p| up to ~5, rounding ~1e-7
            # relative) cancel in a KL of ~1e-3, so a loss carries ~1e-8 absolute (seen: 2.3e-8 on 2.3e-3)
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (got["step"], key)
        fracs = [got[f"teacher/{n}/token_frac"] for n in ("small", "big")]
        assert sum(fracs) == pytest.approx(1.0, abs=1e-12)
        # the shares add up to the step's loss (the same float64 sums, regrouped)
        assert got["teacher/small/loss"] + got["teacher/big/loss"] == pytest.approx(got["distillation/loss"],
                                                                                     rel=1e-12)
        both |= min(fracs) > 0
    assert both, "no step routed rows to both teachers: the test would not test the reassembly"


def test_a_teacher_without_rows_in_a_step_reports_zeros(tmp):
    """One prompt per step: every step has one teacher's rows only; the other one's metrics are there, 0, finite."""
    c = _config(tmp, "one_prompt", steps=3, prompts=1)
    run_training(load_config(base=c), quiet=True)
    rows = _step_rows(tmp / "one_prompt")
    names = [sorted(k for k in r if k.startswith("teacher/")) for r in rows]
    assert all(n == names[0] for n in names)  # the same names every step
    absent_seen = set()
    for r in rows:
        for name in ("small", "big"):
            if r[f"teacher/{name}/token_frac"] == 0.0:
                absent_seen.add(name)
                own = {k: v for k, v in r.items() if k.startswith(f"teacher/{name}/")}
                assert len(own) >= 10 and all(v == 0.0 for v in own.values()), own
            else:
                assert r[f"teacher/{name}/token_frac"] == 1.0
                assert r[f"teacher/{name}/loss"] == pytest.approx(r["distillation/loss"], rel=1e-12)
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
    assert absent_seen, "every step had both teachers"


def test_one_teacher_served_over_http_gives_the_in_process_numbers(tmp, in_process, monkeypatch):
    """teacher 'big' from a real server, 'small' in process; overlap on and off: bit for bit the in-process run.
    With overlap on, the request is still on its way when the step starts (``StepData.scores`` is a Future); off,
    it is not."""
    from concurrent.futures import Future

    from opdistill.teachers import TeacherServiceError
    from tests.server_helpers import free_port
    from tests.test_teacher_service import start_server, stop

    local_rows, _ = in_process
    pending = []
    real = loop_module.train_step
    monkeypatch.setattr(loop_module, "train_step", lambda m, o, data, **kw: (
        pending.append(isinstance(data.scores, Future)), real(m, o, data, **kw))[1])
    port = free_port()
    proc = start_server(str(tmp / "teacher2"), port)
    try:
        url = f"http://127.0.0.1:{port}"
        for overlap in (True, False):
            teachers = [{"name": "small", "path": str(tmp / "teacher")},
                        {"name": "big", "url": url, "overlap": overlap}]
            run = f"served_overlap_{overlap}"
            pending.clear()
            run_training(load_config(base=_config(tmp, run, teachers=teachers)), quiet=True)
            assert pending == [overlap, overlap]
            got = _step_rows(tmp / run)
            keys = [k for k in local_rows[0] if k.startswith(("distillation/", "teacher/", "train/grad_norm"))]
            assert [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in local_rows]
        # a served teacher is checked against the student like teacher.url is, the message naming its key (the
        # in-process member shares the student's tokenizer: an incompatible one is refused before anything loads)
        other = make_model_dir(tmp / "student_other_vocab", hidden=16, layers=1, seed=2, chars="0123456789+=,>ab")
        c = _config(tmp, "served_incompatible", teachers=[{"name": "big", "url": url},
                                                          {"name": "small", "path": other}])
        c["model"] = dict(c["model"], student=other)
        with pytest.raises(TeacherServiceError) as e:
            run_training(load_config(base=c), quiet=True)
        assert str(e.value).startswith(f"teachers.0.url={url}: the server's teacher cannot be distilled into this "
                                       f"student: ")
        # the single-teacher path (teacher.url) with overlap off and on: the in-process teacher's numbers
        single = tiny_config_dict(tmp, steps=2)
        single.update(run_dir=str(tmp / "single_local"), eval={**single["eval"], "num_prompts": 0},
                      checkpoint={"every": 0, "save_final": False})
        single["model"] = dict(single["model"], teacher=str(tmp / "teacher2"))
        run_training(load_config(base=single), quiet=True)
        want = [(r["distillation/loss"], r["train/grad_norm"]) for r in _step_rows(tmp / "single_local")]
        for overlap in (False, True):
            c = dict(single, run_dir=str(tmp / f"single_url_{overlap}"), teacher={"url": url, "overlap": overlap})
            pending.clear()
            run_training(load_config(base=c), quiet=True)
            assert pending == [overlap, overlap]
            assert [(r["distillation/loss"], r["train/grad_norm"]) for r in _step_rows(c["run_dir"])] == want
    finally:
        stop(proc)


def test_a_routed_run_resumes_with_the_uninterrupted_numbers(tmp, in_process):
    """Cut after step 1 (its checkpoint), resumed: step 2 and its per-teacher metrics equal the uninterrupted run's."""
    import shutil

    local_rows, _ = in_process
    c = _config(tmp, "resume_full")
    c["checkpoint"] = {"every": 1, "keep_last": 2}
    run_training(load_config(base=c), quiet=True)
    cut = tmp / "resume_cut"
    shutil.copytree(tmp / "resume_full", cut)
    newest = max((cut / "checkpoints").iterdir())
    assert newest.name.endswith("2")
    shutil.rmtree(newest)
    run_training(load_config(base=dict(c, run_dir=str(cut))), resume=True, quiet=True)
    got = _step_rows(cut)
    keys = [k for k in local_rows[1] if k.startswith(("distillation/", "teacher/", "train/grad_norm"))]
    assert [r["step"] for r in got] == [1, 2]
    assert {k: got[1][k] for k in keys} == {k: local_rows[1][k] for k in keys}


def test_a_named_teachers_client_keys_may_change_on_resume(tmp_path):
    """teachers.N.url (a moved server) and the other client keys may change on --resume, as teacher.url's may; the
    teachers themselves (name, path, how many) may not."""
    from opdistill.train.disk.rundir import RunError, check_checkpoint_config

    old = {"train": {"steps": 2}, "teachers": [{"name": "a", "path": "ta", "url": None},
                                               {"name": "b", "path": None, "url": "http://h:1", "overlap": True}]}
    (tmp_path / "trainer_state.json").write_text(json.dumps({"config": old}))
    new = copy.deepcopy(old)
    new["teachers"][1].update(url="http://h2:2", overlap=False, timeout_s=9.0)
    check_checkpoint_config(tmp_path, new)  # allowed: nothing raised
    for change in (lambda c: c["teachers"][0].update(path="tb"), lambda c: c["teachers"].pop(),
                   lambda c: c["teachers"][1].update(name="c", url="http://h2:2")):
        bad = copy.deepcopy(old)
        change(bad)
        with pytest.raises(RunError) as e:
            check_checkpoint_config(tmp_path, bad)
        assert str(e.value) == (
            f"--resume: checkpoint {tmp_path} was written with another config than this run's: teachers "
            f"{old['teachers']!r} -> {bad['teachers']!r} (the checkpoint was copied from another run, or "
            f"config.yaml was edited by hand); resume with the config it was written with, or start another run_dir")


def test_a_dataset_column_routes_rows(tmp):
    rows = [{"prompt": f"{a}+{b}=", "src": "short" if a < 5 else "long"} for a in range(10) for b in range(3)]
    path = tmp / "mix.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = _config(tmp, "dataset_routed", field="src")
    c["data"] = {"task": "dataset", "path": str(path), "prompts_per_step": 4}
    run_training(load_config(base=c), quiet=True)
    got = _step_rows(tmp / "dataset_routed")
    assert len(got) == 2 and all(r["teacher/small/token_frac"] + r["teacher/big/token_frac"] == pytest.approx(1.0)
                                 for r in got)
    # a value the table does not route, no default: refused at start, naming the value
    c = _config(tmp, "dataset_unrouted", field="src")
    c["data"] = {"task": "dataset", "path": str(path), "prompts_per_step": 4}
    c["routing"]["table"] = {"short": "small", "nothing": "big"}
    with pytest.raises(ConfigError) as e:
        run_training(load_config(base=c), quiet=True)
    assert str(e.value).startswith(f"routing.table.nothing: no row of {path} has src 'nothing' (values: ")
    c["routing"]["table"] = {"short": "small"}
    c["routing"]["default"] = None
    c["teachers"] = c["teachers"][:1]
    with pytest.raises(ConfigError) as e:
        run_training(load_config(base=c), quiet=True)
    assert str(e.value) == (f"routing.table: src 'long' of {path} has no teacher (1 value(s) unrouted); add it to "
                            f"routing.table or set routing.default")
    c["routing"]["field"] = "source"
    with pytest.raises(ConfigError) as e:
        run_training(load_config(base=c), quiet=True)
    assert str(e.value) == f"routing.field: 'source' is not a column of {path} (columns: ['prompt', 'src'])"


def _bad(base: dict, edit) -> str:
    c = copy.deepcopy(base)
    edit(c)
    with pytest.raises(ConfigError) as e:
        load_config(base=c)
    return str(e.value)


def test_bad_multi_teacher_configs_are_refused_with_one_line():
    base = {"model": {"student": "s"}, "loss": {"topk": 4},
            "data": {"task": "mix", "task_args": {"tasks": TASKS}},
            "teachers": [{"name": "a", "path": "ta"}, {"name": "b", "url": "http://127.0.0.1:9"}],
            "routing": {"table": {"short": "a", "long": "b"}}}
    cfg = load_config(base=base)
    assert [t.name for t in cfg.teachers] == ["a", "b"] and cfg.routing.table == {"short": "a", "long": "b"}
    assert _bad(base, lambda c: c["routing"]["table"].update(long="c")) == \
        "routing.table.long: unknown teacher 'c' (teachers: ['a', 'b'])"
    assert _bad(base, lambda c: c["routing"]["table"].update(long=None)) == \
        "routing.table.long: expected a teacher name (one of ['a', 'b']), got None"
    assert _bad(base, lambda c: c["routing"]["table"].update(long="a")) == \
        "teachers: teacher 'b' gets no prompts (neither routing.table nor routing.default names it); route to it " \
        "or remove it"
    assert _bad(base, lambda c: c["routing"]["table"].update(medium="a")) == \
        "routing.table.medium: no prompt has task 'medium' (the tasks of data.task 'mix': ['short', 'long'])"
    assert _bad(base, lambda c: c["routing"]["table"].pop("long") and c["teachers"].pop()) == \
        "routing.table: task 'long' has no teacher; add it to routing.table or set routing.default"
    assert _bad(base, lambda c: c["routing"].update(table={}, default=None)) == \
        "routing.table: expected at least one value: teacher entry (or routing.default), got nothing: no prompt " \
        "would have a teacher"
    assert _bad(base, lambda c: c["routing"].update(default="z")) == \
        "routing.default: unknown teacher 'z' (teachers: ['a', 'b'])"
    assert _bad(base, lambda c: c["teachers"].append({"name": "a", "path": "tc"})) == \
        "teachers.2.name: duplicate teacher name 'a' (names must be unique)"
    assert _bad(base, lambda c: c["teachers"][0].update(url="http://h:1")) == \
        "teachers.0: expected exactly one of path (a model folder, scored in process) or url (a teacher server) " \
        "for teacher 'a', got both"
    assert _bad(base, lambda c: c["teachers"][0].update(name="a/b")) == \
        "teachers.0.name: expected letters, digits, '_', '-' or '.' (it names the metrics teacher/<name>/...), " \
        "got 'a/b'"
    assert _bad(base, lambda c: c["teachers"][1].update(urll="x")).startswith(
        "teachers.1.urll: unknown key (known keys of teachers.1: ['engine', 'url', ")
    assert _bad(base, lambda c: c["teachers"][1].update(timeout_s=0)) == \
        "teachers.1.timeout_s: expected a number > 0, got 0"
    assert _bad(base, lambda c: c["model"].update(teacher="t")) == \
        "model.teacher: expected null when teachers is set (each of teachers has its own path or url), got 't'"
    assert _bad(base, lambda c: c.update(teacher={"url": "http://h:1"})) == \
        "teacher.url: expected null when teachers is set (each of teachers has its own path or url), got 'http://h:1'"
    assert _bad(base, lambda c: c.update(routing=None)) == \
        "routing: expected a routing section with teachers (routing.table: {value: teacher name}, routing.field, " \
        "routing.default), got null (teachers: ['a', 'b'])"
    assert _bad(base, lambda c: (c.pop("teachers"), c["model"].update(teacher="t"))) == \
        "routing: expected null without teachers (routing picks one of the named teachers), got " \
        "{'field': 'task', 'table': {'short': 'a', 'long': 'b'}, 'default': None}"
    assert _bad(base, lambda c: c.update(train={"method": "off_policy"})) == \
        "teachers: set only with train.method on_policy (off_policy samples are written by one teacher; rl has no " \
        "teacher), got train.method 'off_policy'"
    assert _bad(base, lambda c: c.update(train={"device": "cuda"})) == \
        "train.device: expected cpu when teachers is set (named in-process teachers are not placed on a GPU in this " \
        "version), got 'cuda'"
    assert _bad(base, lambda c: c["routing"].update(field="src")) == \
        "routing.field: expected 'task' with data.task 'mix' (a column name needs data.task dataset), got 'src'"


def test_an_incompatible_named_teacher_is_refused_naming_it(tmp):
    other = make_model_dir(tmp / "other_vocab", hidden=32, layers=1, seed=3, chars="0123456789+=,>ab")
    c = _config(tmp, "incompatible")
    c["teachers"][1]["path"] = other
    with pytest.raises(IncompatibleModelsError) as e:
        run_training(load_config(base=c), quiet=True)
    assert str(e.value).startswith("teachers.1.path: student and teacher are not compatible for distillation: ")


def test_a_named_teacher_with_nan_weights_is_refused_naming_it(tmp):
    from safetensors.torch import load_file, save_file

    from opdistill.errors import ModelError

    bad = Path(make_model_dir(tmp / "nan_teacher", hidden=32, layers=1, seed=4))
    w = load_file(str(bad / "model.safetensors"))
    w["model.norm.weight"][0] = float("nan")
    save_file(w, str(bad / "model.safetensors"), metadata={"format": "pt"})
    c = _config(tmp, "nan_teacher")
    c["teachers"][1]["path"] = str(bad)
    with pytest.raises(ModelError) as e:
        run_training(load_config(base=c), quiet=True)
    assert str(e.value) == (f"teachers.1.path: weight model.norm.weight of '{bad}' holds NaN/inf (a corrupt or "
                            f"diverged model folder); use an intact model folder")


def test_mixed_task_draws_tags_and_scores_by_its_own_task():
    task = MixedTask(TASKS, {"short": 1, "long": 3})
    a = PromptSource(task, 5).batch(2, 200)
    assert a == PromptSource(task, 5).batch(2, 200)  # a pure function of (seed, step)
    short = [p for p in a if p.task == "short"]
    assert {p.task for p in a} == {"short", "long"} and 20 < len(short) < 80  # weights 1 : 3 of 200
    assert all(len(p.prompt.split("+")[0]) == (1 if p.task == "short" else 2) for p in a)
    p = a[0]
    assert task.score(p, p.solution) == 1.0 and task.score(p, "0>1") == 0.0
    held = task.held_out(6, 0)
    assert [h.task for h in held] == ["short", "long"] * 3
    with pytest.raises(ConfigError) as e:
        MixedTask({"x": {"task": "carry_add", "digits": 3}})
    assert str(e.value) == ("data.task_args.tasks.x: carry_add takes ['min_digits', 'max_digits'], got unknown "
                            "['digits']")


def test_routed_micro_batches_and_reassembly():
    """One teacher per micro-batch within the token budget; scores put back in the step's row order."""
    from opdistill.train.steps.step import group_split, token_budget_split

    row_teacher = torch.tensor([1, 0, 1, 1, 0, 1])
    groups = [torch.nonzero(row_teacher == j).flatten() for j in (0, 1)]
    micro = group_split([5, 6, 5, 9, 4, 3], 12, groups, token_budget_split)
    assert micro == [[1, 4], [0, 2], [3], [5]]  # teacher 0: 2 x 6 <= 12; teacher 1: 2 x 5, then 9 alone, 3 alone
    assert sorted(r for g in micro for r in g) == list(range(6))
    ids = torch.arange(6 * 2 * 3).reshape(6, 2, 3)
    lp = -torch.rand(6, 2, 3)
    parts = []
    for j in (0, 1):
        rows = torch.nonzero(row_teacher == j).flatten()
        parts.append((rows, TeacherScores(TeacherTopK(ids[rows], lp[rows], validated=True), lp[rows, :, 0])))
    got = TeacherScores.join([s for _, s in parts], torch.cat([rows for rows, _ in parts]))
    assert torch.equal(got.topk.ids, ids) and torch.equal(got.topk.logprobs, lp) and got.topk.validated
    assert torch.equal(got.sampled_logprobs, lp[:, :, 0])


def test_overlapped_scores_follow_the_rows_to_their_device():
    """train.device cuda: train_step moves the rows (data_to) while a request is still on its way (data.scores is a
    Future); the scores that arrive later land on the rows' device. The meta device stands in for CUDA here."""
    from concurrent.futures import Future

    from opdistill.train.run.placement import data_to
    from opdistill.train.steps.step import StepData

    ids = torch.tensor([[1, 2, 3]])
    scores = TeacherScores(TeacherTopK(torch.zeros(1, 3, 2, dtype=torch.long), torch.full((1, 3, 2), -1.0),
                                       validated=True), torch.full((1, 3), -0.5))
    for sampled in (False, True):
        fut: Future = Future()
        data = StepData(ids, torch.ones_like(ids), torch.tensor([[0, 1, 1]]), scores=fut,
                        groups={"teacher/a/": torch.tensor([0])})
        moved = data_to(data, torch.device("meta"))
        assert moved.scores is data.scores and moved.groups["teacher/a/"].device.type == "meta"
        fut.set_result(scores if not sampled else TeacherScores(None, scores.sampled_logprobs))
        got_scores = moved.teacher_scores()
        assert not isinstance(moved.scores, Future)
        got = [got_scores.sampled_logprobs] if sampled else [got_scores.topk.ids, got_scores.topk.logprobs]
        assert [t.device.type for t in got] == ["meta"] * len(got)
        assert sampled or got_scores.topk.validated


def test_metric_sums_renamed_copies_exactly():
    s = MetricSums()
    s.add_mean("distillation/x", torch.tensor([1.0, 2.0, 4.0]))
    s.add_extrema("distillation/x", torch.tensor([1.0, 2.0, 4.0]))
    s.add_sum("distillation/loss", 0.25)
    s.add_mean("other/y", torch.tensor([9.0]))
    r = s.renamed("distillation/", "teacher/a/").reduce()
    assert r == {"teacher/a/x": 7 / 3, "teacher/a/x_min": 1.0, "teacher/a/x_max": 4.0, "teacher/a/loss": 0.25}
    e = s.renamed("distillation/", "teacher/b/", empty=True).reduce()
    assert e == {"teacher/b/x": 0.0, "teacher/b/x_min": 0.0, "teacher/b/x_max": 0.0, "teacher/b/loss": 0.0}
