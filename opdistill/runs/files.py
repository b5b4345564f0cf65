"""Reading a run directory's files back: ``metrics.jsonl`` (and any JSON-lines file written by appends) and the
resolved config as dotted keys. The trainer (``opdistill.train``) writes these files; everything that reads a run
after the fact (``compare``, ``plot``, resume) reads them through here."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

from opdistill.errors import RunError, RunWarning, quote

__all__ = ["read_jsonl", "read_metrics", "flatten_config", "check_metric_rows"]


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSON-lines file written by appends. A last line that does not parse is a write torn by a kill: it is
    dropped with a :class:`RunWarning`; a bad line before the last is corruption and raises :class:`RunError`."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except (json.JSONDecodeError, RecursionError) as e:
            if i == len(lines) - 1:
                warnings.warn(f"{path}: line {i + 1} is torn (a write cut off by a kill?); it is ignored and will be "
                              f"cut off on resume", RunWarning, stacklevel=2)
                break
            why = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            raise RunError(f"{path}: line {i + 1} is not JSON ({why}); the file is corrupt") from None
    return rows


def flatten_config(d: dict, prefix: str = "") -> dict:
    """A nested config dict as ``{"section.key": value}`` (an empty dict stays a value)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten_config(v, key + "."))
        else:
            out[key] = v
    return out



def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl (a torn last line is dropped with a ``RunWarning``)."""
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


def _number(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def check_metric_rows(rows: list) -> str | None:
    """The first way metrics.jsonl's ``rows`` are not what the trainer writes, or None: each row an object with an
    integer ``step`` >= 0, and a number (or null) for every metric (what ``compare`` and ``plot`` draw; a list where a
    number belongs was a traceback from the table, a string step a silent plot)."""
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            return f"row {i} is {quote(row)}, expected an object (one metrics row per step)"
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            return f"row {i}: 'step' is {quote(step)}, expected an integer >= 0"
        for k, v in row.items():
            if "/" in k and not _number(v):
                return f"row {i} (step {step}): {k!r} is {quote(v)}, expected a number or null"
    return None
