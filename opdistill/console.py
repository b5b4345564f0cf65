"""What the command line prints besides a command's own output: one line per warning (naming the package it came
from, and the rank under torchrun), a metrics table, where a run's files are, and the one command that continues a
run that stopped. The CLI's formatting, in one place (opdistill/cli.py parses arguments and calls the commands)."""
from __future__ import annotations

import contextlib
import logging
import os
import sys

from opdistill.errors import UserError

__all__ = ["metrics_table", "quiet_transformers", "rank", "rank_tag", "resume_advice", "run_files", "train_report",
           "one_line_warning", "console_logging"]


def quiet_transformers():
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def train_report(summary: dict, *, tensorboard: bool, as_json: bool = False) -> str:
    """What ``opdistill train`` prints at the end: where the run's files are, its steps and training time, and the
    table of its last evaluation; ``as_json``: the same as one JSON object (for scripts)."""
    import json

    if as_json:
        return json.dumps({"steps": summary["steps"], "train_time_s": round(summary["train_time_s"], 2),
                           "run_dir": summary["run_dir"], "checkpoint": summary["checkpoint"],
                           "final_eval": summary["final_eval"]}, indent=1)
    out = [run_files(summary["run_dir"], summary["checkpoint"], tensorboard),
           f"\n{summary['steps']} steps, {summary['train_time_s']:.1f} s of training"]
    if summary["final_eval"]:
        step = summary["final_eval"].get("step", summary["steps"])
        out += [f"\nheld-out evaluation at step {step} ({len(summary['eval_history'])} evaluations in "
                f"metrics.jsonl):\n", metrics_table(summary["final_eval"])]
    return "\n".join(out)


def run_files(run_dir: str, checkpoint: str | None, tensorboard: bool) -> str:
    """Where a run's files are, one per line."""
    from pathlib import Path

    lines = [f"run folder:  {run_dir}",
             f"checkpoints: {Path(run_dir) / 'checkpoints'}"
             + (f" (newest: {Path(checkpoint).name})" if checkpoint else " (none written: checkpoint.*)"),
             f"metrics:     {Path(run_dir) / 'metrics.jsonl'} (opdistill plot {run_dir})"]
    tb = Path(run_dir) / "tensorboard"
    if tensorboard and tb.is_dir():
        lines.append(f"tensorboard: {tb} (tensorboard --logdir {tb})")
    return "\n".join(lines)


def metrics_table(metrics: dict, level: float = 0.95) -> str:
    """A markdown table of evaluation metrics: one row per metric, its value and its interval (``metric_lo`` and
    ``metric_hi``, when computed); other keys (``step``, ``train_time_s``) are left out."""
    import math

    def num(x) -> str:
        return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.4g}"

    rows = [f"| metric | value | {level:.0%} interval |", "|---|---|---|"]
    for name, v in metrics.items():
        if not name.startswith("eval/") or (name.endswith(("_lo", "_hi")) and name[:-3] in metrics):
            continue
        lo, hi = metrics.get(f"{name}_lo"), metrics.get(f"{name}_hi")
        interval = f"[{num(lo)}, {num(hi)}]" if lo is not None and hi is not None else ""
        rows.append(f"| {name} | {num(v)} | {interval} |")
    return "\n".join(rows)


def _command(args, flag: str) -> str:
    """The train command line as given, with ``flag`` (--resume or --overwrite) instead of either."""
    import shlex

    words = ["opdistill", "train", "--config", str(args.config), flag, *args.overrides]
    line = shlex.join(words)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun's own arguments are not known here
        line = f"the same torchrun launch of {shlex.join(words[1:])}"
    return line


def resume_advice(args, run_dir, checkpoint: str | None) -> str:
    """What is kept and the one command that continues: the checkpoint to resume from (``checkpoint``, or the
    newest in ``run_dir``) and ``--resume``; without any, the command that starts again."""
    import warnings as _warnings
    from pathlib import Path

    from opdistill.train.disk.checkpoint import checkpoint_step, latest_checkpoint

    if checkpoint is None:
        try:
            with _warnings.catch_warnings():
                _warnings.simplefilter("ignore")
                found = latest_checkpoint(run_dir)
        except UserError:
            found = None
        checkpoint = None if found is None else str(found)
    if checkpoint is not None:
        step = checkpoint_step(checkpoint)
        return f"checkpoint of step {step}: {checkpoint}; resume with: {_command(args, '--resume')}"
    if (Path(run_dir) / "config.yaml").exists():
        return f"no checkpoint was written; start again with: {_command(args, '--overwrite')}"
    return "nothing was written; start again with the same command"


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def rank_tag() -> str:
    """``[rank R] `` under torchrun with more than one process (warnings and errors name the rank), else ""."""
    return f"[rank {rank()}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""


def _origin(category, filename: str) -> str:
    """The package a warning comes from: opdistill for its own warning types and files, else the top-level package
    of the file that warned (``.../site-packages/transformers/...`` -> transformers; the standard library:
    python)."""
    from pathlib import Path

    if getattr(category, "__module__", "").split(".")[0] == "opdistill":
        return "opdistill"
    parts = Path(filename or "").parts
    here = Path(__file__).resolve().parent
    try:
        Path(filename).resolve().relative_to(here)
        return "opdistill"
    except (ValueError, OSError, TypeError):
        pass
    for marker in ("site-packages", "dist-packages"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            return Path(parts[parts.index(marker) + 1]).stem
    import sysconfig

    if filename and Path(filename).resolve().is_relative_to(Path(sysconfig.get_paths()["stdlib"]).resolve()):
        return "python"
    return "opdistill"  # a file of no installed package: opdistill's caller (stacklevel), e.g. a script


def one_line_warning(message, category, filename, lineno, line=None):
    origin = _origin(category, filename)
    if origin == "opdistill":
        return f"opdistill: {rank_tag()}warning: {message}\n"
    return f"opdistill: {rank_tag()}warning from {origin} ({category.__name__}): {message}\n"


class _ConsoleHandler(logging.Handler):
    """opdistill's log records on stderr, in the warnings' format: ``opdistill: [rank R] warning: ...`` from WARNING
    up (``error:`` from ERROR), ``opdistill: ...`` for INFO; written through tqdm, so a progress bar on the terminal
    is redrawn under the line instead of being written over."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level = "error: " if record.levelno >= logging.ERROR else "warning: " if record.levelno >= logging.WARNING \
                else ""
            line = f"opdistill: {rank_tag()}{level}{record.getMessage()}"
            try:
                from tqdm import tqdm
            except ImportError:
                print(line, file=sys.stderr, flush=True)
            else:
                tqdm.write(line, file=sys.stderr)
        except Exception:  # noqa: BLE001 -- logging's own rule: a failing handler reports and goes on
            self.handleError(record)


@contextlib.contextmanager
def console_logging(level: int = logging.INFO):
    """While a command runs: the ``opdistill`` loggers print through :class:`_ConsoleHandler` from ``level`` up
    (records still reach the root logger's handlers, e.g. a caller's or pytest's)."""
    root = logging.getLogger("opdistill")
    handler, old_level = _ConsoleHandler(level), root.level
    root.addHandler(handler)
    root.setLevel(level)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
