"""Stopping a run and continuing it: SIGINT / SIGTERM mid-step stop after that step with its checkpoint and one line
naming it and the --resume command; a second signal aborts at once without touching the checkpoints; a teacher server
killed mid-run leaves the checkpoint of the last completed step and the same line. Every resume, run as the line
says, reproduces the uninterrupted run's per-step losses bit for bit.

The training processes are real ``opdistill train`` processes (``opdistill.cli.main`` in a fresh interpreter) that the
test signals with ``os.kill``. So that the signal lands mid-step whatever the machine's load, the process runs with
one pause: when step ``PAUSE`` starts collecting (and, for the second signal, when its checkpoint is about to be
renamed into place) it touches a marker file and waits for the test to say it has sent the signal.
"""
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from opdistill.train import load_config, run_training
from tests.server_helpers import free_port, start_server_process, stop_server_process
from tests.trainer_helpers import tiny_config_dict

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
STEPS, PAUSE = 6, 3

_PAUSED_TRAIN = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from opdistill.cli import main
    from opdistill.train.disk import checkpoint
    from opdistill.train.steps import collect

    marks, pause, pause_save = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"

    def wait_for(name):
        while not (marks / name).exists():
            time.sleep(0.01)

    collect_step = collect.Collector.__call__

    def paused_step(self, step, student):
        if step == pause:
            (marks / "in_step").touch()
            wait_for("signalled")
        return collect_step(self, step, student)

    def before_rename(tmp):
        if pause_save and tmp.name.startswith(f".tmp-step_{pause:08d}"):
            (marks / "in_save").touch()
            wait_for("signalled_again")

    collect.Collector.__call__ = paused_step
    checkpoint._before_rename_hook = before_rename
    sys.exit(main(sys.argv[4:]))
""")


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir):
    return [(r["step"], r["distillation/loss"], r["train/grad_norm"]) for r in _rows(run_dir)
            if "distillation/loss" in r]


def _evals(run_dir):
    return [(r["step"], r["eval/teacher_kl"], r["eval/greedy_acc"]) for r in _rows(run_dir) if "eval/teacher_kl" in r]


def _config(tmp: Path, name: str, **sections) -> tuple[Path, dict]:
    cfg = tiny_config_dict(tmp, steps=STEPS, eval={"every": 3, "num_prompts": 4},
                           checkpoint={"every": 100, "keep_last": 2})
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    cfg["run_dir"] = str(tmp / name)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its per-step losses and evaluations."""
    tmp = tmp_path_factory.mktemp("interrupt")
    _, cfg = _config(tmp, "full")
    run_training(load_config(base=cfg), quiet=True)
    return tmp, _losses(cfg["run_dir"]), _evals(cfg["run_dir"])


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.time() + 180
    while not path.exists():
        assert proc.poll() is None, f"exited {proc.returncode} before {path.name}: {proc.stderr.read()[-2000:]}"
        assert time.time() < deadline, f"no {path.name} in 180 s"
        time.sleep(0.01)


def _start_paused(tmp: Path, cfg_path: Path, pause_save: bool = False) -> tuple[subprocess.Popen, Path]:
    marks = tmp / f"marks-{cfg_path.stem}"
    marks.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _PAUSED_TRAIN, str(marks), str(PAUSE), str(int(pause_save)),
                             "train", "--config",
                             str(cfg_path)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, marks


def _run_as_said(line: str) -> subprocess.CompletedProcess:
    """Run the command after 'resume with: ' (its 'opdistill' as this interpreter's ``-m opdistill.cli``)."""
    words = shlex.split(line.split("resume with: ", 1)[1])
    assert words[:2] == ["opdistill", "train"], line
    return subprocess.run([sys.executable, "-m", "opdistill.cli", *words[1:]], env=ENV, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_step_stops_after_it_with_a_checkpoint_and_the_resume_line(reference, sig):
    tmp, full_losses, full_evals = reference
    cfg_path, cfg = _config(tmp, f"stopped-{sig.name}")
    proc, marks = _start_paused(tmp, cfg_path)
    _wait_for(marks / "in_step", proc)  # step 3 is collecting its rows
    os.kill(proc.pid, sig)
    (marks / "signalled").touch()
    out, err = proc.communicate(timeout=150)
    assert proc.returncode == 128 + sig, err[-3000:]
    run = Path(cfg["run_dir"])
    ckpt = run / "checkpoints" / f"step_{PAUSE:08d}"
    key = "Ctrl-C" if sig == signal.SIGINT else sig.name
    lines = err.strip().splitlines()
    assert (f"opdistill: {sig.name} received: stopping after the current step and writing its checkpoint ({key} "
            f"again aborts at once; the checkpoints already written stay intact)") in lines
    assert lines[-1] == (f"opdistill train: stopped by {sig.name} after step {PAUSE} of {STEPS}; checkpoint of step "
                         f"{PAUSE}: {ckpt}; resume with: opdistill train --config {cfg_path} --resume")
    assert "Traceback" not in err and out == ""
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [ckpt.name]  # the stop's own (every=100)
    assert [s for s, *_ in _losses(run)] == [1, 2, 3]  # the step in progress was completed, nothing after it
    resumed = _run_as_said(lines[-1])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(run) == full_losses  # bit for bit
    assert _evals(run) == full_evals


def test_a_second_sigint_aborts_at_once_and_keeps_the_checkpoints_intact(reference):
    tmp, full_losses, full_evals = reference
    cfg_path, cfg = _config(tmp, "aborted", checkpoint={"every": 2})
    proc, marks = _start_paused(tmp, cfg_path, pause_save=True)
    _wait_for(marks / "in_step", proc)
    os.kill(proc.pid, signal.SIGINT)
    (marks / "signalled").touch()
    _wait_for(marks / "in_save", proc)  # the stop's checkpoint of step 3 is written, not yet renamed into place
    os.kill(proc.pid, signal.SIGINT)
    (marks / "signalled_again").touch()
    _, err = proc.communicate(timeout=150)
    assert proc.returncode == 130, err[-3000:]
    run = Path(cfg["run_dir"])
    kept = run / "checkpoints" / "step_00000002"
    last = err.strip().splitlines()[-1]
    assert last == (f"opdistill train: aborted by a second SIGINT; checkpoint of step 2: {kept}; resume with: "
                    f"opdistill train --config {cfg_path} --resume")
    assert "Traceback" not in err
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names[-1] == "step_00000002" and not any(n.startswith("step_00000003") for n in names)
    resumed = _run_as_said(last)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(run) == full_losses
    assert _evals(run) == full_evals


def test_teacher_server_killed_mid_run_then_resume_as_the_message_says(reference):
    tmp, full_losses, _ = reference
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg_path, cfg = _config(tmp, "served", eval={"num_prompts": 0},
                            teacher={"url": url, "retries": 1, "backoff_s": 0.05, "timeout_s": 30})
    serve = [sys.executable, "-m", "opdistill.cli", "serve-teacher", "--model", cfg["model"]["teacher"], "--port",
             str(port), "--threads", "1"]
    server = start_server_process(serve, url, tmp / "server1.log", what="serve-teacher", timeout_s=120, env=ENV)
    run = Path(cfg["run_dir"])
    try:
        proc = subprocess.Popen([sys.executable, "-m", "opdistill.cli", "train", "--config", str(cfg_path)], env=ENV,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 180
        while not ((run / "metrics.jsonl").exists() and _losses(run)) and proc.poll() is None:
            assert time.time() < deadline
            time.sleep(0.005)
        stop_server_process(server, grace_s=0)  # the teacher goes away mid-run (after step 1 at least)
        _, err = proc.communicate(timeout=150)
    finally:
        stop_server_process(server, grace_s=0)
    assert proc.returncode == 2, err[-3000:]
    done = [s for s, *_ in _losses(run)]
    assert done and done == list(range(1, done[-1] + 1)) and done[-1] < STEPS
    k = done[-1]
    *_, error, advice = err.strip().splitlines()
    assert error.startswith(f"opdistill train: teacher service error: teacher.url={url}: POST /v1/score (step "
                            f"{k + 1}:")
    assert error.endswith("start the teacher server or fix teacher.url, then continue the run with --resume")
    ckpt = run / "checkpoints" / f"step_{k:08d}"
    assert advice == (f"opdistill train: checkpoint of step {k}: {ckpt}; resume with: opdistill train --config "
                      f"{cfg_path} --resume")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [ckpt.name]  # written by the failure
    # the server is back where the config says, and the line's command continues the run
    server = start_server_process(serve, url, tmp / "server2.log", what="serve-teacher", timeout_s=120, env=ENV)
    try:
        resumed = _run_as_said(advice)
    finally:
        stop_server_process(server, grace_s=0)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(run) == full_losses  # the server's fp32 scores are the in-process teacher's, bit for bit


def test_a_teacher_failing_before_the_first_step_leaves_a_step_0_checkpoint(tmp_path):
    """Nothing completed yet: --resume must still work, as the teacher's message says (a step-0 checkpoint)."""
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg_path, cfg = _config(tmp_path, "never", eval={"num_prompts": 0},
                            teacher={"url": url, "retries": 0, "backoff_s": 0.01, "timeout_s": 5})
    res = subprocess.run([sys.executable, "-m", "opdistill.cli", "train", "--config", str(cfg_path)], env=ENV,
                         capture_output=True, text=True, timeout=150)
    assert res.returncode == 2, res.stderr[-3000:]
    *_, error, advice = res.stderr.strip().splitlines()
    assert error.startswith(f"opdistill train: teacher service error: teacher.url={url}: ")
    ckpt = Path(cfg["run_dir"]) / "checkpoints" / "step_00000000"
    assert advice == (f"opdistill train: checkpoint of step 0: {ckpt}; resume with: opdistill train --config "
                      f"{cfg_path} --resume")
    again = _run_as_said(advice)  # the teacher is still away: the same failure, not "no checkpoint"
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1] == advice


def test_a_failing_evaluation_keeps_its_step_and_the_resumed_run_evaluates_it_first(reference, monkeypatch):
    from opdistill.teachers import TeacherServiceError
    from opdistill.train import loop

    tmp, full_losses, full_evals = reference
    _, cfg = _config(tmp, "eval-failed")
    real = loop.run_eval

    def failing_at_step_3(*a, values_path=None, **k):
        if values_path is not None and values_path.name == "step_000003.json":
            raise TeacherServiceError("teacher.url=x: the teacher went away")
        return real(*a, values_path=values_path, **k)

    monkeypatch.setattr(loop, "run_eval", failing_at_step_3)
    with pytest.raises(TeacherServiceError) as e:
        run_training(load_config(base=cfg), quiet=True)
    run = Path(cfg["run_dir"])
    assert e.value.checkpoint == str(run / "checkpoints" / "step_00000003")  # the update of step 3 is kept
    assert [s for s, *_ in _losses(run)] == [1, 2, 3]  # the step's own line, without its evaluation
    monkeypatch.undo()
    run_training(load_config(base=cfg), resume=True, quiet=True)
    assert _losses(run) == full_losses
    assert _evals(run) == full_evals  # step 3's evaluation ran first on resume
