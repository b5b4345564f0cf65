"""`opdistill eval` (JSON with intervals, on any run directory), `opdistill compare` (table + PNG, seed groups) and
the demo's figure, on tiny real runs and on hand-written metrics."""
import json
import math
import shutil

import numpy as np
import pytest
import yaml

from opdistill.cli import main
from opdistill.demo import demo_figure
from opdistill.train.run.config import load_config
from opdistill.runs.values import METRICS
from opdistill.runs.files import read_metrics
from opdistill.train.loop import run_training
from tests.trainer_helpers import tiny_config_dict

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two seeds of one tiny config (2 steps, evaluated at every step), and a copy of seed 0 whose config differs by
    the learning rate (another group)."""
    tmp = tmp_path_factory.mktemp("cmp")
    out = []
    for seed in (0, 1):
        cfg = tiny_config_dict(tmp, steps=2, train={"seed": seed}, eval={"every": 1, "num_prompts": 4, "batch_size": 4,
                                                                        "bootstrap_resamples": 200},
                               checkpoint={"every": 0, "save_final": True})
        cfg["run_dir"] = str(tmp / f"base-seed{seed}")
        run_training(load_config(base=cfg), quiet=True)
        out.append(tmp / f"base-seed{seed}")
    other = tmp / "highlr-seed0"
    shutil.copytree(out[0], other)
    conf = yaml.safe_load((other / "config.yaml").read_text())
    conf["optim"]["lr"] = 0.5
    (other / "config.yaml").write_text(yaml.safe_dump(conf))
    rows = [json.loads(x) for x in (other / "metrics.jsonl").read_text().splitlines()]
    for r in rows:  # its own timings, as any other run has (a byte-identical metrics.jsonl is refused as a copy)
        if "time/step_s" in r:
            r["time/step_s"] *= 1.5
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out + [other]


def _capture_figures(monkeypatch):
    from matplotlib.figure import Figure

    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k))[1])
    return figures


def test_eval_on_a_run_dir_reports_every_metric_with_its_interval(runs, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", str(runs[0]), "eval.num_samples=2", "eval.bootstrap_resamples=300", "--out", str(out),
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    report = json.loads(out.read_text())
    assert printed == report
    assert report["checkpoint"].endswith("step_00000002")  # RUN_DIR: its newest checkpoint by default
    assert (report["num_problems"], report["num_samples"], report["bootstrap_resamples"]) == (4, 2, 300)
    assert set(report["metrics"]) == {m for m in METRICS if "used_tool" not in m}  # those: episodes' only
    for name, m in report["metrics"].items():
        assert m["lo"] <= m["value"] <= m["hi"], (name, m)
    acc = report["metrics"]["eval/sampled_acc"]["value"]
    assert acc * 8 == pytest.approx(round(acc * 8))  # 4 problems x 2 samples


def test_eval_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["eval", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"opdistill eval: config error: {tmp_path}: no config.yaml (expected a run directory, "
                   f"or pass --config FILE)")


def test_logged_evaluations_carry_intervals(runs):
    rows = [r for r in read_metrics(runs[0]) if "eval/greedy_acc" in r]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        for name in ("eval/greedy_acc", "eval/teacher_kl", "eval/teacher_kl_k3", "eval/overlap_ratio"):
            assert r[f"{name}_lo"] <= r[name] <= r[f"{name}_hi"], (name, r)
        assert r["eval/teacher_kl_k3"] >= 0  # (r - 1) - log r >= 0 token by token


def test_compare_groups_seeds_and_draws_curves_with_bands(runs, tmp_path, capsys, monkeypatch):
    figures = _capture_figures(monkeypatch)
    png = tmp_path / "cmp.png"
    metrics = ["eval/greedy_acc", "eval/teacher_kl"]
    assert main(["compare", *map(str, runs), "--out", str(png), "--metric", metrics[0], "--metric", metrics[1]]) == 0
    text = capsys.readouterr().out
    assert png.read_bytes()[:8] == PNG
    finals = [[r for r in read_metrics(d) if m in r][-1] for d in runs[:2] for m in metrics]

    def cell(row, m):
        return f"{row[m]:.3f} [{row[m + '_lo']:.3f}, {row[m + '_hi']:.3f}]"

    lines = text.splitlines()
    seed0 = next(line for line in lines if line.startswith("| base | 0 |"))
    assert cell(finals[0], metrics[0]) in seed0 and cell(finals[1], metrics[1]) in seed0
    seed1 = next(line for line in lines if line.startswith("| base | 1 |"))
    assert cell(finals[2], metrics[0]) in seed1 and cell(finals[3], metrics[1]) in seed1
    mean = next(line for line in lines if line.startswith("| base | mean of 2 |"))
    kl = [finals[1]["eval/teacher_kl"], finals[3]["eval/teacher_kl"]]
    assert f"{sum(kl) / 2:.3f} (seeds {min(kl):.3f}..{max(kl):.3f})" in mean
    assert any(line.startswith("| highlr | 0 |") for line in lines)
    assert not any(line.startswith("| highlr | mean") for line in lines)  # a group of one seed has no mean row

    (fig,) = figures
    axes = fig.axes
    assert len(axes) == 4  # 2 metrics x (vs step, vs time)
    curves = [[r for r in read_metrics(d) if "eval/teacher_kl" in r] for d in runs[:2]]
    times = [{r["step"]: r["time/train_total_s"] for r in read_metrics(d) if "time/train_total_s" in r} | {0: 0.0}
             for d in runs[:2]]
    for ax, x_of in ((axes[2], lambda r, i: r["step"]), (axes[3], lambda r, i: times[i][r["step"]])):
        thin = [ln for ln in ax.lines if ln.get_linewidth() < 1]
        bold = [ln for ln in ax.lines if ln.get_linewidth() > 2.3]
        assert len(thin) == 2 and len(bold) == 1  # the base group's two seeds and their mean
        for i, ln in enumerate(thin):
            assert list(ln.get_xdata()) == pytest.approx([x_of(r, i) for r in curves[i]])
            assert list(ln.get_ydata()) == pytest.approx([r["eval/teacher_kl"] for r in curves[i]])
        assert list(bold[0].get_ydata()) == pytest.approx(
            [(a["eval/teacher_kl"] + b["eval/teacher_kl"]) / 2 for a, b in zip(*curves)])
        assert len(ax.collections) == 3  # an interval band per run


def test_runs_keep_per_problem_values_and_compare_pairs_them(runs, tmp_path, capsys):
    from opdistill.runs.stats import paired_change

    for d in runs[:2]:  # one file per evaluation, equal to the logged metrics' sums
        assert sorted(p.name for p in (d / "eval").iterdir()) == [f"step_00000{s}.json" for s in (0, 1, 2)]
        last = json.loads((d / "eval" / "step_000002.json").read_text())
        row = [r for r in read_metrics(d) if "eval/teacher_kl" in r][-1]
        assert sum(last["k1_sum"]) / sum(last["tokens"]) == pytest.approx(row["eval/teacher_kl"], rel=1e-12)
        assert len(last["problems"]) == 4
    assert main(["compare", str(runs[0]), str(runs[1]), "--out", str(tmp_path / "c.png"),
                 "--metric", "eval/teacher_kl"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| base | 2 |"))
    before, after = [], []
    for d in runs[:2]:
        first, last = (json.loads((d / "eval" / f"step_00000{s}.json").read_text()) for s in (0, 2))
        before.append((first["k1_sum"], first["tokens"]))
        after.append((last["k1_sum"], last["tokens"]))
    point = sum(sum(a[0]) / sum(a[1]) / (sum(b[0]) / sum(b[1])) for a, b in zip(after, before)) / 2 - 1
    iv = paired_change(before, after)
    assert f"{point:+.3f} [{iv.lo:+.3f}, {iv.hi:+.3f}] (step 0->2)" in line


def test_compare_pairs_groups_step_by_step(runs, tmp_path, capsys):
    from opdistill.runs.stats import paired_difference

    assert main(["compare", *map(str, runs), "--out", str(tmp_path / "c.png"), "--metric", "eval/teacher_kl",
                 "--metric", "eval/sampled_acc"]) == 0
    text = capsys.readouterr().out
    assert "Difference from the first group at each step their runs evaluated" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| highlr - base |")]
    assert [ln.split("|")[2].strip() for ln in rows] == ["0", "1", "2"]

    def load(d, step):
        return json.loads((d / "eval" / f"step_{step:06d}.json").read_text())

    for row in rows:
        step = int(row.split("|")[2])
        for cell, (num, den) in zip(row.split("|")[3:5], (("k1_sum", "tokens"), ("sampled_correct", "samples"))):
            vals = [load(d, step) for d in (runs[2], runs[0], runs[1])]  # highlr (a copy of base seed 0), base seeds
            r = [sum(v[num]) / sum(v[den]) for v in vals]
            point = r[0] - (r[1] + r[2]) / 2  # group means: highlr's one seed minus base's two
            iv = paired_difference([(vals[0][num], vals[0][den])], [(v[num], v[den]) for v in vals[1:]])
            assert cell.strip() == f"{point:+.3f} [{iv.lo:+.3f}, {iv.hi:+.3f}]"
    # step 0: every run evaluated the same untrained student on the same problems, so the difference is exactly 0
    assert rows[0].split("|")[3].strip() == "+0.000 [+0.000, +0.000]"
    # one group: nothing to difference
    assert main(["compare", str(runs[0]), "--out", str(tmp_path / "d.png")]) == 0
    assert "Difference from the first group" not in capsys.readouterr().out


def test_compare_baseline_and_eval_at_start_false(runs, tmp_path, capsys, monkeypatch):
    base = runs[0] / "eval" / "step_000000.json"
    assert main(["compare", str(runs[0]), "--out", str(tmp_path / "a.png"), "--metric", "eval/teacher_kl"]) == 0
    own = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| base | 1 |"))
    assert main(["compare", str(runs[0]), "--out", str(tmp_path / "b.png"), "--metric", "eval/teacher_kl",
                 "--baseline", str(base)]) == 0
    text = capsys.readouterr().out
    assert "Change from the baseline to the last evaluation" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("| base | 1 |"))
    assert line == own.replace("(step 0->2)", "(baseline->2)")
    # a run that skips the step-0 evaluation keeps only its later values; --baseline pairs them with the start
    cfg = tiny_config_dict(tmp_path, steps=1, eval={"every": 1, "num_prompts": 4, "batch_size": 4, "at_start": False,
                                                    "bootstrap_resamples": 0}, checkpoint={"every": 0})
    cfg["run_dir"] = str(tmp_path / "late")
    run_training(load_config(base=cfg), quiet=True)
    assert [r["step"] for r in read_metrics(tmp_path / "late") if "eval/teacher_kl" in r] == [1]
    assert [p.name for p in (tmp_path / "late" / "eval").iterdir()] == ["step_000001.json"]
    figures = _capture_figures(monkeypatch)
    assert main(["compare", str(tmp_path / "late"), "--baseline", str(base), "--out", str(tmp_path / "d.png"),
                 "--metric", "eval/teacher_kl"]) == 0
    capsys.readouterr()
    start = json.loads(base.read_text())
    (ax, _), = [figures[0].axes[:2]]
    (line,) = ax.lines  # the baseline is the late run's step-0 point
    assert list(line.get_xdata()) == [0, 1]
    assert line.get_ydata()[0] == pytest.approx(sum(start["k1_sum"]) / sum(start["tokens"]), rel=1e-12)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["compare", str(tmp_path / "late"), "--baseline", str(bad), "--out", str(tmp_path / "c.png")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"opdistill compare: error: --baseline {bad}: unreadable per-problem values ({bad}: expected an object of "
        f"per-problem lists with a 'problems' list)")


def test_change_table_cells_from_hand_written_values(tmp_path):
    """Hand-written per-problem values: a metric 30% lower on every problem reads -0.300 with a zero-width interval;
    an accuracy changes in points, and a run with one evaluation reads n/a."""
    from opdistill.runs.compare import Group, change_table, load_runs
    from opdistill.runs.stats import paired_difference

    def run(name, evals):
        d = tmp_path / name
        (d / "eval").mkdir(parents=True)
        # the evaluation rows the trainer logs beside each values file (compare reads only those metrics.jsonl holds)
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "eval/greedy_acc": 0.0}) + "\n" for s in evals))
        for step, vals in evals.items():
            (d / "eval" / f"step_{step:06d}.json").write_text(json.dumps(vals))
        return d

    start = {"problems": [1.0] * 3, "greedy_correct": [0.0] * 3, "tokens": [10.0, 20.0, 30.0],
             "k1_sum": [5.0, 1.0, 9.0]}
    end = {**start, "greedy_correct": [1.0, 0.0, 1.0], "k1_sum": [3.5, 0.7, 6.3]}
    a, b = load_runs([run("a", {0: start, 40: end}), run("b", {40: end})])
    table = change_table([Group("a", [a]), Group("b", [b])], ["eval/teacher_kl", "eval/greedy_acc"])
    lines = table.splitlines()
    # an accuracy changes in points: 0 -> 2/3 is +0.667 (relative to 0 it was undefined, and the cell read n/a)
    iv = paired_difference([(np.array(end["greedy_correct"]), np.ones(3))], [(np.zeros(3), np.ones(3))])
    assert lines[2] == f"| a | 1 | -0.300 [-0.300, -0.300] (step 0->40) | +0.667 [{iv.lo:+.3f}, {iv.hi:+.3f}] (step 0->40) |"
    assert lines[3] == "| b | 1 | n/a | n/a |"


def test_eval_writes_per_problem_values(runs, tmp_path, capsys):
    out = tmp_path / "v.json"
    assert main(["eval", str(runs[0]), "eval.bootstrap_resamples=0", "--values", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    vals = json.loads(out.read_text())
    assert len(vals["problems"]) == 4
    assert sum(vals["k1_sum"]) / sum(vals["tokens"]) == pytest.approx(report["metrics"]["eval/teacher_kl"]["value"],
                                                                      rel=1e-12)


def test_compare_refuses_a_folder_without_metrics(tmp_path, capsys):
    assert main(["compare", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"opdistill compare: error: {tmp_path}: no metrics.jsonl (expected a run directory written by opdistill train)")


def test_demo_figure_from_fake_metrics(tmp_path, monkeypatch):
    """Three methods x two seeds of hand-written metrics: accuracy and teacher-KL vs step and vs time, each seed thin
    with its band, the mean over seeds bold."""
    figures = _capture_figures(monkeypatch)
    values = {}
    for mi, method in enumerate(("on_policy", "off_policy", "rl")):
        for seed in (0, 1):
            run = tmp_path / f"{method}-seed{seed}"
            run.mkdir()
            rows, vals = [], []
            for k, step in enumerate((0, 5, 10)):
                acc, kl = 0.1 * k + 0.01 * seed + mi * 0.2, 1.0 - 0.2 * k + 0.05 * seed
                t = 1.5 * step + seed if step else 0.0  # training time; 0 before the first step
                vals.append((step, t, acc, kl))
                if step:  # the step's training row, then its evaluation row (as the loop's final evaluation logs)
                    rows.append({"step": step, "time/train_total_s": t, "distillation/loss": 0.1})
                rows.append({"step": step, "eval/greedy_acc": acc, "eval/greedy_acc_lo": acc - 0.05,
                             "eval/greedy_acc_hi": acc + 0.05, "eval/teacher_kl": kl, "eval/teacher_kl_lo": kl - 0.1,
                             "eval/teacher_kl_hi": kl + 0.1})
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            values[method, seed] = vals
    png = demo_figure(tmp_path, seeds=(0, 1))
    assert png == tmp_path / "demo.png" and png.read_bytes()[:8] == PNG
    (fig,) = figures
    assert len(fig.axes) == 4
    acc_vs_time = fig.axes[1]
    bold = [ln for ln in acc_vs_time.lines if ln.get_linewidth() > 2.3]
    thin = [ln for ln in acc_vs_time.lines if ln.get_linewidth() < 1]
    assert len(bold) == 3 and len(thin) == 6
    for mi, method in enumerate(("on_policy", "off_policy", "rl")):
        a, b = values[method, 0], values[method, 1]
        assert list(bold[mi].get_xdata()) == pytest.approx([(x[1] + y[1]) / 2 for x, y in zip(a, b)])
        assert list(bold[mi].get_ydata()) == pytest.approx([(x[2] + y[2]) / 2 for x, y in zip(a, b)])
        assert bold[mi].get_label() == f"{method} (mean of 2 seeds)"


@pytest.mark.parametrize("budget", [None, 1])
def test_per_problem_values_match_a_float64_reference(tmp_path, monkeypatch, budget):
    """evaluate_values on a tiny student/teacher, 2 samples per problem: every per-problem sum equals the same sum
    computed from full-vocabulary float64 log-probs (tests/reference.py for the tail KL and the diagnostics).
    ``budget=1``: the diagnostics' logits budget allows one row per forward (the memory bound), same values."""
    import torch
    import torch.nn.functional as F

    from opdistill.train.steps import evaluate as evaluate_mod

    if budget is not None:
        monkeypatch.setattr(evaluate_mod, "DIAGNOSTIC_LOGITS", budget)

    from opdistill.data import PromptSource, render_prompt
    from opdistill.engines.rollout import generate_rollouts
    from opdistill.teachers import LocalTeacher
    from opdistill.train.steps.evaluate import evaluate_values
    from opdistill.train.loop import build_task, load_models
    from tests.reference import diagnostics_reference, topk_row

    cfg = load_config(base=tiny_config_dict(tmp_path))
    tok, student, teacher = load_models(cfg)
    task = build_task(cfg)
    problems = PromptSource(task, 0, 0).held_out(3)
    K, seed = 4, 99
    widths = []  # rows of each full-sequence student forward (the diagnostics)
    hook = student.register_forward_pre_hook(lambda m, a, kw: widths.append(tuple(kw["input_ids"].shape)),
                                             with_kwargs=True)
    vals = evaluate_values(student, tok, task, problems, teacher=LocalTeacher(teacher), max_new_tokens=12, topk=K,
                           batch_size=2, seed=seed, num_samples=2)
    hook.remove()
    full = max(w[1] for w in widths)
    assert [w[0] for w in widths if w[1] == full] == ([2, 2, 2] if budget is None else [1] * 6)
    prompts = [render_prompt(tok, p.prompt, use_chat_template=True) for p in problems]
    ro = generate_rollouts(student, tok, prompts, n=2, max_new_tokens=12, seed=seed, step=0)  # the same keyed draw
    with torch.no_grad():
        zs = student(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits.double()
        zt = teacher(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits.double()
    log_pi, log_nu = F.log_softmax(zs, -1), F.log_softmax(zt, -1)
    ref = {k: [0.0] * 3 for k in ("samples", "correct", "tokens", "k1", "k3", "tail", "q", "p", "overlap")}
    for r, i in enumerate(ro.prompt_index):
        ref["samples"][i] += 1
        ref["correct"][i] += float(task.score(problems[i], ro.texts[r]))
        for t in range(ro.input_ids.shape[1] - 1):
            if not ro.response_mask[r, t + 1]:
                continue
            y = int(ro.input_ids[r, t + 1])
            log_r = float(log_nu[r, t, y] - log_pi[r, t, y])
            top = torch.topk(log_nu[r, t], K)
            q, p, count, _ = diagnostics_reference(zs[r, t][None], top.indices[None], top.values[None])
            ref["tokens"][i] += 1
            ref["k1"][i] += -log_r
            ref["k3"][i] += math.expm1(log_r) - log_r
            ref["tail"][i] += float(topk_row(zs[r, t], top.indices, top.values, "tail", "reverse"))
            ref["q"][i] += float(q[0])
            ref["p"][i] += float(p[0])
            ref["overlap"][i] += int(count[0])
    got = {"samples": vals.samples, "correct": vals.sampled_correct, "tokens": vals.tokens, "k1": vals.k1_sum,
           "k3": vals.k3_sum, "tail": vals.tail_kl_sum, "q": vals.student_mass_sum, "p": vals.teacher_mass_sum,
           "overlap": vals.overlap_count}
    assert sum(ref["tokens"]) > 6
    for key, expected in ref.items():
        assert got[key].tolist() == pytest.approx(expected, rel=1e-4, abs=1e-5), key
    assert vals.overlap_slots.tolist() == [K * n for n in ref["tokens"]]
    assert vals.greedy_correct.shape == (3,) and set(vals.greedy_correct.tolist()) <= {0.0, 1.0}


def test_demo_method_differences_from_kept_values(tmp_path):
    """Each later method minus the first, at equal time (each run's last evaluation) and at the equal step, mean over
    seeds, from hand-written per-problem values: the point is the difference of the accuracies and KLs as written."""
    from opdistill.demo import method_differences
    from opdistill.runs.stats import paired_difference

    rng = np.random.default_rng(0)
    n = 30
    last = {("on_policy", 0): 12, ("on_policy", 1): 14, ("off_policy", 0): 10, ("off_policy", 1): 10}
    written = {}
    for (method, seed), end in last.items():
        for step in (10, end):
            correct = (rng.uniform(size=n) < (0.7 if method == "on_policy" else 0.4)).astype(float)
            tokens = rng.integers(5, 40, size=n).astype(float)
            kl = rng.uniform(0, 2, size=n) * tokens
            written[method, seed, step] = (correct, tokens, kl)
            folder = tmp_path / f"{method}-seed{seed}" / "eval"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"step_{step:06d}.json").write_text(json.dumps(
                {"problems": [1.0] * n, "greedy_correct": correct.tolist(), "tokens": tokens.tolist(),
                 "k1_sum": kl.tolist()}))
    runs = {m: [{"seed": s, "history": [{"step": 0}, {"step": 10}, {"step": last[m, s]}]} for s in (0, 1)]
            for m in ("on_policy", "off_policy")}
    diffs = method_differences(tmp_path, runs, s_eq=10)
    assert set(diffs) == {"off_policy"}

    def at(method, step_of, which):
        out = []
        for s in (0, 1):
            correct, tokens, kl = written[method, s, step_of(method, s)]
            out.append((correct, np.ones(n)) if which == "acc" else (kl, tokens))
        return out

    for key, step_of in (("acc", lambda m, s: last[m, s]), ("acc_eq", lambda m, s: 10),
                         ("kl", lambda m, s: last[m, s]), ("kl_eq", lambda m, s: 10)):
        which = "acc" if key.startswith("acc") else "kl"
        a, b = at("off_policy", step_of, which), at("on_policy", step_of, which)
        point = sum(x.sum() / y.sum() for x, y in a) / 2 - sum(x.sum() / y.sum() for x, y in b) / 2
        iv = paired_difference(a, b)
        assert diffs["off_policy"][key] == pytest.approx([point, iv.lo, iv.hi], abs=1e-12)
    assert diffs["off_policy"]["acc"][0] < -0.1  # written with 0.4 vs 0.7 accuracy: off-policy clearly behind


def test_compare_shows_an_accuracy_change_in_points_and_titles_its_figure(runs, tmp_path, capsys, monkeypatch):
    # issue 35 item 7: 0.14 -> 0.48 was shown as +2.429 (relative), and the figure had no title
    import shutil

    run = tmp_path / "acc-seed0"
    shutil.copytree(runs[0], run, ignore=shutil.ignore_patterns(".lock"))
    steps = sorted(int(p.stem.split("_")[1]) for p in (run / "eval").glob("step_*.json"))
    for step, correct in ((steps[0], [0.0, 1.0, 0.0, 0.0]), (steps[-1], [1.0, 1.0, 1.0, 0.0])):
        path = run / "eval" / f"step_{step:06d}.json"
        values = json.loads(path.read_text())
        values["greedy_correct"] = correct
        path.write_text(json.dumps(values))
    from opdistill.runs.stats import paired_difference

    figures = _capture_figures(monkeypatch)
    assert main(["compare", str(run), "--out", str(tmp_path / "acc.png"), "--metric", "eval/greedy_acc",
                 "--metric", "eval/teacher_kl"]) == 0
    text = capsys.readouterr().out
    assert "| run | seeds | eval/greedy_acc change (absolute) | eval/teacher_kl change (relative) |" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| acc | 1 |"))
    iv = paired_difference([(np.array([1.0, 1, 1, 0]), np.ones(4))], [(np.array([0.0, 1, 0, 0]), np.ones(4))])
    assert row.split("|")[3].strip() == f"+0.500 [{iv.lo:+.3f}, {iv.hi:+.3f}] (step {steps[0]}->{steps[-1]})"
    assert figures[0]._suptitle.get_text() == "opdistill compare: acc (1 seed)"
