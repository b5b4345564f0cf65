"""scripts/compare_step_metrics.py: the largest relative per-step difference between two runs' metrics."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path, name, rows):
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_the_largest_relative_difference_and_its_step(tmp_path):
    a = _run(tmp_path, "a", [{"step": 1, "distillation/loss": 2.0, "train/grad_norm": 1.0},
                             {"step": 2, "distillation/loss": 1.5, "train/grad_norm": 1.0},
                             {"step": 2, "eval/teacher_kl": 0.5},  # an evaluation row of the same step
                             {"step": 3, "distillation/loss": 9.0}])
    b = _run(tmp_path, "b", [{"step": 1, "distillation/loss": 2.0, "train/grad_norm": 1.0},
                             {"step": 2, "distillation/loss": 1.0, "train/grad_norm": 1.25}])
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_step_metrics.py"), str(a), str(b),
                          "--metric", "distillation/loss", "--metric", "train/grad_norm", "--metric", "eval/x"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout.splitlines()
    assert out == [f"{a} against {b}",
                   "  distillation/loss: max relative difference 5.00e-01 (step 2) over 2 steps (1-2)",
                   "  train/grad_norm: max relative difference 2.00e-01 (step 2) over 2 steps (1-2)",
                   "  eval/x: no step has it in both runs"]
