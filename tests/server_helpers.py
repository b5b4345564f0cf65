"""Server processes for the tests: a free port, a server started and waited for (``GET /health`` answers 200), and
stopped. One home for tests/test_teacher_service.py (``serve-teacher`` hf), tests/test_teacher_service_vllm.py
(``serve-teacher --engine vllm``) and tests/test_teacher_stock_vllm.py (a stock vLLM OpenAI server)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["free_port", "start_server_process", "stop_server_process"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log: Path, n: int = 3000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no log)"


def start_server_process(cmd: list[str], url: str, log: Path, *, what: str, timeout_s: float, env: dict | None = None,
                         new_session: bool = False) -> subprocess.Popen:
    """Start ``cmd`` (its output into the file ``log``: nobody reads a pipe while the tests run, and a full one
    blocks the server) and wait until ``url``/health answers 200. A server that exits first, or does not answer in
    ``timeout_s``, raises RuntimeError naming ``what`` with the end of its log (and is killed). ``new_session``: the
    server gets its own process group (one with child processes: :func:`stop_server_process` with ``group``)."""
    import httpx

    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=new_session)
    t0 = time.time()
    while True:
        if proc.poll() is not None:
            stop_server_process(proc, grace_s=0, group=new_session)  # what is left of its group
            raise RuntimeError(f"{what} exited {proc.returncode} before /health answered; its log ends:\n{_tail(log)}")
        if time.time() - t0 > timeout_s:
            stop_server_process(proc, grace_s=0, group=new_session)
            raise RuntimeError(f"{what}: /health did not answer 200 in {timeout_s:g} s; its log ends:\n{_tail(log)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def stop_server_process(proc: subprocess.Popen, *, grace_s: float = 30, group: bool = False) -> None:
    """SIGTERM, up to ``grace_s`` seconds to shut down (0: SIGKILL at once), then SIGKILL; ``group``: whatever is
    left of its process group too (a vLLM API server and its engine core)."""
    if proc.poll() is None and grace_s > 0:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    if group:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    elif proc.poll() is None:
        proc.kill()
    proc.wait()
