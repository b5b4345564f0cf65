"""Durable writes: the one home of the fsync idiom (a run's files, outputs, teacher caches, checkpoints).

A file is written whole or not at all: into a fresh temporary file beside its place (created exclusively, never
through a link), flushed and fsync'ed, renamed over its place (a rename replaces a link itself, never its target),
and its folder fsync'ed so the rename survives a crash. A reader sees the old file or the new one, never a part.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["fsync_path", "fsync_tree", "replace_durably", "write_whole"]


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder (its entries: a rename or a new file in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path``, then ``path`` itself."""
    for p in sorted(path.rglob("*")):
        if p.is_file():
            fsync_path(p)
    fsync_path(path)


def replace_durably(tmp: Path, path: Path) -> Path:
    """``tmp`` (written by another library, e.g. safetensors) fsync'ed and renamed over ``path``; the folder
    fsync'ed."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)
    return path


def write_whole(path: str | os.PathLike, data: bytes | str, *, mode: int = 0o666) -> Path:
    """Write ``data`` to ``path`` whole (module notes); ``mode``: the new file's, less the umask."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()  # never write through a link left at the temporary name
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_path(path.parent)
    return path
