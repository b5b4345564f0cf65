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


# -- a tiny trained run shared by the run-directory probes (7, 8, 9) ------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run: 3 steps, evaluated at every step (per-problem values eval/step_00000N.json), checkpoints at
    steps 2 only (every 2, no final save): a run "interrupted" after its step-3 evaluation. Tests copy it before
    changing it."""
    from opdistill.train.loop import run_training
    from tests.trainer_helpers import tiny_config_dict

    tmp = tmp_path_factory.mktemp("trained")
    cfg = tiny_config_dict(tmp, steps=3, eval={"every": 1, "num_prompts": 4, "bootstrap_resamples": 50},
                           checkpoint={"every": 2, "keep_last": 5, "save_final": False})
    run_training(load_config(base=cfg), quiet=True)
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return tmp / "run", path


def _copy_run(trained, dest):
    import shutil

    run, cfg_path = trained
    shutil.copytree(run, dest)
    return dest


# -- 7. an export (or any output) inside a run's entries is refused ---------------------------------------------------
def test_probe_7_export_into_a_checkpoint_folder_is_refused(trained, tmp_path, capsys):
    run = _copy_run(trained, tmp_path / "run")
    ckpt = run / "checkpoints" / "step_00000002"
    out = ckpt / "sub"  # was exported there; the next rotation of a resumed run deleted it without a word
    assert main(["export", str(run), "--out", str(out)]) == 2
    assert _err(capsys) == [f"opdistill export: run error: --out {out} is inside {run / 'checkpoints'}, which belongs "
                            f"to the run in {run} (the run's rotation, --resume or --overwrite would delete it or take "
                            f"it for its own); choose a path outside the run's entries"]
    assert not out.exists() and sorted(p.name for p in ckpt.iterdir()) == sorted(
        [*json.loads((ckpt / "manifest.json").read_text())["files"], "manifest.json"])
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0  # outside: fine
    assert (tmp_path / "exported" / "model.safetensors").is_file()


@pytest.mark.parametrize("argv, flag, inside", [
    (["eval", "{run}", "--out", "{run}/checkpoints/report.json"], "--out", "checkpoints"),
    (["eval", "{run}", "--values", "{run}/eval/step_000099.json"], "--values", "eval"),
    (["eval", "{run}", "--out", "{run}/config.yaml"], "--out", "config.yaml"),
    (["score", "--config", "{cfg}", "--out", "{run}/tensorboard/cache.safetensors"], "--out", "tensorboard"),
    (["compare", "{run}", "--out", "{run}/eval/compare.png"], "--out", "eval"),
    (["plot", "{run}", "--out", "{run}/checkpoints/step_00000002/metrics.png"], "--out", "checkpoints"),
])
def test_every_output_inside_a_runs_entries_is_refused_before_any_work(trained, argv, flag, inside, capsys):
    run, cfg = trained
    argv = [a.format(run=run, cfg=cfg) for a in argv]
    out = argv[argv.index(flag) + 1]
    before = sorted(str(p) for p in run.rglob("*"))
    assert main(argv) == 2
    where = f"is {run / inside}" if out == str(run / inside) else f"is inside {run / inside}"
    assert _err(capsys)[-1].endswith(f"error: {flag} {out} {where}, which belongs to the run in {run} (the run's "
                                     f"rotation, --resume or --overwrite would delete it or take it for its own); "
                                     f"choose a path outside the run's entries")
    assert sorted(str(p) for p in run.rglob("*")) == before


def test_plot_still_writes_its_own_runs_metrics_png(trained, tmp_path, capsys):
    run = _copy_run(trained, tmp_path / "run")
    assert main(["plot", str(run)]) == 0
    assert (run / "metrics.png").read_bytes()[:4] == b"\x89PNG"


def _hold_lock(path):
    """A separate process holding ``path``'s output lock (what a concurrent writer holds) until killed."""
    import subprocess
    import sys

    lock = path.parent / f".{path.name}.lock"
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; from filelock import FileLock; "
                             f"held = FileLock({str(lock)!r}); held.acquire(); print('locked', flush=True); time.sleep(120)"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc, lock


def test_probe_9_two_exports_to_one_out_are_refused(trained, tmp_path, capsys):
    """Was `OSError: Directory not empty` (a traceback) for the one that finished second."""
    run, _ = trained
    out = tmp_path / "exported"
    proc, lock = _hold_lock(out)
    try:
        assert main(["export", str(run), "--out", str(out)]) == 2
    finally:
        proc.kill()
        proc.wait()
    assert _err(capsys) == [f"opdistill export: run error: --out {out} is being written by another opdistill process "
                            f"(it holds {lock}); wait for it to finish, or choose another --out"]
    assert not out.exists()
    assert main(["export", str(run), "--out", str(out)]) == 0  # the lock is gone with its holder


# -- 8. compare reads only the run's surviving evaluations, and each run once -----------------------------------------
def test_probe_8_compare_ignores_evaluations_a_resume_threw_away(trained, tmp_path, capsys):
    run = _copy_run(trained, tmp_path / "run")
    _, cfg = trained
    assert (run / "eval" / "step_000003.json").is_file()  # evaluated at step 3, last checkpoint at step 2
    with pytest.warns(UserWarning, match=r"set aside the evaluations after step 2 \(the resumed checkpoint\): "
                                         r"step_000003\.json moved to"):
        assert main(["train", "--config", str(cfg), "--resume", f"run_dir={run}", "train.steps=2"]) == 0
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [0, 1, 2]
    assert sorted(p.name for p in (run / "eval").iterdir()) == [".discarded-step_000003.json", "step_000000.json",
                                                                "step_000001.json", "step_000002.json"]
    capsys.readouterr()
    assert main(["compare", str(run), "--out", str(tmp_path / "c.png")]) == 0
    table = capsys.readouterr().out
    assert "(step 0->2)" in table and "->3" not in table  # was: the table at step 2, the change (step 0->3)


def test_probe_8_compare_reads_older_runs_surviving_history_only(trained, tmp_path, capsys):
    """A run resumed by an older version kept eval/step_000003.json beside a trimmed metrics.jsonl: compare pairs only
    the evaluations metrics.jsonl still holds."""
    run = _copy_run(trained, tmp_path / "run")
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["step"] <= 2]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["compare", str(run), "--out", str(tmp_path / "c.png")]) == 0
    table = capsys.readouterr().out
    assert "(step 0->2)" in table and "->3" not in table


def test_probe_8_the_same_run_twice_is_refused(trained, tmp_path, capsys):
    run, _ = trained
    alias = tmp_path / "alias"
    alias.symlink_to(run)
    for second in (run, alias, run / ".." / run.name):
        assert main(["compare", str(run), str(second), "--out", str(tmp_path / "c.png")]) == 2  # was a "mean of 2"
        assert _err(capsys) == [f"opdistill compare: error: {second}: the run is given twice ({run} and {second} are "
                                f"one folder); give each run once (a run counted twice would pass for two seeds)"]


# -- 9. tracebacks where one line was due ---------------------------------------------------------------------------
def _fake_run(path, rows, config="run_dir: x\n"):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if config is not None:
        (path / "config.yaml").write_text(config)
    return path


@pytest.mark.parametrize("rows, config, line", [
    ([{"step": 0, "eval/greedy_acc": [1]}], "run_dir: x\n",  # was a TypeError traceback
     "{metrics}: row 1 (step 0): 'eval/greedy_acc' is [1], expected a number or null"),
    ([{"step": 0, "eval/greedy_acc": 0.5}, {"step": "a", "eval/greedy_acc": 0.5}], "run_dir: x\n",
     "{metrics}: row 2: 'step' is 'a', expected an integer >= 0"),
    ([[1, 2]], "run_dir: x\n", "{metrics}: row 1 is [1, 2], expected an object (one metrics row per step)"),
    ([{"step": 0, "eval/greedy_acc": 0.5}], "a: [1\n",
     "{config}: unreadable (expected ',' or ']', but got '<stream end>'); expected the config.yaml opdistill train "
     "wrote"),
    ([{"step": 0, "eval/greedy_acc": 0.5}], "- 1\n", "{config}: expected a YAML mapping, got list"),
])
def test_probe_9_compare_of_a_malformed_run_is_one_line(tmp_path, rows, config, line, capsys):
    run = _fake_run(tmp_path / "r", rows, config)
    assert main(["compare", str(run), "--out", str(tmp_path / "c.png")]) == 2
    assert _err(capsys) == ["opdistill compare: error: " + line.format(metrics=run / "metrics.jsonl",
                                                                       config=run / "config.yaml")]


@pytest.mark.parametrize("command", ["compare", "plot"])
def test_probe_9_an_image_out_matplotlib_cannot_write_is_refused_first(tmp_path, command, capsys):
    run = _fake_run(tmp_path / "r", [{"step": 0, "eval/greedy_acc": 0.5, "distillation/loss": 1.0}])
    out = tmp_path / "x.safetensors"  # was a ValueError traceback from matplotlib, after the work
    assert main([command, str(run), "--out", str(out)]) == 2
    line = _err(capsys)[-1]
    assert line.startswith(f"opdistill {command}: config error: --out: {out} is not an image file name matplotlib "
                           f"writes (it ends in '.safetensors'; use .png, or one of ")
    assert not out.exists()
    assert main([command, str(run), "--out", str(tmp_path / "x.png")]) == 0


def test_probe_9_serve_teacher_arguments_are_one_line(tmp_path, capsys):
    for argv, line in [
        (["--threads", "-2"], "opdistill serve-teacher: error: argument --threads: expected an integer >= 1, got -2"),
        (["--port", "99999"], "opdistill serve-teacher: error: argument --port: expected a port number in [1, 65535], "
                              "got 99999"),
    ]:
        with pytest.raises(SystemExit) as e:  # argparse: before the model loads
            main(["serve-teacher", "--model", "builtin:demo-teacher", *argv])
        assert e.value.code == 2 and _err(capsys)[-1] == line
    assert main(["serve-teacher", "--model", "builtin:../../etc"]) == 2
    assert _err(capsys) == ["opdistill serve-teacher: serve error: --model: unknown builtin 'builtin:../../etc' "
                            "(known: ['builtin:demo-teacher', 'builtin:demo-student'])"]
    bad = tmp_path / "token"
    bad.write_bytes(b"\xff\xfe\x00secret")  # was a UnicodeDecodeError traceback
    assert main(["serve-teacher", "--model", "builtin:demo-teacher", "--token-file", str(bad)]) == 2
    assert _err(capsys) == [f"opdistill serve-teacher: serve error: --token-file {bad}: not UTF-8 text (invalid start "
                            f"byte at byte 0); the token is one line of text"]


def test_serve_teacher_refuses_a_port_in_use_before_loading(capsys, monkeypatch):
    import socket

    import opdistill.serve.app as app

    monkeypatch.setattr(app, "load_tokenizer", lambda *a, **k: pytest.fail("loaded before the port check"),
                        raising=False)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["serve-teacher", "--model", "builtin:demo-teacher", "--port", str(port)]) == 2
    assert _err(capsys) == [f"opdistill serve-teacher: serve error: --port {port}: cannot bind 127.0.0.1:{port} "
                            f"(Address already in use); choose another --port, or stop what holds it"]


def test_probe_9_a_client_token_file_that_is_not_utf8_is_one_line(tmp_path):
    pytest.importorskip("httpx")
    from opdistill.teachers import RemoteTeacher, TeacherServiceError

    bad = tmp_path / "token"
    bad.write_bytes(b"\xff\xfe\x00secret")
    with pytest.raises(TeacherServiceError) as e:
        RemoteTeacher("http://127.0.0.1:9", token_file=str(bad))
    assert str(e.value) == (f"teacher.token_file={str(bad)!r}: not UTF-8 text (invalid start byte at byte 0); the "
                            f"token is one line of text")
    bad.write_text("tok en\n")  # a header cannot carry it as sent
    with pytest.raises(TeacherServiceError, match=r"the token holds a space, a control or a non-ASCII character"):
        RemoteTeacher("http://127.0.0.1:9", token_file=str(bad))
