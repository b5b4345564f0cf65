"""Where opdistill writes: a run directory's own entries, and the rules for every other output.

A run directory (``config.yaml`` or ``.lock`` in it) owns the entries in :data:`RUN_ENTRIES`: the trainer rewrites,
rotates, trims or deletes them (``keep_last`` rotation, ``--resume`` trimming, ``--overwrite``). Anything another
command writes there would be deleted without a word (an export into ``checkpoints/step_N/sub`` is gone at the next
rotation) or read as the run's own (a values file in ``eval/``). So every output a command is given (``export
--out``, ``eval --out`` / ``--values``, ``score --out``, ``compare --out``, ``plot --out``) is refused there by
:func:`check_output_path`, and a run directory inside another run's entries likewise (``train/disk/rundir.py``).

Two processes writing one output at once (two exports to one ``--out``) are refused by :func:`output_lock`: an OS file
lock (``filelock``) on ``.NAME.lock`` beside the output, taken before any work and held until the output is in
place. Outputs are written whole, through a temporary file renamed into place (:func:`write_output`).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from opdistill.durable import write_whole
from opdistill.errors import ConfigError, RunError, quote

__all__ = ["RUN_ENTRIES", "LOCK_NAME", "owner_of", "check_output_path", "output_lock", "try_lock", "write_output",
           "check_image_path", "save_figure"]

# What a run writes into its folder; a fresh run refuses a folder holding any of them (".lock" excepted).
RUN_ENTRIES = ("config.yaml", "config_history.jsonl", "inputs.json", "metrics.jsonl", "checkpoints", "tensorboard",
               "metrics.png", "teacher_heads.json", "wandb", "eval")
LOCK_NAME = ".lock"


def owner_of(path: str | os.PathLike) -> tuple[Path, Path] | None:
    """``(entry, run folder)`` when ``path`` (resolved: links followed) is one of a run's entries or lies inside one,
    else None."""
    resolved = Path(path).resolve()
    for entry in [resolved, *resolved.parents]:
        owner = entry.parent
        if entry.name in RUN_ENTRIES and entry != owner and any(
                os.path.lexists(owner / n) for n in ("config.yaml", LOCK_NAME)):
            return entry, owner
    return None


def check_output_path(path: str | os.PathLike, flag: str, *, allow: tuple = ()) -> None:
    """Refuse an output ``path`` that is a run's entry or lies inside one (module notes); ``allow``: entries this
    output may be (``plot`` writes its own run's ``metrics.png``)."""
    found = owner_of(path)
    if found is None:
        return
    entry, owner = found
    resolved = Path(path).resolve()
    if resolved in {Path(a).resolve() for a in allow}:
        return
    where = f"is {entry}" if entry == resolved else f"is inside {entry}"
    raise RunError(f"{flag} {path} {where}, which belongs to the run in {owner} (the run's rotation, --resume or "
                   f"--overwrite would delete it or take it for its own); choose a path outside the run's entries")


def try_lock(lock_path: Path, busy: str):
    """Take the exclusive file lock ``lock_path`` now or never: held by another process, :class:`RunError`
    ``busy``. Returns the held ``filelock.FileLock`` (release it when done)."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(lock_path), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise RunError(busy) from None
    return lock


@contextlib.contextmanager
def output_lock(path: str | os.PathLike, flag: str):
    """Hold an exclusive lock on output ``path`` (a file ``.NAME.lock`` beside it) while it is written; another
    process writing the same output is refused at once (:class:`RunError`)."""
    path = Path(path)
    parent = path.parent
    parent.mkdir(parents=True, exist_ok=True)
    lock_path = parent / f".{path.name}.lock"
    if lock_path.is_symlink():
        raise RunError(f"{lock_path} is a symlink; remove it (opdistill never locks through a link)")
    lock = try_lock(lock_path, f"{flag} {path} is being written by another opdistill process (it holds "
                               f"{lock_path}); wait for it to finish, or choose another {flag}")
    try:
        yield path
    finally:
        lock.release()


def write_output(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` whole: a temporary file beside it, fsync'ed, renamed over ``path`` (a reader sees
    the old file or the new one, never a part)."""
    return write_whole(path, data)  # opdistill/durable.py


def _image_formats() -> list[str]:
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


def check_image_path(path: str | os.PathLike, flag: str) -> None:
    """Refuse an image output whose name matplotlib cannot write (``--out x.safetensors``), before any work."""
    suffix = Path(path).suffix.lstrip(".").lower()
    formats = _image_formats()
    if suffix not in formats:
        raise ConfigError(f"{flag}: {path} is not an image file name matplotlib writes (it ends in "
                          f"{quote('.' + suffix if suffix else 'no extension')}; use .png, or one of "
                          f"{', '.join(formats)})")


def save_figure(fig, path: str | os.PathLike, **kwargs) -> Path:
    """``fig.savefig`` into a temporary file beside ``path``, then renamed over it (:func:`write_output`'s rule)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format=path.suffix.lstrip(".").lower(), **kwargs)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return path
