"""Stopping a run cleanly: SIGINT or SIGTERM asks for a stop at the next safe point; a second one aborts at once.

The first signal only sets a flag and says so in one line on stderr. The loop reads the flag at its safe point,
between steps (``stop_requested``): the step in progress, its evaluation and a checkpoint being written are finished
first, then the checkpoint of that last completed step is written (atomic, like every checkpoint) and the loop
returns. Under torchrun the launcher forwards the signal to every worker, not at the same instant: the ranks agree
through one all-reduce (the maximum of the flags) at every safe point, so all of them stop after the same step and
write the same sharded checkpoint.

A second signal raises :class:`Aborted` at once, wherever the main thread is: a checkpoint being written then stays a
hidden temporary folder (removed by the next save) and never replaces anything, the earlier checkpoints are
untouched (the rename is the commit), and metrics.jsonl lines are whole (one ``write`` each). The handlers that were
there before are put back first, so a third signal acts as it would without opdistill.

This is how preemption works on clusters (Slurm, Kubernetes: SIGTERM, a grace period, then SIGKILL) and what the
trainers users know do (torchtitan checks a flag between steps and checkpoints; TRL's Trainer saves on a signal):
a run stopped this way resumes exactly with ``opdistill train --config C --resume``.
"""
from __future__ import annotations

import os
import signal
import threading

__all__ = ["Aborted", "CALLBACK", "StopSignals"]

CALLBACK = "callback"  # a stop a Python callback asked for (run_training's ``callbacks``)

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Aborted(KeyboardInterrupt):
    """A second SIGINT/SIGTERM: the run stops at once (a ``KeyboardInterrupt``: no ``except Exception`` swallows
    it). ``signal_name``: the signal; ``exit_code``: 128 + its number, the shell's convention."""

    def __init__(self, signum: int):
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(f"aborted by a second {self.signal_name}")


class StopSignals:
    """``with StopSignals(what) as stop``: SIGINT and SIGTERM set ``stop.signal_name`` instead of ending the
    process (main thread only; elsewhere nothing is installed and the flag never sets). ``what``: what the first
    signal's line says will happen. ``stop.requested(ctx)``: whether any rank was asked to stop (a collective under
    torchrun: every rank calls it at the same point)."""

    def __init__(self, what: str = "stopping after the current step and writing its checkpoint"):
        self.what = what
        self.signal_name: str | None = None
        self.signum: int | None = None
        self._previous: dict | None = None

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.getsignal(s) for s in _SIGNALS}
            for s in _SIGNALS:
                signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._previous is not None:
            for s, handler in self._previous.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None:  # the second one: at once
            self._restore()
            raise Aborted(signum)
        self.signum, self.signal_name = signum, signal.Signals(signum).name
        # os.write, not print: a handler can run while the main thread is inside a print (reentrant-call error)
        key = "Ctrl-C" if signum == signal.SIGINT else self.signal_name
        os.write(2, f"\nopdistill: {self.signal_name} received: {self.what} ({key} again aborts at once; the "
                    f"checkpoints already written stay intact)\n".encode())

    def ask(self, reason: str) -> None:
        """A stop at the next safe point asked by the program itself (``reason``, e.g. :data:`CALLBACK`), as a first
        signal asks: the step's checkpoint is written and the loop returns."""
        if self.signal_name is None:
            self.signal_name = reason

    def requested(self, ctx=None) -> bool:
        """Whether a stop was asked, on any rank (``ctx``: a ``DistContext``; its ``max`` is a no-op at world 1)."""
        flag = float(self.signal_name is not None)
        if ctx is not None:
            flag = ctx.max(flag)
        if flag and self.signal_name is None:  # another rank's signal: stop with it
            self.signal_name = "a peer's signal"
        return bool(flag)
