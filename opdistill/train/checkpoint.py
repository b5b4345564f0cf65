"""Atomic, verified checkpoints with no pickle anywhere, and exact resume.

A checkpoint is a folder ``checkpoints/step_00000012/`` holding

- the student as a transformers folder (``model.safetensors`` + ``config.json`` [+ tokenizer], loadable by
  ``from_pretrained``),
- ``trainer_state.safetensors``: every tensor of the trainer state, flattened to names (the optimizer's per-parameter
  state ``optimizer/{param index}/{name}``, the torch and numpy RNG states),
- ``trainer_state.json``: the rest (step, data position, training time, evaluation history, run counters, the
  optimizer's param groups and non-tensor state, the scheduler's state, the Python RNG state),
- ``manifest.json``, written LAST: the SHA-256 and size of every other file.

Nothing here unpickles: safetensors and JSON are data formats, so a crafted checkpoint cannot run code. A legacy
``trainer_state.pt`` is never read (it has no manifest, so it is refused as a resume point; ``opdistill eval`` reads
its ``model.safetensors`` only).

The folder is written into a hidden temporary folder, every file fsync'ed, the manifest written and fsync'ed last,
and the folder then renamed into place: a rename is atomic, so a process killed during a save leaves either no new
folder or a complete one, and the previous checkpoints are untouched. Loading verifies the manifest (every listed
file present, same size, same SHA-256); :func:`resume_checkpoint` walks back from the newest to the newest intact
checkpoint with a warning for each one skipped. A checkpoint whose weights or optimizer state hold a NaN/inf is never
written (:class:`NonFiniteError`). Old checkpoints beyond ``keep_last`` are deleted only after the new one is in
place; leftover temporary folders of killed saves are removed by the next save.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from opdistill.train.rundir import (CheckpointError, NonFiniteError, RunWarning, atomic_write_text,
                                    check_not_symlink)

__all__ = ["save_checkpoint", "latest_checkpoint", "resume_checkpoint", "load_checkpoint", "load_weights",
           "verify_checkpoint", "list_checkpoints", "set_aside_newer", "rng_state", "set_rng_state", "FORMAT_VERSION"]

FORMAT_VERSION = 1
_PREFIX = "step_"
_NAME = re.compile(r"step_(\d{8})")
_TMP = ".tmp-"
_SET_ASIDE = ".skipped-"  # corrupt checkpoints newer than the one a run resumed from (kept for inspection, not read)
MANIFEST = "manifest.json"
STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
WEIGHTS = "model.safetensors"
_REQUIRED = (WEIGHTS, STATE_JSON, STATE_TENSORS)
# Test hook: called after the files are written and before the rename (a test kills the process here).
_before_rename_hook = None


# ---- RNG and optimizer state <-> (tensors, JSON) -------------------------------------------------------------------

def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def _split_state(optimizer, scheduler) -> tuple[dict, dict]:
    """(tensors, JSON-able dict) holding the optimizer, scheduler and RNG states."""
    tensors, opt_scalars = {}, {}
    opt = optimizer.state_dict()
    for idx, st in opt["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optimizer/{idx}/{name}"] = v.detach().cpu().contiguous().clone()
            else:
                opt_scalars.setdefault(str(idx), {})[name] = v
    rng = rng_state()
    tensors["rng/torch"] = rng["torch"]
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = rng["numpy"]
    tensors["rng/numpy_keys"] = torch.from_numpy(np.asarray(np_keys, dtype=np.uint32).view(np.int32).copy())
    py_version, py_internal, py_gauss = rng["python"]
    meta = {
        "optimizer": {"param_groups": opt["param_groups"], "state_scalars": opt_scalars,
                      "state_params": sorted(int(i) for i in opt["state"])},
        "scheduler": scheduler.state_dict(),
        "rng": {"numpy": [np_name, int(np_pos), int(np_has_gauss), float(np_gauss)],
                "python": [py_version, list(py_internal), py_gauss]},
    }
    return tensors, meta


def _restore_state(tensors: dict, meta: dict, optimizer, scheduler) -> None:
    if optimizer is not None:
        om = meta["optimizer"]
        state = {}
        for idx in om["state_params"]:
            state[idx] = dict(om["state_scalars"].get(str(idx), {}))
        for name, v in tensors.items():
            parts = name.split("/")
            if parts[0] == "optimizer":
                state.setdefault(int(parts[1]), {})[parts[2]] = v
        # JSON has no tuples: the optimizers' tuple hyper-parameters (AdamW's betas) come back as lists
        groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
                  for g in om["param_groups"]]
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    if scheduler is not None:
        scheduler.load_state_dict(meta["scheduler"])
    np_name, np_pos, np_has_gauss, np_gauss = meta["rng"]["numpy"]
    py_version, py_internal, py_gauss = meta["rng"]["python"]
    set_rng_state({"torch": tensors["rng/torch"],
                   "numpy": (np_name, tensors["rng/numpy_keys"].numpy().view(np.uint32), np_pos, np_has_gauss,
                             np_gauss),
                   "python": (py_version, tuple(py_internal), py_gauss)})


# ---- integrity ------------------------------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_manifest(folder: Path, step: int) -> None:
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = p.relative_to(folder).as_posix()
            files[rel] = {"sha256": _sha256(p), "bytes": p.stat().st_size}
    manifest = {"format": "opdistill-checkpoint", "version": FORMAT_VERSION, "step": step, "files": files}
    atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def verify_checkpoint(path: str | Path, *, only: tuple[str, ...] | None = None) -> dict:
    """Check the manifest of checkpoint folder ``path`` (every listed file present, a regular file, same size and
    SHA-256; the trainer-state files listed); return it. ``only``: verify just these files (e.g. the weights).
    Raises :class:`CheckpointError` naming the file and what is wrong."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        legacy = " (a legacy checkpoint with trainer_state.pt? it is not read: pickle can run code)" \
            if (path / "trainer_state.pt").exists() else ""
        raise CheckpointError(f"{mpath}: missing; the checkpoint is incomplete or not written by this opdistill "
                              f"version{legacy}")
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        version = manifest["version"]
        if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
            raise TypeError("'files' is not a mapping of file -> {sha256, bytes}")
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e!r})") from e
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: checkpoint format version {version!r}, this opdistill reads version "
                              f"{FORMAT_VERSION}")
    named = _NAME.fullmatch(path.name)
    if named and int(named.group(1)) != manifest.get("step"):
        raise CheckpointError(f"{mpath}: holds step {manifest.get('step')!r} but the folder is named {path.name} "
                              f"(a renamed or copied checkpoint)")
    for name in files:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{mpath}: lists {name!r}, which is outside the checkpoint folder")
    needed = only if only is not None else _REQUIRED
    for name in needed:
        if name not in files:
            raise CheckpointError(f"{path / name}: not listed in {mpath}")
    for name in (only if only is not None else files):
        entry = files[name]
        p = path / name
        if p.is_symlink() or not p.is_file():
            raise CheckpointError(f"{p}: missing or not a regular file (listed in {mpath})")
        if p.stat().st_size != entry["bytes"]:
            raise CheckpointError(f"{p}: {p.stat().st_size} bytes, the manifest says {entry['bytes']} (truncated "
                                  f"or corrupt)")
        if _sha256(p) != entry["sha256"]:
            raise CheckpointError(f"{p}: SHA-256 does not match {mpath} (the file is corrupt)")
    return manifest


# ---- the checkpoints folder -----------------------------------------------------------------------------------------

def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The ``step_NNNNNNNN`` folders of ``RUN_DIR/checkpoints``, oldest first. Temporary folders of killed saves and
    set-aside corrupt ones are skipped silently, anything else with a :class:`RunWarning`; a symlink is refused."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    check_not_symlink(ckpt_dir)
    if not ckpt_dir.exists():
        return []
    found = []
    for p in sorted(ckpt_dir.iterdir()):
        if p.name.startswith((_TMP, _SET_ASIDE)):
            continue
        check_not_symlink(p)
        if p.is_dir() and _NAME.fullmatch(p.name):
            found.append(p)
        else:
            warnings.warn(f"{p}: not a checkpoint (expected a folder step_NNNNNNNN); ignored", RunWarning,
                          stacklevel=2)
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint folder by name (unverified; see :func:`resume_checkpoint`)."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def resume_checkpoint(run_dir: str | Path, *, hint: str = "") -> Path:
    """The newest intact checkpoint of the run. Each newer one that fails :func:`verify_checkpoint` is skipped with a
    :class:`RunWarning` naming it and why. Raises :class:`CheckpointError` when there is no checkpoint or none is
    intact, naming each file and reason (``hint``: what the user can do, appended to the message)."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    found = list_checkpoints(run_dir)
    if not found:
        raise CheckpointError(f"no checkpoint under {ckpt_dir}{hint}")
    reasons = []
    for ckpt in reversed(found):
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as e:
            reasons.append(str(e))
            warnings.warn(f"skipping checkpoint {ckpt}: {e}", RunWarning, stacklevel=2)
            continue
        return ckpt
    raise CheckpointError(f"no intact checkpoint under {ckpt_dir}: {'; '.join(reasons)}{hint}")


def set_aside_newer(run_dir: str | Path, resumed: Path) -> list[Path]:
    """Rename every checkpoint newer than ``resumed`` (the ones :func:`resume_checkpoint` skipped as corrupt) to
    ``checkpoints/.skipped-step_N``: they belong to a timeline the resumed run recomputes, and left in place a later
    save's ``keep_last`` rotation would delete good checkpoints in their favour. Kept for inspection, never read."""
    moved = []
    for ckpt in list_checkpoints(run_dir):
        if int(ckpt.name[len(_PREFIX):]) > int(resumed.name[len(_PREFIX):]):
            dest = ckpt.with_name(_SET_ASIDE + ckpt.name)
            if dest.exists():
                shutil.rmtree(dest)
            os.rename(ckpt, dest)
            warnings.warn(f"moved the skipped checkpoint {ckpt} to {dest} (not read again; delete it when done "
                          f"inspecting)", RunWarning, stacklevel=2)
            moved.append(dest)
    return moved


def _check_finite(model, optimizer, step: int) -> None:
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise NonFiniteError(f"step {step}: weight {name} holds NaN/inf; the checkpoint is not written. Likely "
                                 f"causes: fp16 overflow (use model.dtype=bfloat16 or float32), a learning rate too "
                                 f"high (optim.lr), bad data or teacher scores")
    for idx, st in optimizer.state.items():
        for key, v in st.items():
            if isinstance(v, torch.Tensor) and not torch.isfinite(v).all():
                raise NonFiniteError(f"step {step}: optimizer state {key!r} holds NaN/inf; the checkpoint is not "
                                     f"written. Likely causes: fp16 overflow, a learning rate too high (optim.lr), "
                                     f"bad data or teacher scores")


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: str | Path, step: int, model, optimizer, scheduler, state: dict, *, keep_last: int = 2,
                    tokenizer=None) -> Path:
    """Write checkpoint ``step`` atomically (``state``: JSON-able run state, e.g. training time and history); keep
    the newest ``keep_last``; return its folder. Refuses non-finite weights or optimizer state."""
    from safetensors.torch import save_file

    _check_finite(model, optimizer, step)
    ckpt_dir = Path(run_dir) / "checkpoints"
    check_not_symlink(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for stale in ckpt_dir.glob(_TMP + "*"):  # a save killed earlier
        if stale.is_symlink() or not stale.is_dir():
            stale.unlink()
        else:
            shutil.rmtree(stale, ignore_errors=True)
    final = ckpt_dir / f"{_PREFIX}{step:08d}"
    check_not_symlink(final)
    tmp = ckpt_dir / f"{_TMP}{final.name}-{os.getpid()}"
    tmp.mkdir()
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    tensors, meta = _split_state(optimizer, scheduler)
    save_file(tensors, str(tmp / STATE_TENSORS))
    meta = {"step": step, **state, **meta}
    (tmp / STATE_JSON).write_text(json.dumps(meta) + "\n")
    _fsync_tree(tmp)
    _write_manifest(tmp, step)  # last: a folder with a valid manifest is complete
    if _before_rename_hook is not None:
        _before_rename_hook(tmp)
    if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
        shutil.rmtree(final)
    os.rename(tmp, final)
    fd = os.open(ckpt_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    for old in [p for p in list_checkpoints(run_dir) if p != final][: -keep_last + 1 or None]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# ---- loading --------------------------------------------------------------------------------------------------------

def load_weights(path: str | Path, model) -> dict | None:
    """Load only the weights of checkpoint folder ``path`` (``model.safetensors``) into ``model``; verified against
    the manifest when there is one (a folder without one, e.g. a legacy checkpoint, is loaded with a warning). Never
    reads the trainer state. Returns the manifest (None without one)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / WEIGHTS).is_file():
        raise CheckpointError(f"{path / WEIGHTS}: missing; --checkpoint must be a checkpoint folder "
                              f"(checkpoints/step_NNNNNNNN) holding {WEIGHTS}")
    manifest = None
    if (path / MANIFEST).exists():
        manifest = verify_checkpoint(path, only=(WEIGHTS,))
    else:
        warnings.warn(f"{path}: no {MANIFEST}; loading {WEIGHTS} unverified", RunWarning, stacklevel=2)
    try:
        weights = load_file(str(path / WEIGHTS))
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types on a bad header
        raise CheckpointError(f"{path / WEIGHTS}: not a readable safetensors file ({e})") from e
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # same names, other shapes: a checkpoint of another model size
        first = str(e).strip().splitlines()
        raise CheckpointError(f"{path / WEIGHTS}: does not match the model ({first[-1].strip() if first else e})") \
            from None
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise CheckpointError(f"{path / WEIGHTS}: does not match the model (missing {sorted(missing)}, unexpected "
                              f"{sorted(unexpected)})")
    if tied:
        model.tie_weights()
    return manifest


def load_checkpoint(path: str | Path, model, optimizer=None, scheduler=None) -> dict:
    """Verify checkpoint folder ``path``, load its weights, optimizer and scheduler (when given) and RNG states;
    return the saved run state (``step``, ``train_time``, ...)."""
    from safetensors.torch import load_file

    path = Path(path)
    verify_checkpoint(path)
    load_weights(path, model)
    try:
        meta = json.loads((path / STATE_JSON).read_text())
        tensors = load_file(str(path / STATE_TENSORS))
        _restore_state(tensors, meta, optimizer, scheduler)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 -- a verified file that does not fit this model/optimizer
        raise CheckpointError(f"{path}: trainer state does not fit this run ({type(e).__name__}: {e})") from e
    for key in ("optimizer", "scheduler", "rng"):
        meta.pop(key, None)
    return meta
