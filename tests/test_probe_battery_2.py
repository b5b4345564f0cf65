"""Regressions of the second probe battery (issue 26; docs/reliability.md, "Probe battery, round two").

One test (or a few) per numbered finding of the issue, named ``test_probe_N_...``: each failed on e881490's behaviour
(a silent wrong result, a hang, a lost export, a traceback) and now refuses early with one line naming what to fix.
The later tests are the variations this round added (same classes, new inputs).
"""
from __future__ import annotations

import json
import os
import re

import pytest
import yaml

from opdistill.cli import main
from opdistill.errors import ConfigError
from opdistill.train.config import load_config
from opdistill.yaml12 import MAX_DEPTH, MAX_VALUES

BASE = {"model": {"student": "s", "teacher": "t"}, "loss": {"topk": 4}}


def _err(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]


# -- 4. a YAML alias bomb; 9: nesting deep enough for a RecursionError ----------------------------------------------
def _bomb(levels: int, key: str = "eval:\n  num_prompts") -> str:
    """A billion-laughs document: level i is a list of nine aliases of level i - 1 (9**levels values in all), the
    last level the value of ``key``."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    return "\n".join(lines) + f"\n{key}: *l{levels - 1}\n"


def _bomb_line(path) -> str:
    # level 6 (9**6 = 531441 values) is the first above MAX_VALUES; it is on line 6
    return (f"{path}:6: not valid YAML (the aliases expand to more than {MAX_VALUES} values (an alias bomb?); a config "
            f"holds far fewer)")


def test_probe_4_an_alias_bomb_is_refused_in_one_short_line(tmp_path, capsys):
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb(8))
    assert len(path.read_bytes()) < 700  # was: exit 2, but the "one line" was 226 MB (the expanded value)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == _bomb_line(path)
    assert main(["train", "--config", str(path)]) == 2
    assert _err(capsys) == [f"opdistill train: config error: {e.value}"]


def test_probe_4_a_ten_level_bomb_stays_within_memory(tmp_path):
    """Was a MemoryError traceback after 55 s under a 3 GB limit; run under a 2 GB address-space limit, so that a
    regression fails here instead of taking the machine's memory."""
    import resource
    import subprocess
    import sys

    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb(10))

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    out = subprocess.run([sys.executable, "-m", "opdistill.cli", "train", "--config", str(path)], preexec_fn=limit,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert (out.returncode, out.stderr.strip().splitlines()) == (2, [f"opdistill train: config error: "
                                                                     f"{_bomb_line(path)}"])


def test_probe_4_a_value_below_the_bound_is_quoted_by_a_short_prefix(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(_bomb(4))  # 9**4 = 6561 values (twice): within the bound, and still not a number of prompts
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides=["model.student=s", "model.teacher=t", "loss.topk=4"])
    msg = str(e.value)
    assert msg.startswith("eval.num_prompts: expected an integer >= 0, got [[[") and len(msg) < 200, msg[:300]
    with pytest.raises(ConfigError) as e:  # a long string is quoted by its ends, not in full
        load_config(base=BASE, overrides=["train.steps=" + "9" * 10 + "x" * 100_000])
    assert len(str(e.value)) < 200 and str(e.value).startswith("train.steps: expected an integer >= 0, got '999")


@pytest.mark.parametrize("text, line", [
    ("eval:\n  num_prompts: " + "[" * 5000 + "]" * 5000 + "\n", 2),  # was a RecursionError traceback
    ("data:\n  task_args: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n", 2),
])
def test_probe_9_deeply_nested_yaml_is_one_line(tmp_path, text, line, capsys):
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}:{line}: not valid YAML (nested more than {MAX_DEPTH} levels deep; a config needs " \
                           f"far fewer)"
    assert main(["train", "--config", str(path)]) == 2
    assert len(_err(capsys)) == 1


def test_a_recursive_alias_and_a_bomb_in_an_override_are_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(base=BASE, overrides=["data.task_args=&a {x: *a}"])
    assert str(e.value) == ("data.task_args: cannot read '&a {x: *a}' as a YAML value (a recursive alias (a collection "
                            "that contains itself))")
    bomb = "[" + ", ".join(["&a [" + ", ".join(["1"] * 10) + "]"] + ["*a"] * 9) + "]"  # fine: 110 values
    assert load_config(base=BASE, overrides=[f"data.task_args={{v: {bomb}}}"]).data.task_args["v"][9] == [1] * 10
    big = _bomb(7, "v").replace("\n", ", ").rstrip(", ")
    with pytest.raises(ConfigError, match=r"^data\.task_args: cannot read '.*' as a YAML value \(the aliases expand "
                                          r"to more than 100000 values"):
        load_config(base=BASE, overrides=[f"data.task_args={{{big}}}"])


# -- 10. overrides (and files) read with YAML 1.2 rules -------------------------------------------------------------
@pytest.mark.parametrize("override, expected", [
    ("train.seed=010", ("train", "seed", 10)),  # was 8 (YAML 1.1 octal)
    ("train.seed=0o10", ("train", "seed", 8)),  # 1.2's octal
    ("train.seed=0x10", ("train", "seed", 16)),
    ("optim.lr=1e-3", ("optim", "lr", 1e-3)),
    ("optim.lr=.5", ("optim", "lr", 0.5)),
    ("eval.greedy=false", ("eval", "greedy", False)),
    ("eval.greedy=True", ("eval", "greedy", True)),
])
def test_probe_10_overrides_read_yaml_1_2_numbers(override, expected):
    section, key, value = expected
    got = getattr(getattr(load_config(base=BASE, overrides=[override]), section), key)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("override, line", [
    ("train.steps=1:30", "train.steps: expected an integer >= 0, got '1:30'"),  # was 90 steps (base 60)
    ("eval.greedy=no", "eval.greedy: expected true or false, got 'no'"),  # was false
    ("eval.greedy=off", "eval.greedy: expected true or false, got 'off'"),
    ("train.seed=1_000", "train.seed: expected an integer in [0, 4294967295], got '1_000'"),
    ("train.seed=2001-01-01", "train.seed: expected an integer in [0, 4294967295], got '2001-01-01'"),
])
def test_probe_10_yaml_1_1_forms_are_strings_and_refused_where_a_number_belongs(override, line, capsys):
    with pytest.raises(ConfigError) as e:
        load_config(base=BASE, overrides=[override])
    assert str(e.value) == line


def test_files_follow_the_same_rules_and_config_yaml_reads_back_in_both_schemas(tmp_path):
    from opdistill.yaml12 import dump_yaml, load_yaml

    path = tmp_path / "c.yaml"
    path.write_text("model: {student: s, teacher: t}\nloss: {topk: 4}\ntrain: {seed: 010, steps: 0x0a}\n")
    cfg = load_config(path)
    assert (cfg.train.seed, cfg.train.steps) == (10, 10)
    path.write_text("model: {student: s, teacher: t}\nloss: {topk: 4}\neval: {greedy: yes}\n")
    with pytest.raises(ConfigError, match=r"^eval\.greedy: expected true or false, got 'yes'$"):
        load_config(path)
    # strings that either schema would read as another type are quoted when a run's config.yaml is written
    data = {"run_dir": "010", "a": "no", "b": "0o17", "c": "1e3", "d": "1:30", "e": "null", "f": 10, "g": 1e-3}
    text = dump_yaml(data)
    assert load_yaml(text) == data and yaml.safe_load(text) == data
