"""``opdistill plot RUN_DIR``: one PNG of loss, teacher-KL, overlap ratio, masses and accuracy against step."""
from __future__ import annotations

from pathlib import Path

from opdistill.errors import RunError
from opdistill.runs.files import check_metric_rows, read_metrics
from opdistill.runs.outputs import check_image_path, check_output_path, output_lock, save_figure

__all__ = ["PANELS", "plot_run"]

# (title, metric names): distillation/loss for distillation, policy/loss for RL (train.method rl), task/loss and
# loss/total with task rewards (tests/test_trainer_metric_names.py checks that every name here is emitted by some run)
PANELS = [
    ("loss", ["distillation/loss", "policy/loss", "task/loss", "loss/total"]),
    ("teacher-KL (held-out, student samples)", ["eval/teacher_kl"]),
    ("overlap ratio", ["distillation/overlap_ratio", "eval/overlap_ratio"]),
    ("masses on teacher top-k", ["distillation/student_mass", "distillation/teacher_mass", "eval/student_mass",
                                 "eval/teacher_mass"]),
    ("accuracy (held-out)", ["eval/greedy_acc", "eval/sampled_acc", "train/reward"]),
]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """RUN_DIR's metrics as one figure, written to ``out`` (default RUN_DIR/metrics.png, the run's own plot; any other
    run's entries are refused: ``opdistill.runs.outputs``)."""
    out = Path(out) if out else Path(run_dir) / "metrics.png"
    check_image_path(out, "--out")
    check_output_path(out, "--out", allow=(Path(run_dir) / "metrics.png",))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir) if Path(run_dir).is_dir() else []
    if not rows:
        raise RunError(f"{Path(run_dir) / 'metrics.jsonl'}: no metrics to plot (is {run_dir} a run directory that "
                       f"has logged a step?)")
    why = check_metric_rows(rows)
    if why:
        raise RunError(f"{Path(run_dir) / 'metrics.jsonl'}: {why}")
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for ax, (title, keys) in zip(axes, PANELS):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if key.startswith("eval/") else None, markersize=3, label=key)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(str(run_dir), fontsize=9)
    fig.tight_layout()
    with output_lock(out, "--out"):
        save_figure(fig, out, dpi=110)
    plt.close(fig)
    return out
