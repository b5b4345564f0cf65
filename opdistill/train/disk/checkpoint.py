"""Atomic, verified checkpoints with no pickle anywhere, and exact resume.

A checkpoint is a folder ``checkpoints/step_00000012/`` holding

- the student as a transformers folder (``model.safetensors`` + ``config.json`` [+ tokenizer], loadable by
  ``from_pretrained``),
- ``trainer_state.safetensors``: every tensor of the trainer state, flattened to names (the optimizer's per-parameter
  state ``optimizer/{param index}/{name}``, the torch and numpy RNG states),
- ``trainer_state.json``: the rest (step, data position, training time, evaluation history, run counters, the
  optimizer's param groups and non-tensor state, the scheduler's state, the Python RNG state),
- ``manifest.json``, written LAST: the SHA-256 and size of every other file.

A multi-process run (torchrun) writes a *sharded* checkpoint into the same temporary folder, manifest and rename:
``dcp/`` holds the model and optimizer state written by every rank with torch.distributed.checkpoint (loadable at
any world size, one plain process included), rank 0 adds the full student as the transformers folder and
``trainer_state.*`` without the optimizer, and the manifest says ``"layout": "dcp"`` (docs/distributed.md). DCP's
metadata is pickled; it is read by an unpickler that resolves only DCP's own metadata classes (``_safe_dcp_reader``).

Nothing here unpickles arbitrary objects: safetensors and JSON are data formats, so a crafted checkpoint cannot run
code. A legacy ``trainer_state.pt`` is never read (it has no manifest, so it is refused as a resume point;
``opdistill eval`` reads its ``model.safetensors`` only).

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

from opdistill.durable import fsync_path, fsync_tree
from opdistill.train.run.lora import ADAPTERS, load_adapters, save_model
from opdistill.train.disk.rundir import (CheckpointError, NonFiniteError, RunWarning, atomic_write_text,
                                    check_not_symlink, follow_umask)

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
DCP_DIR = "dcp"  # a sharded checkpoint's model and optimizer state (torch.distributed.checkpoint)
DCP_METADATA = f"{DCP_DIR}/.metadata"
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


def _split_state(optimizer, scheduler, rng: dict | None = None) -> tuple[dict, dict]:
    """(tensors, JSON-able dict) holding the optimizer (unless None: a sharded checkpoint keeps it in DCP),
    scheduler and RNG states (``rng``: a :func:`rng_state` taken earlier; None: now)."""
    tensors, opt_scalars = {}, {}
    opt = optimizer.state_dict() if optimizer is not None else {"state": {}, "param_groups": []}
    for idx, st in opt["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optimizer/{idx}/{name}"] = v.detach().cpu().contiguous().clone()
            else:
                opt_scalars.setdefault(str(idx), {})[name] = v
    rng = rng_state() if rng is None else rng
    tensors["rng/torch"] = rng["torch"]
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = rng["numpy"]
    tensors["rng/numpy_keys"] = torch.from_numpy(np.asarray(np_keys, dtype=np.uint32).view(np.int32).copy())
    py_version, py_internal, py_gauss = rng["python"]
    meta = {
        "optimizer": None if optimizer is None else {
            "param_groups": opt["param_groups"], "state_scalars": opt_scalars,
            "state_params": sorted(int(i) for i in opt["state"])},
        "scheduler": scheduler.state_dict(),
        "rng": {"numpy": [np_name, int(np_pos), int(np_has_gauss), float(np_gauss)],
                "python": [py_version, list(py_internal), py_gauss]},
    }
    return tensors, meta


def _restore_state(tensors: dict, meta: dict, optimizer, scheduler) -> None:
    if optimizer is not None and meta["optimizer"] is not None:
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


def _write_manifest(folder: Path, step: int, layout: str = "single") -> None:
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = p.relative_to(folder).as_posix()
            files[rel] = {"sha256": _sha256(p), "bytes": p.stat().st_size}
    manifest = {"format": "opdistill-checkpoint", "version": FORMAT_VERSION, "step": step, "files": files}
    if layout != "single":
        manifest["layout"] = layout
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
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({type(e).__name__}: {str(e)[:200]})") from None
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
    layout = manifest.get("layout", "single")
    if layout not in ("single", "dcp"):
        raise CheckpointError(f"{mpath}: unknown checkpoint layout {layout!r} (expected single or dcp)")
    base = _REQUIRED if ADAPTERS not in files else (ADAPTERS,) + _REQUIRED[1:]  # a LoRA student: its adapters
    needed = only if only is not None else base + ((DCP_METADATA,) if layout == "dcp" else ())
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

def checkpoint_step(path: str | Path) -> int:
    """The step a checkpoint folder holds, from its name (``step_00000040`` -> 40)."""
    return int(Path(path).name.split("_")[-1])


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


def save_checkpoint(run_dir: str | Path, step: int, model, optimizer, scheduler, state: dict, *, keep_last: int = 2,
                    tokenizer=None, group=None, rng: dict | None = None,
                    extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Write checkpoint ``step`` atomically (``state``: JSON-able run state, e.g. training time and history); keep
    the newest ``keep_last``; return its folder. Refuses non-finite weights or optimizer state. ``group``: the
    data-parallel group of a multi-process run (every rank calls this): a sharded checkpoint (module docstring).
    ``rng``: the RNG states to record (:func:`rng_state` taken when the step completed; None: the current ones), for
    a checkpoint written after a later step failed part-way. ``extra``: more tensors for the trainer state (the
    pipelined step's weight versions, ``pipeline/...``), returned by :func:`load_checkpoint` as
    ``extra_tensors``."""
    from safetensors.torch import save_file

    if group is not None:
        return _save_sharded(run_dir, step, model, optimizer, scheduler, state, keep_last=keep_last,
                             tokenizer=tokenizer, group=group, rng=rng, extra=extra)
    _check_finite(model, optimizer, step)
    tmp, final = _prepare_dirs(run_dir, step, str(os.getpid()))
    save_model(model, tmp)  # the whole model, or a LoRA student's adapters only (train/run/lora.py)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    tensors, meta = _split_state(optimizer, scheduler, rng)
    _add_extra(tensors, extra)
    save_file(tensors, str(tmp / STATE_TENSORS))
    meta = {"step": step, **state, **meta}
    (tmp / STATE_JSON).write_text(json.dumps(meta) + "\n")
    return _finish(run_dir, tmp, final, step, keep_last, "single")


def _add_extra(tensors: dict, extra: dict | None) -> None:
    if extra:
        clash = sorted(set(extra) & set(tensors))
        if clash:
            raise ValueError(f"save_checkpoint: extra tensor names clash with the trainer state's: {clash[:3]}")
        tensors.update({k: v.detach().cpu().contiguous() for k, v in extra.items()})


def _finish(run_dir, tmp: Path, final: Path, step: int, keep_last: int, layout: str) -> Path:
    """Modes as the umask says, fsync, manifest last, rename into place, prune to ``keep_last``."""
    follow_umask(tmp)  # safetensors writes 0600
    fsync_tree(tmp)
    _write_manifest(tmp, step, layout)  # last: a folder with a valid manifest is complete
    if _before_rename_hook is not None:
        _before_rename_hook(tmp)
    if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(final.parent)
    for old in [p for p in list_checkpoints(run_dir) if p != final][: -keep_last + 1 or None]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _prepare_dirs(run_dir, step: int, tmp_suffix: str) -> tuple[Path, Path]:
    """(temporary folder, final folder) of checkpoint ``step``; leftover temporary folders of killed saves removed."""
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
    tmp = ckpt_dir / f"{_TMP}{final.name}-{tmp_suffix}"
    tmp.mkdir()
    return tmp, final


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _save_sharded(run_dir, step: int, model, optimizer, scheduler, state: dict, *, keep_last: int, tokenizer,
                  group, rng: dict | None = None, extra: dict | None = None) -> Path:
    """The multi-process save: every rank writes its shards of the model and optimizer state with
    torch.distributed.checkpoint into ``dcp/`` of the temporary folder; rank 0 adds the full student as a
    transformers folder (``model.safetensors``, for ``from_pretrained`` and ``opdistill eval``), the scheduler, RNG
    and run state (and ``extra``, the same on every rank: rank 0's), then the manifest and the rename, exactly as in
    one process."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from opdistill.train.run.distributed import broadcast_text
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    rank = dist.get_rank(group)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    local = [_local(v) for v in list(model_sd.values()) + _tensors_of(optim_sd) if isinstance(v, torch.Tensor)]
    finite = torch.tensor([float(all(bool(torch.isfinite(t).all()) for t in local if t.is_floating_point()))])
    dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=group)
    if not finite.item():
        raise NonFiniteError(f"step {step}: the weights or optimizer state hold NaN/inf; the checkpoint is not "
                             f"written. Likely causes: fp16 overflow (use model.dtype=bfloat16 or float32), a learning "
                             f"rate too high (optim.lr), bad data or teacher scores")
    tmp = None
    if rank == 0:
        tmp, final = _prepare_dirs(run_dir, step, "dcp")
    tmp = Path(broadcast_text(str(tmp) if tmp is not None else None, group))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / DCP_DIR), process_group=group)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        module = getattr(model, "module", model)
        module.save_pretrained(tmp, state_dict=full, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        tensors, meta = _split_state(None, scheduler, rng)
        _add_extra(tensors, extra)
        save_file(tensors, str(tmp / STATE_TENSORS))
        meta = {"step": step, **state, **meta, "world_size": dist.get_world_size(group)}
        (tmp / STATE_JSON).write_text(json.dumps(meta) + "\n")
        _finish(run_dir, tmp, final, step, keep_last, "dcp")
    dist.barrier(group=group)  # no rank goes on (or exits) before the checkpoint is in place
    return Path(run_dir) / "checkpoints" / f"{_PREFIX}{step:08d}"


def _tensors_of(tree) -> list:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors_of(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors_of(v)]
    return []


# ---- loading --------------------------------------------------------------------------------------------------------

def load_weights(path: str | Path, model) -> dict | None:
    """Load only the weights of checkpoint folder ``path`` (``model.safetensors``) into ``model``; verified against
    the manifest when there is one (a folder without one, e.g. a legacy checkpoint, is loaded with a warning). Never
    reads the trainer state. Returns the manifest (None without one)."""
    from safetensors.torch import load_file

    path = Path(path)
    name = ADAPTERS if (path / ADAPTERS).is_file() else WEIGHTS  # a LoRA student's checkpoint holds its adapters
    if not (path / name).is_file():
        raise CheckpointError(f"{path / WEIGHTS}: missing; --checkpoint must be a checkpoint folder "
                              f"(checkpoints/step_NNNNNNNN) holding {WEIGHTS}")
    manifest = None
    if (path / MANIFEST).exists():
        manifest = verify_checkpoint(path, only=(name,))
    else:
        warnings.warn(f"{path}: no {MANIFEST}; loading {name} unverified", RunWarning, stacklevel=2)
    try:
        weights = load_file(str(path / name))
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types on a bad header
        raise CheckpointError(f"{path / name}: not a readable safetensors file ({e})") from e
    if name == ADAPTERS:
        try:
            load_adapters(model, weights, str(path / name))
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        return manifest
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # same names, other shapes: a checkpoint of another model size
        first = str(e).strip().splitlines()
        raise CheckpointError(f"{path / name}: does not match the model ({first[-1].strip() if first else e})") \
            from None
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise CheckpointError(f"{path / WEIGHTS}: does not match the model (missing {sorted(missing)}, unexpected "
                              f"{sorted(unexpected)})")
    if tied:
        model.tie_weights()
    return manifest


def load_checkpoint(path: str | Path, model, optimizer=None, scheduler=None, group=None) -> dict:
    """Verify checkpoint folder ``path``, load its weights, optimizer and scheduler (when given) and RNG states;
    return the saved run state (``step``, ``train_time``, ...). A sharded checkpoint loads at any world size (one
    process included: torch.distributed.checkpoint reshards); ``group``: the data-parallel group of a multi-process
    run (every rank calls this)."""
    from safetensors.torch import load_file

    path = Path(path)
    manifest = verify_checkpoint(path)
    sharded = manifest.get("layout") == "dcp"
    if sharded:
        _load_sharded(path, model, optimizer, group)
    elif group is not None:
        _load_single_into_sharded(path, model, optimizer)
    else:
        load_weights(path, model)
    try:
        meta = json.loads((path / STATE_JSON).read_text())
        tensors = load_file(str(path / STATE_TENSORS))
        _restore_state(tensors, meta, None if sharded or group is not None else optimizer, scheduler)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 -- a verified file that does not fit this model/optimizer
        raise CheckpointError(f"{path}: trainer state does not fit this run ({type(e).__name__}: {e})") from e
    for key in ("optimizer", "scheduler", "rng", "world_size"):
        meta.pop(key, None)
    extra = {k: v for k, v in tensors.items() if not k.startswith(("optimizer/", "rng/"))}
    if extra:  # the pipelined step's weight versions (save_checkpoint(extra=...))
        meta["extra_tensors"] = extra
    return meta


def _load_single_into_sharded(path: Path, model, optimizer) -> None:
    """A one-process checkpoint into a multi-process run (every rank reads the full files): the weights from
    ``model.safetensors``, the optimizer state from ``trainer_state.*`` (saved by parameter index, the order of the
    student's trainable parameters, which DDP and FSDP2 keep) keyed by parameter name for ``set_state_dict``."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True)
    try:
        module = getattr(model, "module", model)
        weights = load_file(str(path / WEIGHTS))
        if getattr(module.config, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
        if optimizer is not None:
            meta = json.loads((path / STATE_JSON).read_text())["optimizer"]
            tensors = load_file(str(path / STATE_TENSORS))
            names = [n for n, p in module.named_parameters() if p.requires_grad]
            state = {names[i]: dict(meta["state_scalars"].get(str(i), {})) for i in meta["state_params"]}
            for key, v in tensors.items():
                parts = key.split("/")
                if parts[0] == "optimizer":
                    state.setdefault(names[int(parts[1])], {})[parts[2]] = v
            groups = [{**{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()},
                       "params": [names[i] for i in g["params"]]} for g in meta["param_groups"]]
            set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups}, options=full)
    except Exception as e:  # noqa: BLE001 -- a verified checkpoint that does not fit this model/optimizer
        raise CheckpointError(f"{path}: does not fit this run ({type(e).__name__}: {e})") from e


def _load_sharded(path: Path, model, optimizer, group) -> None:
    """Model (and optimizer) state of a sharded checkpoint into ``model`` (plain, DDP or FSDP2) at this world size.
    Read through :func:`_safe_dcp_reader`: no arbitrary object is unpickled (module docstring)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    reader, planner = _safe_dcp_reader(path / DCP_DIR)
    reader.read_metadata()  # refuses a crafted metadata file with its own message, before DCP wraps the error
    try:
        model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
        wanted = {"model": model_sd} if optimizer is None else {"model": model_sd, "optim": optim_sd}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(wanted, storage_reader=reader, planner=planner, process_group=group, no_dist=group is None)
        set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=wanted["model"],
                       optim_state_dict=wanted.get("optim", {}))
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 -- a verified checkpoint that does not fit this model/optimizer
        raise CheckpointError(f"{path / DCP_DIR}: does not fit this run ({type(e).__name__}: {e})") from e


def _safe_dcp_reader(folder: Path):
    """(storage reader, load planner) for torch.distributed.checkpoint that never unpickle an arbitrary object.

    DCP writes its ``.metadata`` with pickle and its non-tensor values (the optimizer's hyper-parameters) with
    ``torch.save``; its stock reader loads them with ``pickle.load`` and ``torch.load(weights_only=False)``, either of
    which runs code from a crafted file. Here the metadata is read by an unpickler that resolves only DCP's own
    metadata classes, torch sizes/dtypes/layouts and paths (anything else is a :class:`CheckpointError`), and the
    values by ``torch.load(weights_only=True)``; tensors are already read with ``weights_only=True`` by DCP."""
    import io
    import pickle

    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint import filesystem as dcp_fs
    from torch.distributed.checkpoint import metadata as dcp_meta

    allowed = {("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_fs._StorageInfo}
    allowed.update({("pathlib", n): getattr(__import__("pathlib"), n)
                    for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")})
    allowed.update({("torch.distributed.checkpoint.metadata", n): v for n, v in vars(dcp_meta).items()
                    if isinstance(v, type) and v.__module__ == dcp_meta.__name__})
    allowed.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    where = folder / ".metadata"

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in allowed:
                return allowed[(module, name)]
            raise CheckpointError(f"{where}: refers to {module}.{name}, which a checkpoint's metadata never holds "
                                  f"(a crafted file?); it is not loaded")

    class _Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(where, "rb") as f:
                metadata = _Unpickler(f).load()
            if not isinstance(metadata, dcp_meta.Metadata):
                raise CheckpointError(f"{where}: not DCP metadata ({type(metadata).__name__})")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = dcp_meta.StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class _Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as e:  # noqa: BLE001 -- weights_only refuses anything but plain data
                raise CheckpointError(f"{folder}: value {read_item.dest_index.fqn!r} is not plain data ({e})") from e
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return _Reader(str(folder)), _Planner()
