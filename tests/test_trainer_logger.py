"""RunLogger: metrics.jsonl synchronous, TensorBoard written by a background thread, drained on close and SIGTERM."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from opdistill.runs.files import read_metrics
from opdistill.train.disk.logger import RunLogger

pytest.importorskip("tensorboard", reason="tensorboard (the [tensorboard] extra) is not installed")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _scalars(run_dir, tag):
    events = EventAccumulator(str(Path(run_dir) / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def test_tensorboard_is_written_off_the_main_thread_and_drained_on_close(tmp_path, monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    writers = []
    real = SummaryWriter.add_scalar

    def spy(self, *a, **k):
        writers.append(threading.current_thread())
        return real(self, *a, **k)

    monkeypatch.setattr(SummaryWriter, "add_scalar", spy)
    before = signal.getsignal(signal.SIGTERM)
    logger = RunLogger(tmp_path, tensorboard=True, progress=False)
    assert signal.getsignal(signal.SIGTERM) == logger._on_sigterm
    for step in range(1, 21):
        logger.log(step, {"a": step * 0.5, "b": float("nan"), "c": "text"})
        # metrics.jsonl is synchronous: the line is on disk when log returns
        assert read_metrics(tmp_path)[-1] == {"step": step, "a": step * 0.5, "b": None, "c": "text"}
    logger.close()
    assert signal.getsignal(signal.SIGTERM) == before  # the previous handler is back
    assert len(writers) == 20 and threading.main_thread() not in writers
    assert _scalars(tmp_path, "a") == [(s, s * 0.5) for s in range(1, 21)]
    assert _scalars(tmp_path, "b") == []  # non-finite and non-numeric values are not TensorBoard scalars
    logger.close()  # idempotent


_SIGTERM_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from torch.utils.tensorboard import SummaryWriter
    from opdistill.train.disk.logger import RunLogger
    real = SummaryWriter.add_scalar
    def slow(self, *a, **k):  # a writer that lags behind the training loop
        time.sleep(0.01)
        return real(self, *a, **k)
    SummaryWriter.add_scalar = slow
    logger = RunLogger(sys.argv[1], tensorboard=True, progress=False)
    for step in range(1, 61):
        logger.log(step, {"a": float(step)})
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    print("not reached")
""")


def test_sigterm_drains_the_queue_and_still_terminates(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _SIGTERM_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stderr.decode()[-2000:]
    assert b"not reached" not in proc.stdout
    assert len(read_metrics(tmp_path)) == 60
    assert _scalars(tmp_path, "a") == [(s, float(s)) for s in range(1, 61)]  # every queued scalar was written
