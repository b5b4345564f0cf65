"""The metric names the plot, the progress bar and docs/trainer.md use are the names the trainer emits.

Two tiny runs through the real loop (RL with evaluation; on-policy distillation with policy gradient and task
rewards) give the emitted names; a name that the plot, the progress bar or the docs use but no run emits fails, and
so does a run whose loss the plot's loss panel would not draw (the RL loss was named ``actor/pg_loss`` there while the
code emits ``policy/loss``).
"""
import json
import re
from pathlib import Path

import pytest

from opdistill.train.run.config import load_config
from opdistill.runs.files import read_metrics
from opdistill.train.disk.logger import PROGRESS_KEYS
from opdistill.train.loop import run_training
from opdistill.runs.plot import LABELS, PANELS, plot_run
from tests.trainer_helpers import tiny_config_dict

DOCS = Path(__file__).resolve().parents[1] / "docs" / "trainer.md"
METRIC = re.compile(r"`((?:distillation|policy|task|loss|train|time|perf|eval|rollout|env)/[a-z_]+)`")
LOSS_PANEL = dict(PANELS)["loss"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: metrics.jsonl rows} of one RL run and one distillation run using every loss term."""
    tmp = tmp_path_factory.mktemp("names")
    configs = {
        "rl": tiny_config_dict(tmp, method="rl", steps=1, eval={"every": 1, "num_prompts": 2, "batch_size": 2},
                               checkpoint={"every": 0, "save_final": False}),
        "distill": tiny_config_dict(tmp, steps=1, eval={"num_prompts": 0}, checkpoint={"every": 0, "save_final": False},
                                    loss={"support": "tail", "divergence": "reverse", "use_policy_gradient": True,
                                          "use_task_rewards": True, "distillation_coef": 0.5},
                                    rollout={"tis_cap": 2.0}),
    }
    multi = tiny_config_dict(tmp, steps=1, eval={"num_prompts": 0}, checkpoint={"every": 0, "save_final": False})
    multi["model"]["teacher"] = None
    multi["data"] = {"task": "mix", "prompts_per_step": 4, "task_args": {"tasks": {
        "short": {"task": "carry_add", "min_digits": 1, "max_digits": 1},
        "long": {"task": "carry_add", "min_digits": 2, "max_digits": 2}}}}
    multi["teachers"] = [{"name": "a", "path": str(tmp / "teacher")}, {"name": "b", "path": str(tmp / "teacher")}]
    multi["routing"] = {"table": {"short": "a", "long": "b"}}
    configs["multi"] = multi  # two routed teachers: the teacher/<name>/* names
    configs["pipelined"] = tiny_config_dict(  # train.max_staleness: the staleness, waits and ICE-POP names
        tmp, steps=2, eval={"num_prompts": 0}, checkpoint={"every": 0, "save_final": False},
        train={"max_staleness": 1}, rollout={"correction": "icepop", "icepop_band": [0.5, 2.0]})
    from opdistill.env.demo import ENV_CONFIG

    configs["episodes"] = {  # tools (SPEC 6.8): the env/* names and the evaluation's tool use
        "model": {"student": "builtin:demo-tool-student", "teacher": "builtin:demo-tool-teacher"},
        "data": {"task": "lookup_add", "prompts_per_step": 2}, "env": ENV_CONFIG, "rollout": {"n": 2},
        "loss": {"loss_mode": "topk", "topk": 8, "divergence": "reverse"},
        "train": {"steps": 1, "threads": 1}, "eval": {"every": 1, "num_prompts": 2, "batch_size": 2},
        "checkpoint": {"every": 0, "save_final": False}, "log": {"tensorboard": False, "progress": False}}
    out = {}
    for name, cfg in configs.items():
        cfg["run_dir"] = str(tmp / name)
        run_training(load_config(base=cfg), quiet=True)
        out[name] = read_metrics(tmp / name)
    return out


def _emitted(runs) -> set[str]:
    return {k for rows in runs.values() for r in rows for k in r}


def test_every_run_has_its_loss_on_the_loss_panel(runs):
    for name, rows in runs.items():
        steps = [r for r in rows if "train/grad_norm" in r]
        assert steps, name
        for r in steps:
            drawn = [k for k in LOSS_PANEL if r.get(k) is not None]
            assert drawn, f"{name}: the loss panel {LOSS_PANEL} draws none of the step's metrics {sorted(r)}"
    assert runs["rl"][1]["policy/loss"] is not None  # the RL loss by its emitted name


def test_plot_and_progress_names_are_emitted(runs):
    emitted = _emitted(runs)
    plotted = {k for _, keys in PANELS for k in keys}
    assert plotted - emitted == set(), "plot.PANELS names metrics no run emits"
    assert {k for k, _ in PROGRESS_KEYS} - emitted == set(), "logger.PROGRESS_KEYS names metrics no run emits"


def test_names_in_docs_are_emitted(runs):
    documented = set(METRIC.findall(DOCS.read_text()))
    assert {"policy/loss", "task/loss", "distillation/pg_loss", "eval/teacher_kl"} <= documented  # the regex reads the page
    assert documented - _emitted(runs) == set(), "docs/trainer.md names metrics no run emits"


def test_per_teacher_names_in_docs_are_emitted(runs):
    """`teacher/<name>/X` on docs/trainer.md and docs/teacher_service.md: X is emitted for each of the teachers."""
    text = DOCS.read_text() + (DOCS.parent / "teacher_service.md").read_text()
    documented = set(re.findall(r"teacher/<name>/([a-z_]+)", text))
    assert {"token_frac", "loss", "divergence", "teacher_mass", "overlap_ratio"} <= documented
    emitted = {k for r in runs["multi"] for k in r}
    missing = {f"teacher/{t}/{x}" for x in documented for t in ("a", "b")} - emitted
    assert missing == set(), "the docs name per-teacher metrics the multi-teacher run does not emit"


def test_plot_of_an_rl_run_draws_its_loss(runs, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k))[1])
    rl_dir = tmp_path / "rl"
    rl_dir.mkdir()
    (rl_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs["rl"]))
    png = plot_run(rl_dir)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    loss_axis = fig.axes[[title for title, _ in PANELS].index("loss")]
    assert [line.get_label() for line in loss_axis.lines] == [LABELS["policy/loss"]]
