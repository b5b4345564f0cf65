"""Checkpoints: no pickle on any load path (a crafted trainer_state.pt never runs), the SHA-256 manifest, fallback to
the newest intact checkpoint, an exact round trip of the trainer state, and the non-finite refusal."""
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from opdistill.cli import main
from opdistill.models import load_model
from opdistill.train.disk import checkpoint as ckpt_mod
from opdistill.train.disk.checkpoint import (MANIFEST, list_checkpoints, load_checkpoint, load_weights,
                                             resume_checkpoint, save_checkpoint, verify_checkpoint)
from opdistill.runs.files import read_metrics
from opdistill.train.disk.rundir import CheckpointError, NonFiniteError, RunWarning
from tests.trainer_helpers import make_model_dir, tiny_config_dict


class _Evil:
    """Unpickling this creates the file ``marker``: proof that code from the checkpoint ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant_pickle(folder: Path, marker: Path) -> None:
    torch.save({"step": 1, "optimizer": _Evil(marker)}, folder / "trainer_state.pt")


@pytest.fixture
def model_dir(tmp_path):
    return make_model_dir(tmp_path / "m", hidden=16)


def _model_and_opt(model_dir, steps=2):
    torch.manual_seed(0)
    model = load_model(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for _ in range(steps):  # populate the optimizer state
        out = model(input_ids=torch.randint(0, model.config.vocab_size, (2, 5))).logits
        out.square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def test_trainer_state_round_trip_is_exact_and_pickle_free(tmp_path, model_dir):
    model, opt, sched = _model_and_opt(model_dir)
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    np.random.standard_normal()  # leaves a cached Gaussian in numpy's state
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    folder = save_checkpoint(tmp_path / "run", 7, model, opt, sched, {"train_time": 1.5, "eval_history": [{"a": 1}]})
    files = sorted(p.name for p in folder.iterdir())
    assert not [f for f in files if f.endswith((".pt", ".bin", ".pkl"))]
    manifest = json.loads((folder / MANIFEST).read_text())
    assert sorted(manifest["files"]) == [f for f in files if f != MANIFEST]

    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    model2, opt2, sched2 = _model_and_opt(model_dir, steps=1)
    state = load_checkpoint(folder, model2, opt2, sched2)
    assert state == {"step": 7, "train_time": 1.5, "eval_history": [{"a": 1}]}
    for (k, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), k
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert s1["state"].keys() == s2["state"].keys()
    for i in s1["state"]:
        for name, v in s1["state"][i].items():
            assert torch.equal(v, s2["state"][i][name]) and v.dtype == s2["state"][i][name].dtype, (i, name)
    assert {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"} == \
           {k: v for k, v in sched2.state_dict().items() if k != "lr_lambdas"}
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[1]
    np_now = np.random.get_state()
    assert np_now[0] == rng[2][0] and np.array_equal(np_now[1], rng[2][1]) and np_now[2:] == rng[2][2:]


def test_crafted_pickle_never_runs_on_eval_or_resume(tmp_path, capsys):
    cfg = tiny_config_dict(tmp_path, steps=2, eval={"num_prompts": 2}, checkpoint={"every": 1, "keep_last": 3})
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    assert main(["train", "--config", str(cfg_file)]) == 0
    marker = tmp_path / "pwned"
    ckpts = list_checkpoints(run)

    # 1. a legacy-style folder: weights + a malicious trainer_state.pt, no manifest
    legacy = ckpts[-1].with_name("step_00000009")
    shutil.copytree(ckpts[-1], legacy)
    (legacy / MANIFEST).unlink()
    _plant_pickle(legacy, marker)
    with pytest.warns(RunWarning, match=r"step_00000009: no manifest.json; loading model.safetensors unverified"):
        assert main(["eval", "--config", str(cfg_file), "--checkpoint", str(legacy)]) == 0
    assert not marker.exists()
    with pytest.warns(RunWarning, match=r"skipping checkpoint .*step_00000009: .*manifest.json: missing; the "
                                        r"checkpoint is incomplete or not written by this opdistill version \(a "
                                        r"legacy checkpoint with trainer_state.pt\? it is not read: pickle can run "
                                        r"code\)"):
        assert main(["train", "--config", str(cfg_file), "--resume", "train.steps=3"]) == 0
    assert not marker.exists()

    # 2. a malicious trainer_state.pt listed in a manifest with its correct hash (an attacker can rewrite it)
    newest = list_checkpoints(run)[-1]
    _plant_pickle(newest, marker)
    ckpt_mod._write_manifest(newest, 3)
    verify_checkpoint(newest)
    assert main(["eval", "--config", str(cfg_file), "--checkpoint", "latest"]) == 0
    assert main(["train", "--config", str(cfg_file), "--resume", "train.steps=4"]) == 0
    assert not marker.exists()
    # the planted file is a working exploit: unpickling it does create the marker
    torch.load(newest.with_name("step_00000003") / "trainer_state.pt", weights_only=False)
    assert marker.exists()


def _flip_byte(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def _saved_run(tmp_path, model_dir, steps=(1, 2, 3)):
    model, opt, sched = _model_and_opt(model_dir, steps=1)
    run = tmp_path / "run"
    for s in steps:
        save_checkpoint(run, s, model, opt, sched, {"train_time": float(s)}, keep_last=10)
    return run, model


def test_a_byte_flip_is_detected_and_named(tmp_path, model_dir):
    run, model = _saved_run(tmp_path, model_dir, steps=(1,))
    folder = run / "checkpoints" / "step_00000001"
    _flip_byte(folder / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder, model)
    assert str(e.value) == (f"{folder / 'model.safetensors'}: SHA-256 does not match {folder / MANIFEST} (the file "
                            f"is corrupt)")
    with pytest.raises(CheckpointError) as e:
        load_weights(folder, model)  # eval's path verifies the weights too
    assert str(e.value).endswith("model.safetensors: SHA-256 does not match " + str(folder / MANIFEST)
                                 + " (the file is corrupt)")
    p = folder / "trainer_state.json"
    p.write_bytes(p.read_bytes()[:-3])
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(folder, only=("trainer_state.json",))
    size = p.stat().st_size
    assert str(e.value) == f"{p}: {size} bytes, the manifest says {size + 3} (truncated or corrupt)"


def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, model_dir):
    run, _ = _saved_run(tmp_path, model_dir)
    c = run / "checkpoints"
    _flip_byte(c / "step_00000003" / "trainer_state.safetensors")
    (c / "step_00000002" / MANIFEST).unlink()  # e.g. a partial copy
    with pytest.warns(RunWarning) as rec:
        assert resume_checkpoint(run) == c / "step_00000001"
    assert [str(w.message) for w in rec] == [
        f"skipping checkpoint {c / 'step_00000003'}: {c / 'step_00000003' / 'trainer_state.safetensors'}: SHA-256 "
        f"does not match {c / 'step_00000003' / MANIFEST} (the file is corrupt)",
        f"skipping checkpoint {c / 'step_00000002'}: {c / 'step_00000002' / MANIFEST}: missing; the checkpoint is "
        f"incomplete or not written by this opdistill version"]
    (c / "step_00000001" / "model.safetensors").unlink()
    with pytest.warns(RunWarning), pytest.raises(CheckpointError) as e:
        resume_checkpoint(run, hint="; HINT")
    assert str(e.value) == (
        f"no intact checkpoint under {c}: "
        f"{c / 'step_00000003' / 'trainer_state.safetensors'}: SHA-256 does not match "
        f"{c / 'step_00000003' / MANIFEST} (the file is corrupt); "
        f"{c / 'step_00000002' / MANIFEST}: missing; the checkpoint is incomplete or not written by this opdistill "
        f"version; {c / 'step_00000001' / 'model.safetensors'}: missing or not a regular file (listed in "
        f"{c / 'step_00000001' / MANIFEST}); HINT")


def test_cli_resume_skips_a_corrupt_checkpoint_and_stays_exact(tmp_path):
    cfg = tiny_config_dict(tmp_path, steps=3, eval={"num_prompts": 0}, checkpoint={"every": 1, "keep_last": 3})
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    assert main(["train", "--config", str(cfg_file)]) == 0
    full = [(r["step"], r["distillation/loss"], r["train/grad_norm"]) for r in read_metrics(run)]
    c = run / "checkpoints"
    _flip_byte(c / "step_00000003" / "model.safetensors")
    with pytest.warns(RunWarning) as rec:
        assert main(["train", "--config", str(cfg_file), "--resume"]) == 0
    messages = [str(w.message) for w in rec]
    assert messages[0].startswith(f"skipping checkpoint {c / 'step_00000003'}: ")
    assert messages[1] == (f"moved the skipped checkpoint {c / 'step_00000003'} to {c / '.skipped-step_00000003'} "
                           f"(not read again; delete it when done inspecting)")
    resumed = [(r["step"], r["distillation/loss"], r["train/grad_norm"]) for r in read_metrics(run)]
    assert resumed == full  # step 3 recomputed from step 2, bit for bit
    assert sorted(p.name for p in c.iterdir()) == [".skipped-step_00000003", "step_00000001", "step_00000002",
                                                   "step_00000003"]
    verify_checkpoint(c / "step_00000003")


def test_manifest_is_written_last(tmp_path, model_dir, monkeypatch):
    run, model = _saved_run(tmp_path, model_dir, steps=(1,))
    model2, opt, sched = _model_and_opt(model_dir, steps=1)

    def boom(folder, step, *layout):
        assert {p.name for p in folder.iterdir()} >= {"model.safetensors", "config.json", "trainer_state.json",
                                                      "trainer_state.safetensors"}
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod, "_write_manifest", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(run, 2, model2, opt, sched, {"train_time": 0.0})
    assert [p.name for p in list_checkpoints(run)] == ["step_00000001"]  # nothing half-written became visible
    verify_checkpoint(run / "checkpoints" / "step_00000001")


def test_non_finite_weights_are_never_saved(tmp_path, model_dir):
    run, _ = _saved_run(tmp_path, model_dir, steps=(1,))
    model, opt, sched = _model_and_opt(model_dir, steps=1)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError) as e:
        save_checkpoint(run, 2, model, opt, sched, {"train_time": 0.0})
    assert str(e.value) == (
        "step 2: weight model.layers.0.mlp.up_proj.weight holds NaN/inf; the checkpoint is not written. Likely "
        "causes: fp16 overflow (use model.dtype=bfloat16 or float32), a learning rate too high (optim.lr), bad data "
        "or teacher scores")
    model, opt, sched = _model_and_opt(model_dir, steps=1)
    next(iter(opt.state.values()))["exp_avg_sq"][0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"step 3: optimizer state 'exp_avg_sq' holds NaN/inf; the checkpoint "
                                             r"is not written"):
        save_checkpoint(run, 3, model, opt, sched, {"train_time": 0.0})
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000001"]


def test_eval_checkpoint_must_be_a_checkpoint_folder(tmp_path, model_dir, capsys):
    cfg = tiny_config_dict(tmp_path, steps=1, eval={"num_prompts": 2})
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    assert main(["eval", "--config", str(cfg_file), "--checkpoint", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"opdistill eval: run error: {tmp_path / 'model.safetensors'}: missing; --checkpoint must be a checkpoint folder "
        f"(checkpoints/step_NNNNNNNN) holding model.safetensors")
    assert main(["eval", "--config", str(cfg_file), "--checkpoint", "latest"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"opdistill eval: run error: no checkpoint under {tmp_path / 'run' / 'checkpoints'}")


def test_manifest_must_match_its_folder(tmp_path, model_dir):
    run, _ = _saved_run(tmp_path, model_dir, steps=(1,))
    c = run / "checkpoints"
    shutil.copytree(c / "step_00000001", c / "step_00000009")  # a copied checkpoint posing as a later step
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(c / "step_00000009")
    assert str(e.value) == (f"{c / 'step_00000009' / MANIFEST}: holds step 1 but the folder is named step_00000009 "
                            f"(a renamed or copied checkpoint)")
    mpath = c / "step_00000001" / MANIFEST
    manifest = json.loads(mpath.read_text())
    manifest["files"]["../../outside"] = {"sha256": "0" * 64, "bytes": 0}
    mpath.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(c / "step_00000001")
    assert str(e.value) == f"{mpath}: lists '../../outside', which is outside the checkpoint folder"
    mpath.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"manifest.json: unreadable manifest \(JSONDecodeError"):
        verify_checkpoint(c / "step_00000001")
