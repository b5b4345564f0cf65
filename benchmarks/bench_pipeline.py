"""The pipelined step (``train.max_staleness``, issue 23) against the sequential one: training steps/s and where each
stage waits, with the teacher in a separate server process.

The work: configs/demo_carry_add.yaml (32 prompts x 4 samples per step, up to 64 new tokens, top-8 tail forward KL)
with ``train.threads=1``, scored by ``opdistill serve-teacher --model builtin:demo-teacher --threads 1`` on this
machine (one core each when the machine has two), no evaluation, no checkpoint. S = 0 is today's loop (the teacher
request overlapped with the student's forward, ``teacher.overlap``); S > 0 runs with ``rollout.correction=tis
rollout.tis_cap=2``. Each configuration runs in a fresh process, interleaved (the order rotates each repeat), after
waiting for a quiet machine (``benchmarks/bench_trainer.py``'s ``wait_quiet``); the server is started once and
shared. Reported per S: medians [min-max] over the repeats of the training steps/s (steps 2..N: ``time/step_s``,
the first step holds start-up) and the mean seconds per step the trainer waited for its batch (``time/wait_batch_s``),
the generator waited for its weights (``time/wait_version_s``), and the stages themselves (``time/rollout_s``,
``time/teacher_s`` in the generator; ``time/update_s`` in the trainer).

    PYTHONPATH=. python benchmarks/bench_pipeline.py --repeats 3 --steps 12
    PYTHONPATH=. python benchmarks/bench_pipeline.py --repeats 1 --steps 3 --quiet-timeout 5   # smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_teacher_service import start_server
from benchmarks.bench_trainer import wait_quiet

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("time/wait_batch_s", "time/wait_version_s", "time/rollout_s", "time/teacher_s", "time/update_s")


def one_run(S: int, url: str, steps: int, out: Path) -> dict:
    run_dir = out / f"s{S}_{time.time_ns()}"
    cmd = [sys.executable, "-m", "opdistill.cli", "train", "--config", str(ROOT / "configs" / "demo_carry_add.yaml"),
           f"teacher.url={url}", f"train.steps={steps}", "train.threads=1", f"train.max_staleness={S}",
           "eval.num_prompts=0", "checkpoint.every=0", "checkpoint.save_final=false", "log.tensorboard=false",
           "log.progress=false", f"run_dir={run_dir}"]
    if S:
        cmd += ["rollout.correction=tis", "rollout.tis_cap=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"S={S}: the run failed (exit {res.returncode}): {res.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step_s" in r and r["step"] >= 2]
    step_s = [r["time/step_s"] for r in rows]
    return {"steps_per_s": len(step_s) / sum(step_s),
            **{k: statistics.fmean(r.get(k, 0.0) for r in rows) for k in KEYS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--quiet-busy", type=float, default=0.15)
    ap.add_argument("--quiet-timeout", type=float, default=120)
    args = ap.parse_args()
    proc, url = start_server(["--model", "builtin:demo-teacher", "--threads", "1"], timeout_s=60)
    results: dict[int, list] = {S: [] for S in args.staleness}
    try:
        with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
            for r in range(args.repeats):
                order = args.staleness[r % len(args.staleness):] + args.staleness[:r % len(args.staleness)]
                for S in order:
                    quiet = wait_quiet(args.quiet_busy, args.quiet_timeout)
                    res = one_run(S, url, args.steps, Path(tmp))
                    results[S].append(res)
                    print(f"repeat {r + 1}/{args.repeats} S={S}: {res['steps_per_s']:.3f} steps/s"
                          f"{'' if quiet['quiet'] else ' (machine not quiet)'}", file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait(30)

    def med(S, key):
        vals = [x[key] for x in results[S]]
        return statistics.median(vals), min(vals), max(vals)

    base = med(args.staleness[0], "steps_per_s")[0]
    print(f"\n{os.cpu_count()} CPUs; demo config, teacher server --threads 1, train.threads=1, {args.steps} steps "
          f"(2..{args.steps} timed), {args.repeats} repeats\n")
    print("| S | steps/s median [min-max] | vs S=%d | wait for batch s/step | generator waits for weights | "
          "rollout s | teacher s | update s |" % args.staleness[0])
    print("|---|---|---|---|---|---|---|---|")
    for S in args.staleness:
        m, lo, hi = med(S, "steps_per_s")
        cells = [f"{med(S, k)[0]:.3f}" for k in KEYS]
        print(f"| {S} | {m:.3f} [{lo:.3f}-{hi:.3f}] | {m / base:.2f}x | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
