"""``opdistill plot``: a grid of panels (not one wide strip), titles, axes and legends in words, not metric keys."""
import json

from matplotlib.figure import Figure

from opdistill.cli import main
from opdistill.runs.plot import LABELS, PANELS


def test_plot_is_a_grid_labelled_in_words(tmp_path, monkeypatch):
    rows = [{"step": s, "distillation/loss": 1.0 / (s + 1), "distillation/overlap_ratio": 0.5,
             "distillation/student_mass": 0.4, "distillation/teacher_mass": 0.6} for s in range(1, 5)]
    rows += [{"step": s, "eval/teacher_kl": 0.3, "eval/greedy_acc": 0.2 * s, "eval/sampled_acc": 0.1,
              "eval/overlap_ratio": 0.5, "eval/student_mass": 0.4, "eval/teacher_mass": 0.6} for s in (0, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k))[1])
    assert main(["plot", str(tmp_path)]) == 0
    (fig,) = figures
    width, height = fig.get_size_inches()
    assert width / height < 2  # a grid, not a 2310x374 strip
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert len(shown) == len(PANELS)
    assert len({round(ax.get_position().y0, 3) for ax in shown}) == 2  # two rows of panels
    words = [t for ax in shown for t in (ax.get_title(), ax.get_xlabel(), ax.get_ylabel())]
    words += [line.get_label() for ax in shown for line in ax.lines]
    assert all(w and "/" not in w and "_" not in w for w in words), words
    assert {line.get_label() for ax in shown for line in ax.lines} == {LABELS[k] for r in rows for k in r
                                                                        if k != "step"}
    assert set(LABELS) == {k for _, keys in PANELS for k in keys}  # every plotted metric has words
