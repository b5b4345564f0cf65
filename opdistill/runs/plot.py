"""``opdistill plot RUN_DIR``: one PNG of a run's curves against the training step, a grid of panels (loss,
teacher-KL, top-k overlap, probability masses, accuracy) labelled in words, readable when shrunk."""
from __future__ import annotations

import math
from pathlib import Path

from opdistill.errors import RunError
from opdistill.runs.files import check_metric_rows, read_metrics
from opdistill.runs.outputs import check_image_path, check_output_path, output_lock, save_figure

__all__ = ["PANELS", "LABELS", "plot_run"]

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

# what a person reads: each panel's title and y-axis, each curve's legend (docs/trainer.md defines the metrics)
TITLES = {
    "loss": ("Training loss", "loss"),
    "teacher-KL (held-out, student samples)": ("Teacher-KL on the student's held-out samples", "nats per token"),
    "overlap ratio": ("Top-k overlap: student vs teacher", "share of the teacher's top-k"),
    "masses on teacher top-k": ("Probability mass on the teacher's top-k", "probability mass"),
    "accuracy (held-out)": ("Accuracy and reward", "share correct"),
}
LABELS = {
    "distillation/loss": "distillation loss",
    "policy/loss": "policy-gradient loss (RL)",
    "task/loss": "task-reward loss",
    "loss/total": "total loss",
    "eval/teacher_kl": "held-out",
    "distillation/overlap_ratio": "training samples",
    "eval/overlap_ratio": "held-out samples",
    "distillation/student_mass": "student, training samples",
    "distillation/teacher_mass": "teacher, training samples",
    "eval/student_mass": "student, held-out samples",
    "eval/teacher_mass": "teacher, held-out samples",
    "eval/greedy_acc": "greedy accuracy, held-out",
    "eval/sampled_acc": "sampled accuracy, held-out",
    "train/reward": "reward of the training samples",
}
COLUMNS = 3


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
    n_rows = math.ceil(len(PANELS) / COLUMNS)
    fig, grid = plt.subplots(n_rows, COLUMNS, figsize=(4.6 * COLUMNS, 3.6 * n_rows), squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax, (panel, keys) in zip(axes, PANELS):
        title, ylabel = TITLES[panel]
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if key.startswith("eval/") else None, markersize=3, label=LABELS[key])
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("training step", fontsize=10)
        ax.set_ylabel(ylabel, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=9)
        else:
            ax.text(0.5, 0.5, "not logged by this run", ha="center", va="center", transform=ax.transAxes,
                    fontsize=10, color="gray")
    for ax in axes[len(PANELS):]:
        ax.set_visible(False)
    fig.suptitle(f"opdistill run {run_dir}", fontsize=11)
    fig.tight_layout()
    with output_lock(out, "--out"):
        save_figure(fig, out, dpi=110)
    plt.close(fig)
    return out
