"""A run directory belongs to one run: refusal of a fresh train on a run, --overwrite, --resume rules, the lock, no
write through a symlink, the config check on resume (refused keys with their diff, allowed keys logged), a torn
metrics line and a stray checkpoints folder (docs/reliability.md)."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opdistill.cli import main
from opdistill.runs.files import read_metrics
from opdistill.train.disk.rundir import (RESUMABLE_KEYS, RunError, RunWarning, atomic_write_text, config_changes,
                                    open_nofollow, open_run_dir)
from tests.trainer_helpers import tiny_config_dict

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


@pytest.fixture
def cfg_file(tmp_path):
    cfg = tiny_config_dict(tmp_path, steps=2, eval={"num_prompts": 0}, checkpoint={"every": 1, "keep_last": 3})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(cfg_file, *extra):
    return main(["train", "--config", str(cfg_file), *extra])


def _last_err_line(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1]


def _step_lines(run):
    return [r["step"] for r in read_metrics(run) if "distillation/loss" in r]


def test_fresh_train_on_a_run_is_refused_overwrite_replaces_it(cfg_file, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(cfg_file) == 0
    before = (run / "metrics.jsonl").read_bytes()
    assert _train(cfg_file, "train.steps=1") == 2
    assert _last_err_line(capsys) == (
        f"opdistill train: run error: run_dir {run} already holds a run (config.yaml, inputs.json, metrics.jsonl, checkpoints); continue it "
        f"with --resume, replace it with --overwrite, or choose another run_dir")
    assert (run / "metrics.jsonl").read_bytes() == before  # nothing touched
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]

    assert _train(cfg_file, "--overwrite", "train.steps=1") == 0
    assert _step_lines(run) == [1]  # the old run's lines are gone, not mixed in
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001"]
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 1


def test_a_run_refused_at_start_up_leaves_no_run(cfg_file, tmp_path, monkeypatch):
    from opdistill.train import assemble

    def broken(cfg, tok=None, **kwargs):
        raise RuntimeError("model folder missing")

    monkeypatch.setattr(assemble, "load_models", broken)
    with pytest.raises(RuntimeError, match="model folder missing"):
        _train(cfg_file)
    run = tmp_path / "run"
    assert [p.name for p in run.iterdir() if p.name != ".lock"] == []  # nothing that counts as a run
    monkeypatch.undo()
    assert _train(cfg_file) == 0  # so the corrected command just works, no --overwrite needed


def test_resume_needs_a_run_and_a_checkpoint(cfg_file, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(cfg_file, "--resume") == 2
    assert _last_err_line(capsys) == (
        f"opdistill train: run error: --resume: {run} holds no run (no config.yaml); start a new run without --resume")
    assert _train(cfg_file, "checkpoint.every=0", "checkpoint.save_final=false") == 0
    capsys.readouterr()
    assert _train(cfg_file, "--resume", "checkpoint.every=0", "checkpoint.save_final=false") == 2
    assert _last_err_line(capsys) == (
        f"opdistill train: run error: no checkpoint under {run / 'checkpoints'}; start the run again with --overwrite, or use "
        f"another run_dir")
    assert _train(cfg_file, "--resume", "--overwrite") == 2
    assert _last_err_line(capsys) == (
        "opdistill train: run error: --resume and --overwrite contradict each other: --resume continues the run in run_dir, "
        "--overwrite deletes it")


_HOLD = "import sys, time; from opdistill.train.disk.rundir import open_run_dir; rd = open_run_dir(sys.argv[1]); " \
        "print('held', flush=True); time.sleep(120)"


def test_a_second_process_is_refused_by_the_lock(cfg_file, tmp_path, capsys):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(run)], env=ENV, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        assert _train(cfg_file) == 2
        assert _last_err_line(capsys) == (
            f"opdistill train: run error: run_dir {run} is in use by another opdistill process (it holds {run / '.lock'}); "
            f"wait for it to finish, or choose another run_dir")
        assert not (run / "metrics.jsonl").exists() and not (run / "config.yaml").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert _train(cfg_file) == 0  # an OS lock: released when its holder is killed


def test_in_process_second_open_is_refused(tmp_path):
    with open_run_dir(tmp_path / "r"):
        with pytest.raises(RunError, match=r"is in use by another opdistill process"):
            open_run_dir(tmp_path / "r")
    open_run_dir(tmp_path / "r").close()  # released by close()


@pytest.mark.parametrize("entry", ["metrics.jsonl", "config.yaml", "checkpoints"])
def test_symlinks_in_the_run_dir_are_refused_never_followed(cfg_file, tmp_path, capsys, entry):
    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir() if entry == "checkpoints" else victim.write_text("precious\n")
    (run / entry).symlink_to(victim)
    assert _train(cfg_file) == 2
    assert _last_err_line(capsys) == (
        f"opdistill train: run error: {run / entry} is a symlink; opdistill never writes through links in a run directory "
        f"(replace it with a regular file or folder, or use another run_dir)")
    assert _train(cfg_file, "--resume") == 2  # resume checks before reading anything too
    assert (victim.is_dir() and not any(victim.iterdir())) or victim.read_text() == "precious\n"
    assert _train(cfg_file, "--overwrite") == 0  # --overwrite removes the link itself, not its target
    assert (victim.is_dir() and not any(victim.iterdir())) or victim.read_text() == "precious\n"
    assert not (run / entry).is_symlink()


def test_symlinked_checkpoint_entry_is_refused_on_resume(cfg_file, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(cfg_file) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "checkpoints" / "step_00000009").symlink_to(elsewhere)
    assert _train(cfg_file, "--resume", "train.steps=3") == 2
    assert _last_err_line(capsys) == (
        f"opdistill train: run error: {run / 'checkpoints' / 'step_00000009'} is a symlink; opdistill never writes through "
        f"links in a run directory (replace it with a regular file or folder, or use another run_dir)")


def test_write_helpers_never_follow_links(tmp_path):
    target = tmp_path / "target"
    target.write_text("precious\n")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(RunError, match=r"link is a symlink; opdistill never writes through links"):
        open_nofollow(link, os.O_WRONLY | os.O_APPEND)
    with pytest.raises(RunError, match=r"link is a symlink; opdistill never writes through links"):
        atomic_write_text(link, "overwritten")
    assert target.read_text() == "precious\n"


def test_resume_refuses_meaning_changes_with_the_full_diff(cfg_file, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(cfg_file) == 0
    config_before = (run / "config.yaml").read_bytes()
    assert _train(cfg_file, "--resume", "optim.lr=0.05", "loss.divergence=reverse", "train.seed=7",
                  "train.steps=3") == 2
    assert _last_err_line(capsys) == (
        f"opdistill train: run error: --resume: the config changes what run {run} means: loss.divergence 'forward' -> "
        f"'reverse', optim.lr 0.01 -> 0.05, train.seed 0 -> 7; to continue the run, give its own values again (e.g. "
        f"the overrides it started with): loss.divergence=forward optim.lr=0.01 train.seed=0 (only "
        f"{', '.join(RESUMABLE_KEYS)} may change on resume; another run_dir starts a new run, and --overwrite deletes "
        f"this one)")
    assert (run / "config.yaml").read_bytes() == config_before
    assert not (run / "config_history.jsonl").exists()
    assert _step_lines(run) == [1, 2]


def test_resume_logs_allowed_changes_and_never_rewrites_config_yaml(cfg_file, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(cfg_file) == 0
    config_before = (run / "config.yaml").read_bytes()
    with pytest.warns(RunWarning, match=r"train.steps changed 2 -> 3: the cosine schedule now decays over 3 steps"):
        assert _train(cfg_file, "--resume", "train.steps=3", "log.tensorboard=true") == 0
    assert _step_lines(run) == [1, 2, 3]
    err = capsys.readouterr().err.splitlines()  # issue 35: a resume says where it starts and what it changed
    ckpt = run / "checkpoints" / "step_00000002"
    assert f"opdistill: resuming {run} from step 2 ({ckpt})" in err
    assert "opdistill: --resume changes train.steps: 2 -> 3 (recorded in config_history.jsonl)" in err
    assert "opdistill: --resume changes log.tensorboard: False -> True (recorded in config_history.jsonl)" in err
    assert (run / "config.yaml").read_bytes() == config_before
    rows = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["resumed_at_step"] == 2
    assert rows[0]["changes"] == {"log.tensorboard": {"from": False, "to": True},
                                  "train.steps": {"from": 2, "to": 3}}
    # the same values again: nothing new to log (compared with config.yaml + the history)
    assert _train(cfg_file, "--resume", "train.steps=3", "log.tensorboard=true") == 0
    assert len((run / "config_history.jsonl").read_text().splitlines()) == 1
    assert not [line for line in capsys.readouterr().err.splitlines() if "--resume changes" in line]
    # back to the file's values: that is a change too, and it is logged
    assert _train(cfg_file, "--resume", "train.steps=3") == 0
    last = json.loads((run / "config_history.jsonl").read_text().splitlines()[-1])
    assert last["changes"] == {"log.tensorboard": {"from": True, "to": False}} and last["resumed_at_step"] == 3


def test_config_changes_is_a_flat_diff_of_every_key():
    old = {"a": {"b": 1, "c": {"d": 2}}, "e": 3, "t": {}}
    new = {"a": {"b": 1, "c": {"d": 5}}, "e": 3, "t": {"x": 1}, "n": None}
    assert config_changes(old, new) == {"a.c.d": (2, 5), "t": ({}, None), "t.x": (None, 1)}


def test_torn_metrics_line_is_cut_off_with_a_warning(cfg_file, tmp_path):
    run = tmp_path / "run"
    assert _train(cfg_file) == 0
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "distillation/lo')  # a write cut off by a kill
    n = len((run / "metrics.jsonl").read_text().splitlines())
    with pytest.warns(RunWarning, match=rf"metrics.jsonl: line {n} is torn \(a write cut off by a kill\?\)"):
        assert _step_lines(run) == [1, 2]
    with pytest.warns(RunWarning, match=r"is torn"):
        assert _train(cfg_file, "--resume", "train.steps=3") == 0
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if "distillation/loss" in line] == [1, 2, 3]


def test_a_bad_line_before_the_last_is_corruption(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"ste\n{"step": 2}\n')
    with pytest.raises(RunError) as e:
        read_metrics(tmp_path)
    assert str(e.value) == f"{tmp_path / 'metrics.jsonl'}: line 2 is not JSON (Unterminated string starting at); " \
                           f"the file is corrupt"


def test_stray_folder_in_checkpoints_is_ignored_with_a_warning(cfg_file, tmp_path):
    run = tmp_path / "run"
    assert _train(cfg_file) == 0
    (run / "checkpoints" / "notes").mkdir()
    with pytest.warns(RunWarning, match=r"checkpoints/notes: not a checkpoint \(expected a folder step_NNNNNNNN\); "
                                        r"ignored"):
        assert _train(cfg_file, "--resume", "train.steps=3") == 0
    assert _step_lines(run) == [1, 2, 3]
    assert (run / "checkpoints" / "notes").is_dir()  # not ours: left alone
