"""The two-head full-vocabulary loss (student hidden + lm_head, teacher hidden + lm_head), forward + backward:
opdistill against Liger-Kernel's ``LigerFusedLinearJSDLoss`` and the GEMM floor, on the same inputs.

    ours     ``opdistill.fused.fused_jsd_loss`` (per-token weights 1/N: the mean over tokens, the gradient computed in
             forward chunk by chunk, ``parallel.stages.divergence_step`` on each chunk), automatic chunk size
    liger    ``liger_kernel.chunked_loss.LigerFusedLinearJSDLoss(weight_hard_loss=0, weight_soft_loss=1, beta)``
             (compiled with torch.compile, its default; chunks of 1024 tokens; the mean over tokens), when
             liger-kernel is importable (an optional benchmark dependency, never a runtime one)
    floor    the four GEMMs every method must run and nothing else: student logits, teacher logits, grad hidden,
             grad weight, in chunks of ``--floor-chunk`` tokens in the inputs' dtype (bf16 GEMMs for bf16)
    naive    (``--naive``) both [N, V] logits, TRL's generalized JSD, autograd (GBs at these sizes)

Every (configuration, method) runs in a fresh process, the methods interleaved, ``--repeats`` rounds; the table
shows medians. A process builds the inputs, runs one warm-up step on the first 1024 tokens (the chunk shapes of the
timed step: Liger compiles there), then times one step: wall-clock and process CPU time (user + system, all threads; less disturbed by other work on shared
cores). Peak memory is the process's peak resident set during the timed step (the kernel's high-water mark, reset
after the warm-up with /proc/self/clear_refs) minus its resident set before it, minus the bytes of the gradients
the step must produce (hidden and weight, in their dtype): what the method needs *beyond* inputs, weights and
gradients. Each process also reports its loss and a gradient checksum, and the table says how far liger's loss is
from ours (both are the mean per-token JSD).

Liger-Kernel runs from a separate environment: its package depends on triton, which a CPU machine does not need
for the chunked losses, so it is installed without dependencies:

    python3 -m venv .venv-bench && .venv-bench/bin/pip install torch==2.13.0 -e . \\
        && .venv-bench/bin/pip install --no-deps liger-kernel==0.8.5
    .venv-bench/bin/python benchmarks/bench_full_vocab.py                      # the docs/performance.md table
    .venv-bench/bin/python benchmarks/bench_full_vocab.py --ns 256 --hidden 512 --dtypes fp32 --repeats 1  # quick
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch

V = 151_936
METHODS = ("ours", "liger", "floor")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> bool:
    """Reset the kernel's high-water mark of this process's resident set (Linux >= 4.0); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) * 1024


def trim() -> None:
    """Return freed heap pages to the kernel (glibc), so the next step's buffers count as new memory."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def make_inputs(n: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    """Student (hidden, weight) with gradients, teacher (hidden, weight) without; logits of a few units, the
    teacher's correlated with the student's (a distillation, not two random models)."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, hidden, generator=g) * 0.5
    ws = torch.randn(V, hidden, generator=g) / hidden**0.5 * 4
    ht = hs + 0.3 * torch.randn(n, hidden, generator=g)
    wt = ws + 0.5 * torch.randn(V, hidden, generator=g) / hidden**0.5 * 4
    return (hs.to(dtype).requires_grad_(True), ws.to(dtype).requires_grad_(True), ht.to(dtype), wt.to(dtype))


def make_step(method: str, n: int, beta: float, floor_chunk: int):
    """A function (hs, ws, ht, wt) -> loss that runs forward and backward (gradients into hs.grad, ws.grad)."""
    if method == "ours":
        from opdistill.fused import fused_jsd_loss

        weights = torch.full((n,), 1.0 / n)

        def step(hs, ws, ht, wt):
            loss, _ = fused_jsd_loss(hs, ws, ht, wt, weights, beta=beta)
            loss.backward()
            return loss
    elif method == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        fn = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta)
        labels = torch.zeros(n, dtype=torch.long)  # every token counts (no ignore_index)

        def step(hs, ws, ht, wt):
            loss = fn(hs, ws, ht, wt, labels)
            loss.backward()
            return loss
    elif method == "floor":
        def step(hs, ws, ht, wt):
            with torch.no_grad():
                gh = torch.empty_like(hs)
                gw = torch.zeros_like(ws)
                for a in range(0, n, floor_chunk):
                    zs = hs[a : a + floor_chunk] @ ws.t()  # student logits (they stand in for dL/dz below)
                    zt = ht[a : a + floor_chunk] @ wt.t()  # teacher logits
                    del zt
                    gh[a : a + floor_chunk] = zs @ ws  # grad hidden
                    gw.addmm_(zs.t(), hs[a : a + floor_chunk])  # grad weight
                hs.grad, ws.grad = gh, gw
            return torch.zeros(())
    elif method == "naive":
        def step(hs, ws, ht, wt):
            s = torch.log_softmax((hs @ ws.t()).float(), -1)
            with torch.no_grad():
                t = torch.log_softmax((ht @ wt.t()).float(), -1)
            if beta == 0.0:
                per = (t.exp() * (t - s)).sum(-1)
            elif beta == 1.0:
                per = (s.exp() * (s - t)).sum(-1)
            else:
                m = torch.logaddexp(t + torch.log(torch.tensor(beta)), s + torch.log1p(torch.tensor(-beta)))
                per = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
            loss = per.mean()
            loss.backward()
            return loss
    else:
        raise ValueError(method)
    return step


def reference(hs, ws, ht, wt, beta: float, chunk: int = 256):
    """(loss, grad hidden, grad weight) in float64 from the same (possibly bf16) inputs: TRL's generalized JSD on
    float64 logits, autograd, chunks of rows (not opdistill's code)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.reference import trl_generalized_jsd

    n = hs.shape[0]
    w64 = ws.detach().double().requires_grad_(True)
    wt64 = wt.double()
    loss, gh = 0.0, torch.empty(hs.shape, dtype=torch.float64)
    for a in range(0, n, chunk):
        h64 = hs[a : a + chunk].detach().double().requires_grad_(True)
        part = trl_generalized_jsd(h64 @ w64.t(), ht[a : a + chunk].double() @ wt64.t(), beta=beta).sum() / n
        part.backward()
        gh[a : a + chunk] = h64.grad
        loss += float(part)
    return loss, gh, w64.grad


def worker(method: str, n: int, hidden: int, dtype_name: str, beta: float, floor_chunk: int,
           accuracy: bool = False) -> dict:
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    hs, ws, ht, wt = make_inputs(n, hidden, dtype)
    # warm-up on the first 1024 tokens: thread pools, kernels, Liger's torch.compile (its chunks are 1024 tokens, so
    # the shapes it compiles for are the timed step's; ours are 512 or 256, the floor's --floor-chunk)
    w = min(n, 1024)
    hw = hs[:w].detach().clone().requires_grad_(True)
    make_step(method, w, beta, floor_chunk)(hw, ws, ht[:w], wt)
    del hw
    ws.grad = None
    step = make_step(method, n, beta, floor_chunk)
    trim()
    base = rss_bytes()
    exact_peak = reset_peak()
    grad_bytes = hs.numel() * hs.element_size() + ws.numel() * ws.element_size()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = step(hs, ws, ht, wt)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    extra = max((peak_bytes() if exact_peak else rss_bytes()) - base - grad_bytes, 0)
    out = {"method": method, "n": n, "hidden": hidden, "dtype": dtype_name, "beta": beta, "seconds": seconds,
           "cpu_seconds": cpu, "extra_bytes": extra, "exact_peak": exact_peak, "loss": float(loss)}
    if accuracy and method != "floor":
        ref_loss, ref_gh, ref_gw = reference(hs, ws, ht, wt, beta)

        def rel(x, ref):
            return float((x.double() - ref).norm() / ref.norm())

        out.update(loss_err=abs(float(loss) - ref_loss) / abs(ref_loss), grad_hidden_err=rel(hs.grad, ref_gh),
                   grad_weight_err=rel(ws.grad, ref_gw))
    return out


def available(method: str) -> bool:
    if method != "liger":
        return True
    try:
        import liger_kernel.chunked_loss  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", type=int, nargs="*", default=[1024, 2048, 4096], help="token counts N")
    ap.add_argument("--hidden", type=int, nargs="*", default=[512, 896], help="hidden sizes H (both models)")
    ap.add_argument("--dtypes", nargs="*", default=["fp32", "bf16"])
    ap.add_argument("--betas", type=float, nargs="*", default=[1.0],
                    help="1 = reverse KL (what loss_mode full trains with), 0 = forward KL, between: the JSD")
    ap.add_argument("--methods", nargs="*", default=list(METHODS), choices=[*METHODS, "naive"])
    ap.add_argument("--naive", action="store_true", help="add the naive [N, V] autograd method")
    ap.add_argument("--floor-chunk", type=int, default=1024, help="tokens per chunk of the floor's GEMMs")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (fresh process per run, methods interleaved)")
    ap.add_argument("--accuracy", action="store_true",
                    help="also compare each method's loss and gradients with a float64 reference (TRL's JSD, "
                         "autograd, from the same inputs) and print a second table; small N only (float64 GEMMs)")
    ap.add_argument("--json", help="also write every run's record here")
    ap.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        m, n, h, d, b, fc, acc = args.worker
        print(json.dumps(worker(m, int(n), int(h), d, float(b), int(fc), acc == "1")))
        return
    methods = list(dict.fromkeys(args.methods + (["naive"] if args.naive else [])))
    missing = [m for m in methods if not available(m)]
    if missing:
        print(f"# {', '.join(missing)}: not importable here (see the module docstring to install); left out",
              file=sys.stderr)
        methods = [m for m in methods if m not in missing]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    configs = [(n, h, d, b) for d in args.dtypes for h in args.hidden for n in args.ns for b in args.betas]
    runs: dict[tuple, list[dict]] = {}
    records = []
    for rep in range(args.repeats):
        for cfg in configs:
            order = methods[rep % len(methods):] + methods[: rep % len(methods)]  # rotate who goes first
            for method in order:
                n, h, d, b = cfg
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", method, str(n), str(h), d, str(b),
                       str(args.floor_chunk), "1" if args.accuracy else "0"]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
                if out.returncode != 0:
                    print(f"# {method} N={n} H={h} {d} beta={b} failed (exit {out.returncode}):\n"
                          f"{out.stderr[-1500:]}", file=sys.stderr, flush=True)
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                records.append(r)
                runs.setdefault((*cfg, method), []).append(r)
                print(f"# round {rep + 1}/{args.repeats} {method:6s} N={n:5d} H={h} {d} beta={b}: "
                      f"{r['seconds']:.2f} s wall, {r['cpu_seconds']:.2f} s CPU, {r['extra_bytes'] / 2**20:.0f} MiB, "
                      f"loss {r['loss']:.6f}", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)

    def med(rs, key):
        return statistics.median(r[key] for r in rs)

    print(f"V = {V}, torch {torch.__version__}, {torch.get_num_threads()} threads, CPU; medians of {args.repeats} "
          "runs (fresh process each, methods interleaved); times of one forward + backward after a warm-up step")
    print("| dtype | H | N | beta | method | wall s | CPU s | x floor (CPU) | x liger (CPU) | peak MiB above "
          "inputs+grads | x liger | loss rel. diff vs ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cfg in configs:
        ref = {m: runs.get((*cfg, m)) for m in methods}
        for m in methods:
            rs = ref[m]
            if not rs:
                continue

            def ratio(key, other):
                o = ref.get(other)
                return f"{med(rs, key) / med(o, key):.2f}" if o and med(o, key) > 0 else "-"

            diff = "-"
            if m != "ours" and m != "floor" and ref.get("ours"):
                a, b = med(rs, "loss"), med(ref["ours"], "loss")
                diff = f"{abs(a - b) / max(abs(b), 1e-30):.1e}"
            n, h, d, b = cfg
            print(f"| {d} | {h} | {n} | {b:g} | {m} | {med(rs, 'seconds'):.2f} | {med(rs, 'cpu_seconds'):.2f} | "
                  f"{ratio('cpu_seconds', 'floor')} | {ratio('cpu_seconds', 'liger')} | "
                  f"{med(rs, 'extra_bytes') / 2**20:.0f} | {ratio('extra_bytes', 'liger')} | {diff} |")
    if args.accuracy:
        print()
        print("Relative error against the float64 reference (same inputs): |loss - ref| / |ref|, and "
              "||grad - ref|| / ||ref|| for the student's hidden states and lm_head weight")
        print("| dtype | H | N | beta | method | loss | grad hidden | grad weight |")
        print("|---|---|---|---|---|---|---|---|")
        for cfg in configs:
            for m in methods:
                rs = runs.get((*cfg, m))
                if rs and "loss_err" in rs[0]:
                    n, h, d, b = cfg
                    print(f"| {d} | {h} | {n} | {b:g} | {m} | {rs[0]['loss_err']:.1e} | "
                          f"{rs[0]['grad_hidden_err']:.1e} | {rs[0]['grad_weight_err']:.1e} |")


if __name__ == "__main__":
    main()

