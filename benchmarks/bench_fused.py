"""Forward+backward time and peak memory of four ways to get a top-k distillation loss from hidden states.

    (a) naive    logits = h W^T for the whole batch, then ``topk_divergence`` (fp32 log-softmax, gather, top-k)
    (b) chunked  the same [N, V] logits, then verl-style chunks: each chunk upcast to fp32, logsumexp, gather and
                 top-k under activation checkpointing (no fp32 [N, V] buffer, but the [N, V] logits and their
                 gradient remain)
    (c) fused    ``opdistill.fused.fused_topk_divergence`` (one chunk of logits at a time, recomputed in backward;
                 per-token losses, any downstream use)
    (c') fused_w ``opdistill.fused.fused_topk_loss`` (the same loss reduced with known per-token weights, here 1/N;
                 gradients computed in forward, no recompute)
    (d) floor    the three bare lm_head GEMMs with no loss: logits, grad_hidden, grad_weight

Every configuration runs in a fresh subprocess.  Peak memory is that process's peak RSS minus its RSS once the
inputs exist, minus the bytes of the gradients the step must produce (hidden and weight): what the method needs
*beyond* inputs, weights and their gradients.  Times are of one forward+backward after a small warm-up: wall-clock,
and the process's CPU time (user + system, all threads), which is less disturbed by other work on shared cores;
the ratios use CPU time.

    python benchmarks/bench_fused.py                 # N in {1024, 4096}, fp32 and bf16 (GBs of RAM, minutes)
    python benchmarks/bench_fused.py --quick         # N in {256, 1024}
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

H, V, K = 896, 151_936, 32
METHODS = ("naive", "chunked", "fused", "fused_w", "floor")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def make_inputs(n: int, dtype: torch.dtype, vocab: int = V, hidden: int = H, k: int = K, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hidden, generator=g) * 0.5).to(dtype).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5 * 4).to(dtype).requires_grad_(True)
    # teacher top-k: random distinct ids, log-probs of a peaked distribution (mass < 1)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(min(n, 64))])
    ids = ids.repeat((n + 63) // 64, 1)[:n]
    lp = torch.log_softmax(torch.randn(n, k + 1, generator=g) * 2, -1)[:, :k]
    return h, w, ids, lp


def step(method: str, h, w, ids, lp):
    from opdistill.fused import fused_topk_divergence, fused_topk_loss
    from opdistill.ops.topk import topk_divergence, topk_loss_from_logprobs

    n = h.shape[0]
    if method == "naive":
        logits = h @ w.t()
        loss = topk_divergence(logits, ids, lp, support="tail", divergence="forward").loss.sum() / n
        loss.backward()
    elif method == "chunked":
        logits = h @ w.t()
        chunk = 256

        def piece(z, i, t):  # one chunk: fp32 upcast, logsumexp, gather, top-k (overlap metric)
            z = z.float()
            s = z.gather(-1, i) - torch.logsumexp(z, -1, keepdim=True)
            torch.topk(z.detach(), k=i.shape[-1], dim=-1)
            return topk_loss_from_logprobs(s, t, support="tail", divergence="forward").sum()

        total = 0.0
        for a in range(0, n, chunk):
            total = total + torch.utils.checkpoint.checkpoint(
                piece, logits[a : a + chunk], ids[a : a + chunk], lp[a : a + chunk], use_reentrant=False
            )
        (total / n).backward()
    elif method == "fused":
        loss = fused_topk_divergence(h, w, ids, lp, support="tail", divergence="forward").loss.sum() / n
        loss.backward()
    elif method == "fused_w":
        weights = torch.full((n,), 1.0 / n)
        loss, _ = fused_topk_loss(h, w, ids, lp, weights, support="tail", divergence="forward")
        loss.backward()
    elif method == "floor":
        with torch.no_grad():
            z = h @ w.t()  # logits
            h.grad = z @ w  # grad_hidden (z stands in for dL/dz)
            w.grad = z.t() @ h  # grad_weight
    else:
        raise ValueError(method)


def worker(method: str, n: int, dtype_name: str, hidden: int = H) -> dict:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    wh, ww, wi, wl = make_inputs(64, dtype, vocab=4096, hidden=hidden)
    step(method, wh, ww, wi, wl)  # warm-up: thread pools, kernels (small shapes, little memory)
    del wh, ww, wi, wl
    h, w, ids, lp = make_inputs(n, dtype, hidden=hidden)
    base = rss_bytes()
    grad_bytes = h.numel() * h.element_size() + w.numel() * w.element_size()
    t0, c0 = time.perf_counter(), time.process_time()
    step(method, h, w, ids, lp)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    extra = max(peak_rss_bytes() - base - grad_bytes, 0)
    return {"method": method, "n": n, "dtype": dtype_name, "seconds": seconds, "cpu_seconds": cpu, "extra_bytes": extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N in {256, 1024} instead of {1024, 4096}")
    ap.add_argument("--ns", type=int, nargs="*", help="override the token counts")
    ap.add_argument("--dtypes", nargs="*", default=["fp32", "bf16"])
    ap.add_argument("--methods", nargs="*", default=list(METHODS))
    ap.add_argument("--hidden", type=int, default=H, help=f"hidden size H (default {H})")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds over all configurations (interleaved, fresh process each); the table shows medians")
    ap.add_argument("--worker", nargs=4, metavar=("METHOD", "N", "DTYPE", "HIDDEN"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.worker[2], int(args.worker[3]))))
        return
    ns = args.ns or ([256, 1024] if args.quick else [1024, 4096])
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    runs: dict[tuple, list[dict]] = {}
    for _ in range(args.repeats):
        for dtype_name in args.dtypes:
            for n in ns:
                for method in args.methods:
                    out = subprocess.run(
                        [sys.executable, os.path.abspath(__file__), "--worker", method, str(n), dtype_name,
                         str(args.hidden)],
                        capture_output=True, text=True, env=env,
                    )
                    if out.returncode != 0:
                        print(f"{method} N={n} {dtype_name} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                        continue
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    runs.setdefault((dtype_name, n, method), []).append(r)
                    print(f"# done {method:8s} N={n:5d} {dtype_name}: {r['seconds']:.2f}s wall {r['cpu_seconds']:.2f}s "
                          f"cpu {r['extra_bytes'] / 2**20:.0f} MiB", file=sys.stderr, flush=True)

    def median(rs: list[dict], key: str) -> float:
        return sorted(r[key] for r in rs)[len(rs) // 2]

    rows = [dict(rs[0], **{k: median(rs, k) for k in ("seconds", "cpu_seconds", "extra_bytes")})
            for rs in runs.values()]
    print(f"H={args.hidden} V={V} K={K}, torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, "
          f"medians of {args.repeats}")
    print("| dtype | N | method | wall s | CPU s | x naive | x floor | peak MiB above inputs+grads | x naive | x floor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    by = {(r["dtype"], r["n"], r["method"]): r for r in rows}
    for r in rows:
        a, d = by.get((r["dtype"], r["n"], "naive")), by.get((r["dtype"], r["n"], "floor"))

        def ratio(key, ref):
            return f"{r[key] / ref[key]:.2f}" if ref and ref[key] > 0 else "-"

        print(f"| {r['dtype']} | {r['n']} | {r['method']} | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} | "
              f"{ratio('cpu_seconds', a)} | {ratio('cpu_seconds', d)} | {r['extra_bytes'] / 2**20:.0f} | "
              f"{ratio('extra_bytes', a)} | {ratio('extra_bytes', d)} |")


if __name__ == "__main__":
    main()
