"""How far two runs' per-step training metrics are apart: for each metric, the largest relative difference
|a - b| / |b| over the steps both runs logged (RUN_B is the reference), and the step where it is.

Two runs of the same data and seed with two ways of computing the same loss (the teacher's hidden states and
lm_head against its K = V log-probs, in process against through a server, world 1 against 2) must agree step for
step; this prints how closely they do (docs/examples.md 2.6).

    python scripts/compare_step_metrics.py RUN_A RUN_B [--metric distillation/loss --metric train/grad_norm]
"""
from __future__ import annotations

import argparse
import sys

from opdistill.runs.files import check_metric_rows, read_metrics


def steps(run_dir: str) -> dict[int, dict]:
    rows = read_metrics(run_dir)
    bad = check_metric_rows(rows)
    if bad:
        sys.exit(f"{run_dir}/metrics.jsonl: {bad}")
    by_step: dict[int, dict] = {}
    for row in rows:  # a step's training row and its evaluation row are merged
        by_step.setdefault(row["step"], {}).update(row)
    return by_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_a")
    ap.add_argument("run_b", help="the reference run")
    ap.add_argument("--metric", action="append", default=None,
                    help="a metric of metrics.jsonl (repeatable; default: distillation/loss and train/grad_norm)")
    args = ap.parse_args()
    a, b = steps(args.run_a), steps(args.run_b)
    print(f"{args.run_a} against {args.run_b}")
    for metric in args.metric or ["distillation/loss", "train/grad_norm"]:
        common = sorted(s for s in a if s in b and a[s].get(metric) is not None and b[s].get(metric) is not None)
        if not common:
            print(f"  {metric}: no step has it in both runs")
            continue
        rel = {s: abs(a[s][metric] - b[s][metric]) / max(abs(b[s][metric]), 1e-300) for s in common}
        worst = max(rel, key=rel.get)
        print(f"  {metric}: max relative difference {rel[worst]:.2e} (step {worst}) over {len(common)} steps "
              f"({common[0]}-{common[-1]})")


if __name__ == "__main__":
    main()
