"""Atomic checkpoints and exact resume.

A checkpoint is a folder ``checkpoints/step_00000012/`` holding the student as a transformers folder
(``model.safetensors`` + ``config.json``, loadable by ``from_pretrained``) and ``trainer_state.pt`` (optimizer,
scheduler, RNG states, step, data position, accumulated training time). It is written into a hidden temporary folder,
every file fsync'ed, and then renamed into place: a rename is atomic, so a process killed during a save leaves either
no new folder or a complete one, and the previous checkpoints are untouched. Old checkpoints beyond ``keep_last`` are
deleted only after the new one is in place. Leftover temporary folders of killed saves are removed by the next save.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

__all__ = ["save_checkpoint", "latest_checkpoint", "load_checkpoint", "rng_state", "set_rng_state"]

_PREFIX = "step_"
_TMP = ".tmp-"
# Test hook: called after the weights are written and before the rename (a test kills the process here).
_before_rename_hook = None


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


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


def _complete(ckpt_dir: Path) -> list[Path]:
    if not ckpt_dir.exists():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def save_checkpoint(run_dir: str | Path, step: int, model, optimizer, scheduler, state: dict, *, keep_last: int = 2,
                    tokenizer=None) -> Path:
    """Write checkpoint ``step`` atomically; keep the newest ``keep_last``; return its folder."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for stale in ckpt_dir.glob(_TMP + "*"):  # a save killed earlier
        shutil.rmtree(stale, ignore_errors=True)
    final = ckpt_dir / f"{_PREFIX}{step:08d}"
    tmp = ckpt_dir / f"{_TMP}{final.name}-{os.getpid()}"
    tmp.mkdir()
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save(
        {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng_state(),
         **state},
        tmp / "trainer_state.pt",
    )
    _fsync_tree(tmp)
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
    for old in _complete(ckpt_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = _complete(Path(run_dir) / "checkpoints")
    return found[-1] if found else None


def load_checkpoint(path: str | Path, model, optimizer=None, scheduler=None) -> dict:
    """Load weights (and optimizer/scheduler/RNG when given) from a checkpoint folder; returns the saved state."""
    from safetensors.torch import load_file

    path = Path(path)
    weights = load_file(str(path / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"{path}: checkpoint does not match the model (missing {missing}, unexpected {unexpected})")
    if tied:
        model.tie_weights()
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state
