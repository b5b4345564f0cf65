"""The user-error types: one home for every mistake a user can fix (a config key, a file, a model folder).

The CLI catches :class:`UserError`, prints its message as one line and exits with status 2 (``--debug`` shows the
traceback); any other exception is a bug and keeps its traceback. Messages name what to fix first: the dotted config
key (``optim.lr: expected a number > 0, got -1``), or the file and line (``p.jsonl:3: not valid JSON ...``). The
types are also ``ValueError`` so library callers that catch ``ValueError`` keep working.
"""
from __future__ import annotations

import errno as _errno
import re as _re
import reprlib

__all__ = ["UserError", "ConfigError", "DataError", "DiskError", "ModelError", "IncompatibleModelsError", "RewardError",
           "RunError", "RunWarning", "disk_error", "first_line", "quote"]

# what the machine's disk says, not a bug: full, over quota, read-only, permission denied, an I/O error
DISK_ERRNOS = {_errno.ENOSPC, _errno.EDQUOT, _errno.EROFS, _errno.EACCES, _errno.EPERM, _errno.EIO}
_DISK_HINTS = {_errno.ENOSPC: "free some space", _errno.EDQUOT: "free some space or raise the quota",
               _errno.EROFS: "write somewhere writable", _errno.EACCES: "check its permissions",
               _errno.EPERM: "check its permissions and immutable flag", _errno.EIO: "check the disk"}

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple, _REPR.maxset = 2, 4, 6, 6, 6
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 60


def quote(value, limit: int = 80) -> str:
    """``repr(value)`` short enough for a one-line message: at most about ``limit`` characters (reprlib elides the
    middle of long strings and the rest of long collections with ``...``), never the whole of a huge value."""
    text = _REPR.repr(value)
    if "..." not in text:  # nothing elided: the plain repr (reprlib sorts dict keys; repr keeps their order)
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, at most ``limit`` characters (what a one-line error quotes of
    another's)."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else "(no message)"


class UserError(Exception):
    """Base of the errors a user fixes; the message is one line that names the key, argument or file."""

    kind = "error"  # the CLI prints "opdistill COMMAND: KIND: MESSAGE"


class ConfigError(UserError, ValueError):
    """A configuration key is unknown, has the wrong type, or a bad value. The message starts with the dotted key."""

    kind = "config error"


class DataError(UserError, ValueError):
    """A data file is missing, empty or malformed. The message starts with the file (and line)."""

    kind = "data error"


class ModelError(UserError, ValueError):
    """A model folder is missing or cannot be loaded. The message names the config key and the folder."""

    kind = "model error"


class IncompatibleModelsError(UserError, ValueError):
    """Student and teacher cannot be distilled token by token (vocabulary, special tokens or chat template differ)."""

    kind = "model error"


class RewardError(UserError, ValueError):
    """A reward function (``reward.functions``, opdistill/data/rewards.py) raised or returned something other than
    one finite number per completion; the message names the function, the step and the row."""

    kind = "reward error"


class RunError(UserError):
    """A refusal of the run directory, a checkpoint or the run's state; the message is one line naming the file or
    key and the fix. The CLI prints it and exits 2."""

    kind = "run error"


class DiskError(UserError, OSError):
    """The disk refused a write or read (full, read-only, permission, I/O error); the message names the path. What
    was written before it (checkpoints, metrics lines) is intact."""

    kind = "disk error"

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def disk_error(e: BaseException) -> DiskError | None:
    """``e`` as a :class:`DiskError` when it is the disk's refusal (an ``OSError`` of :data:`DISK_ERRNOS`, or
    safetensors' error wrapping one: ``... (os error 28) at path "..."``), else None."""
    if isinstance(e, DiskError):
        return e
    code, path, why = getattr(e, "errno", None), getattr(e, "filename", None), getattr(e, "strerror", None)
    if type(e).__name__ == "SafetensorError":
        m = _re.search(r"I/O error: (.*?) \(os error (\d+)\)(?: at path \"(.*?)\")?", str(e))
        if m is None:
            return None
        why, code, path = m.group(1), int(m.group(2)), m.group(3)
    elif not isinstance(e, OSError):
        return None
    if code not in DISK_ERRNOS:
        return None
    out = DiskError(code, f"{path or 'a file'}: {why or 'refused'} ({_DISK_HINTS[code]})")
    out.advice = getattr(e, "advice", None)
    return out


class RunWarning(UserWarning):
    """Something in the run directory was skipped or repaired (a corrupt checkpoint, a stray folder, a torn line)."""
