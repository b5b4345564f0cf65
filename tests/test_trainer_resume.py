"""Exact resume after SIGKILL, and atomic checkpoints (a kill during a save leaves the previous one intact)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
import yaml

from opdistill.train.disk.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tests.trainer_helpers import make_model_dir, tiny_config_dict

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def _losses(run_dir):
    rows = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["distillation/loss"], r["train/grad_norm"]) for r in rows if "distillation/loss" in r]


def _train_cmd(cfg_path, *extra):
    return [sys.executable, "-m", "opdistill.cli", "train", "--config", str(cfg_path), *extra]


def test_resume_after_sigkill_reproduces_the_uninterrupted_run(tmp_path):
    steps = 10
    cfg = tiny_config_dict(tmp_path, steps=steps, checkpoint={"every": 1, "keep_last": 2},
                           eval={"num_prompts": 0}, optim={"lr": 1e-2, "warmup_steps": 3})
    cfg["run_dir"] = str(tmp_path / "full")
    full_cfg = tmp_path / "full.yaml"
    full_cfg.write_text(yaml.safe_dump(cfg))
    cfg["run_dir"] = str(tmp_path / "killed")
    killed_cfg = tmp_path / "killed.yaml"
    killed_cfg.write_text(yaml.safe_dump(cfg))

    # The interrupted run: SIGKILL as soon as its checkpoint of step 3 exists (the run is then mid-step 4 or later).
    proc = subprocess.Popen(_train_cmd(killed_cfg), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckpt3 = tmp_path / "killed" / "checkpoints" / "step_00000003"
    deadline = time.time() + 120
    while not ckpt3.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    killed_at = latest_checkpoint(tmp_path / "killed")
    assert killed_at is not None and int(killed_at.name.split("_")[1]) < steps

    # The uninterrupted run, then the resume, in the same kind of process.
    subprocess.run(_train_cmd(full_cfg), env=ENV, check=True, capture_output=True)
    subprocess.run(_train_cmd(killed_cfg, "--resume"), env=ENV, check=True, capture_output=True)
    full, resumed = _losses(tmp_path / "full"), _losses(tmp_path / "killed")
    assert [s for s, *_ in resumed] == list(range(1, steps + 1))  # no duplicated or missing step lines
    assert resumed == full  # bit-for-bit the same per-step losses and gradient norms


_CRASH_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    from opdistill.models import load_model
    from opdistill.train.disk import checkpoint
    model = load_model(sys.argv[1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    checkpoint.save_checkpoint(sys.argv[2], 1, model, opt, sched, {"train_time": 1.0})
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, sys.argv[3])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    checkpoint._before_rename_hook = lambda tmp: os.kill(os.getpid(), signal.SIGKILL)
    checkpoint.save_checkpoint(sys.argv[2], 2, model, opt, sched, {"train_time": 2.0})
    print("not reached")
""")


def test_kill_during_save_leaves_previous_checkpoint_intact(tmp_path):
    mdir = make_model_dir(tmp_path / "m", hidden=16)
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", _CRASH_SCRIPT, mdir, str(run), str(tmp_path / "w1.pt")], env=ENV,
                       capture_output=True)
    assert r.returncode == -signal.SIGKILL and b"not reached" not in r.stdout, r.stderr.decode()[-2000:]
    assert any(p.name.startswith(".tmp-") for p in (run / "checkpoints").iterdir())  # the half-written save
    latest = latest_checkpoint(run)
    assert latest.name == "step_00000001"
    from opdistill.models import load_model

    model = load_model(mdir)
    state = load_checkpoint(latest, model)
    assert state["step"] == 1 and state["train_time"] == 1.0
    expected = torch.load(tmp_path / "w1.pt")
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    # the next save cleans the leftover temporary folder and prunes to keep_last
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for step in (2, 3, 4):
        save_checkpoint(run, step, model, opt, sched, {"train_time": 0.0}, keep_last=2)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]
