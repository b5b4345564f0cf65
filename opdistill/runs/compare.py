"""``opdistill compare RUN_DIR ...``: the final evaluation metrics of several runs in one table, and their evaluation
curves (vs step and vs training time, with the 95% interval bands) in one PNG.

Runs whose resolved configs (RUN_DIR/config.yaml) differ only by ``train.seed`` (and ``run_dir``) form a group: the
table shows a row per seed and a ``mean`` row (the mean of the seeds' point estimates, with the range of those
estimates over the seeds in brackets, since the per-problem values behind a mean are not in metrics.jsonl); the
figure draws each seed thin with its interval band and the group's mean bold. Everything is read from metrics.jsonl
(``read_metrics``): evaluation rows are those holding the metric; the training time of an evaluation is the
``time/train_total_s`` logged at its step (0 at step 0).

When the runs kept their per-problem evaluation values (``RUN_DIR/eval/step_NNNNNN.json``, written by the trainer at
every evaluation), a second table gives each group's change from its first evaluation to its last, paired over
problems and averaged over its seeds (:func:`opdistill.runs.stats.paired_change`): e.g. ``-0.31 [-0.38, -0.24]``
is a 31% lower metric whose 95% interval excludes 0. ``--baseline VALUES.json`` (``opdistill eval --values`` of the
start the runs share, e.g. runs trained with ``eval.at_start: false``) is the "first evaluation" of every run, in
that table and as the step-0 point of the curves of runs that did not evaluate step 0 themselves. With two or more
groups, a third table gives each later group minus the first at every step all their runs evaluated, paired over
problems (:func:`opdistill.runs.stats.paired_difference`): e.g. on- minus off-policy greedy accuracy at step 150,
``-0.058 [-0.088, -0.031]`` (docs/demo.md: off-policy ahead there, resolved).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from opdistill.errors import UserError
from opdistill.runs.files import check_metric_rows, flatten_config, read_metrics
from opdistill.runs.outputs import check_image_path, check_output_path, output_lock, save_figure
from opdistill.runs.stats import paired_change, paired_difference
from opdistill.runs.values import METRICS, summarize, values_from_json
from opdistill.yaml12 import load_yaml

__all__ = ["DEFAULT_METRICS", "Run", "Group", "load_runs", "group_runs", "format_table", "metric_sums",
           "change_table", "difference_table", "plot_groups", "compare"]

DEFAULT_METRICS = ("eval/greedy_acc", "eval/sampled_acc", "eval/teacher_kl", "eval/teacher_kl_k3",
                   "eval/topk_reverse_kl")
_VARY = ("run_dir", "train.seed")  # keys that may differ inside a group


class CompareError(UserError, ValueError):
    """A RUN_DIR given to compare is not a run directory (the message names it)."""

    kind = "error"


@dataclass
class Run:
    path: Path
    config: dict | None
    rows: list[dict]
    seed: object = None
    _values: dict = field(default_factory=dict, repr=False)  # step -> EvalValues, each file read once

    def curve(self, metric: str) -> list[dict]:
        """[{step, time, value, lo, hi}] of the evaluation rows holding ``metric`` (lo/hi None when not logged)."""
        times = {0: 0.0}
        for r in self.rows:
            if r.get("time/train_total_s") is not None:
                times[r["step"]] = r["time/train_total_s"]
        out = []
        for r in self.rows:
            v = r.get(metric)
            if v is None:
                continue
            out.append({"step": r["step"], "time": times.get(r["step"]), "value": v,
                        "lo": r.get(f"{metric}_lo"), "hi": r.get(f"{metric}_hi")})
        return out

    def final(self, metric: str) -> dict | None:
        c = self.curve(metric)
        return c[-1] if c else None

    def value_steps(self) -> list[int]:
        """The steps whose per-problem evaluation values the run kept (RUN_DIR/eval/step_NNNNNN.json), in order: only
        those of evaluations metrics.jsonl still holds. A resume trims metrics.jsonl back to its checkpoint (and sets
        the later values files aside); a values file of a step the run's history no longer has belongs to the
        timeline the resume threw away, and is never read."""
        folder = self.path / "eval"
        kept = {r["step"] for r in self.rows if any(k.startswith("eval/") for k in r)}
        steps = [int(m.group(1)) for p in folder.glob("step_*.json") if (m := re.fullmatch(r"step_(\d+)\.json", p.name))]
        return sorted(s for s in steps if s in kept)

    def values(self, step: int):
        if step not in self._values:
            self._values[step] = read_values(self.path / "eval" / f"step_{step:06d}.json")
        return self._values[step]


@dataclass
class Group:
    label: str
    runs: list[Run] = field(default_factory=list)


def load_runs(run_dirs) -> list[Run]:
    """The runs of ``run_dirs``, each read and checked (CompareError naming the file otherwise); a run given twice
    (the same folder under two names, or a copy: the same metrics.jsonl, whose timings no two runs share) is
    refused: it would count as two seeds, or as a difference of 0."""
    runs, seen, contents = [], {}, {}
    for d in run_dirs:
        path = Path(d)
        if not (path / "metrics.jsonl").is_file():
            raise CompareError(f"{path}: no metrics.jsonl (expected a run directory written by opdistill train)")
        same = seen.setdefault(path.resolve(), path)
        if same is not path:
            raise CompareError(f"{path}: the run is given twice ({same} and {path} are one folder); give each run "
                               f"once (a run counted twice would pass for two seeds)")
        twin = contents.setdefault(hashlib.sha256((path / "metrics.jsonl").read_bytes()).hexdigest(), path)
        if twin is not path:
            raise CompareError(f"{path}: the same metrics.jsonl as {twin}, byte for byte: one run twice (a copy?); "
                               f"give each run once")
        config = None
        if (path / "config.yaml").is_file():
            config = _read_config(path / "config.yaml")
        seed = flatten_config(config).get("train.seed") if config is not None else None
        runs.append(Run(path, config, _checked_rows(path / "metrics.jsonl", read_metrics(path)), seed))
    return runs


def _read_config(path: Path) -> dict:
    import yaml

    try:
        config = load_yaml(path.read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise CompareError(f"{path}: unreadable ({' '.join(str(getattr(e, 'problem', None) or e).split())}); "
                           f"expected the config.yaml opdistill train wrote") from None
    if not isinstance(config, dict):
        raise CompareError(f"{path}: expected a YAML mapping, got {type(config).__name__}")
    return config


def _checked_rows(path: Path, rows: list) -> list[dict]:
    """metrics.jsonl's rows checked (:func:`opdistill.runs.files.check_metric_rows`), as CompareError."""
    why = check_metric_rows(rows)
    if why:
        raise CompareError(f"{path}: {why}")
    return rows


def _label(runs: list[Run]) -> str:
    names = [re.sub(r"[-_.]?seed[-_]?\d+$", "", r.path.name) or r.path.name for r in runs]
    return names[0] if len(set(names)) == 1 else names[0] + "+"


def group_runs(runs: list[Run]) -> list[Group]:
    """Runs whose configs differ only by seed (and run_dir), in order of first appearance; a run without a
    config.yaml is a group of its own. Two runs of one config and one seed are refused: the same run twice (a
    copy), whose "mean over seeds" would count one seed twice."""
    groups: list[tuple[object, list[Run]]] = []
    for run in runs:
        key = None if run.config is None else sorted(
            (k, repr(v)) for k, v in flatten_config(run.config).items() if k not in _VARY)
        for gkey, members in groups:
            if key is not None and gkey == key:
                twin = next((m for m in members if m.seed == run.seed), None)
                if twin is not None:
                    raise CompareError(f"{run.path}: the same config and train.seed ({run.seed!r}) as {twin.path}: "
                                       f"one run twice (a copy?); a group's runs must differ by train.seed")
                members.append(run)
                break
        else:
            groups.append((key, [run]))
    out = [Group(_label(members), members) for _, members in groups]
    seen: dict[str, int] = {}
    for g in out:  # two groups with the same name: number them
        seen[g.label] = seen.get(g.label, 0) + 1
        if seen[g.label] > 1:
            g.label = f"{g.label} ({seen[g.label]})"
    return out


def _fmt(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.3f}"


def _cell(point: dict | None) -> str:
    if point is None:
        return "n/a"
    if point["lo"] is None or point["hi"] is None:
        return _fmt(point["value"])
    return f"{_fmt(point['value'])} [{_fmt(point['lo'])}, {_fmt(point['hi'])}]"


def available_metrics(runs: list[Run], metrics=None) -> list[str]:
    if metrics:
        return list(metrics)
    present = {k for r in runs for row in r.rows for k in row}
    found = [m for m in DEFAULT_METRICS if m in present]
    return found or ["eval/greedy_acc"]


def format_table(groups: list[Group], metrics: list[str]) -> str:
    """Markdown: a row per run (final value [95% interval]) and a mean row per group of several seeds."""
    head = "| run | seed | step | train time (s) | " + " | ".join(metrics) + " |"
    lines = [head, "|" + "---|" * (4 + len(metrics))]
    for g in groups:
        for r in g.runs:
            finals = [r.final(m) for m in metrics]
            last = next((f for f in finals if f is not None), None)
            step = last["step"] if last else None
            time = last["time"] if last else None
            lines.append(f"| {g.label} | {r.seed if r.seed is not None else r.path.name} | "
                         f"{step if step is not None else 'n/a'} | {_fmt(time) if time is not None else 'n/a'} | "
                         + " | ".join(_cell(f) for f in finals) + " |")
        if len(g.runs) > 1:
            cells = []
            for m in metrics:
                vals = [f["value"] for f in (r.final(m) for r in g.runs) if f is not None and f["value"] is not None]
                if len(vals) != len(g.runs):
                    cells.append("n/a")
                else:
                    cells.append(f"{_fmt(sum(vals) / len(vals))} (seeds {_fmt(min(vals))}..{_fmt(max(vals))})")
            lines.append(f"| {g.label} | mean of {len(g.runs)} | | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def metric_sums(values: list, metric: str) -> list[tuple] | None:
    """[(num, den)] of ``metric`` for each evaluation's per-problem values; None when one did not measure it."""
    num, den = METRICS[metric]
    if any(getattr(v, f) is None for v in values for f in (num, den)):
        return None
    return [(getattr(v, num).numpy(), getattr(v, den).numpy()) for v in values]


def absolute_change(metric: str) -> bool:
    """Whether ``metric``'s change is shown as a difference (accuracies, a share of problems or samples) rather than
    relative to its start (divergences, masses)."""
    return metric.endswith("_acc")


def _change_cell(group: Group, metric: str, resamples: int, baseline=None) -> str:
    before, after, spans = [], [], set()
    for r in group.runs:
        steps = r.value_steps()
        if len(steps) < (1 if baseline is not None else 2):
            return "n/a"
        first = baseline if baseline is not None else r.values(steps[0])
        last = r.values(steps[-1])
        sums = metric_sums([first, last], metric) if first.num_problems == last.num_problems else None
        if sums is None:
            return "n/a"  # not the same problems (or the metric not measured): nothing to pair
        before.append(sums[0])
        after.append(sums[1])
        spans.add(("baseline" if baseline is not None else f"step {steps[0]}", steps[-1]))
    if absolute_change(metric):  # an accuracy: the change in points (0.14 -> 0.48 is +0.34, not +2.43)
        iv = paired_difference(after, before, resamples=resamples)
    else:
        iv = paired_change(before, after, resamples=resamples)
    if not math.isfinite(iv.value):
        return "n/a"  # a ratio that is 0 (or undefined) before: no relative change
    span = ""
    if len(spans) == 1:  # every seed spans the same steps: name them
        start, end = spans.pop()
        span = f" ({start}->{end})"
    return f"{iv.value:+.3f} [{iv.lo:+.3f}, {iv.hi:+.3f}]{span}"


def change_table(groups: list[Group], metrics: list[str], *, baseline=None, resamples: int = 1000) -> str | None:
    """Markdown: per group and metric, the relative change from the first evaluation that kept per-problem values
    (or from ``baseline``, an :class:`EvalValues` of the same problems, e.g. the untrained student's) to the last,
    paired over problems, mean over the group's seeds [95% interval]; None when no run kept them."""
    metrics = [m for m in metrics if m in METRICS]
    need = 1 if baseline is not None else 2
    if not metrics or not any(len(r.value_steps()) >= need for g in groups for r in g.runs):
        return None
    lines = ["| run | seeds | " + " | ".join(f"{m} change ({'absolute' if absolute_change(m) else 'relative'})"
                                             for m in metrics) + " |", "|" + "---|" * (2 + len(metrics))]
    for g in groups:
        cells = [_change_cell(g, m, resamples, baseline) for m in metrics]
        lines.append(f"| {g.label} | {len(g.runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def difference_table(groups: list[Group], metrics: list[str], *, resamples: int = 1000) -> str | None:
    """Markdown: each later group minus the first (mean over each group's seeds), at every step where all their runs
    kept per-problem values of the same problems, paired over problems [95% interval]; None when there is no such
    step (or only one group)."""
    metrics = [m for m in metrics if m in METRICS]
    if len(groups) < 2 or not metrics:
        return None
    ref = groups[0]
    lines = []
    for g in groups[1:]:
        runs = [*g.runs, *ref.runs]
        for step in sorted(set.intersection(*(set(r.value_steps()) for r in runs))):
            values = [r.values(step) for r in runs]
            if len({v.num_problems for v in values}) != 1:
                continue  # not the same problems: nothing to pair
            cells = []
            for m in metrics:
                sums = metric_sums(values, m)
                iv = None if sums is None else paired_difference(sums[:len(g.runs)], sums[len(g.runs):],
                                                                 resamples=resamples)
                cells.append("n/a" if iv is None or not math.isfinite(iv.value)
                             else f"{iv.value:+.3f} [{iv.lo:+.3f}, {iv.hi:+.3f}]")
            lines.append(f"| {g.label} - {ref.label} | {step} | " + " | ".join(cells) + " |")
    if not lines:
        return None
    head = ["| difference | step | " + " | ".join(metrics) + " |", "|" + "---|" * (2 + len(metrics))]
    return "\n".join(head + lines)


def read_values(path: str | Path, what: str | None = None):
    """Per-problem values written by the trainer (``RUN_DIR/eval/step_NNNNNN.json``) or ``opdistill eval --values``;
    CompareError naming ``what`` (default: the path) when unreadable."""
    path = Path(path)
    try:
        return values_from_json(json.loads(path.read_text()), str(path))
    except (OSError, json.JSONDecodeError, ValueError, RecursionError) as e:
        raise CompareError(f"{what or path}: unreadable per-problem values ({str(e)[:200]})") from None


def _mean_curve(runs: list[Run], metric: str) -> list[tuple[int, float, float]]:
    """(step, mean time, mean value) at the steps every run evaluated."""
    curves = [{p["step"]: p for p in r.curve(metric)} for r in runs]
    common = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    out = []
    for s in common:
        pts = [c[s] for c in curves]
        times = [p["time"] for p in pts]
        t = sum(times) / len(times) if all(x is not None for x in times) else float("nan")
        out.append((s, t, sum(p["value"] for p in pts) / len(pts)))
    return out


def plot_groups(groups: list[Group], metrics: list[str], out: str | Path, *, title: str | None = None) -> Path:
    """One PNG: a row per metric, columns vs step and vs training time; each run thin with its interval band, each
    group's mean (over its seeds) bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(metrics), 2, figsize=(10, 3.0 * len(metrics)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for gi, g in enumerate(groups):
        color = colors[gi % len(colors)]
        for mi, metric in enumerate(metrics):
            for col, xkey in enumerate(("step", "time")):
                ax = axes[mi][col]
                for r in g.runs:
                    pts = [p for p in r.curve(metric) if p[xkey] is not None]
                    if not pts:
                        continue
                    xs = [p[xkey] for p in pts]
                    single = len(g.runs) == 1
                    ax.plot(xs, [p["value"] for p in pts], color=color, lw=2.0 if single else 0.8,
                            alpha=1.0 if single else 0.6, marker="o", markersize=2,
                            label=g.label if single else None)
                    band = [p for p in pts if p["lo"] is not None and p["hi"] is not None]
                    if band:
                        ax.fill_between([p[xkey] for p in band], [p["lo"] for p in band], [p["hi"] for p in band],
                                        color=color, alpha=0.12, lw=0)
                if len(g.runs) > 1:
                    mean = _mean_curve(g.runs, metric)
                    xs = [m[0] if xkey == "step" else m[1] for m in mean]
                    ax.plot(xs, [m[2] for m in mean], color=color, lw=2.4,
                            label=f"{g.label} (mean of {len(g.runs)} seeds)")
                ax.set_xlabel("step" if xkey == "step" else "training time (s)")
                ax.set_ylabel(metric, fontsize=8)
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, out, dpi=100)
    plt.close(fig)
    return out


def _default_title(groups: list[Group]) -> str:
    """The figure's title when none is given: the groups compared, and their seeds."""
    names = ", ".join(f"{g.label} ({len(g.runs)} seed{'s' if len(g.runs) != 1 else ''})" for g in groups)
    return f"opdistill compare: {names if len(names) <= 150 else names[:147] + '...'}"


def compare(run_dirs, *, out: str | Path | None = None, metrics=None, title: str | None = None,
            baseline: str | Path | None = None) -> dict:
    """Table (markdown) and PNG of the runs; returns {"table", "png", "groups": {label: [run dirs]}}."""
    if not run_dirs:
        raise CompareError("compare: expected at least one RUN_DIR")
    out = Path(out) if out is not None else Path(run_dirs[0]) / "compare.png"
    check_image_path(out, "--out")
    check_output_path(out, "--out")
    runs = load_runs(run_dirs)
    base = read_values(baseline, f"--baseline {baseline}") if baseline is not None else None
    if base is not None:  # the shared start is every run's step-0 point when the run did not evaluate it itself
        start_row = {"step": 0, **summarize(base)}
        for r in runs:
            if not any(row.get("step") == 0 and any(k.startswith("eval/") for k in row) for row in r.rows):
                r.rows.insert(0, start_row)
    metrics = available_metrics(runs, metrics)
    groups = group_runs(runs)
    table = format_table(groups, metrics)
    change = change_table(groups, metrics, baseline=base)
    if change is not None:
        start = "the baseline" if baseline is not None else "the first evaluation"
        table += (f"\n\nChange from {start} to the last evaluation (accuracies: after - before; other metrics: "
                  "relative, after / before - 1; paired over problems, mean over seeds, 95% interval):\n\n" + change)
    difference = difference_table(groups, metrics)
    if difference is not None:
        table += ("\n\nDifference from the first group at each step their runs evaluated (paired over problems, mean "
                  "over each group's seeds, 95% interval):\n\n" + difference)
    with output_lock(out, "--out"):
        png = plot_groups(groups, metrics, out, title=title if title is not None else _default_title(groups))
    return {"table": table, "png": png, "groups": {g.label: [str(r.path) for r in g.runs] for g in groups}}
