"""Run-directory logging: metrics.jsonl (one line per step), TensorBoard events, a console progress bar.

metrics.jsonl is appended one whole line per ``os.write`` through a descriptor opened with ``O_NOFOLLOW`` (a symlink
is refused); a last line torn by a kill is dropped with a warning when read, and cut off when the run resumes.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from opdistill.train.rundir import atomic_write_text, open_nofollow, read_jsonl

__all__ = ["PROGRESS_KEYS", "RunLogger", "NullLogger", "read_metrics"]

# (metric, short name) shown on the progress bar when the step emits it; RL emits policy/loss, distillation emits
# distillation/loss (tests/test_trainer_metric_names.py checks that every name here is emitted by some run)
PROGRESS_KEYS = (("distillation/loss", "loss"), ("policy/loss", "pg"), ("train/reward", "reward"),
                 ("eval/teacher_kl", "kl"), ("eval/greedy_acc", "acc"))


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl (a torn last line is dropped with a ``RunWarning``)."""
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


class RunLogger:
    def __init__(self, run_dir: str | Path, *, start_step: int = 0, tensorboard: bool = True, progress: bool = True,
                 total_steps: int | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        # A resumed run drops the lines written after its checkpoint, so the file reads like one uninterrupted run.
        kept = [r for r in read_metrics(self.run_dir) if r.get("step", 0) <= start_step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._fd = open_nofollow(self.path, os.O_WRONLY | os.O_APPEND)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
            except ImportError:  # tensorboard is an optional extra
                self.tb = None
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in metrics.items()}}
        line = (json.dumps(row) + "\n").encode()
        if os.write(self._fd, line) != len(line):  # a short write (disk full): stop rather than leave a torn line
            raise OSError(f"{self.path}: short write (disk full?)")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.bar is not None:
            post = {}
            for key, short in PROGRESS_KEYS:
                if key in metrics and metrics[key] is not None:
                    post[short] = f"{metrics[key]:.4g}"
            if post:
                self.bar.set_postfix(post, refresh=False)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.close()


class NullLogger:
    """The logger of the ranks other than 0 in a multi-process run: rank 0 alone writes the run's logs."""

    def log(self, step: int, metrics: dict) -> None:
        pass

    def advance(self) -> None:
        pass

    def close(self) -> None:
        pass
