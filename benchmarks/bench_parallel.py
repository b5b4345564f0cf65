"""Vocab-parallel top-k loss: bytes moved by collectives per token, and forward+backward wall time at 1/2/4 ranks.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_parallel.py [--tokens 128] [--vocab 151936] [--k 20]

Two ways to get the top-k loss from vocab-sharded logits [N, V/P]:
  vocab-parallel   ``vocab_parallel_topk_divergence``: all-reduce MAX [N], all-reduce SUM [N, 1+K], all_gather [N, 2K]
  gather-logits    all_gather the shards into [N, V], then ``topk_divergence`` on the full logits
"saved" is what autograd keeps for backward beyond the input logits (``saved_tensors_hooks``), per token and rank.
Bytes are measured by wrapping the torch.distributed calls (message bytes each rank passes in) and converted to
the traffic each rank sends with ring algorithms: all-reduce 2 (P-1)/P M, all_gather (P-1) M.  Wall time is the
median of a few forward+backward iterations on CPU with gloo, one thread per rank (on a machine with fewer cores
than ranks the ranks share cores, so read the 4-rank times as an upper bound).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from opdistill.ops import topk_divergence  # noqa: E402
from opdistill.parallel import vocab_parallel_topk_divergence  # noqa: E402


class ByteCounter:
    """Wrap all_reduce / all_gather: message bytes and ring traffic (bytes this rank sends)."""

    def __init__(self, world: int):
        self.world, self.message, self.ring = world, 0, 0.0

    def __enter__(self):
        self._ar, self._ag = dist.all_reduce, dist.all_gather
        P = self.world

        def all_reduce(t, *a, **k):
            self.message += t.numel() * t.element_size()
            self.ring += 2 * (P - 1) / P * t.numel() * t.element_size()
            return self._ar(t, *a, **k)

        def all_gather(out, t, *a, **k):
            self.message += t.numel() * t.element_size()
            self.ring += (P - 1) * t.numel() * t.element_size()
            return self._ag(out, t, *a, **k)

        dist.all_reduce, dist.all_gather = all_reduce, all_gather
        return self

    def __exit__(self, *exc):
        dist.all_reduce, dist.all_gather = self._ar, self._ag
        return False


def inputs(N: int, V: int, K: int, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, V, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])
    lp = torch.log_softmax(torch.randn(N, K, generator=g), -1) - 0.1
    return x, ids, lp


def gather_logits_loss(local, ids, lp, group, world):
    """Baseline: all_gather the vocab shards (autograd-aware: backward slices this rank's columns)."""
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    rank = dist.get_rank(group)
    parts[rank] = local
    return topk_divergence(torch.cat(parts, -1), ids, lp, support="tail").loss


def saved_bytes(forward, inp: torch.Tensor) -> int:
    """Bytes autograd saves for backward during ``forward()`` (then runs the backward), beyond the input logits'
    own storage."""
    storages = {}  # data_ptr -> bytes: a tensor saved twice (e.g. by logsumexp and gather) counts once
    ptr = inp.untyped_storage().data_ptr()

    def pack(t):
        if t.untyped_storage().data_ptr() != ptr:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    loss.sum().backward()
    return sum(storages.values())


def timed(fn, iters: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(rank: int, world: int, port: int, args, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        dtype = getattr(torch, args.dtype)
        x, ids, lp = inputs(args.tokens, args.vocab, args.k, dtype)
        Vl = -(-args.vocab // world)
        local = torch.nn.functional.pad(x, (0, world * Vl - args.vocab))[:, rank * Vl : (rank + 1) * Vl].contiguous()
        local.requires_grad_(True)

        def vp():
            res = vocab_parallel_topk_divergence(local, ids, lp, group=group, vocab_size=args.vocab, support="tail")
            return res.loss

        def gl():
            return gather_logits_loss(local, ids, lp, group, world)

        rows = []
        for name, forward in (("vocab-parallel", vp), ("gather-logits", gl)):
            with ByteCounter(world) as c:
                saved = saved_bytes(forward, local)
            t = timed(lambda: forward().sum().backward(), args.iters)
            rows.append((name, world, c.message / args.tokens, c.ring / args.tokens, saved / args.tokens, t))
        if rank == 0:
            with open(out_path, "a") as f:
                for r in rows:
                    f.write("\t".join(map(str, r)) + "\n")
    finally:
        dist.destroy_process_group()


def single(args, out_path: str) -> None:
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    x, ids, lp = inputs(args.tokens, args.vocab, args.k, dtype)
    x.requires_grad_(True)

    def vp():
        return vocab_parallel_topk_divergence(x, ids, lp, support="tail").loss

    def ref():
        return topk_divergence(x, ids, lp, support="tail").loss

    with open(out_path, "a") as f:
        for name, forward in (("vocab-parallel", vp), ("topk_divergence", ref)):
            saved = saved_bytes(forward, x) / args.tokens
            f.write(f"{name}\t1\t0\t0\t{saved}\t{timed(lambda: forward().sum().backward(), args.iters)}\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--ranks", default="1,2,4")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.tsv")
        for world in (int(r) for r in args.ranks.split(",")):
            if world == 1:
                single(args, out)
                continue
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(worker, args=(world, port, args, out), nprocs=world, join=True)
        with open(out) as f:
            rows = [line.rstrip("\n").split("\t") for line in f]
    print(f"N={args.tokens} tokens, V={args.vocab}, K={args.k}, logits {args.dtype}, CPU gloo, "
          f"{os.cpu_count()} cores, torch {torch.__version__}")
    print(f"{'method':<16} {'ranks':>5} {'msg B/token':>12} {'ring B/token/rank':>18} {'saved B/token':>14} "
          f"{'fwd+bwd ms':>11}")
    for name, world, msg, ring, saved, t in rows:
        print(f"{name:<16} {world:>5} {float(msg):>12.0f} {float(ring):>18.0f} {float(saved):>14.0f} "
              f"{1000 * float(t):>11.1f}")


if __name__ == "__main__":
    main()
