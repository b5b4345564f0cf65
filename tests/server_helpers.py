"""Teacher servers for the tests: a free port, a server started and waited for (``GET /health`` answers 200), and
stopped; the rows the tests send them. One home for tests/test_teacher_service.py (``serve-teacher`` hf),
tests/test_teacher_service_vllm.py (``serve-teacher --engine vllm``) and tests/test_teacher_stock_vllm.py (a stock
vLLM OpenAI server)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import torch

DEMO = Path(__file__).resolve().parent.parent / "opdistill" / "assets" / "demo"

__all__ = ["free_port", "start_server_process", "stop_server_process", "padded_rows", "demo_student_rows",
           "assert_same_ids_but_ties"]


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


def padded_rows(*, V: int = 18, B: int, S: int, seed: int):
    """Random ``(input_ids, attention_mask, response_mask)`` [B, S] (B >= 3) of a V-token vocabulary: rows 1 and 2
    right-padded (4 and 1 padding positions), the response from position 4 on."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    am = torch.ones(B, S, dtype=torch.long)
    am[1, S - 4 :] = 0
    am[2, S - 1 :] = 0
    rm = torch.zeros(B, S, dtype=torch.long)
    rm[:, 4:] = 1
    return ids, am, rm * am


def demo_student_rows():
    """Right-padded prompt + response rows as the trainer holds them (the positions a training step scores): the
    packaged demo student's samples (n = 2, 24 new tokens, seed 0) on 6 carry-add prompts."""
    import random

    from opdistill.data import CarryAdditionTask, render_prompt
    from opdistill.models import load_model, load_tokenizer
    from opdistill.engines.rollout import generate_rollouts

    tok = load_tokenizer(DEMO / "student")
    student = load_model(DEMO / "student")
    rng = random.Random(0)
    task = CarryAdditionTask(1, 3)
    prompts = [render_prompt(tok, task.sample(rng).prompt) for _ in range(6)]
    ro = generate_rollouts(student, tok, prompts, n=2, temperature=1.0, max_new_tokens=24, seed=0)
    return ro.input_ids, ro.attention_mask, ro.response_mask


def assert_same_ids_but_ties(ids: torch.Tensor, ref_ids: torch.Tensor, ref_logprobs: torch.Tensor, bound: float):
    """Two engines' top-K ids [P, K] at the same positions agree, except where two of the reference's neighbouring
    log-probs tie within ``bound`` (their order is then the engine's float rounding)."""
    same = ids == ref_ids
    gaps = (ref_logprobs[:, 1:] - ref_logprobs[:, :-1]).abs() < bound
    tied = torch.zeros_like(same)
    tied[:, 1:] |= gaps
    tied[:, :-1] |= gaps
    assert bool((same | tied).all())
