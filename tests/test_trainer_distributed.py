"""``opdistill train`` on torch.distributed (gloo, 2 processes) against the one-process run of the same config.

One ``mp.spawn`` launch (tests/distributed_trainer.py) runs every world-2 trainer case in order: on_policy (FSDP2,
4 steps, a checkpoint each step), its resume at world 2 from the step-2 checkpoint, the sharded teacher's scores
against the replicated teacher's, on_policy with ``model.teacher_sharded`` (2 steps), off_policy (DDP) and rl
(FSDP2), two routed teachers, then the same 2 processes as a 1 x 2 (dp x tp) mesh with ``distributed.tp_size=2``
(vocab-parallel lm_head: on_policy, rl, the sampled-token loss on an odd vocabulary, and on_policy in fp64 with
its checkpoints, and the two routed teachers). One more launch runs a 2 x 2 mesh on 4 processes (also with the
teacher sharded over the dp groups). The world-1 runs happen in this process.
Then one ``torchrun -m opdistill train`` launch covers the real entry point
on the demo config, and one more a rank that raises (the job must stop promptly with that rank's error).

Expectations: the same sampled tokens (keyed sampling, rows of a prompt on one rank), per-step
``distillation/loss`` (``policy/loss`` for rl) and ``train/grad_norm`` equal to 1e-5 relative (fp32), exactly one
metrics line per step, evaluation numbers equal to world 1's (accuracies exactly, log-prob sums to 1e-4 relative:
the sampler's fp32 log-probs differ in the last bits with the batch shape), and a checkpoint saved at world 2 that
resumes at world 1 and at world 2 with the uninterrupted run's losses (and a world-1 checkpoint at world 2).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from opdistill.data import CARRY_ADD_CHARS
from opdistill.errors import ConfigError
from opdistill.train import loop
from opdistill.train.run.config import load_config
from opdistill.runs.files import read_metrics
from tests.distributed_trainer import record_rollouts
from tests.parallel_launch import launch
from tests.trainer_helpers import make_bpe_model_dir, make_model_dir, tiny_config_dict

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
REL = 1e-5


def _configs(tmp: Path) -> dict:
    common = dict(data={"prompts_per_step": 4}, optim={"lr": 1e-2, "warmup_steps": 1, "schedule": "constant"},
                  eval={"num_prompts": 4, "batch_size": 4}, checkpoint={"every": 1, "keep_last": 4})
    on = tiny_config_dict(tmp, method="on_policy", steps=4, **common)
    off = tiny_config_dict(tmp, method="off_policy", steps=3, distributed={"strategy": "ddp"}, **common)
    # rl on a dataset whose answer is one digit "somewhere in the response": the tiny random student earns a reward
    # often enough that the groups' advantages are not all 0 (carry_add's exact sums it never gets)
    rows = [{"prompt": f"{a}+{b}=", "answer": str((a + b) % 10)} for a in range(3) for b in range(4)]
    (tmp / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rl = tiny_config_dict(tmp, method="rl", steps=3, rollout={"n": 4, "max_new_tokens": 12}, **common)
    rl["data"] = {"task": "dataset", "path": str(tmp / "rl.jsonl"), "answer_field": "answer", "prompts_per_step": 4,
                  "answer_match": "contains"}
    # sampled-token loss (k3) on models of an odd vocabulary (19 = carry_add's 18 + one unused id): under tp 2 the
    # lm_head shards are 10 and 9 rows wide, the second padded to 10 columns (train/run/tensor_parallel.py)
    v19 = tmp / "v19"
    v19.mkdir()
    make_model_dir(v19 / "teacher", hidden=32, layers=2, seed=1, chars=CARRY_ADD_CHARS + "#")
    make_model_dir(v19 / "student", hidden=16, layers=1, seed=2, chars=CARRY_ADD_CHARS + "#")
    sampled = tiny_config_dict(v19, method="on_policy", steps=3, **common)
    sampled["loss"] = {"loss_mode": "sampled", "estimator": "k3"}
    # float64: the tp runs' exactness (and their checkpoints) at 1e-9, out of reach of fp32 rounding, which Adam at
    # lr 1e-2 amplifies step by step (fp32 tp vs world 1: ~1e-7 at step 1, ~3e-5 at step 4; fp64: ~1e-15)
    on64 = {**on, "model": {**on["model"], "dtype": "float64"}}
    # two teachers routed by task (tests/test_multi_teacher.py): per-teacher metrics reduced over the group
    mt = tiny_config_dict(tmp, method="on_policy", steps=2, **common)
    mt["model"] = dict(mt["model"], teacher=None)
    mt["data"] = {"task": "mix", "prompts_per_step": 4, "task_args": {"tasks": {
        "short": {"task": "carry_add", "min_digits": 1, "max_digits": 1},
        "long": {"task": "carry_add", "min_digits": 2, "max_digits": 2}}}}
    mt["teachers"] = [{"name": "a", "path": mt["model"]["student"]}, {"name": "b", "path": on["model"]["teacher"]}]
    mt["routing"] = {"table": {"short": "a", "long": "b"}}
    mt["checkpoint"] = {"every": 0, "save_final": False}
    # the teacher FSDP2-sharded over the ranks: 2 steps, no checkpoint (its losses are compared with "on"'s first 2)
    on_tshard = {**on, "model": {**on["model"], "teacher_sharded": True}, "train": {**on["train"], "steps": 2},
                 "checkpoint": {"every": 0, "save_final": False}}
    # the pipelined step: train.max_staleness 1 with TIS (each rank's rows made ahead in its own thread)
    def s1(cfg: dict, **train) -> dict:
        return {**cfg, "train": {**cfg["train"], "max_staleness": 1, **train},
                "rollout": {**cfg["rollout"], "correction": "tis", "tis_cap": 2.0}}

    on_s1_tshard = {**s1(on, steps=3), "model": {**on["model"], "teacher_sharded": True},
                    "checkpoint": {"every": 0, "save_final": False}}
    # decoding from the FSDP2 shards (distributed.decode sharded, no replica): 5 held-out problems in chunks of 2
    # (3 on rank 0, 2 on rank 1: 2 chunks against 1) so the ranks' forwards must be kept in step
    dsharded = {**on, "train": {**on["train"], "steps": 3}, "distributed": {"decode": "sharded"},
                "eval": {"num_prompts": 5, "batch_size": 2}, "checkpoint": {"every": 0, "save_final": False}}
    # a teacher with another tokenizer (byte-level BPE; xtok.mode bpm, SPEC 6.6): the mapping per row, its
    # counts reduced over the ranks
    xtok = {**on, "model": {**on["model"], "teacher": make_bpe_model_dir(tmp / "teacher_bpe")},
            "xtok": {"mode": "bpm", "teacher_topk": 64}, "train": {**on["train"], "steps": 3},
            "checkpoint": {"every": 0, "save_final": False}}
    # a privileged context (SPEC 6.7) over the self-teacher (a frozen copy of the starting student): each rank lays
    # out its rows under the teacher's prompts
    ctx = {**on, "model": {**on["model"], "teacher": "self"}, "teacher": {"context": {"examples": 2}},
           "train": {**on["train"], "steps": 3}, "checkpoint": {"every": 0, "save_final": False}}
    # Gemma 3's architecture (tiny, random: scaled tied embeddings, a sliding window of 8 that the rows cross)
    gemma = {**on, "model": {"student": make_model_dir(tmp / "g_student", hidden=16, layers=2, seed=2, arch="gemma3"),
                             "teacher": make_model_dir(tmp / "g_teacher", hidden=32, layers=2, seed=1,
                                                       arch="gemma3")},
             "train": {**on["train"], "steps": 3}, "checkpoint": {"every": 0, "save_final": False}}
    # episodes (SPEC 6.8): the packaged tool-using pair in the demo environment (lookup_add: a tool call, its result,
    # the answer); each rank runs its prompts' episodes, keyed by the global prompt index and the turn
    from opdistill.env.demo import ENV_CONFIG

    ep = {**on, "model": {"student": "builtin:demo-tool-student", "teacher": "builtin:demo-tool-teacher"},
          "data": {"task": "lookup_add", "prompts_per_step": 4}, "env": ENV_CONFIG,
          "rollout": {"n": 2, "max_new_tokens": 48}, "optim": {**common["optim"], "lr": 1e-3},
          "train": {**on["train"], "steps": 3}, "checkpoint": {"every": 0, "save_final": False}}
    return {"ep": ep, "dsharded": dsharded, "on": on, "ctx": ctx, "gemma": gemma, "off": off, "rl": rl, "sampled": sampled, "on64": on64, "mt": mt,
            "on_tshard": on_tshard, "xtok": xtok,
            "on_s1": s1(on), "on_s1_tshard": on_s1_tshard, "on64_s1": s1(on64, steps=3)}


def _tp(cfg: dict, tp: int = 2, steps: int | None = None) -> dict:
    out = {**cfg, "distributed": {**cfg.get("distributed", {}), "tp_size": tp}}
    return out if steps is None else {**out, "train": {**cfg["train"], "steps": steps}}


def _with_run_dir(cfg: dict, run_dir: Path) -> dict:
    return {**cfg, "run_dir": str(run_dir)}


def _losses(run_dir, key="distillation/loss"):
    return [(r["step"], r[key], r["train/grad_norm"]) for r in read_metrics(run_dir) if key in r]


# Absolute tolerance of a step loss: world 2 runs other micro-batch shapes through the student, so its fp32 log-probs
# (|log p| up to ~5) round differently by ~1e-7 relative, and they cancel in a KL of ~1e-3: the loss carries an
# absolute fp32 error of that size (seen up to 1.8e-8 on one machine, 1e-5 relative to a 1.8e-3 loss).
LOSS_ABS = 1e-7


def _assert_close_rows(got, want, rel=REL, abs_tol=1e-12):
    assert [s for s, *_ in got] == [s for s, *_ in want]
    for (s, *g), (_, *w) in zip(got, want):
        for a, b in zip(g, w):
            assert a == pytest.approx(b, rel=rel, abs=abs_tol), (s, g, w)


def _copy_run_cut_at(src: Path, dst: Path, step: int) -> Path:
    """A copy of run ``src`` whose checkpoints after ``step`` are removed (a resume continues from ``step``)."""
    shutil.copytree(src, dst)
    for c in (dst / "checkpoints").iterdir():
        if int(c.name.split("_")[1]) > step:
            shutil.rmtree(c)
    return dst


def _eval_rows(run_dir):
    return [{k: v for k, v in r.items() if k.startswith("eval/")} for r in read_metrics(run_dir)
            if "eval/greedy_acc" in r]


def _world2_tokens(out: Path, name: str) -> dict:
    """{step: {global prompt index: [rows]}} merged over both ranks."""
    merged: dict = {}
    for rank in (0, 1):
        for step, prompts in json.loads((out / f"{name}_tokens_rank{rank}.json").read_text()).items():
            for p, rows in prompts.items():
                assert p not in merged.setdefault(step, {}), "a prompt sampled on two ranks"
                merged[step][p] = rows
    return merged


def _run_world1(name: str, cfg: dict, run_dir: Path) -> dict:
    sink: dict = {}
    restore = record_rollouts(sink)
    try:
        loop.run_training(load_config(base=_with_run_dir(cfg, run_dir)), quiet=True)
    finally:
        restore()
    return sink


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The world-2 launch and the world-1 runs of the same configs; returns (tmp, configs, world-1 tokens)."""
    tmp = tmp_path_factory.mktemp("dist")
    cfgs = _configs(tmp)
    tokens1 = {name: _run_world1(name, cfgs[name], tmp / f"w1_{name}") for name in ("on", "on64")}  # first: the
    # launch resumes their checkpoints
    plan = [
        {"name": "on", "config": _with_run_dir(cfgs["on"], tmp / "w2_on")},
        {"name": "on_resume", "config": _with_run_dir(cfgs["on"], tmp / "w2_on_resume"), "resume": True,
         "prepare_resume_from": str(tmp / "w2_on"), "resume_step": 2},
        {"name": "on_from1", "config": _with_run_dir(cfgs["on"], tmp / "w2_on_from1"), "resume": True,
         "prepare_resume_from": str(tmp / "w1_on"), "resume_step": 2},
        {"sharded_teacher_scores": cfgs["on"]["model"]["teacher"]},
        {"name": "on_tshard", "config": _with_run_dir(cfgs["on_tshard"], tmp / "w2_on_tshard")},
        {"name": "off", "config": _with_run_dir(cfgs["off"], tmp / "w2_off")},
        {"name": "rl", "config": _with_run_dir(cfgs["rl"], tmp / "w2_rl")},
        # distributed.tp_size=2 on the same 2 processes: a 1 x 2 (dp x tp) mesh, vocab-parallel lm_head
        {"name": "tp_on", "config": _with_run_dir(_tp(cfgs["on"], steps=3), tmp / "tp_on")},
        {"name": "tp_rl", "config": _with_run_dir(_tp(cfgs["rl"]), tmp / "tp_rl")},
        {"name": "tp_sampled", "config": _with_run_dir(_tp(cfgs["sampled"]), tmp / "tp_sampled")},
        {"name": "tp_on64", "config": _with_run_dir(_tp(cfgs["on64"]), tmp / "tp_on64")},
        {"name": "tp_on64_resume", "config": _with_run_dir(_tp(cfgs["on64"]), tmp / "tp_on64_resume"),
         "resume": True, "prepare_resume_from": str(tmp / "tp_on64"), "resume_step": 2},
        {"name": "tp_from_1", "config": _with_run_dir(_tp(cfgs["on64"]), tmp / "tp_from_1"), "resume": True,
         "prepare_resume_from": str(tmp / "w1_on64"), "resume_step": 2},
        {"name": "mt", "config": _with_run_dir(cfgs["mt"], tmp / "w2_mt")},
        # two routed teachers with the vocab-parallel lm_head (1 x 2): routed micro-batches, per-teacher metrics
        {"name": "tp_mt", "config": _with_run_dir(_tp(cfgs["mt"]), tmp / "tp_mt")},
        # the pipelined step (train.max_staleness 1): FSDP2, its resume, a sharded teacher, the 1 x 2 mesh in fp64
        {"name": "dsharded", "config": _with_run_dir(cfgs["dsharded"], tmp / "w2_dsharded")},
        {"name": "on_s1", "config": _with_run_dir(cfgs["on_s1"], tmp / "w2_on_s1")},
        {"name": "on_s1_resume", "config": _with_run_dir(cfgs["on_s1"], tmp / "w2_on_s1_resume"), "resume": True,
         "prepare_resume_from": str(tmp / "w2_on_s1"), "resume_step": 2},
        {"name": "on_s1_tshard", "config": _with_run_dir(cfgs["on_s1_tshard"], tmp / "w2_on_s1_tshard")},
        {"name": "tp_on64_s1", "config": _with_run_dir(_tp(cfgs["on64_s1"]), tmp / "tp_on64_s1")},
        {"name": "xtok", "config": _with_run_dir(cfgs["xtok"], tmp / "w2_xtok")},
        {"name": "ctx", "config": _with_run_dir(cfgs["ctx"], tmp / "w2_ctx")},
        {"name": "ep", "config": _with_run_dir(cfgs["ep"], tmp / "w2_ep")},
        {"name": "ep_dsharded", "config": _with_run_dir({**cfgs["ep"], "distributed": {"decode": "sharded"}},
                                                        tmp / "w2_ep_dsharded")},
        {"name": "gemma", "config": _with_run_dir(cfgs["gemma"], tmp / "w2_gemma")},
        {"name": "gemma_dsharded", "config": _with_run_dir({**cfgs["gemma"], "distributed": {"decode": "sharded"}},
                                                           tmp / "w2_gemma_dsharded")},
        {"name": "tp_gemma", "config": _with_run_dir(_tp(cfgs["gemma"]), tmp / "tp_gemma")},
        {"name": "tp_xtok", "config": _with_run_dir(_tp(cfgs["xtok"]), tmp / "tp_xtok")},
        {"name": "xtok_tshard", "config": _with_run_dir({**cfgs["xtok"], "model": {**cfgs["xtok"]["model"],
                                                                                   "teacher_sharded": True}},
                                                        tmp / "w2_xtok_tshard")},
    ]
    out = tmp / "out"
    out.mkdir()
    (out / "plan.json").write_text(json.dumps(plan))
    t0 = time.monotonic()
    launch("tests.distributed_trainer:run_plan", 2, str(out))
    print(f"world-2 launch: {time.monotonic() - t0:.1f} s")
    for name in ("off", "rl", "sampled", "mt", "on_tshard", "on_s1", "on64_s1", "dsharded", "xtok", "ctx",
                 "gemma", "ep"):
        tokens1[name] = _run_world1(name, cfgs[name], tmp / f"w1_{name}")
    return tmp, cfgs, tokens1


@pytest.mark.parametrize("name", ["on", "off", "rl", "mt", "ctx", "ep"])
def test_world2_samples_and_losses_equal_world1(runs, name):
    tmp, _, tokens1 = runs
    assert _world2_tokens(tmp / "out", name) == tokens1[name]  # the same sampled tokens, prompt by prompt
    key = "policy/loss" if name == "rl" else "distillation/loss"
    w1, w2 = _losses(tmp / f"w1_{name}", key), _losses(tmp / f"w2_{name}", key)
    assert len(w1) == {"on": 4, "mt": 2}.get(name, 3)
    assert all(gn > 0 for *_, gn in w1)  # a real gradient every step (an all-zero one would compare trivially)
    _assert_close_rows(w2, w1, abs_tol=LOSS_ABS)
    if name == "ep":  # episodes: the environment's counts are reduced over the ranks too, and tools were called
        env1 = [{k: v for k, v in r.items() if k.startswith("env/")} for r in read_metrics(tmp / "w1_ep")
                if "env/turns" in r]
        env2 = [{k: v for k, v in r.items() if k.startswith("env/")} for r in read_metrics(tmp / "w2_ep")
                if "env/turns" in r]
        assert env2 == env1 and all(r["env/env_tokens"] > 0 for r in env1)
    # exactly one metrics line per step (plus the evaluations before the first and after the last step)
    steps = [r["step"] for r in read_metrics(tmp / f"w2_{name}") if "train/grad_norm" in r]
    assert steps == list(range(1, len(w1) + 1))


@pytest.mark.parametrize("name", ["xtok", "tp_xtok", "xtok_tshard"])
def test_cross_tokenizer_teacher_at_world2_and_tp2_equals_world1(runs, name):
    """A teacher with another tokenizer (xtok.mode bpm): world 2, the 1 x 2 mesh (only the first tp rank maps, its
    mask and counts reach its peer) and the teacher FSDP2-sharded over the ranks give world 1's samples, losses,
    xtok/* counts and evaluation."""
    tmp, _, tokens1 = runs
    run = tmp / (name if name == "tp_xtok" else f"w2_{name}")
    w1, got = _losses(tmp / "w1_xtok"), _losses(run)
    assert len(w1) == 3 and all(gn > 0 for *_, gn in w1)
    _assert_close_rows(got, w1, rel=3e-5, abs_tol=LOSS_ABS)
    tokens = _tp_tokens(tmp / "out", name) if name == "tp_xtok" else _world2_tokens(tmp / "out", name)
    assert tokens == tokens1["xtok"]
    ref = [r for r in read_metrics(tmp / "w1_xtok") if "train/grad_norm" in r]
    mine = [r for r in read_metrics(run) if "train/grad_norm" in r]
    for a, b in zip(mine, ref):
        for k in ("xtok/exact_frac", "xtok/masked_frac", "train/response_tokens"):  # counts: exact
            assert a[k] == b[k], k
        # the teacher's fp32 log-probs of other row batches round differently
        assert a["xtok/residual_mass"] == pytest.approx(b["xtok/residual_mass"], rel=1e-6)
        assert 0 < b["xtok/exact_frac"] <= 1
    evals, want = _eval_rows(run), _eval_rows(tmp / "w1_xtok")
    assert len(evals) == len(want) == 2
    for a, b in zip(evals, want):
        for k in b:
            assert a[k] == b[k] if k.endswith("_acc") else a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), k


def _assert_teacher_metrics_close(run_dir, ref_dir, abs_tol) -> None:
    """Every teacher/<name>/* metric of each step of ``run_dir`` equals ``ref_dir``'s (the one-process routed run)
    to REL relative, ``abs_tol(name)`` absolute; both teachers scored rows in every step."""
    ref = [r for r in read_metrics(ref_dir) if "train/grad_norm" in r]
    got = [r for r in read_metrics(run_dir) if "train/grad_norm" in r]
    assert len(ref) == len(got) == 2
    for a, b in zip(got, ref):
        names = sorted(k for k in b if k.startswith("teacher/"))
        assert names == sorted(k for k in a if k.startswith("teacher/")) and len(names) >= 20
        assert 0 < b["teacher/a/token_frac"] < 1  # both teachers scored rows in the step
        for k in names:
            assert a[k] == pytest.approx(b[k], rel=REL, abs=abs_tol(k)), k


def test_world2_per_teacher_metrics_equal_world1(runs):
    """Two routed teachers: every teacher/<name>/* metric reduced over the group equals the one-process value, to
    the fp32 rounding of the terms a near-zero loss cancels: LOSS_ABS for the means (a divergence of 8e-4 differed
    by 1.7e-8), 1e-6 for a per-token extremum, one token's loss, where nothing averages the rounding out (one ulp of
    a log-prob of magnitude 2-4 is 2.4e-7: 1.9e-7 seen on a 1.7e-3 loss_min)."""
    tmp, _, _ = runs
    _assert_teacher_metrics_close(tmp / "w2_mt", tmp / "w1_mt",
                                  lambda k: 1e-6 if k.endswith(("_min", "_max")) else LOSS_ABS)


def test_tp2_with_two_routed_teachers_equals_world1(runs):
    """teachers + routing with distributed.tp_size=2 (1 x 2): the per-step losses, gradient norms and every
    teacher/<name>/* metric equal the one-process routed run's (fp32, 2 steps). Teacher "a" is the student's own
    folder: its per-token losses at step 1 are 0 in one process and fp32 rounding of the vocab-parallel logsumexp at
    tp 2 (loss_max 2.8e-8 seen; the largest difference of any metric 6e-8, 2 ulp of a 0.27 mass), hence an absolute
    tolerance of 2e-7 besides the relative 1e-5.  The tail rest mass is summed directly (docs/losses.md), so a
    per-token loss carries the fp32 rounding of lse to first order (~P * 1e-7 |lse|, as truncated does) instead of
    cancelling it when teacher = student: the step loss at tp 2 differs from one process by up to 4e-8 (seen), hence
    an absolute 1e-7 on the step losses as well."""
    tmp, _, tokens1 = runs
    assert _tp_tokens(tmp / "out", "tp_mt") == tokens1["mt"]
    _assert_close_rows(_losses(tmp / "tp_mt"), _losses(tmp / "w1_mt"), abs_tol=1e-7)
    _assert_teacher_metrics_close(tmp / "tp_mt", tmp / "w1_mt", lambda k: 2e-7)


def test_world2_evaluation_equals_world1(runs):
    tmp, _, _ = runs
    for name in ("on", "rl", "ctx"):  # ctx: the teacher-KL under the teacher's prompts
        w1, w2 = _eval_rows(tmp / f"w1_{name}"), _eval_rows(tmp / f"w2_{name}")
        assert len(w1) == len(w2) == 2 and set(w1[0]) == set(w2[0])
        for a, b in zip(w2, w1):
            for k in b:
                if k.endswith("_acc"):
                    assert a[k] == b[k], k
                else:
                    assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-9), k


def test_sharded_teacher_scores_equal_the_replicated_teachers(runs):
    """``model.teacher_sharded``: FSDP2's gathered weights are the teacher's, so the scores are bit-identical, also
    with row counts that differ by rank (padding forwards keep FSDP2's collectives in step: same count per rank)
    and a rank with no row; the weights are sharded again after each call. Also for a teacher built on the meta
    device whose ranks read only their own rows of each weight from the folder (issue 24 part 4)."""
    tmp, _, _ = runs
    results = [json.loads((tmp / "out" / f"sharded_scores_rank{r}.json").read_text()) for r in (0, 1)]
    for r in results:
        assert r["exact"] == [True] * 9  # the third teacher read only its shards from the folder (issue 24)
        # row_chunk 2: 3 + 2 + 2 chunks on the longest rank; row_chunk 64: 1 per call
        assert r["forwards"] == [7, 3, 7]
        assert r["sharded_after"] == [True, True, True]
        assert all(f <= 0.5 + 0.02 for f in r["local_fraction"])  # each rank holds half of every weight (+ a row)
        # a folder that does not fit the model, refused on every rank (models.load_shards, the student's reader too)
        assert r["refused"] == {
            "missing": "model.teacher: <folder> has no tensor 'model.norm.weight' to read this rank's shard from (its "
                       "checkpoint names differ from the model's); set model.teacher_sharded=false to load it whole",
            "shape": "model.teacher: <folder>: tensor 'model.norm.weight' has shape (31,), the model's parameter (32,)",
            "nan": "model.teacher: a weight of '<folder>' holds NaN/inf (a corrupt or diverged model folder); use an "
                   "intact model folder"}


def test_sharded_teacher_trains_as_the_replicated_one(runs):
    """A torchrun-style world-2 run with ``model.teacher_sharded: true``: the same per-step losses and gradient norms
    as the replicated teacher's run (exactly: the scores are identical) and as world 1 (1e-5), the same evaluation,
    one metrics line per step; at world 1 (no process group) the flag keeps the teacher as it is and trains the
    same."""
    tmp, _, tokens1 = runs
    replicated, sharded = _losses(tmp / "w2_on")[:2], _losses(tmp / "w2_on_tshard")
    assert len(sharded) == 2 and all(gn > 0 for *_, gn in sharded)
    assert sharded == replicated
    _assert_close_rows(sharded, _losses(tmp / "w1_on")[:2], abs_tol=LOSS_ABS)
    assert _eval_rows(tmp / "w2_on_tshard")[0] == _eval_rows(tmp / "w2_on")[0]  # step 0: the teacher-KL included
    assert "eval/teacher_kl" in _eval_rows(tmp / "w2_on_tshard")[0]
    assert [r["step"] for r in read_metrics(tmp / "w2_on_tshard") if "train/grad_norm" in r] == [1, 2]
    assert _world2_tokens(tmp / "out", "on_tshard") == tokens1["on_tshard"]
    assert _losses(tmp / "w1_on_tshard") == _losses(tmp / "w1_on")[:2]


@pytest.mark.parametrize("extra, why", [
    ({"teacher": {"url": "http://127.0.0.1:1"}}, "with teacher.url (the server holds the teacher)"),
    ({"teacher": {"engine": "vllm"}}, "with teacher.engine vllm (the engine holds the teacher)"),
    ({"train": {"method": "off_policy"}}, "with train.method off_policy (the teacher decodes the samples, and a "
                                          "sharded teacher must run the same forwards on every rank)"),
    ({"train": {"method": "off_policy"}, "data": {"teacher_cache": "c.safetensors"}},
     "with data.teacher_cache (the cache replaces the teacher)"),
    ({"train": {"method": "rl"}, "model": {"teacher": None}, "rollout": {"n": 2}},
     "without a teacher model folder (model.teacher is None)"),
    ({"model": {"teacher": None}, "teachers": [{"name": "a", "path": "ta"}], "routing": {"default": "a"}},
     "with teachers (named teachers are replicated on every rank; only model.teacher can be sharded)"),
])
def test_teacher_sharded_refuses_what_has_no_in_process_teacher_to_shard(extra, why):
    base = {"model": {"student": "s", "teacher": "t", "teacher_sharded": True},
            "loss": {"loss_mode": "topk", "topk": 4}}
    for section, values in extra.items():
        base[section] = {**base.get(section, {}), **values} if isinstance(values, dict) else values
    with pytest.raises(ConfigError) as e:
        load_config(base=base)
    assert str(e.value) == f"model.teacher_sharded: expected false {why}, got True"


def test_checkpoint_saved_at_world2_resumes_at_world1_and_world2_and_back(runs):
    tmp, cfgs, _ = runs
    full = _losses(tmp / "w1_on")
    ckpt = tmp / "w2_on" / "checkpoints" / "step_00000004"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["layout"] == "dcp" and "dcp/.metadata" in manifest["files"]
    # resumed at world 2 (inside the launch) from the step-2 checkpoint
    _assert_close_rows(_losses(tmp / "w2_on_resume"), full, abs_tol=LOSS_ABS)
    # and a one-process checkpoint (world 1's step 2) resumed at world 2
    _assert_close_rows(_losses(tmp / "w2_on_from1"), full, abs_tol=LOSS_ABS)
    # resumed here, at world 1, from the same checkpoint
    w1 = _copy_run_cut_at(tmp / "w2_on", tmp / "w1_resume", 2)
    loop.run_training(load_config(base=_with_run_dir(cfgs["on"], w1)), resume=True, quiet=True)
    _assert_close_rows(_losses(w1), full, abs_tol=LOSS_ABS)
    # the final student is also a plain transformers folder, holding exactly the sharded state's weights
    from transformers import AutoModelForCausalLM

    from opdistill.train.disk.checkpoint import load_checkpoint

    exported = AutoModelForCausalLM.from_pretrained(ckpt)
    from_dcp = AutoModelForCausalLM.from_pretrained(cfgs["on"]["model"]["student"])
    state = load_checkpoint(ckpt, from_dcp)
    assert state["step"] == 4
    for (n, a), (m, b) in zip(exported.state_dict().items(), from_dcp.state_dict().items()):
        assert n == m and torch.equal(a, b), n


def test_decoding_from_the_shards_equals_world1(runs):
    """``distributed.decode: sharded`` (issue 24): no replica of the student; rollouts and the evaluation decode
    with the FSDP2 student itself, every forward gathering each layer's shards (and using the tied embedding by its
    vocabulary rows: the root is never gathered while decoding; the student built without weights, each rank
    reading only its shards), the ranks' forwards kept in step
    though each decodes its own rows (and rank 0 has a chunk of held-out prompts more). The same sampled tokens as
    world 1, the per-step losses within 1e-5, the evaluation's accuracies exactly (its log-prob sums to 1e-4)."""
    tmp, _, tokens1 = runs
    assert _world2_tokens(tmp / "out", "dsharded") == tokens1["dsharded"]
    for rank in (0, 1):  # the vocabulary-sized root (the tied embedding) is used by its rows, never gathered whole
        seen = json.loads((tmp / "out" / f"dsharded_decoding_rank{rank}.json").read_text())
        assert seen["forwards"] > 100 and seen["root_gathered"] == 0 and seen["student_shards"], (rank, seen)
    w1, w2 = _losses(tmp / "w1_dsharded"), _losses(tmp / "w2_dsharded")
    assert len(w1) == 3 and all(gn > 0 for *_, gn in w1)
    _assert_close_rows(w2, w1, abs_tol=LOSS_ABS)
    rows, want = _eval_rows(tmp / "w2_dsharded"), _eval_rows(tmp / "w1_dsharded")
    assert len(rows) == len(want) == 2 and set(rows[0]) == set(want[0])
    for a, b in zip(rows, want):
        for k in b:
            assert a[k] == b[k] if k.endswith("_acc") else a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-9), k


def test_episodes_decoded_from_the_shards_equal_world1(runs):
    """Episodes with ``distributed.decode: sharded`` (SPEC 6.8): each rank's episodes end at their own turns, and a
    rank with none left takes part in the others' turns with empty ones, so the FSDP2 forwards stay in step; the
    same tokens, losses and env/* counts as world 1, and the same evaluation."""
    tmp, _, tokens1 = runs
    assert _world2_tokens(tmp / "out", "ep_dsharded") == tokens1["ep"]
    for rank in (0, 1):
        seen = json.loads((tmp / "out" / f"ep_dsharded_decoding_rank{rank}.json").read_text())
        assert seen["forwards"] > 50 and seen["student_shards"], (rank, seen)
    w1, w2 = _losses(tmp / "w1_ep"), _losses(tmp / "w2_ep_dsharded")
    assert len(w1) == 3
    _assert_close_rows(w2, w1, abs_tol=LOSS_ABS)
    env1, env2 = ([{k: v for k, v in r.items() if k.startswith("env/")} for r in read_metrics(run) if "env/turns" in r]
                  for run in (tmp / "w1_ep", tmp / "w2_ep_dsharded"))
    assert env2 == env1 and len(env1) == 3
    rows, want = _eval_rows(tmp / "w2_ep_dsharded"), _eval_rows(tmp / "w1_ep")
    assert len(rows) == len(want) == 2 and set(rows[0]) == set(want[0])
    for a, b in zip(rows, want):
        for k in b:
            assert a[k] == b[k] if k.endswith(("_acc", "_used_tool")) else a[k] == pytest.approx(b[k], rel=1e-4,
                                                                                                abs=1e-9), k


@pytest.mark.parametrize("name", ["gemma", "gemma_dsharded", "tp_gemma"])
def test_gemma3_at_world2_equals_world1(runs, name):
    """Gemma 3's architecture (issue 33): FSDP2 at world 2, decoding from the shards (its scaled, tied embedding
    used by its vocabulary rows: the root never gathered) and the 1 x 2 mesh (vocab-parallel lm_head) give world 1's
    samples and per-step losses (1e-5)."""
    tmp, _, tokens1 = runs
    tokens = _tp_tokens(tmp / "out", name) if name.startswith("tp_") else _world2_tokens(tmp / "out", name)
    assert tokens == tokens1["gemma"]
    w1 = _losses(tmp / "w1_gemma")
    assert len(w1) == 3 and all(gn > 0 for *_, gn in w1)
    _assert_close_rows(_losses(tmp / (name if name.startswith("tp_") else f"w2_{name}")), w1, abs_tol=LOSS_ABS)
    if name == "gemma_dsharded":
        for rank in (0, 1):
            seen = json.loads((tmp / "out" / f"{name}_decoding_rank{rank}.json").read_text())
            assert seen["forwards"] > 50 and seen["root_gathered"] == 0 and seen["student_shards"], (rank, seen)
        # the evaluation's sampled log-probs come from the decoding (the rows path: the embedding's scale applied)
        rows, want = _eval_rows(tmp / "w2_gemma_dsharded"), _eval_rows(tmp / "w1_gemma")
        assert len(rows) == len(want) == 2 and set(rows[0]) == set(want[0])
        for a, b in zip(rows, want):
            for k in b:
                assert a[k] == b[k] if k.endswith("_acc") else a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-9), k


def test_pipelined_step_at_world2_equals_world1(runs):
    """``train.max_staleness: 1`` with TIS under torchrun (issue 23): each rank's rows are made ahead in its own
    thread by the weights of step t - 2, gathered whole by ``Pipeline.publish``, and the thread runs no collective
    (its metrics are reduced when the trainer takes the batch). The same samples as world 1, the per-step losses
    within 1e-5; the run is really pipelined (staleness 0, 1, 1, 1; losses that differ from S = 0's). A world-2
    checkpoint (rank 0 writes the weight versions) resumes at world 2 and at world 1 to the uninterrupted run's
    losses. A sharded teacher (scored in the trainer's thread when the batch is taken) trains as the replicated
    one; the 1 x 2 (dp x tp) mesh in fp64 equals world 1 to 1e-9."""
    tmp, cfgs, tokens1 = runs
    assert _world2_tokens(tmp / "out", "on_s1") == tokens1["on_s1"]
    w1, w2 = _losses(tmp / "w1_on_s1"), _losses(tmp / "w2_on_s1")
    assert len(w1) == 4 and all(gn > 0 for *_, gn in w1)
    _assert_close_rows(w2, w1, abs_tol=LOSS_ABS)
    staleness = [r["train/staleness"] for r in read_metrics(tmp / "w2_on_s1") if "train/grad_norm" in r]
    assert staleness == [0.0, 1.0, 1.0, 1.0]
    s0 = _losses(tmp / "w1_on")
    # step 1: the same weights (its TIS weights are 1 up to the sampler's last bits); then a version older
    assert w1[0][1] == pytest.approx(s0[0][1], rel=1e-6) and all(abs(a[1] - b[1]) > 1e-3 * b[1] for a, b in
                                                                 zip(w1[1:], s0[1:]))
    with safe_open(str(tmp / "w2_on_s1" / "checkpoints" / "step_00000004" / "trainer_state.safetensors"), "pt") as f:
        assert {k.split("/")[1] for k in f.keys() if k.startswith("pipeline/")} == {"3"}  # step 5 would need it
    _assert_close_rows(_losses(tmp / "w2_on_s1_resume"), w2, abs_tol=LOSS_ABS)
    w1_resume = _copy_run_cut_at(tmp / "w2_on_s1", tmp / "w1_on_s1_resume", 2)
    loop.run_training(load_config(base=_with_run_dir(cfgs["on_s1"], w1_resume)), resume=True, quiet=True)
    _assert_close_rows(_losses(w1_resume), w1, abs_tol=LOSS_ABS)
    # a sharded teacher: its scores are the replicated teacher's, so the losses are the replicated run's exactly
    assert _losses(tmp / "w2_on_s1_tshard") == w2[:3]
    assert _world2_tokens(tmp / "out", "on_s1_tshard") == {s: p for s, p in tokens1["on_s1"].items() if int(s) <= 3}
    # the 1 x 2 mesh (vocab-parallel lm_head), fp64: the tp leader's thread alone samples and asks the teacher
    _assert_close_rows(_losses(tmp / "tp_on64_s1"), _losses(tmp / "w1_on64_s1"), rel=1e-9)
    assert _tp_tokens(tmp / "out", "tp_on64_s1") == tokens1["on64_s1"]


# -- distributed.tp_size > 1: vocab-parallel lm_head (train/run/tensor_parallel.py) ------------------------------------

def _tp_tokens(out: Path, name: str, ranks=(0, 1), steps: int | None = None) -> dict:
    """The tokens of the tp ranks ``ranks`` of one data-parallel rank: its first tp rank sampled every step's rows
    and asked the teacher once per step; its tp peers did neither (they received them: issue 24)."""
    per_rank = [json.loads((out / f"{name}_tokens_rank{r}.json").read_text()) for r in ranks]
    requests = [json.loads((out / f"{name}_requests_rank{r}.json").read_text()) for r in ranks]
    assert all(t == {} for t in per_rank[1:]), "a tp peer generated rollouts"
    assert all(r == [] for r in requests[1:]), "a tp peer asked the teacher"
    n = len(per_rank[0]) if steps is None else steps
    assert sorted(map(int, per_rank[0])) == list(range(1, n + 1))
    if not name.endswith("_rl"):  # rl has no teacher
        assert requests[0] == list(range(1, n + 1)), requests[0]  # once per step, in order
    return per_rank[0]


@pytest.mark.parametrize("name,ref", [("tp_on", "on"), ("tp_rl", "rl"), ("tp_sampled", "sampled"),
                                      ("tp_on64", "on64")])
def test_tp2_samples_and_losses_equal_world1(runs, name, ref):
    """1 x 2 (dp x tp) against one process: on_policy with the top-k tail loss, rl (policy gradient on the sampled
    tokens' log-probs) and the sampled-token k3 loss on an odd vocabulary (uneven shards), in fp32 over 3 steps to
    1e-5 relative (the tail loss: 3e-5, its rest mass is summed directly and a per-token loss now carries the fp32
    rounding of lse to first order, ~1e-7 absolute, docs/losses.md; 1.5e-5 seen on the step-3 gradient norm after
    two AdamW steps); on_policy in fp64 over 4 steps to 1e-9. Tied embeddings (the tiny models tie them)."""
    tmp, _, tokens1 = runs
    key = "policy/loss" if ref == "rl" else "distillation/loss"
    w1, tp = _losses(tmp / f"w1_{ref}", key)[:3 if name == "tp_on" else None], _losses(tmp / name, key)
    assert len(w1) >= 3 and all(gn > 0 for *_, gn in w1)
    _assert_close_rows(tp, w1, rel=1e-9 if ref == "on64" else 3e-5 if ref == "on" else REL)
    tokens = _tp_tokens(tmp / "out", name)
    assert tokens == {s: p for s, p in tokens1[ref].items() if int(s) <= len(w1)}
    assert [r["step"] for r in read_metrics(tmp / name) if "train/grad_norm" in r] == list(range(1, len(w1) + 1))
    if name == "tp_on64":  # evaluation (before the first and after the last step) on the full-lm_head replica
        rows, want = _eval_rows(tmp / name), _eval_rows(tmp / f"w1_{ref}")
        assert len(rows) == len(want) == 2 and set(rows[0]) == set(want[0])
        for a, b in zip(rows, want):
            for k in b:
                assert a[k] == b[k] if k.endswith("_acc") else a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), k


def test_tp2_checkpoints_resume_and_export_the_full_lm_head(runs):
    """A tp checkpoint resumes at tp 2 and at world 1 (DCP reshards the vocabulary shards), a data-parallel
    checkpoint resumes at tp 2, and the exported transformers folder holds the full (tied) lm_head."""
    tmp, cfgs, _ = runs
    full = _losses(tmp / "w1_on64")
    assert len(full) == 4
    _assert_close_rows(_losses(tmp / "tp_on64_resume"), full, rel=1e-9)  # tp checkpoint at tp 2
    _assert_close_rows(_losses(tmp / "tp_from_1"), full, rel=1e-9)  # world 1's one-process checkpoint at tp 2
    w1 = _copy_run_cut_at(tmp / "tp_on64", tmp / "w1_from_tp", 2)
    loop.run_training(load_config(base=_with_run_dir(cfgs["on64"], w1)), resume=True, quiet=True)
    _assert_close_rows(_losses(w1), full, rel=1e-9)  # the tp checkpoint at world 1
    from transformers import AutoModelForCausalLM

    from opdistill.train.disk.checkpoint import load_checkpoint

    ckpt = tmp / "tp_on64" / "checkpoints" / "step_00000004"
    assert json.loads((ckpt / "manifest.json").read_text())["layout"] == "dcp"
    exported = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    reference = AutoModelForCausalLM.from_pretrained(tmp / "w1_on64" / "checkpoints" / "step_00000004",
                                                     dtype=torch.float64)
    from_dcp = AutoModelForCausalLM.from_pretrained(cfgs["on64"]["model"]["student"], dtype=torch.float64)
    load_checkpoint(ckpt, from_dcp)
    head = exported.get_output_embeddings().weight
    assert head.shape == (18, 16) and head.data_ptr() == exported.get_input_embeddings().weight.data_ptr()
    for (n, a), (_, b), (_, c) in zip(exported.state_dict().items(), reference.state_dict().items(),
                                      from_dcp.state_dict().items(), strict=True):
        assert torch.equal(a, c), n  # the export holds exactly the sharded state's weights
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12), n  # ... which are world 1's


def test_2x2_mesh_on_4_processes_equals_world1(runs):
    """2 x 2 (dp x tp) on 4 gloo processes (fp64, 3 steps): each dp rank's two tp ranks sample its 2 prompts
    alike, and the per-step losses and gradient norms are world 1's to 1e-9; also with the teacher sharded over
    the dp groups (``model.teacher_sharded``, 2 steps)."""
    tmp, cfgs, tokens1 = runs
    out = tmp / "out4"
    out.mkdir()
    # the teacher FSDP2-sharded over the 2 dp ranks next to the (dp, tp) student (fp64, 2 steps, no checkpoint)
    tshard = {**_tp(cfgs["on64"], steps=2), "model": {**cfgs["on64"]["model"], "teacher_sharded": True},
              "checkpoint": {"every": 0, "save_final": False}}
    (out / "plan.json").write_text(json.dumps([
        {"name": "tp4", "config": _with_run_dir(_tp(cfgs["on64"], steps=3), tmp / "tp4")},
        {"name": "tp4_tshard", "config": _with_run_dir(tshard, tmp / "tp4_tshard")}]))
    t0 = time.monotonic()
    launch("tests.distributed_trainer:run_plan", 4, str(out))
    print(f"2x2 launch: {time.monotonic() - t0:.1f} s")
    merged: dict = {}
    for dp_ranks in ((0, 1), (2, 3)):  # the mesh is row-major: ranks 2d, 2d + 1 form dp rank d's tp group
        for step, prompts in _tp_tokens(out, "tp4", dp_ranks).items():
            for p, rows in prompts.items():
                assert p not in merged.setdefault(step, {}), "a prompt sampled on two dp ranks"
                merged[step][p] = rows
    assert merged == {s: p for s, p in tokens1["on64"].items() if int(s) <= 3}
    _assert_close_rows(_losses(tmp / "tp4"), _losses(tmp / "w1_on64")[:3], rel=1e-9)
    # model.teacher_sharded with tp: the teacher sharded over each tp rank's dp group, the same losses
    _assert_close_rows(_losses(tmp / "tp4_tshard"), _losses(tmp / "w1_on64")[:2], rel=1e-9)


def _tp_config(**over):
    return load_config(base={"model": {"student": "s", "teacher": "t"}, "data": {"prompts_per_step": 4},
                             "eval": {"num_prompts": 0}, "loss": {"loss_mode": "topk", "topk": 4}, **over})


def test_tp_refuses_a_student_it_cannot_shard():
    """Checked before any collective: a vocabulary smaller than tp_size, an output embedding that is not a Linear."""
    from opdistill.models import build_tiny_llama, char_tokenizer
    from opdistill.train.run.tensor_parallel import TensorParallel, shard_student

    student = build_tiny_llama(char_tokenizer(CARRY_ADD_CHARS), hidden_size=16, num_layers=1, num_heads=2)
    with pytest.raises(ConfigError) as e:
        shard_student(student, TensorParallel(size=32, mesh=None, group=None))
    assert str(e.value) == ("distributed.tp_size=32: larger than the student's vocabulary (18); set "
                            "distributed.tp_size to a divisor of the world size of at most 18")
    student.lm_head = torch.nn.Identity()
    with pytest.raises(ConfigError) as e:
        shard_student(student, TensorParallel(size=2, mesh=None, group=None))
    assert str(e.value) == ("distributed.tp_size=2: the student's output embedding is Identity, not an nn.Linear "
                            "lm_head; set distributed.tp_size=1")


def test_tp_prompt_shares_are_checked_against_the_data_parallel_size():
    """tp 2 at world 4 is 2 data-parallel ranks: 2 prompts per step are fine for the config checks, 3 are not."""
    from unittest import mock

    import torch.distributed as dist

    from opdistill.train.run.distributed import init_distributed

    env = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    cfg = _tp_config(distributed={"tp_size": 2}, data={"prompts_per_step": 3})
    with mock.patch.dict(os.environ, env), mock.patch.object(dist, "init_process_group"), \
            mock.patch("opdistill.train.run.distributed.agree_on_config"), \
            mock.patch.object(dist, "is_initialized", return_value=True), \
            mock.patch.object(dist, "get_world_size", return_value=4), \
            mock.patch.object(dist, "get_rank", return_value=0), pytest.raises(ConfigError) as e:
        init_distributed(cfg)
    assert str(e.value) == ("data.prompts_per_step: expected a multiple of the data-parallel size 2 (each rank "
                            "samples an equal share of the step's prompts), got 3")


@pytest.mark.parametrize("over,message", [
    ({"distributed": {"tp_size": 3}},
     "distributed.tp_size: expected a divisor of the world size 2 (the ranks form a (data-parallel, "
     "tensor-parallel) mesh of 2 / tp_size x tp_size), got 3"),
    ({"distributed": {"tp_size": 2}, "train": {"fused_lm_head": True}},
     "train.fused_lm_head: not supported with distributed.tp_size > 1 (the vocab-parallel lm_head already keeps "
     "only [tokens, V/tp] logits); set train.fused_lm_head=false"),
    ({"distributed": {"tp_size": 2, "strategy": "ddp"}},
     "distributed.tp_size=2: needs distributed.strategy=fsdp2 (DDP over a tensor-parallel student is not wired in "
     "this version), got ddp"),
    ({"distributed": {"tp_size": 2}, "model": {"student": "s", "teacher": "t", "lora": {"r": 8}}},
     "model.lora: not supported with distributed.tp_size > 1 (the adapters would sit on a vocabulary-sharded "
     "lm_head); set distributed.tp_size=1"),
])
def test_tp_config_errors(over, message):
    with pytest.raises(ConfigError) as e:
        _init_at_world_2(_tp_config(**over))
    assert str(e.value) == message


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo crafted",))


def test_a_crafted_sharded_checkpoint_is_refused_without_running_code(runs, tmp_path):
    import pickle

    from opdistill.models import load_model
    from opdistill.train.disk import checkpoint as ckpt_mod
    from opdistill.train.disk.rundir import CheckpointError

    tmp, cfgs, _ = runs
    ckpt = tmp_path / "step_00000004"
    shutil.copytree(tmp / "w2_on" / "checkpoints" / "step_00000004", ckpt)
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(_Boom()))
    ckpt_mod._write_manifest(ckpt, 4, "dcp")  # a consistent manifest: the attacker rewrote it too
    with pytest.raises(CheckpointError) as e:
        ckpt_mod.load_checkpoint(ckpt, load_model(cfgs["on"]["model"]["student"]))
    assert str(e.value) == (f"{ckpt / 'dcp' / '.metadata'}: refers to posix.system, which a checkpoint's metadata "
                            f"never holds (a crafted file?); it is not loaded")


def _torchrun(*args, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


DEMO_OVERRIDES = ["train.steps=2", "data.prompts_per_step=4", "rollout.max_new_tokens=16", "eval.num_prompts=4",
                  "checkpoint.every=0", "log.tensorboard=false", "log.progress=false", "train.threads=1"]


def test_torchrun_entry_point_on_the_demo_config(tmp_path):
    r = _torchrun("-m", "opdistill", "train", "--config", "configs/demo_carry_add.yaml",
                  f"run_dir={tmp_path / 'w2'}", "--json", *DEMO_OVERRIDES)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count('"steps": 2') == 1  # rank 0 alone reports
    cfg = load_config("configs/demo_carry_add.yaml", [f"run_dir={tmp_path / 'w1'}", *DEMO_OVERRIDES])
    loop.run_training(cfg, quiet=True)
    w1, w2 = _losses(tmp_path / "w1"), _losses(tmp_path / "w2")
    assert len(w1) == 2
    _assert_close_rows(w2, w1, abs_tol=LOSS_ABS)
    assert [r["step"] for r in read_metrics(tmp_path / "w2") if "train/grad_norm" in r] == [1, 2]


_FAIL_ENTRY = """
import os, sys
from opdistill.train import loop
real = loop.train_step
def failing(*args, **kwargs):
    if os.environ["RANK"] == "1" and kwargs.get("group") is not None and failing.calls == 1:
        raise RuntimeError("injected failure on this rank")
    failing.calls += 1
    return real(*args, **kwargs)
failing.calls = 0
loop.train_step = failing
from opdistill.cli import main
sys.exit(main())
"""


def test_a_rank_that_raises_stops_the_job_promptly(tmp_path):
    cfg = tiny_config_dict(tmp_path, steps=4, data={"prompts_per_step": 2}, eval={"num_prompts": 0},
                           distributed={"timeout_s": 600})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "entry.py").write_text(_FAIL_ENTRY)
    t0 = time.monotonic()
    r = _torchrun(str(tmp_path / "entry.py"), "train", "--config", str(tmp_path / "c.yaml"), timeout=240)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert "injected failure on this rank" in r.stderr
    assert elapsed < 120, elapsed  # stopped by the failing rank, not by the 600 s collective timeout
    # the step-1 checkpoint is intact: --resume works (at world size 1 here)
    assert (Path(cfg["run_dir"]) / "checkpoints" / "step_00000001" / "manifest.json").exists()
    loop.run_training(load_config(base=cfg), resume=True, quiet=True)
    assert [r["step"] for r in read_metrics(cfg["run_dir"]) if "train/grad_norm" in r] == [1, 2, 3, 4]


def _init_at_world_2(cfg):
    """``init_distributed(cfg)`` as rank 0 of a (mocked) 2-process torchrun job."""
    from unittest import mock

    import torch.distributed as dist

    from opdistill.train.run.distributed import init_distributed

    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    # no real group: the ranks' config agreement (two collectives; tests/test_probe_battery_2.py) is skipped
    with mock.patch.dict(os.environ, env), mock.patch.object(dist, "init_process_group"), \
            mock.patch("opdistill.train.run.distributed.agree_on_config"), \
            mock.patch.object(dist, "is_initialized", return_value=True), \
            mock.patch.object(dist, "get_world_size", return_value=2), \
            mock.patch.object(dist, "get_rank", return_value=0):
        return init_distributed(cfg)


def test_prompts_per_step_must_divide_by_the_world_size():
    cfg = load_config(base={"model": {"student": "s", "teacher": "t"}, "data": {"prompts_per_step": 3},
                            "loss": {"loss_mode": "topk", "topk": 4}})
    with pytest.raises(ConfigError) as e:
        _init_at_world_2(cfg)
    assert str(e.value) == ("data.prompts_per_step: expected a multiple of the data-parallel size 2 (each rank "
                            "samples an equal share of the step's prompts), got 3")
    cfg = load_config(base={"model": {"student": "s", "teacher": "t"}, "data": {"prompts_per_step": 4},
                            "eval": {"num_prompts": 1}, "loss": {"loss_mode": "topk", "topk": 4}})
    with pytest.raises(ConfigError) as e:
        _init_at_world_2(cfg)
    assert str(e.value) == ("eval.num_prompts: expected 0 or at least the data-parallel size 2 (every rank "
                            "evaluates a share), got 1")


def test_errors_and_warnings_carry_the_rank_under_torchrun(tmp_path, monkeypatch, capsys):
    from opdistill.cli import _one_line_warning, main

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / "c.yaml").write_text("optim:\n  lr: abc\n")
    assert main(["train", "--config", str(tmp_path / "c.yaml")]) == 2
    assert capsys.readouterr().err == "opdistill train: [rank 1] config error: optim.lr: expected a number > 0, got 'abc'\n"
    assert _one_line_warning("careful", UserWarning, "f.py", 1) == "opdistill: [rank 1] warning: careful\n"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _one_line_warning("careful", UserWarning, "f.py", 1) == "opdistill: warning: careful\n"


_FOREIGN_GROUP = """
import json, sys
import torch.distributed as dist
from opdistill.train.run.config import load_config
from opdistill.train.loop import run_training
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
run_training(load_config(base=json.loads(open(sys.argv[1]).read())), quiet=True)
dist.destroy_process_group()
"""


def test_a_one_process_group_made_by_someone_else_trains_as_one_process(tmp_path):
    """An in-process vLLM engine (or a user) may have initialized a world-1 process group without torchrun: the
    trainer then runs as one process (plain modules, the single-process checkpoint layout), not FSDP2 over it."""
    import socket
    import subprocess
    import sys

    cfg = tiny_config_dict(tmp_path, steps=1, eval={"num_prompts": 0}, checkpoint={"every": 1})
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    r = subprocess.run([sys.executable, "-c", _FOREIGN_GROUP, str(tmp_path / "cfg.json"), str(port)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step_00000001" / "manifest.json").read_text())
    assert manifest.get("layout", "single") == "single"


def test_a_sharded_teacher_needs_a_held_out_problem_on_every_rank():
    """A rank with no held-out problem would skip its teacher forwards while the others wait on its gathers."""
    from opdistill.train.disk.preflight import check_held_out

    cfg = _tp_config(model={"student": "s", "teacher": "t", "teacher_sharded": True})
    layout = dict(world=4, dp=4)
    with pytest.raises(ConfigError) as e:
        check_held_out(cfg, 3, **layout)
    assert str(e.value) == ("eval.num_prompts: the held-out set has 3 problem(s), fewer than the 4 data-parallel "
                            "ranks; with model.teacher_sharded every rank evaluates at least one (add held-out rows, "
                            "or set eval.num_prompts=0)")
    check_held_out(cfg, 4, **layout)  # one each
    check_held_out(cfg, 0, **layout)  # no evaluation at all
    check_held_out(_tp_config(), 3, **layout)  # a replicated teacher: a rank with no problem just reports zeros


def test_a_sharded_student_needs_a_held_out_problem_on_every_rank():
    """distributed.decode sharded: a rank with no held-out problem would skip its decoding forwards."""
    from opdistill.train.disk.preflight import check_held_out

    cfg = _tp_config(distributed={"decode": "sharded"})
    with pytest.raises(ConfigError) as e:
        check_held_out(cfg, 1, world=2, dp=2)
    assert str(e.value) == ("eval.num_prompts: the held-out set has 1 problem(s), fewer than the 2 data-parallel "
                            "ranks; with distributed.decode sharded every rank evaluates at least one (add held-out "
                            "rows, or set eval.num_prompts=0)")
    check_held_out(cfg, 2, world=2, dp=2)
    check_held_out(cfg, 1, world=1, dp=1)  # one process: nothing is sharded


@pytest.mark.parametrize("over, why", [
    ({"distributed": {"decode": "sharded", "strategy": "ddp"}}, "with distributed.strategy ddp (DDP keeps the whole "
     "student on every rank; nothing is sharded to decode from)"),
    ({"distributed": {"decode": "sharded", "tp_size": 2}}, "with distributed.tp_size > 1 (the vocab-parallel "
     "lm_head gives each rank a slice of the logits; decoding needs them whole)"),
    ({"distributed": {"decode": "sharded"}, "train": {"max_staleness": 1}, "rollout": {"correction": "none"}},
     "with train.max_staleness 1 (the pipelined step decodes in its own thread from whole weight versions)"),
    ({"distributed": {"decode": "sharded"}, "rollout": {"engine": "vllm"}}, "with rollout.engine vllm (the engine "
     "holds its own weights)"),
])
def test_sharded_decoding_refuses_what_has_no_shards_to_decode_from(over, why):
    with pytest.raises(ConfigError) as e:
        _tp_config(**over)
    assert str(e.value) == f"distributed.decode: expected replica {why}, got 'sharded'"


def test_a_sharded_teacher_too_large_for_a_rank_is_refused_before_loading(tmp_path):
    """model.teacher_sharded reads each rank's shards from the folder; what that takes (the shards plus the largest
    unit a forward gathers whole) comes from the safetensors headers alone and is checked against what the rank has
    before any weight is read."""
    from safetensors.torch import load_file

    from opdistill.train.disk.preflight import check_teacher_shards_fit, sharded_teacher_bytes

    folder = make_model_dir(tmp_path / "teacher", hidden=32, layers=2, seed=1)
    units: dict = {}
    for name, t in load_file(str(Path(folder) / "model.safetensors")).items():  # the tensors themselves
        unit = name.split(".")[2] if name.startswith("model.layers.") else "root"
        units[unit] = units.get(unit, 0) + t.numel() * 4  # float32
    assert set(units) == {"0", "1", "root"}
    shards, largest = sharded_teacher_bytes(folder, "float32", 2)
    assert shards == sum(-(-b // 2) for b in units.values()) and largest == max(units.values())
    assert sharded_teacher_bytes(folder, "bfloat16", 4) == (sum(-(-b // 2 // 4) for b in units.values()),
                                                            max(units.values()) // 2)
    cfg = _tp_config(model={"student": "s", "teacher": folder, "teacher_sharded": True})
    check_teacher_shards_fit(cfg, folder, dp=2, available=(shards + largest, "free"))  # exactly fits
    with pytest.raises(ConfigError) as e:
        check_teacher_shards_fit(cfg, folder, dp=2, available=(shards + largest - 1, "free on this rank's GPU"))
    gib = 1 << 30
    assert str(e.value) == (f"model.teacher_sharded: the teacher's shards ({shards / gib:.2f} GiB per rank over 2 "
                            f"ranks, float32) plus the largest layer a forward gathers ({largest / gib:.2f} GiB) "
                            f"exceed the {(shards + largest - 1) / gib:.2f} GiB free on this rank's GPU; use more "
                            f"ranks, a smaller model.dtype, or a teacher server (teacher.url)")
