"""The Python API (docs/python_api.md): your own reward functions, task objects, model objects and callbacks.

Expectations come from what the functions themselves return (recorded by the test), never from the trainer's sums.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from opdistill.cli import main
from opdistill.data import CarryAdditionTask, DatasetTask, Problem
from opdistill.data.rewards import Rewards
from opdistill.errors import ConfigError, RewardError, RunError
from opdistill.train import load_config, run_training
from opdistill.train.assemble import load_models
from tests.trainer_helpers import tiny_config_dict

ROOT = Path(__file__).resolve().parents[1]
PROBLEMS = [Problem(prompt="1+2=", answer="3"), Problem(prompt="4+4=", answer="8"), Problem(prompt="5+5=", answer="10")]
COMPLETIONS = ["0+1+0=3>3", "x", "5+5+0=10>10"]


def _module(tmp_path, monkeypatch, source: str, name: str = "my_rewards") -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)
    return name


# --- load-time checks: each refusal one ConfigError line naming the entry -----------------------------------------

@pytest.mark.parametrize("source, spec, message", [
    ("", "nosuch_module_xyz:f", "reward.functions.0: cannot import 'nosuch_module_xyz' (ModuleNotFoundError: No module "
                                "named 'nosuch_module_xyz'); the current folder {cwd} and sys.path are searched"),
    ("def good(completions): return [0.0] * len(completions)\n", "my_rewards:bad",
     "reward.functions.0: 'my_rewards' has no attribute 'bad' (its functions: ['good'])"),
    ("bad = 3\n", "my_rewards:bad", "reward.functions.0: expected a callable, got my_rewards:bad = 3"),
    ("def bad(completions, /): return []\n", "my_rewards:bad",
     "reward.functions.0 (my_rewards:bad): parameter 'completions' is positional-only; a reward function is called "
     "with keyword arguments (prompts, completions, answer, step)"),
    ("def bad(completions, scale): return []\n", "my_rewards:bad",
     "reward.functions.0 (my_rewards:bad): parameter 'scale' has no default and is not one of the keywords a reward "
     "function is called with (prompts, completions, answer, step)"),
    ("def bad(prompts, answer): return []\n", "my_rewards:bad",
     "reward.functions.0 (my_rewards:bad): expected a function of the completions (a parameter named 'completions', "
     "or **kwargs), got the parameters ['prompts', 'answer']"),
    ("raise RuntimeError('needs a GPU')\n", "my_rewards:f",
     "reward.functions.0: cannot import 'my_rewards' (RuntimeError: needs a GPU)"),
])
def test_a_reward_function_is_checked_at_load(tmp_path, monkeypatch, source, spec, message):
    _module(tmp_path, monkeypatch, source)
    with pytest.raises(ConfigError) as e:
        Rewards(CarryAdditionTask(), [spec])
    assert str(e.value) == message.format(cwd=Path.cwd())


S = {"model": {"student": "builtin:demo-student", "teacher": "builtin:demo-teacher"}, "loss": {"topk": 8}}


def test_config_rules_and_the_task_entry(tmp_path):
    with pytest.raises(ConfigError, match=r"^reward.functions.0: expected 'task', 'module:function' or "
                                          r"'file.py:function', got 'my_rewards'$"):
        load_config(base={**S, "reward": {"functions": ["my_rewards"]}})
    with pytest.raises(ConfigError, match=r"^reward.weights: expected 2 numbers, one per entry of reward.functions, "
                                          r"got \[1.0\]$"):
        load_config(base={**S, "reward": {"functions": ["task", "m:f"], "weights": [1.0]}})
    with pytest.raises(ConfigError, match=r"^reward.weights: expected 2 numbers, one per reward function, got 1$"):
        Rewards(CarryAdditionTask(), [len, "task"], [2.0])  # the weights of functions handed in (rewards=)
    assert Rewards(CarryAdditionTask(), [], [2.0]).custom  # the verifier, weighed: its metric is logged
    rows = DatasetTask.from_rows([{"prompt": "a"}, {"prompt": "b"}])  # no answers: the verifier has nothing to check
    with pytest.raises(ConfigError, match=r"^reward.functions.0: 'task': the dataset's rows have no answers"):
        Rewards(rows, ["task"])
    assert Rewards(rows).names == ("task",)  # the default stays as it was (NaN reward, as before)
    with pytest.raises(ConfigError, match=r"^reward.functions.1: a second reward named 'task'"):
        Rewards(CarryAdditionTask(), ["task", "task"])
    with pytest.raises(ConfigError, match=r"^rewards.1: a second reward named '<lambda>' .*name them: rewards="):
        Rewards(CarryAdditionTask(), [lambda completions: [], lambda completions: []], key="rewards")
    named = Rewards(CarryAdditionTask(), {"a": lambda completions: [1.0] * len(completions),
                                          "b": lambda completions: [True] * len(completions), "c": "task"})
    assert named.names == ("a", "b", "c")
    assert named(PROBLEMS, COMPLETIONS, 1)[1][:2] == [3.0, 3.0]
    (tmp_path / "r.py").write_text("def f(completions, **kw):\n    return [1.0] * len(completions)\n")
    assert Rewards(CarryAdditionTask(), [f"{tmp_path}/r.py:f"]).names == ("f",)  # a file path works too
    with pytest.raises(ConfigError, match=r"^reward.functions.0: no such file '/nonexistent/r.py'$"):
        Rewards(CarryAdditionTask(), ["/nonexistent/r.py:f"])


# --- call-time: values, keywords, errors naming the row -----------------------------------------------------------

def test_weighted_sum_keywords_and_return_types():
    seen = {}

    def exact(completions, answer):
        seen["exact"] = (list(completions), list(answer))
        return [float(c.rsplit(">", 1)[-1] == a) for c, a in zip(completions, answer)]

    def length(**kwargs):
        seen["length"] = sorted(kwargs)
        return np.array([len(c) for c in kwargs["completions"]], dtype=np.float32)  # numpy and tensors are fine

    def step_bonus(completions, step):
        return tuple(torch.full((len(completions),), float(step)))  # a tuple of 0-d tensors

    r = Rewards(CarryAdditionTask(), [exact, length, step_bonus, "task"], [1.0, -0.5, 2.0, 3.0], key="rewards")
    total, sums = r(PROBLEMS, COMPLETIONS, 7)
    exact_v, len_v = [1.0, 0.0, 1.0], [9.0, 1.0, 11.0]
    task_v = [CarryAdditionTask().score(p, c) for p, c in zip(PROBLEMS, COMPLETIONS)]
    want = [e - 0.5 * n + 2.0 * 7 + 3.0 * t for e, n, t in zip(exact_v, len_v, task_v)]
    assert total.tolist() == pytest.approx(want, abs=1e-12)
    assert sums == pytest.approx([sum(exact_v), sum(len_v), 21.0, sum(task_v)])
    assert seen["exact"] == (COMPLETIONS, ["3", "8", "10"])  # only the keywords it names
    assert seen["length"] == ["answer", "completions", "prompts", "step"]  # **kwargs: all of them
    assert r.names == ("exact", "length", "step_bonus", "task") and r.custom


def test_bad_values_and_a_raising_row_are_one_line_naming_the_function_step_and_row():
    def some(completions):
        return [1.0] * (len(completions) - 1)

    def nan_at_1(completions):
        return [0.0, math.nan, 0.0]

    def none_at_2(completions):
        return [0.0, 0.0, None]

    def scalar(completions):
        return 1.0

    def boom_on_x(completions):
        for c in completions:
            if c == "x":
                raise ValueError("cannot parse 'x'\nsecond line")
        return [0.0] * len(completions)

    def batch_only(completions):
        if len(completions) > 1:
            raise MemoryError("too many at once")
        return [0.0]

    cases = [
        (some, r"^rewards.0 \(some\) returned 2 values at step 3: expected 3, one per completion$"),
        (nan_at_1, r"^rewards.0 \(nan_at_1\) returned nan at step 3 for row 1 \(completion 'x'\): expected a finite "
                   r"number$"),
        (none_at_2, r"^rewards.0 \(none_at_2\) returned None at step 3 for row 2 .*: expected a finite number$"),
        (scalar, r"^rewards.0 \(scalar\) returned 1.0 at step 3: expected a list of 3 numbers, one per completion$"),
        (boom_on_x, r"^rewards.0 \(boom_on_x\) raised ValueError: cannot parse 'x' at step 3 on row 1 \(prompt "
                    r"'4\+4=', completion 'x'\)$"),
        (batch_only, r"^rewards.0 \(batch_only\) raised MemoryError: too many at once at step 3 on the batch of 3 rows "
                     r"\(no row alone raises\)$"),
    ]
    for fn, pattern in cases:
        with pytest.raises(RewardError, match=pattern):
            Rewards(CarryAdditionTask(), [fn], key="rewards")(PROBLEMS, COMPLETIONS, 3)


# --- in the trainer: logged per function, the sum drives RL, callbacks, objects handed in -------------------------

class Recorder:
    """A reward that returns a known value per completion and records what it returned, per call."""

    __name__ = "recorder"

    def __init__(self):
        self.calls = []

    def __call__(self, completions, step):
        values = [float(len(c) % 3) for c in completions]
        self.calls.append((step, values))
        return values


def test_per_function_metrics_are_the_means_of_what_each_function_returned(tmp_path):
    rec = Recorder()
    d = tiny_config_dict(tmp_path, method="rl", steps=3)
    d["model"]["teacher"] = None
    cfg = load_config(base=d)
    cfg = load_config(base={**d, "reward": {"weights": [0.5, 1.0]}})  # the config's weights weigh rewards=
    run_training(cfg, quiet=True, rewards=[rec, "task"])
    lines = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in lines if "reward/recorder" in r}
    assert sorted(steps) == [1, 2, 3] and [s for s, _ in rec.calls] == [1, 2, 3]
    assert any(v for _, values in rec.calls for v in values)  # the weight is seen
    for step, values in rec.calls:
        row = steps[step]
        assert row["reward/recorder"] == pytest.approx(sum(values) / len(values), abs=1e-12)
        assert row["train/reward"] == pytest.approx(0.5 * row["reward/recorder"] + row["reward/task"], abs=1e-12)


def test_default_reward_logs_nothing_new(tmp_path):
    cfg = load_config(base=tiny_config_dict(tmp_path, steps=1))
    run_training(cfg, quiet=True)
    row = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()][-2]
    assert "train/reward" in row and not any(k.startswith("reward/") for k in row)


def test_callback_stops_with_a_checkpoint_then_resume_goes_on_and_a_changed_task_is_refused(tmp_path):
    base = tiny_config_dict(tmp_path, steps=4, checkpoint={"every": 0})
    cfg = load_config(base=base)
    task = CarryAdditionTask(min_digits=2, max_digits=3)  # not the config's (1-2 digits)
    seen = []

    def stop_at_2(step, metrics):
        seen.append((step, "train/reward" in metrics))
        return step == 2

    out = run_training(cfg, quiet=True, task=task, callbacks=[stop_at_2])
    assert seen == [(1, True), (2, True)]
    assert out["stopped"] == "callback" and out["steps"] == 2 and out["exit_code"] == 0
    assert out["checkpoint"].endswith("step_00000002")
    record = json.loads((Path(cfg.run_dir) / "inputs.json").read_text())["inputs"]
    assert record["data.task"]["kind"] == "task" and record["data.task"]["source"] == "CarryAdditionTask"
    with pytest.raises(RunError, match=r"data.task.problems_sha256 .* --accept-changed data.task"):
        run_training(cfg, quiet=True, resume=True, task=CarryAdditionTask(min_digits=3, max_digits=4))
    with pytest.raises(RunError, match=r"data.task.problems_sha256"):  # no task=: the config's own, other problems
        run_training(cfg, quiet=True, resume=True)
    last = []
    out = run_training(cfg, quiet=True, resume=True, task=CarryAdditionTask(min_digits=2, max_digits=3),
                       callbacks=[lambda step, m: last.append(m) or step == 4])
    assert out["steps"] == 4 and out["stopped"] == "callback"  # asked on the last step: stopped, no final eval
    assert [m["step"] for m in last] == [3, 4] and out["final_eval"]["step"] == 0
    out = run_training(cfg, quiet=True, resume=True, task=task)  # its steps done: the final evaluation, then the end
    assert out["stopped"] is None and out["final_eval"]["step"] == 4


def test_model_objects_are_fingerprinted_and_both_reward_sources_refused(tmp_path):
    cfg = load_config(base=tiny_config_dict(tmp_path, steps=1, reward={"functions": ["task"]}))
    models = load_models(cfg)
    with pytest.raises(ConfigError, match=r"^rewards: 1 given in Python and reward.functions=\['task'\] in the "
                                          r"config; name the reward functions in one place$"):
        run_training(cfg, quiet=True, models=models, rewards=[Recorder()])
    run_training(cfg, quiet=True, models=models)
    record = json.loads((Path(cfg.run_dir) / "inputs.json").read_text())["inputs"]
    assert record["model.student"]["kind"] == "model object" and record["teacher"]["kind"] == "model object"
    assert record["data.task"]["kind"] == "task"  # the config's task is recorded too
    folder = load_config(base=tiny_config_dict(tmp_path, steps=1) | {"run_dir": str(tmp_path / "r2")})
    run_training(folder, quiet=True)
    from_folder = json.loads((tmp_path / "r2" / "inputs.json").read_text())["inputs"]
    for key in ("weights_sha256", "config_sha256", "tokenizer_sha256"):  # objects and folders read the same
        assert from_folder["teacher"][key] == record["teacher"][key]


def test_cli_reward_errors_are_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "r.py").write_text("def f(completions):\n    raise KeyError('answer')\n")
    d = tiny_config_dict(tmp_path, steps=2, reward={"functions": [f"{tmp_path}/r.py:f"]})
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(d))
    assert main(["check", "--config", str(path)]) == 0  # imports and signature fine
    capsys.readouterr()
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    line = next(x for x in err if "reward error" in x)
    assert f"reward.functions.0 ({tmp_path}/r.py:f) raised KeyError: 'answer' at step 1 on row 0" in line
    d["reward"] = {"functions": ["nosuch_mod_q:f"]}
    path.write_text(json.dumps(d))
    assert main(["check", "--config", str(path)]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "reward.functions.0: cannot import 'nosuch_mod_q' (ModuleNotFoundError: No module named 'nosuch_mod_q'); the "
        f"current folder {Path.cwd()} and sys.path are searched")


def test_the_python_api_example_runs(tmp_path):
    """examples/python_api.py as a user runs it: trains, the callback stops it, the metrics come back."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "python_api.py"), "--out", str(tmp_path / "run"),
                           "--steps", "8", "--target", "0.0"], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "step   1  loss" in out and "brevity" in out
    assert "stopped by: callback" in out  # target 0: the first evaluation (step 4) satisfies it
    assert "the callback saw steps [1, 2, 3, 4]" in out
    assert (tmp_path / "run" / "checkpoints" / "step_00000004").is_dir()


def test_the_minimal_config_of_the_docs_checks(tmp_path, capsys):
    """docs/python_api.md's minimal YAML, its paths replaced by real folders and a file: `opdistill check` passes."""
    import re

    from tests.trainer_helpers import make_model_dir

    doc = (ROOT / "docs" / "python_api.md").read_text()
    block = re.search(r"## A minimal config.*?```yaml\n(.*?)```", doc, re.S).group(1)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(40)))
    text = (block.replace("path/to/student", make_model_dir(tmp_path / "s", seed=2))
            .replace("path/to/teacher", make_model_dir(tmp_path / "t", seed=1))
            .replace("data/train.jsonl", str(data)).replace("runs/mine", str(tmp_path / "run")))
    assert text != block and "path/to" not in text
    (tmp_path / "mine.yaml").write_text(text)
    assert main(["check", "--config", str(tmp_path / "mine.yaml")]) == 0, capsys.readouterr().err


def test_a_float16_student_handed_in_is_refused_saying_how_to_load_it(tmp_path):
    cfg = load_config(base=tiny_config_dict(tmp_path, steps=1))
    tok, student, teacher = load_models(cfg)
    with pytest.raises(ConfigError, match=r"^models: the student handed in has float16 trainable parameters; .*load "
                                          r"it in bfloat16 or float32 \(from_pretrained\(\.\.\., dtype=\.\.\.\)\)$"):
        run_training(cfg, quiet=True, models=(tok, student.half(), teacher))
