"""Regressions of the second probe battery (issue 26; docs/reliability.md, "Probe battery, round two").

One test (or a few) per numbered finding of the issue, named ``test_probe_N_...``: each failed on e881490's behaviour
(a silent wrong result, a hang, a lost export, a traceback) and now refuses early with one line naming what to fix.
The later tests are the variations this round added (same classes, new inputs).
"""

import json
import os
import re

import pytest
import yaml

from opdistill.cli import main
from opdistill.errors import ConfigError
from opdistill.train.run.config import load_config
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
                            "(known: ['builtin:demo-teacher', 'builtin:demo-student', 'builtin:demo-teacher-bpe', "
                            "'builtin:demo-tool-teacher', 'builtin:demo-tool-student', 'builtin:smollm2', "
                            "'builtin:gemma3-270m'])"]
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


@pytest.mark.parametrize("content, reason", [
    (None, "cannot read the token file (No such file or directory)"),
    (b"", "the token file is empty"),
    (b" \n\t\n", "the token file is empty"),
    (b"a" * (64 << 10) + b"b", "longer than 65536 bytes; a token is one short line of text"),
    (b"caf\xc3\xa9", "the token holds a space, a control or a non-ASCII character; use printable ASCII only (it "
                      "travels in an HTTP header)"),
])
def test_the_one_token_file_reader_names_the_setting_of_each_side(tmp_path, capsys, content, reason):
    """The server's --token-file and the client's teacher.token_file share one reader: the same reason, each side
    naming its own setting."""
    pytest.importorskip("httpx")
    from opdistill.teachers import RemoteTeacher, TeacherServiceError
    from opdistill.teachers.http import read_token_file

    path = tmp_path / "token"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        read_token_file(path)
    assert str(e.value) == reason
    with pytest.raises(TeacherServiceError) as e:
        RemoteTeacher("http://127.0.0.1:9", token_file=str(path))
    assert str(e.value) == f"teacher.token_file={str(path)!r}: {reason}"
    assert main(["serve-teacher", "--model", "builtin:demo-teacher", "--token-file", str(path)]) == 2
    assert _err(capsys) == [f"opdistill serve-teacher: serve error: --token-file {path}: {reason}"]


def test_a_token_file_is_one_line_of_printable_ascii(tmp_path):
    from opdistill.teachers.http import read_token_file

    path = tmp_path / "token"
    path.write_bytes(b"  s3cr3t-Token_~!\n")
    assert read_token_file(path) == "s3cr3t-Token_~!"


# -- teacher servers: one in-process uvicorn per module, serving the tiny teacher and a broken stand-in -------------
def _serve_in_thread(app, **config):
    """``app`` on a free 127.0.0.1 port in a uvicorn thread; returns (url, stop)."""
    import threading
    import time

    import uvicorn

    from tests.server_helpers import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started

    def stop():
        server.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{port}", stop


BROKEN = {"defect": None}  # which defect the stand-in server's next answers carry (set by each test)


def _defective(result, defect: str):
    """``result`` (a real ScoreResult) with one defect at scored position 1, slot 2."""
    import numpy as np

    ids, lp, nxt = result.topk_ids.copy(), result.topk_logprobs.copy(), result.next_logprobs.copy()
    if defect == "id_out_of_vocab":
        ids[1, 2] = 18
    elif defect == "id_negative":
        ids[1, 2] = -3
    elif defect == "nan_logprob":
        lp[1, 2] = np.nan
    elif defect == "positive_logprob":
        lp[1, 2] = 0.5
    elif defect == "duplicate_id":
        ids[1, 2] = ids[1, 0]
    elif defect == "inf_next":
        nxt[1] = np.inf
    elif defect == "mass_above_one":
        lp[1, :] = -0.01
    elif defect == "short":
        ids, lp, nxt = ids[:-1], lp[:-1], nxt[:-1]
    return type(result)(ids, lp, nxt, result.requested_logprobs, result.temperature)


@pytest.fixture(scope="module")
def teacher_service(tmp_path_factory):
    """(TeacherService of the tiny teacher, the tiny config dict)."""
    pytest.importorskip("fastapi")
    from opdistill.models import load_model, load_tokenizer
    from opdistill.serve.app import TeacherService
    from opdistill.teachers import LocalTeacher
    from tests.trainer_helpers import tiny_config_dict

    tmp = tmp_path_factory.mktemp("svc")
    cfg = tiny_config_dict(tmp)
    teacher = LocalTeacher(load_model(cfg["model"]["teacher"]).requires_grad_(False))
    return TeacherService(teacher, load_tokenizer(cfg["model"]["teacher"]), model_id="tiny"), cfg


@pytest.fixture(scope="module")
def service(teacher_service):
    """Our server (``create_app``, default limits) in a uvicorn thread: (url, config dict)."""
    from opdistill.serve.app import create_app

    svc, cfg = teacher_service
    url, stop = _serve_in_thread(create_app(svc))
    yield url, cfg
    stop()


@pytest.fixture(scope="module")
def broken(teacher_service):
    """A stand-in server: our /info, and /v1/score answers carrying the defect ``BROKEN["defect"]``: (url, cfg)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import Response

    from opdistill.serve.app import score_rows
    from opdistill.teachers.wire import MEDIA_BINARY, MEDIA_JSON, _json_floats, encode_result, parse_accept

    svc, cfg = teacher_service
    app = FastAPI()

    @app.get("/info")
    def info():
        return svc.info

    @app.post("/v1/score")
    async def score(request: Request):
        body = await request.json()
        r = score_rows(svc.teacher, *(torch.tensor(body[n]) for n in ("input_ids", "attention_mask", "response_mask")),
                       k=body["k"], temperature=body["temperature"])
        media, codec = parse_accept(request.headers.get("accept"))
        r = _defective(r, BROKEN["defect"])
        r.model, r.teacher = svc.model_id, svc.identity  # our server's identity: the defect is in the scores only
        if media == MEDIA_JSON:  # written as json.dumps writes NaN/inf (not JSON, but Python reads it back)
            payload = json.dumps({"model": r.model, "teacher": r.teacher, "temperature": r.temperature,
                                  "num_positions": len(r.next_logprobs),
                                  "k": r.topk_ids.shape[1], "next_logprobs": _json_floats(r.next_logprobs),
                                  "topk_ids": r.topk_ids.tolist(), "topk_logprobs": _json_floats(r.topk_logprobs)})
            return Response(payload.encode(), media_type=MEDIA_JSON)
        return Response(encode_result(r, media=media, codec=codec, vocab_size=svc.vocab_size),
                        media_type=f"{MEDIA_BINARY};logprobs={codec}")

    url, stop = _serve_in_thread(app)
    yield url, cfg
    stop()


@pytest.fixture(scope="module")
def strict_service(teacher_service):
    """Our server with a 1 s head deadline and a 1 s body deadline (what ``serve-teacher --header-timeout-s 1
    --body-timeout-s 1`` runs): its url."""
    from opdistill.serve.app import create_app, header_deadline_protocol

    svc, _ = teacher_service
    url, stop = _serve_in_thread(create_app(svc, body_timeout_s=1.0), http=header_deadline_protocol(1.0))
    yield url
    stop()


import torch  # noqa: E402  (the service fixture's stand-in builds tensors)


def _rows():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1]])
    am = torch.ones(2, 6, dtype=torch.long)
    rm = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    return ids, am, rm


# -- 5. the client trusts the server's answers -> checked by a cache file's rules ------------------------------------
@pytest.mark.parametrize("defect, payload, why", [
    ("id_out_of_vocab", "fp32", "topk_ids holds 18 at [1, 2]; token ids must lie in [0, 18) (the teacher's "
                                "vocabulary)"),
    ("id_negative", "json", "topk_ids holds -3 at [1, 2]; token ids must lie in [0, 18) (the teacher's vocabulary)"),
    ("nan_logprob", "fp32", "topk_logprobs holds nan at [1, 2]; log-probs must be finite or -inf"),
    ("positive_logprob", "fp32", "topk_logprobs holds 0.5 at [1, 2]; log-probs must be <= 0 (tolerance 0.001)"),
    ("duplicate_id", "fp32", "topk_ids names id {dup} twice at position 1; the ids of a position's top-k are "
                             "distinct (its mass would count twice)"),
    ("inf_next", "json", "next_logprobs holds inf at [1]; log-probs must be finite or -inf"),
    ("mass_above_one", "fp32", "the top-k mass holds 3.9602 at [1]; a distribution's mass is at most 1 (+0.001 "
                               "rounding)"),
])
def test_probe_5_every_answer_is_checked_like_a_cache_file(broken, defect, payload, why):
    from opdistill.teachers import RemoteTeacher, Rows, ScoreRequest, TeacherServiceError

    broken, cfg = broken
    BROKEN["defect"] = defect
    rows = Rows(*_rows())
    with RemoteTeacher(broken, payload=payload, retries=0) as c:
        c.fetch_info()
        if "{dup}" in why:
            BROKEN["defect"] = None
            good = c.score_positions(*_rows(), k=4)
            why = why.format(dup=int(good.topk_ids[1, 0]))
            BROKEN["defect"] = defect
        with pytest.raises(TeacherServiceError) as e:  # was: the scores passed on (a traceback in the loss, or NaN)
            c.score(rows, ScoreRequest(k=4, sampled=True, what="step 1"))
    assert str(e.value) == (f"teacher.url={broken}: POST /v1/score (step 1) answered invalid scores: {why}; the "
                            f"server is broken or is not an opdistill teacher server (the rules of a teacher cache "
                            f"file)")


def test_probe_5_training_on_a_broken_server_stops_in_one_line(broken, tmp_path, capsys):
    broken, cfg = broken
    BROKEN["defect"] = "positive_logprob"
    c = dict(cfg, run_dir=str(tmp_path / "run"), teacher={"url": broken, "retries": 0})
    c["train"] = dict(cfg["train"], steps=1)
    c["eval"] = dict(cfg["eval"], num_prompts=0)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(c))
    assert main(["train", "--config", str(path)]) == 2  # was a ValueError traceback from the loss
    line = next(x for x in _err(capsys) if "error:" in x)  # (then the line naming the checkpoint to resume from)
    assert re.fullmatch(rf"opdistill train: teacher service error: teacher\.url={re.escape(broken)}: POST /v1/score "
                        rf"\(step 1: \d+ rows x \d+ positions\) answered invalid scores: topk_logprobs holds 0\.5 at "
                        rf"\[1, 2\]; log-probs must be <= 0 \(tolerance 0\.001\); the server is broken or is not an "
                        rf"opdistill teacher server \(the rules of a teacher cache file\)", line), line


# -- 3. a server that trickles its answer: a deadline for the whole request ------------------------------------------
def _trickle_server(interval_s: float = 0.2, total_s: float = 60.0):
    """A raw HTTP server that answers every request with a 200 head, then one body byte every ``interval_s`` (never
    idle long enough for a per-read timeout) for up to ``total_s``; returns (url, stop)."""
    import socket
    import threading
    import time

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    stopped = threading.Event()

    def handle(conn):
        with conn:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1)) if b"ontent-length" in head else 0
            while len(body) < length:
                body += conn.recv(65536)
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
                t0 = time.time()
                while not stopped.is_set() and time.time() - t0 < total_s:
                    conn.sendall(b" ")
                    time.sleep(interval_s)
            except OSError:  # the client gave up and closed the connection
                pass

    def serve():
        while not stopped.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()

    def stop():
        stopped.set()
        listener.close()

    return f"http://127.0.0.1:{listener.getsockname()[1]}", stop


@pytest.mark.timeout(120)  # the old client waited for the whole trickle (here 60 s a try): this fails, not hangs
def test_probe_3_a_trickling_server_hits_the_deadline_of_the_whole_request():
    from opdistill.teachers import RemoteTeacher, TeacherServiceError

    url, stop = _trickle_server()
    try:
        with RemoteTeacher(url, timeout_s=1.0, retries=1, backoff_s=0.0) as c:
            with pytest.raises(TeacherServiceError) as e:
                c.score_positions(*_rows(), k=4, what="step 1")
    finally:
        stop()
    assert str(e.value) == (f"teacher.url={url}: POST /v1/score (step 1) failed after 2 tries (no complete answer "
                            f"within teacher.timeout_s=1 s, the deadline of the whole request); start the teacher "
                            f"server or fix teacher.url, then continue the run with --resume")


@pytest.mark.timeout(120)
def test_probe_3_the_deadline_names_a_named_teachers_key():
    from opdistill.teachers.http import HttpClient, TeacherServiceError

    url, stop = _trickle_server()
    try:
        client = HttpClient(url, timeout_s=0.5, retries=0, key="teachers.1.url")
        with pytest.raises(TeacherServiceError, match=r"no complete answer within teachers\.1\.timeout_s=0\.5 s"):
            client.request("GET", "/info", "server info")
        client.close()
    finally:
        stop()


def test_an_answer_above_the_size_bound_is_refused(service):
    from opdistill.teachers.http import HttpClient, TeacherServiceError

    url, _ = service
    client = HttpClient(url, max_response_bytes=100, retries=3)
    try:
        with pytest.raises(TeacherServiceError) as e:
            client.request("GET", "/info", "server info")
    finally:
        client.close()
    assert re.fullmatch(rf"teacher\.url={re.escape(url)}: GET /info \(server info\) answered more than 100 bytes \(\d+ "
                        rf"read\); the answer is refused \(a server of this size of request answers far less\)",
                        str(e.value))


# -- 6. the server answers garbage -> every row checked, nothing invalid sent ----------------------------------------
def _post(url, body=None, content=None, headers=None):
    import httpx

    r = httpx.post(url + "/v1/score", json=body, content=content, headers=headers, timeout=30)
    return r.status_code, (r.json().get("detail") if r.status_code >= 400 else r)


GOOD = {"input_ids": [[1, 2, 3, 4], [4, 3, 2, 1], [1, 1, 2, 2]], "attention_mask": [[1, 1, 1, 1]] * 3,
        "response_mask": [[0, 0, 1, 1]] * 3, "k": 2}


@pytest.mark.parametrize("change, status, detail", [
    # only row 0 was type-checked: 2.7 and 1.9 in row 2 were truncated and scored with 200
    ({"input_ids": [[1, 2, 3, 4], [4, 3, 2, 1], [1, 2.7, 2, 2]]}, 400,
     "input_ids: expected integers only, got 2.7 at row 2, position 1"),
    ({"response_mask": [[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1.9, 1]]}, 400,
     "response_mask: expected integers only, got 1.9 at row 2, position 2"),
    ({"attention_mask": [[1, 1, 1, 1], [1, 1, 1, 1], [1, True, 1, 1]]}, 400,
     "attention_mask: expected integers only, got true at row 2, position 1"),
    ({"input_ids": [[1, 2, 3, 4], [4, 3, 2, 1], [1, 1, 2, 2 ** 64]]}, 400,
     "input_ids: expected integers only, got 18446744073709551616 at row 2, position 3"),
    ({"input_ids": [[1, 2, 3, 4], [4, 3, 2, 1], [1, 1, 2, [2]]]}, 400,
     "input_ids: expected integers only, got list at row 2, position 3"),
    # 1e-300 divided the logits in float32 (0): 200 with NaN log-probs, which is not JSON
    ({"temperature": 1e-300}, 422, "temperature: expected a number in [1.175e-38, 3.403e+38] (a float32 the logits "
                                   "can be divided by), got 1e-300"),
])
def test_probe_6_every_row_and_value_of_a_request_is_checked(service, change, status, detail):
    url, _ = service
    assert _post(url, {**GOOD, **change}) == (status, detail)
    assert _post(url, GOOD)[0] == 200  # still serving


def test_probe_6_invalid_scores_are_never_sent(service):
    """A temperature that still divides in float32 but overflows a larger model's logits (logits / 2e-38 is +inf
    above |z| = 6.8) gives NaN log-probs; the server checks its answer by the client's rules first: 422 naming the
    temperature (500 at temperature 1: a broken teacher), never a body with NaN (which is not JSON)."""
    import numpy as np

    from opdistill.serve.app import result_refusal
    from opdistill.teachers.wire import ScoreResult, encode_result

    url, _ = service
    ids, am, rm = (torch.tensor(GOOD[n]) for n in ("input_ids", "attention_mask", "response_mask"))
    parsed = {"input_ids": ids, "attention_mask": am, "response_mask": rm, "k": 2, "requested_ids": None}
    nan = ScoreResult(np.array([[0, 1]] * 6), np.array([[np.nan, -1.0]] * 6, np.float32),  # 6 scored positions
                      np.array([-1.0] * 6, np.float32), None, 2e-38)
    assert result_refusal(nan, {**parsed, "temperature": 2e-38}, 18) == (
        422, "temperature: the teacher's scores at temperature 2e-38 are not valid (topk_logprobs holds nan at "
             "[0, 0]; log-probs must be finite or -inf); ask for a temperature its logits can be divided by")
    assert result_refusal(nan, {**parsed, "temperature": 1.0}, 18) == (
        500, "scoring produced invalid scores (topk_logprobs holds nan at [0, 0]; log-probs must be finite or -inf); "
             "the teacher is broken")
    with pytest.raises(ValueError):  # and the JSON codec cannot write a NaN any more
        encode_result(nan, media="application/json", vocab_size=18)
    status, r = _post(url, {**GOOD, "temperature": 1e-37}, headers={"Accept": "application/json"})
    assert status == 200 and json.loads(r.content, parse_constant=lambda c: pytest.fail(f"{c} in the answer"))


def test_probe_6_a_deeply_nested_body_gets_400_not_500(service):
    url, _ = service
    deep = b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert _post(url, content=deep, headers={"Content-Type": "application/json"}) == (
        400, "the body is not valid JSON here (nested too deeply); a request is a flat object of lists of lists")


def test_a_trickled_body_gets_408_and_trickled_headers_are_cut(strict_service):
    import socket
    import time

    url = strict_service
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # the head, then a body that trickles
        s.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
                  b"\r\n{")
        answer = b""
        t0 = time.time()
        while b"\r\n\r\n" not in answer and time.time() - t0 < 30:
            try:
                s.settimeout(0.3)
                answer += s.recv(65536)
            except socket.timeout:
                s.sendall(b" ")  # one byte each 0.3 s: never idle, never done
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # a head that never ends
        s.sendall(b"GET /health HTTP/1.1\r\n")
        closed_after = None
        t0 = time.time()
        while time.time() - t0 < 30:
            try:
                s.sendall(b"X-Slow: y\r\n")
                s.settimeout(0.3)
                if s.recv(65536) == b"":
                    closed_after = time.time() - t0
                    break
            except socket.timeout:
                continue
            except OSError:
                closed_after = time.time() - t0
                break
    assert closed_after is not None  # cut by the 1 s head deadline (a per-read timeout never fired: bytes kept coming)


# -- 1. ranks started with different configs -------------------------------------------------------------------------
def _two_ranks(cfg_path, overrides: list[list[str]], timeout=300):
    """Two ``python -m opdistill.cli train`` processes started by hand as ranks 0 and 1 of one gloo job (what a
    user's launcher does), each with its own overrides; returns [(exit status, stderr)] by rank."""
    import subprocess
    import sys

    from tests.server_helpers import free_port

    port = free_port()
    procs = []
    for rank, extra in enumerate(overrides):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "opdistill.cli", "train", "--config", str(cfg_path),
                                       *extra], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        out.append((p.returncode, err))
    return out


def test_probe_1_ranks_with_different_configs_are_refused(tmp_path):
    from tests.trainer_helpers import tiny_config_dict

    cfg = tiny_config_dict(tmp_path, steps=1, data={"prompts_per_step": 4}, eval={"num_prompts": 0},
                           checkpoint={"every": 0, "save_final": False})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # was: both exit 0, config.yaml with rank 0's values, a step-1 loss that is neither config's
    got = _two_ranks(path, [["optim.lr=0.01", "train.seed=0"], ["optim.lr=0.05", "train.seed=1"]])
    line = ("distributed: rank 1 resolved another config than rank 0 (optim.lr 0.01 -> 0.05, train.seed 0 -> 1; ranks "
            "that differ from rank 0: [1]); start every rank with the same config file and overrides")
    for rank, (code, err) in enumerate(got):
        assert (code, err.strip().splitlines()[-1:]) == (2, [f"opdistill train: [rank {rank}] config error: {line}"])
    assert not (tmp_path / "run").exists()  # refused before the run directory was touched


# -- 2. what a path or URL points to is fingerprinted; a change is refused with its diff ----------------------------
def _edit_weight(folder, name="model.norm.weight"):
    """Change one value of one tensor of a model folder in place (same names, shapes and size)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    w = load_file(str(path))
    w[name][0] += 0.5
    save_file(w, str(path), metadata={"format": "pt"})


def _weights_sha(folder, dtype="float32"):
    """The teacher-cache / server fingerprint of a folder's weights (what /info states), short."""
    from opdistill.models import load_model
    from opdistill.teachers.fingerprint import teacher_fingerprint

    return teacher_fingerprint(load_model(folder, dtype=dtype))["teacher_weights_sha256"][:12]


def _file_sha(path):
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


@pytest.fixture()
def data_run(tmp_path):
    """A one-step run of an in-process teacher folder on a dataset file, checkpointed: (run, config path, teacher
    folder, data file)."""
    from opdistill.train.loop import run_training
    from tests.trainer_helpers import tiny_config_dict

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}="}) + "\n" for a in range(10, 16) for b in range(3)))
    cfg = tiny_config_dict(tmp_path, steps=1, data={"task": "dataset", "path": str(data), "prompts_per_step": 3},
                           eval={"num_prompts": 2}, checkpoint={"every": 1})
    del cfg["data"]["task_args"]
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_training(load_config(path), quiet=True)
    return tmp_path / "run", path, tmp_path / "teacher", data


def test_probe_2_a_teacher_folder_or_data_file_changed_under_a_run_is_refused(data_run, capsys):
    run, cfg, teacher, data = data_run
    before = (_weights_sha(teacher), _file_sha(data), data.stat().st_size)
    metrics = (run / "metrics.jsonl").read_text()
    _edit_weight(teacher)  # was: --resume continued on the new weights, exit 0
    text = data.read_text()
    data.write_text(text.replace("10+0=", "19+9="))  # rewritten in place: same size, other prompts
    resume = ["train", "--config", str(cfg), "--resume", "train.steps=2"]
    assert main(resume) == 2
    from opdistill.train.assemble import build_task
    from opdistill.train.disk.inputs import object_inputs

    problems = (json.loads((run / "inputs.json").read_text())["inputs"]["data.task"]["problems_sha256"][:12],
                object_inputs(task=build_task(load_config(cfg)))["data.task"]["problems_sha256"][:12])
    diff = (f"teacher.weights_sha256 {before[0]!r} -> {_weights_sha(teacher)!r}, data.path.sha256 {before[1]!r} -> "
            f"{_file_sha(data)!r}")
    task_diff = f"data.task.problems_sha256 {problems[0]!r} -> {problems[1]!r}"  # the rows' problems differ too
    assert _err(capsys)[-1] == (f"opdistill train: run error: --resume: what run {run} reads has changed since it was "
                                f"recorded: {diff}, {task_diff}; give the run the inputs it started with, or name the "
                                f"changes to accept them: --accept-changed teacher,data.path,data.task")
    assert (run / "metrics.jsonl").read_text() == metrics  # refused before anything was written
    assert main(["eval", str(run)]) == 2  # eval reads the same teacher and data
    assert _err(capsys)[-1].startswith(f"opdistill eval: run error: eval: what run {run} reads has changed since it "
                                       f"was recorded: {diff}; ")
    assert main(resume + ["--accept-changed", "teacher"]) == 2  # all must be named
    assert _err(capsys)[-1].endswith("--accept-changed data.path,data.task")
    record = json.loads((run / "inputs.json").read_text())["inputs"]
    assert set(record) == {"model.student", "teacher", "data.path", "data.task"}
    assert record["data.path"] == {"kind": "file", "source": str(data), "method": "sha256", "size": before[2],
                                   "sha256": __import__("hashlib").sha256(text.encode()).hexdigest()}
    assert main(resume + ["--accept-changed", "teacher,data.path,data.task"]) == 0  # named: accepted and recorded
    rows = [json.loads(r) for r in (run / "config_history.jsonl").read_text().splitlines()]
    inputs = [r["inputs"] for r in rows if "inputs" in r]
    assert len(inputs) == 1 and sorted(inputs[0]) == ["data.path", "data.task", "teacher"]
    assert inputs[0]["teacher"]["from"]["weights_sha256"][:12] == before[0]
    assert main(resume[:-1] + ["train.steps=3"]) == 0  # the next resume compares with the accepted inputs
    assert main(["eval", str(run), "eval.num_prompts=2"]) == 0


def test_probe_2_accept_changed_names_inputs_and_needs_resume(data_run, capsys):
    run, cfg, _, _ = data_run
    assert main(["train", "--config", str(cfg), "--resume", "--accept-changed", "teachr"]) == 2
    assert _err(capsys)[-1] == (f"opdistill train: run error: --accept-changed: 'teachr' is not an input of run {run} "
                                f"(its inputs: data.path, data.task, model.student, teacher)")
    assert main(["train", "--config", str(cfg), "--overwrite", "--accept-changed", "teacher"]) == 2
    assert _err(capsys)[-1] == ("opdistill train: config error: --accept-changed: only with --resume (a fresh run "
                                "records what it reads; a resumed one compares it)")


def test_probe_2_a_lora_runs_base_edited_is_refused_by_resume_and_export(tmp_path, capsys):
    pytest.importorskip("peft")
    from opdistill.train.loop import run_training
    from tests.trainer_helpers import tiny_config_dict

    cfg = tiny_config_dict(tmp_path, steps=1, eval={"num_prompts": 0}, checkpoint={"every": 1})
    cfg["model"]["lora"] = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_training(load_config(path), quiet=True)
    run, student = tmp_path / "run", tmp_path / "student"
    before = _weights_sha(student)
    _edit_weight(student)  # the base the adapters sit on: was resumed on, and merged into by export
    diff = f"model.student.weights_sha256 {before!r} -> {_weights_sha(student)!r}"
    assert main(["train", "--config", str(path), "--resume", "train.steps=2"]) == 2
    assert _err(capsys)[-1] == (f"opdistill train: run error: --resume: what run {run} reads has changed since it was "
                                f"recorded: {diff}; give the run the inputs it started with, or name the changes to "
                                f"accept them: --accept-changed model.student")
    out = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(out)]) == 2
    assert _err(capsys)[-1] == (f"opdistill export: run error: export: what run {run} reads has changed since it was "
                                f"recorded: {diff}; give the run the inputs it started with, or name the changes to "
                                f"accept them: --accept-changed model.student")
    assert not out.exists()
    assert main(["export", str(run), "--out", str(out), "--accept-changed", "model.student"]) == 0


def test_probe_2_a_teacher_server_serving_another_model_is_refused(service, teacher_service, tmp_path, capsys):
    """A run started on our server, resumed with teacher.url at a server of another model (its /info weights hash was
    never recorded); the server of the same model the run started with compares equal even in process."""
    import httpx

    from opdistill.models import load_model, load_tokenizer
    from opdistill.serve.app import TeacherService, create_app
    from opdistill.teachers import LocalTeacher
    from opdistill.train.loop import run_training
    from tests.trainer_helpers import make_model_dir

    url, cfg = service
    c = dict(cfg, run_dir=str(tmp_path / "run"), teacher={"url": url})
    c["train"] = dict(cfg["train"], steps=1)
    c["eval"] = dict(cfg["eval"], num_prompts=0)
    c["checkpoint"] = {"every": 1}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(c))
    run_training(load_config(path), quiet=True)
    other = make_model_dir(tmp_path / "other_teacher", hidden=32, layers=2, seed=7)  # same tokenizer, other weights
    svc = TeacherService(LocalTeacher(load_model(other)), load_tokenizer(other), model_id="other")
    other_url, stop = _serve_in_thread(create_app(svc))
    try:
        assert main(["train", "--config", str(path), "--resume", "train.steps=2", f"teacher.url={other_url}"]) == 2
    finally:
        stop()
    run = tmp_path / "run"
    ours = httpx.get(url + "/info").json()["teacher_weights_sha256"][:12]  # what each server states
    theirs = svc.info["teacher_weights_sha256"][:12]
    assert _err(capsys)[-1] == (f"opdistill train: run error: --resume: what run {run} reads has changed since it was "
                                f"recorded: teacher.weights_sha256 {ours!r} -> {theirs!r}; give the run the inputs it "
                                f"started with, or name the changes to accept them: --accept-changed teacher")
    assert [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    # the same teacher in process (model.teacher, no url): the same fingerprint, so the resume goes on
    assert main(["train", "--config", str(path), "--resume", "train.steps=2", "teacher.url=null"]) == 0


def test_large_files_are_fingerprinted_by_size_mtime_and_samples(tmp_path, monkeypatch):
    import opdistill.train.disk.inputs as inputs

    monkeypatch.setattr(inputs, "LARGE_FILE_BYTES", 1 << 20)
    f = tmp_path / "big.jsonl"
    f.write_bytes(bytes(range(256)) * 8192)  # 2 MiB
    fp = inputs.file_fingerprint(f)
    assert (fp["method"], fp["size"], set(fp)) == ("size+mtime+sample", 2 << 20, {"method", "size", "mtime_ns",
                                                                                 "sample_sha256"})
    st = f.stat()
    with open(f, "r+b") as h:  # a byte inside the first sampled block (offset 0), mtime put back
        h.write(b"\xff")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert inputs.file_fingerprint(f)["sample_sha256"] != fp["sample_sha256"]
    with open(f, "r+b") as h:  # a byte between two sampled blocks: only the modification time tells
        h.write(b"\x00")
        h.seek(100_000)
        h.write(b"\xff")
    assert inputs.file_fingerprint(f)["mtime_ns"] != fp["mtime_ns"]
    small = tmp_path / "small.jsonl"
    small.write_text("x\n")
    assert inputs.file_fingerprint(small) == {"method": "sha256", "size": 2, "sha256": __import__("hashlib").sha256(
        b"x\n").hexdigest()}


# -- variations of this round (docs/reliability.md, "Probe battery, round two") -------------------------------------
def test_a_config_that_is_a_device_too_large_or_too_long_is_one_line(tmp_path):
    from opdistill.yaml12 import MAX_CONFIG_BYTES

    with pytest.raises(ConfigError) as e:  # was a two-line YAML reader error (NUL characters)
        load_config("/dev/zero")
    assert str(e.value) == "/dev/zero: a device, not a config file (a config is a YAML text file)"
    big = tmp_path / "big.yaml"
    big.write_bytes(b"x: 1\n" + b"#" * MAX_CONFIG_BYTES)
    with pytest.raises(ConfigError) as e:
        load_config(big)
    assert str(e.value) == f"{big}: larger than 4 MiB; a config is a few KB of YAML (data belongs in data.path)"
    flat = tmp_path / "flat.yaml"  # 1.5 MB, a million values: was parsed whole (a 40 MB one ran for minutes)
    flat.write_text("x: [" + ",".join(["1"] * 1_000_000) + "]\n")
    with pytest.raises(ConfigError) as e:
        load_config(flat)
    assert str(e.value) == f"{flat}:1: not valid YAML (more than {MAX_VALUES} values; a config holds far fewer)"


def test_a_nul_character_in_any_config_string_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e:  # was a ValueError traceback ("embedded null byte") from mkdir
        load_config(base=BASE, overrides=['run_dir="runs/a\\0b"'])
    assert str(e.value) == "run_dir: expected text without a NUL character, got 'runs/a\\x00b'"
    with pytest.raises(ConfigError, match=r"^data\.task_args\.name: expected text without a NUL character"):
        load_config(base=BASE, overrides=['data.task_args={name: "x\\0"}'])


def test_a_run_dir_that_cannot_be_created_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**BASE, "model": {"student": "builtin:demo-student", "teacher": "builtin:demo-teacher"},
                                   "run_dir": str(tmp_path / ("a" * 300))}))
    assert main(["train", "--config", str(cfg)]) == 2  # was an OSError traceback (File name too long)
    assert _err(capsys) == [f"opdistill train: run error: run_dir {tmp_path / ('a' * 300)}: cannot create it (File "
                            f"name too long); choose another run_dir"]


def test_token_files_are_read_bounded(capsys):
    pytest.importorskip("httpx")
    from opdistill.teachers import RemoteTeacher, TeacherServiceError

    with pytest.raises(TeacherServiceError) as e:  # /dev/zero: was a MemoryError
        RemoteTeacher("http://127.0.0.1:9", token_file="/dev/zero")
    assert str(e.value) == ("teacher.token_file='/dev/zero': longer than 65536 bytes; a token is one short line of "
                            "text")
    assert main(["serve-teacher", "--model", "builtin:demo-teacher", "--token-file", "/dev/zero"]) == 2
    assert _err(capsys) == ["opdistill serve-teacher: serve error: --token-file /dev/zero: longer than 65536 bytes; "
                            "a token is one short line of text"]


def test_the_server_refuses_huge_numbers_and_duplicate_fields(service):
    url, _ = service
    head = b'{"input_ids": [[1,2,3,4]], "attention_mask": [[1,1,1,1]], "response_mask": [[0,0,1,1]], "k": 2, '
    huge = head + b'"temperature": 1' + b"0" * 400 + b"}"  # was an OverflowError: 500
    status, detail = _post(url, content=huge, headers={"Content-Type": "application/json"})
    assert (status, detail) == (422, "temperature: expected a finite number > 0, got 1" + "0" * 39 + "...")
    twice = head + b'"k": 3}'  # json keeps the last without a word
    assert _post(url, content=twice, headers={"Content-Type": "application/json"}) == (
        400, 'the body is not valid JSON (the field "k" appears twice)')


def test_a_redirect_is_refused_not_followed():
    pytest.importorskip("fastapi")
    from fastapi import FastAPI
    from fastapi.responses import RedirectResponse

    from opdistill.teachers import RemoteTeacher, TeacherServiceError

    app = FastAPI()

    @app.get("/info")
    def info():
        return RedirectResponse("http://elsewhere.invalid/info", status_code=302)

    url, stop = _serve_in_thread(app)
    try:
        with RemoteTeacher(url, retries=0) as c, pytest.raises(TeacherServiceError) as e:
            c.fetch_info()  # was: "answered something that is not JSON"
    finally:
        stop()
    assert str(e.value) == (f"teacher.url={url}: GET /info (server info) was redirected (HTTP 302 to "
                            f"'http://elsewhere.invalid/info'); redirects are not followed: set teacher.url to the "
                            f"server's own address")


def test_compare_refuses_a_copy_of_a_run_as_another_seed(trained, tmp_path, capsys):
    run, _ = trained
    copy = _copy_run(trained, tmp_path / "copy")  # was: "mean of 2" over one seed
    assert main(["compare", str(run), str(copy), "--out", str(tmp_path / "c.png")]) == 2
    assert _err(capsys) == [f"opdistill compare: error: {copy}: the same metrics.jsonl as {run}, byte for byte: one "
                            f"run twice (a copy?); give each run once"]
    rows = (copy / "metrics.jsonl").read_text().splitlines()  # a re-run of one config and seed: its own timings
    (copy / "metrics.jsonl").write_text("\n".join(rows[:-1] + [rows[-1].replace('"step"', '"step" ', 1)]) + "\n")
    assert main(["compare", str(run), str(copy), "--out", str(tmp_path / "c.png")]) == 2
    assert _err(capsys) == [f"opdistill compare: error: {copy}: the same config and train.seed (0) as {run}: one run "
                            f"twice (a copy?); a group's runs must differ by train.seed"]


def test_plot_checks_the_rows_it_draws(tmp_path, capsys):
    run = _fake_run(tmp_path / "r", [{"step": "a", "distillation/loss": 1.0}])  # was a silent plot of 'a'
    assert main(["plot", str(run), "--out", str(tmp_path / "p.png")]) == 2
    assert _err(capsys) == [f"opdistill plot: run error: {run / 'metrics.jsonl'}: row 1: 'step' is 'a', expected an "
                            f"integer >= 0"]


def test_demo_out_inside_a_run_is_refused_before_anything_is_written(trained, tmp_path, capsys):
    run = _copy_run(trained, tmp_path / "run")
    out = run / "checkpoints" / "demo"
    assert main(["demo", "--out", str(out), "--budget-s", "1", "--seeds", "0"]) == 2
    assert _err(capsys)[-1].startswith(f"opdistill demo: run error: --out {out} is inside {run / 'checkpoints'}")
    assert not out.exists()  # was: the folder made, then the first run refused


def test_eval_of_a_run_without_a_record_says_its_inputs_are_not_compared(trained, tmp_path):
    run = _copy_run(trained, tmp_path / "run")
    (run / "inputs.json").unlink()
    with pytest.warns(UserWarning, match=rf"eval: run {re.escape(str(run))} has no record of what it reads "
                                         r"\(inputs\.json: it started before opdistill kept one, or the file was "
                                         r"removed\); its inputs are not compared"):
        assert main(["eval", str(run), "eval.num_prompts=2"]) == 0


DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON that Python's parser cannot nest (a RecursionError)


@pytest.mark.parametrize("file, command, line", [
    ("inputs.json", ["eval", "{run}", "eval.num_prompts=2"],
     "opdistill eval: run error: {run}/inputs.json: unreadable (RecursionError: maximum recursion depth exceeded while "
     "decoding a JSON array from a unicode string); the run's record of what it reads is damaged (delete it to record "
     "the current inputs at the next --resume)"),
    ("metrics.jsonl", ["compare", "{run}", "--out", "{tmp}/c.png"],
     "opdistill compare: run error: {run}/metrics.jsonl: line 1 is not JSON (nested too deeply); the file is corrupt"),
    ("eval/step_000003.json", ["compare", "{run}", "--out", "{tmp}/c.png"],
     "opdistill compare: error: {run}/eval/step_000003.json: unreadable per-problem values (maximum recursion depth "
     "exceeded while decoding a JSON array from a unicode string)"),
    ("checkpoints/step_00000002/manifest.json", ["export", "{run}", "--out", "{tmp}/x"],
     "opdistill export: run error: no intact checkpoint under {run}/checkpoints: {run}/checkpoints/step_00000002/"
     "manifest.json: unreadable manifest (RecursionError: maximum recursion depth exceeded while decoding a JSON array "
     "from a unicode string)"),
])
def test_deeply_nested_json_in_a_run_is_one_line(trained, tmp_path, file, command, line, capsys):
    """A crafted (or corrupted) run directory: each JSON file the commands read, nested deeper than Python's parser
    goes, was a RecursionError traceback."""
    run = _copy_run(trained, tmp_path / "run")
    path = run / file
    path.write_text(DEEP + "\n" + (path.read_text() if file == "metrics.jsonl" else ""))
    assert main([a.format(run=run, tmp=tmp_path) for a in command]) == 2
    assert _err(capsys)[-1] == line.format(run=run)


def test_a_damaged_history_row_is_one_line(trained, tmp_path, capsys):
    run = _copy_run(trained, tmp_path / "run")
    with open(run / "config_history.jsonl", "a") as f:
        f.write(json.dumps({"resumed_at_step": 2, "inputs": {"teacher": {"from": 1}}}) + "\n")  # was a KeyError
    assert main(["eval", str(run), "eval.num_prompts=2"]) == 2
    assert _err(capsys)[-1] == (f"opdistill eval: run error: {run / 'config_history.jsonl'}: row 1: 'inputs' is not "
                                f"{{name: {{\"from\", \"to\"}}}}; the run's history is damaged")


def test_a_deeply_nested_dataset_line_is_a_data_error(tmp_path):
    from opdistill.data import DatasetTask
    from opdistill.errors import DataError

    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "1+1="}) + "\n" + DEEP + "\n")
    with pytest.raises(DataError) as e:
        DatasetTask(str(data))
    assert str(e.value) == f"{data}:2: not valid JSON here (nested too deeply)"


@pytest.mark.parametrize("override, line", [
    ("eval.greedy=!!bool yes", "eval.greedy: cannot read '!!bool yes' as a YAML value ('yes' is not a YAML 1.2 boolean "
                               "(true or false))"),  # was False, silently
    ("train.seed=!!int 1_000", "train.seed: cannot read '!!int 1_000' as a YAML value ('1_000' is not a YAML 1.2 "
                               "integer)"),  # was 1000 (Python's int() reads underscores)
    ("train.seed=!!int abc", "train.seed: cannot read '!!int abc' as a YAML value ('abc' is not a YAML 1.2 integer)"),
    ("data.task_args=!!python/object/apply:os.system [echo x]", "data.task_args: cannot read '!!python/object/apply:"
     "os.system [echo x]' as a YAML value (could not determine a constructor for the tag 'tag:yaml.org,2002:python/"
     "object/apply:os.system')"),
])
def test_explicit_yaml_tags_follow_the_same_rules(override, line):
    with pytest.raises(ConfigError) as e:
        load_config(base=BASE, overrides=[override])
    assert str(e.value) == line
    assert load_config(base=BASE, overrides=["train.seed=!!int 0o10", "optim.lr=!!float 3"]).optim.lr == 3.0
