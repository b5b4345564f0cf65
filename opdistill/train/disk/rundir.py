"""The run directory: one run per folder, an exclusive lock, the config it was started with, writes that never follow
symlinks.

A run directory holds ``config.yaml`` (the resolved config the run was started with, written once and never rewritten),
``config_history.jsonl`` (one line per resume that changed an allowed key), ``metrics.jsonl``, ``tensorboard/``,
``eval/`` (the per-problem values of each evaluation) and ``checkpoints/``. The rules (docs/reliability.md):

- A fresh ``train`` on a folder that holds a run is refused: ``--resume`` continues it, ``--overwrite`` deletes it
  first, another ``run_dir`` leaves it alone. ``--resume`` on a folder without a checkpoint is refused too.
- One process at a time: ``open_run_dir`` takes an exclusive ``filelock`` on ``RUN_DIR/.lock`` (released when the
  process ends, even by SIGKILL: it is an OS lock) and a second process is refused, naming the lock.
- Nothing in the folder is written through a symlink: the known entries are checked with ``lstat`` and refused when
  they are links, and files are opened with ``O_NOFOLLOW`` (the run folder itself may be a link, e.g. to another disk).
- ``--resume`` compares the resolved config with the run's: only the keys in :data:`RESUMABLE_KEYS` may change (each
  change is appended to ``config_history.jsonl``); any other difference is refused with the diff of every changed key.

Every refusal raises :class:`RunError` (the CLI prints its one-line message and exits 2).
"""
from __future__ import annotations

import datetime
import fnmatch
import json
import os
import re
import shlex
import shutil
import warnings
from pathlib import Path

from opdistill.durable import write_whole
from opdistill.errors import RunError, RunWarning
from opdistill.runs.files import flatten_config, read_jsonl
from opdistill.runs.outputs import LOCK_NAME as _LOCK, RUN_ENTRIES, owner_of, try_lock
from opdistill.yaml12 import dump_yaml, load_yaml

__all__ = ["RunError", "CheckpointError", "NonFiniteError", "RunWarning", "RESUMABLE_KEYS", "RUN_ENTRIES",
           "RunDir", "open_run_dir", "config_changes", "check_not_symlink", "open_nofollow", "atomic_write_text",
           "read_jsonl", "check_checkpoint_config", "flatten_config", "set_aside_evaluations", "append_history",
           "follow_umask"]

# Keys that may change when a run is resumed (fnmatch patterns over dotted keys): how long to train, what to evaluate
# and log, how often to save, how many threads and how big a micro-batch (the gradient is the same, tested). Everything
# else (models, method, loss, data, seed, optimizer, rollout, dtype) changes what the run means and is refused.
RESUMABLE_KEYS = (
    "run_dir",
    "train.steps",
    "train.max_time_s",
    "train.threads",
    "train.micro_batch_tokens",
    "train.max_nonfinite_steps",
    "eval.*",
    "log.*",
    "checkpoint.*",
    "distributed.*",  # how the run is laid out over processes, not what it computes (same run at any world size)
    "teacher.url",  # the teacher server moved (the client checks its /info against the student at start)
    "teacher.token_file",
    "teacher.timeout_s",
    "teacher.retries",
    "teacher.backoff_s",
    "teacher.overlap",  # requests overlapped with the student's forward or not: the same numbers (tested)
    "teacher.probe_s",  # a pool's health checks, not what its servers compute
    "teacher.patience_s",
    "rollout.vllm_*",  # the vLLM engines' memory knobs (docs/engines.md); the engine choice itself changes the samples
    "model.teacher_sharded",  # where the teacher's weights live, not its scores (equal, tested)
    # a ``teachers`` entry's client keys, as teacher.*'s (the list is compared item by item: _resumable)
    "teachers.*.url",
    "teachers.*.token_file",
    "teachers.*.timeout_s",
    "teachers.*.retries",
    "teachers.*.backoff_s",
    "teachers.*.overlap",
    "teachers.*.probe_s",
    "teachers.*.patience_s",
)

class CheckpointError(RunError):
    """A checkpoint is missing, incomplete, corrupt (SHA-256 mismatch) or not in this version's format."""


class NonFiniteError(RunError):
    """Training produced non-finite values (loss, gradient or weights) and was stopped."""


def check_not_symlink(path: Path) -> None:
    """Refuse ``path`` when it is a symlink (writes never follow links out of the run directory)."""
    if path.is_symlink():
        raise RunError(f"{path} is a symlink; opdistill never writes through links in a run directory "
                       f"(replace it with a regular file or folder, or use another run_dir)")


def open_nofollow(path: Path, flags: int, mode: int = 0o666) -> int:
    """``os.open`` with ``O_NOFOLLOW``: a symlink at ``path`` is refused with :class:`RunError`. A new file gets
    ``mode`` less the umask (0666: as ``open`` gives)."""
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), mode)
    except OSError as e:
        if path.is_symlink():
            raise RunError(f"{path} is a symlink; opdistill never writes through links in a run directory "
                           f"(replace it with a regular file, or use another run_dir)") from e
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to a fresh temporary file beside ``path``, fsync it, and rename it over ``path`` (a rename
    replaces a link itself, never its target; a link at ``path`` is refused first)."""
    check_not_symlink(path)
    write_whole(path, text)


def current_umask() -> int:
    """The process's umask, read without changing it where the OS tells it (/proc/self/status on Linux; elsewhere
    the classic set-and-restore)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: Path) -> None:
    """Give ``path`` (a file, or every file under a folder; links are left alone) the mode a new file gets from
    ``open``: 0666 less the umask. safetensors writes its files 0600 (through a private temporary file), so weights
    would be the only files of a run or an export that another user (a vLLM server, a teammate) cannot read."""
    mode = 0o666 & ~current_umask()
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in files:
        if not p.is_symlink():
            os.chmod(p, mode)


def _resumable(key: str, change: tuple | None = None) -> bool:
    """``key`` matches RESUMABLE_KEYS; a list of sections (``teachers``) of the same length whose items differ only
    in keys that match as ``key.N.subkey`` (``teachers.0.url``) is resumable too."""
    if any(fnmatch.fnmatchcase(key, pattern) for pattern in RESUMABLE_KEYS):
        return True
    a, b = change or (None, None)
    if not (isinstance(a, list) and isinstance(b, list) and len(a) == len(b)
            and all(isinstance(x, dict) for x in a + b)):
        return False
    items = config_changes({key: {str(i): x for i, x in enumerate(a)}}, {key: {str(i): x for i, x in enumerate(b)}})
    return all(_resumable(k) for k in items)


def config_changes(old: dict, new: dict) -> dict[str, tuple]:
    """``{dotted key: (old value, new value)}`` for every key whose value differs (a missing key reads as None)."""
    a, b = flatten_config(old), flatten_config(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def override(key: str, value) -> str:
    """``key=value`` as a dotted override that reads back as ``value`` (YAML: null, true/false, numbers, and
    strings that would read as something else quoted; lists and mappings in JSON flow style)."""
    if isinstance(value, str):
        try:
            plain = value != "" and load_yaml(value) == value
        except Exception:  # noqa: BLE001 -- any text that does not read back as itself is quoted
            plain = False
        return f"{key}={value if plain else json.dumps(value)}"
    return f"{key}={json.dumps(value)}"


def _fmt_changes(changes: dict[str, tuple]) -> str:
    return ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())


class RunDir:
    """An opened, locked run directory (use :func:`open_run_dir`); ``close()`` releases the lock."""

    def __init__(self, path: Path, lock):
        self.path = path
        self._lock = lock

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def history_path(self) -> Path:
        return self.path / "config_history.jsonl"

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def write_config(self, cfg_dict: dict) -> None:
        """The run's config, written once when a fresh run starts."""
        atomic_write_text(self.config_path, dump_yaml(cfg_dict))  # reads back the same under YAML 1.1 and 1.2

    def check_teacher_heads(self, heads: dict[str, str], resume: bool) -> None:
        """The SHA-256 of every teacher head the run's hidden-state payload goes through (``{where: sha}``):
        recorded at a fresh start (``teacher_heads.json``), compared on resume, where a different head (another
        teacher behind the same url or folder) is refused naming it."""
        path = self.path / "teacher_heads.json"
        if resume and path.exists():
            old = json.loads(path.read_text())
            diff = [f"{k}: was {old.get(k, 'none')[:12]}, now {v[:12]}" for k, v in heads.items() if old.get(k) != v]
            if diff:
                raise RunError(f"--resume: the teacher's lm_head changed since the run started ({'; '.join(diff)}); "
                               f"the hidden-state loss would now distill another teacher: resume with the teacher "
                               f"the run started with, or start a new run")
        if heads and not (resume and path.exists()):
            atomic_write_text(path, json.dumps(heads, sort_keys=True) + "\n")

    def effective_config(self, load) -> dict:
        """The run's config as last resumed: ``config.yaml`` (read through ``load``, so new schema keys get their
        defaults) with every change of ``config_history.jsonl`` applied in order."""
        check_not_symlink(self.config_path)
        try:
            base = load(self.config_path)
        except Exception as e:  # noqa: BLE001 -- any load failure of the stored config is one user-facing refusal
            raise RunError(f"{self.config_path}: the run's config no longer loads ({e}); resume it with the opdistill "
                           f"version that started it, or start a new run") from e
        flat = flatten_config(base)
        for row in read_jsonl(self.history_path):
            for key, change in row.get("changes", {}).items():
                flat[key] = change["to"]
        return _unflatten(flat)

    def check_resume_config(self, old: dict, new: dict, step: int, *, record: bool = True) -> dict[str, tuple]:
        """Refuse a change to a key outside :data:`RESUMABLE_KEYS` (with the diff of every such key); append the
        allowed changes to ``config_history.jsonl`` (``record``); return them."""
        changes = config_changes(old, new)
        refused = {k: v for k, v in changes.items() if not _resumable(k, v)}
        if refused:
            repeat = " ".join(shlex.quote(override(k, a)) for k, (a, _) in refused.items())
            raise RunError(f"--resume: the config changes what run {self.path} means: {_fmt_changes(refused)}; to "
                           f"continue the run, give its own values again (e.g. the overrides it started with): "
                           f"{repeat} (only {', '.join(RESUMABLE_KEYS)} may change on resume; another run_dir starts "
                           f"a new run, and --overwrite deletes this one)")
        if changes and record:
            append_history(self, {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                  "resumed_at_step": step,
                                  "changes": {k: {"from": a, "to": b} for k, (a, b) in changes.items()}})
        return changes


def append_history(rd: RunDir, row: dict) -> None:
    """Append one line to the run's ``config_history.jsonl`` (one ``write``, fsync'ed; a link is refused)."""
    check_not_symlink(rd.history_path)
    fd = open_nofollow(rd.history_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with os.fdopen(fd, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _unflatten(flat: dict) -> dict:
    out: dict = {}
    for key, v in flat.items():
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return out


def _holds_run(path: Path) -> list[str]:
    return [name for name in RUN_ENTRIES if os.path.lexists(path / name)]


def check_holds_run(path: Path) -> None:
    """Refuse ``--resume`` of a folder that holds no run (no config.yaml)."""
    if not (path / "config.yaml").exists():
        raise RunError(f"--resume: {path} holds no run (no config.yaml); start a new run without --resume")


def open_run_dir(path: str | Path, *, resume: bool = False, overwrite: bool = False) -> RunDir:
    """Create/open ``path`` for a run and lock it; apply the refusal rules (module docstring). With ``overwrite``
    the previous run's entries (:data:`RUN_ENTRIES`) are deleted first (links are removed, never followed)."""
    if resume and overwrite:
        raise RunError("--resume and --overwrite contradict each other: --resume continues the run in run_dir, "
                       "--overwrite deletes it")
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():
            raise RunError(f"run_dir {path} is a file, not a folder; choose another run_dir")
        _check_not_nested(path)
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a name too long, a read-only disk, a file in the way: one line, not a traceback
        raise RunError(f"run_dir {path}: cannot create it ({e.strerror}); choose another run_dir") from None
    lock = _acquire_lock(path)
    try:
        for name in RUN_ENTRIES:
            if not overwrite:
                check_not_symlink(path / name)
        found = _holds_run(path)
        if overwrite:
            _check_no_run_inside(path, found)
            for name in found:
                p = path / name
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
        elif resume:
            check_holds_run(path)
        elif found:
            raise RunError(f"run_dir {path} already holds a run ({', '.join(found)}); continue it with --resume, "
                           f"replace it with --overwrite, or choose another run_dir")
    except BaseException:
        lock.release()
        raise
    return RunDir(path, lock)


def _check_not_nested(path: Path) -> None:
    """Refuse a ``run_dir`` inside an entry of another run (its ``checkpoints/``, a checkpoint folder, its
    ``tensorboard/``): that run's ``keep_last`` rotation or ``--overwrite`` would delete this one."""
    found = owner_of(path)
    if found is not None:
        entry, owner = found
        raise RunError(f"run_dir {path} is inside {entry}, which belongs to the run in {owner} (its rotation or "
                       f"--overwrite would delete this run); choose a run_dir outside it")


def _check_no_run_inside(path: Path, found: list[str]) -> None:
    """``--overwrite`` deletes ``found``: refuse when another run lives inside one of them (a ``.lock`` there)."""
    for name in found:
        entry = path / name
        if entry.is_dir() and not entry.is_symlink():
            inner = next((p for p in entry.rglob(_LOCK) if not p.is_symlink()), None)
            if inner is not None:
                raise RunError(f"--overwrite would delete {entry}, which holds another run ({inner.parent}); move "
                               f"that run out first, or choose another run_dir")


def set_aside_evaluations(path: Path, step: int) -> list[Path]:
    """A resume from checkpoint ``step`` trims metrics.jsonl to the steps <= ``step`` (``train/disk/logger.py``); the
    per-problem values of the evaluations after it (``eval/step_NNNNNN.json``) are renamed to
    ``eval/.discarded-step_NNNNNN.json`` with it: they belong to the timeline the resume recomputes, and left in place
    ``opdistill compare`` would pair the resumed run's start with an evaluation it never reached. Kept for
    inspection, never read."""
    folder = path / "eval"
    check_not_symlink(folder)
    moved = []
    if not folder.is_dir():
        return moved
    for p in sorted(folder.glob("step_*.json")):
        m = re.fullmatch(r"step_(\d+)\.json", p.name)
        if m and int(m.group(1)) > step and not p.is_symlink():
            dest = p.with_name(".discarded-" + p.name)
            os.replace(p, dest)
            moved.append(dest)
    if moved:
        warnings.warn(f"set aside the evaluations after step {step} (the resumed checkpoint): "
                      f"{', '.join(p.name.removeprefix('.discarded-') for p in moved)} moved to {folder}/.discarded-*; "
                      f"they belong to the timeline this resume recomputes", RunWarning, stacklevel=2)
    return moved


def check_checkpoint_config(ckpt: Path, new: dict) -> None:
    """Refuse resuming from checkpoint ``ckpt`` when the config it was written with (``trainer_state.json``'s
    ``config``, saved by the trainer) differs from ``new`` in a key outside :data:`RESUMABLE_KEYS`: the checkpoint
    was copied from another run, or ``config.yaml`` was edited by hand (the run would silently mix two configs)."""
    try:
        saved = json.loads((ckpt / "trainer_state.json").read_text()).get("config")
    except (OSError, ValueError, AttributeError, RecursionError):
        return  # verify_checkpoint already vouched for the file; a state without a config predates this check
    if not isinstance(saved, dict):
        return
    changes = config_changes(json.loads(json.dumps(saved)), json.loads(json.dumps(new, default=str)))
    refused = {k: v for k, v in changes.items() if not _resumable(k, v)}
    if refused:
        raise RunError(f"--resume: checkpoint {ckpt} was written with another config than this run's: "
                       f"{_fmt_changes(refused)} (the checkpoint was copied from another run, or config.yaml was "
                       f"edited by hand); resume with the config it was written with, or start another run_dir")


def _acquire_lock(path: Path):
    lock_path = path / _LOCK
    check_not_symlink(lock_path)
    return try_lock(lock_path, f"run_dir {path} is in use by another opdistill process (it holds {lock_path}); wait "
                               f"for it to finish, or choose another run_dir")
