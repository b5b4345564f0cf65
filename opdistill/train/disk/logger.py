"""Run-directory logging: metrics.jsonl (one line per step), TensorBoard events, optional wandb
(train/disk/wandb_log.py), a console progress bar.

metrics.jsonl is appended one whole line per ``os.write`` through a descriptor opened with ``O_NOFOLLOW`` (a symlink
is refused); a last line torn by a kill is dropped with a warning when read, and cut off when the run resumes. It stays
synchronous: a step's line is on disk when ``log`` returns.

TensorBoard is off the hot path: ``log`` hands the step's scalars to a background thread that owns the
``SummaryWriter`` (building the event protobufs is ~1 ms a step of Python), through a ``SimpleQueue``. ``close`` drains
it. A logger used on its own (``sigterm=True``, the default) also drains it on SIGTERM (the handler drains the queue,
closes the writer, then hands the signal to the handler that was there before, so the exit status is unchanged).
The trainer passes ``sigterm=False``: its own handler (train/run/interrupt.py) turns SIGTERM into a stop at the next
step, after which the logger is closed, and drained, like at any other end.
"""
from __future__ import annotations

import errno
import json
import math
import os
import queue
import signal
import threading
from pathlib import Path

from opdistill.runs.files import read_metrics
from opdistill.train.disk.rundir import atomic_write_text, open_nofollow

__all__ = ["PROGRESS_KEYS", "RunLogger", "NullLogger"]

# (metric, short name) shown on the progress bar when the step emits it; RL emits policy/loss, distillation emits
# distillation/loss (tests/test_trainer_metric_names.py checks that every name here is emitted by some run)
PROGRESS_KEYS = (("distillation/loss", "loss"), ("policy/loss", "pg"), ("train/reward", "reward"),
                 ("eval/teacher_kl", "kl"), ("eval/greedy_acc", "acc"))


class _TensorBoardThread:
    """A ``SummaryWriter`` fed by a background thread: ``put`` returns at once; ``close`` writes everything queued."""

    def __init__(self, log_dir: Path, purge_step: int):
        from torch.utils.tensorboard import SummaryWriter  # ImportError when the extra is missing: the caller's

        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)  # created here: errors surface at once
        self.queue = queue.SimpleQueue()  # put() is reentrant: safe from a signal handler
        self.thread = threading.Thread(target=self._run, name="opdistill-tensorboard", daemon=True)
        self.thread.start()
        self.closed = False

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            step, scalars = item
            for k, v in scalars:
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def put(self, step: int, scalars: list) -> None:
        self.queue.put((step, scalars))

    def close(self, timeout: float | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        self.queue.put(None)
        self.thread.join(timeout)
        self.writer.close()


class RunLogger:
    def __init__(self, run_dir: str | Path, *, start_step: int = 0, tensorboard: bool = True, progress: bool = True,
                 total_steps: int | None = None, wandb=None, sigterm: bool = True, budget_s: float | None = None,
                 desc: str = "train"):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        # A resumed run drops the lines written after its checkpoint, so the file reads like one uninterrupted run.
        kept = [r for r in read_metrics(self.run_dir) if r.get("step", 0) <= start_step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._fd = open_nofollow(self.path, os.O_WRONLY | os.O_APPEND)
        self.tb = None
        self._prev_sigterm = self._sigterm_installed = None
        if tensorboard:
            try:
                self.tb = _TensorBoardThread(self.run_dir / "tensorboard", purge_step=start_step + 1)
            except ImportError:  # tensorboard is an optional extra
                self.tb = None
            if sigterm and self.tb is not None and threading.current_thread() is threading.main_thread():
                self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
                self._sigterm_installed = True
        self.wandb = wandb  # a train.wandb_log.WandbLogger (log.wandb), or None
        self.bar = None
        self.budget_s = budget_s  # train.max_time_s: the bar counts training seconds, not steps (their count is open)
        if progress:
            from tqdm import tqdm

            if budget_s is not None:
                self.bar = tqdm(total=round(budget_s, 1), desc=desc, unit="s", dynamic_ncols=True,
                                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s of training "
                                           "[{elapsed}{postfix}]")
            else:
                self.bar = tqdm(total=total_steps, initial=start_step, desc=desc, dynamic_ncols=True)

    def _cut(self, size: int) -> None:
        """Truncate metrics.jsonl back to ``size`` bytes: a failed append leaves no part of its line."""
        try:
            os.ftruncate(self._fd, size)
        except OSError:  # the original error is the one to report; a reader drops a torn last line anyway
            pass

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in metrics.items()}}
        line = (json.dumps(row) + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, line)
        except OSError:
            self._cut(size)
            raise
        if written != len(line):  # a short write (disk full): cut it off rather than leave a torn line
            self._cut(size)
            raise OSError(errno.ENOSPC, "short write (the disk is full?)", str(self.path))
        if self.tb is not None:
            self.tb.put(step, [(k, v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)])
        if self.wandb is not None:
            self.wandb.log(step, metrics)
        if self.bar is not None:
            post = {"step": step} if self.budget_s is not None else {}
            for key, short in PROGRESS_KEYS:
                if key in metrics and metrics[key] is not None:
                    post[short] = f"{metrics[key]:.4g}"
            if post:
                self.bar.set_postfix(post, refresh=False)

    def advance(self, train_time: float | None = None) -> None:
        """One step done (``train_time``: the run's training seconds so far, for a bar over ``budget_s``)."""
        if self.bar is not None:
            if self.budget_s is None:
                self.bar.update(1)
            elif train_time is not None:
                self.bar.update(round(min(train_time, self.budget_s), 1) - self.bar.n)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.tb is not None:
            self._restore_sigterm()
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()
        if self.bar is not None:
            self.bar.close()

    def _restore_sigterm(self) -> None:
        if self._sigterm_installed:  # None: a handler not installed from Python; put the default back then
            signal.signal(signal.SIGTERM, self._prev_sigterm if self._prev_sigterm is not None else signal.SIG_DFL)
            self._sigterm_installed = False

    def _on_sigterm(self, signum, frame) -> None:
        """Write the queued TensorBoard scalars (10 s at most), then let the previous handler act on the signal."""
        prev = self._prev_sigterm
        self._restore_sigterm()
        self.tb.close(timeout=10.0)
        if callable(prev):
            prev(signum, frame)
        else:  # SIG_DFL (terminate) or SIG_IGN: re-deliver under the restored disposition
            signal.raise_signal(signum)

class NullLogger:
    """The logger of the ranks other than 0 in a multi-process run: rank 0 alone writes the run's logs."""

    def log(self, step: int, metrics: dict) -> None:
        pass

    def advance(self, train_time: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass
