"""Issue 25's learning experiment: does on-policy distillation from a teacher with another tokenizer lift the demo
student as much as distillation from an equally accurate teacher with the student's own tokenizer?

    python scripts/xtok_learning.py --out runs/xtok_learning            # ~8 min on 2 cores (2 lanes)
    python scripts/xtok_learning.py --out runs/xtok_learning --report   # the table again from the runs

From the same start (the character-level demo student, ``configs/demo_cross_tokenizer.yaml``), 60 steps each, two
seeds, 600 held-out problems evaluated at step 60 (greedy accuracy):

- ``same``: the character-level demo teacher (builtin:demo-teacher, 0.995 greedy), top-8 tail forward KL;
- ``bpm``: the byte-level BPE demo teacher (builtin:demo-teacher-bpe, 0.990 greedy), the same loss on its
  distribution mapped onto the student's characters (``xtok.mode bpm``);
- ``sampled``: the BPE teacher through the fallback (``xtok.mode sampled``, the sampled-token k3 loss the
  config's ``loss.loss_mode: sampled`` defaults to), its log-prob of the student's character where both
  tokenizations have a boundary at its start and end.

The untrained student is evaluated once (``opdistill eval --values``); every change is paired over the problems
(``opdistill compare --baseline``), and the lift ratio (bpm's gain over the start / same's gain) carries its
paired bootstrap interval (``opdistill.runs.stats.paired_lift_ratio``). The runs go in two lanes (one torch thread
each); the comparison is at equal steps, so the lanes do not change it.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CONFIG = "configs/demo_cross_tokenizer.yaml"
COMMON = ["eval.at_start=false", "log.progress=false"]
METHODS = {"same": ["model.teacher=builtin:demo-teacher", "xtok.mode=off"],
           "bpm": [],
           "sampled": ["xtok.mode=sampled", "loss.loss_mode=sampled"]}
SEEDS = (0, 1)


def _run(cmd: list[str], log: Path) -> None:
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    print(f"  {log.stem}: {'done' if rc == 0 else f'FAILED (exit {rc}, see {log})'} in {time.time() - t0:.0f} s",
          flush=True)
    if rc:
        raise SystemExit(rc)


def run_all(out: Path, lanes: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    opd = [sys.executable, "-m", "opdistill"]
    print(f"the untrained student on the held-out problems -> {out / 'base.values.json'}", flush=True)
    _run(opd + ["eval", "--config", CONFIG, "--values", str(out / "base.values.json")], out / "base.log")
    jobs = [(f"{m}-seed{s}", opd + ["train", "--config", CONFIG, *COMMON, f"run_dir={out / f'{m}-seed{s}'}",
                                    f"train.seed={s}", *args])
            for s in SEEDS for m, args in METHODS.items()]
    print(f"{len(jobs)} runs of 60 steps in {lanes} lanes", flush=True)
    with ThreadPoolExecutor(max_workers=lanes) as pool:  # each lane a subprocess at a time
        list(pool.map(lambda job: _run(job[1], out / f"{job[0]}.log"), jobs))


def report(out: Path) -> None:
    from opdistill.runs.stats import paired_difference, paired_lift_ratio

    def acc(path: Path) -> tuple:
        v = json.loads(path.read_text())
        return v["greedy_correct"], v["problems"]

    base = acc(out / "base.values.json")
    runs = {m: [acc(next((out / f"{m}-seed{s}" / "eval").glob("step_*.json"))) for s in SEEDS] for m in METHODS}
    start = sum(base[0]) / sum(base[1])
    print(f"greedy accuracy on {len(base[0])} held-out problems, start {start:.3f}; step 60, seeds {list(SEEDS)}\n")
    print("| method | seed 0 | seed 1 | mean | lift over the start | lift / same's lift [95%] | minus same [95%] |")
    print("|---|---|---|---|---|---|---|")
    for m, evals in runs.items():
        accs = [sum(n) / sum(d) for n, d in evals]
        mean = sum(accs) / len(accs)
        ratio = paired_lift_ratio(base, evals, runs["same"])
        diff = paired_difference(evals, runs["same"])
        cells = ("1 (reference)", "0") if m == "same" else (
            f"{ratio.value:.2f} [{ratio.lo:.2f}, {ratio.hi:.2f}]", f"{diff.value:+.3f} [{diff.lo:+.3f}, {diff.hi:+.3f}]")
        print(f"| {m} | {accs[0]:.3f} | {accs[1]:.3f} | {mean:.3f} | {mean - start:+.3f} | {cells[0]} | {cells[1]} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/xtok_learning")
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--report", action="store_true", help="only print the table from existing runs")
    args = ap.parse_args()
    out = Path(args.out)
    if not args.report:
        run_all(out, args.lanes)
    report(out)


if __name__ == "__main__":
    main()
