"""Collectives per call of every vocab-sharded path, counted on a real 2-process gloo group.

The vocab-parallel ops and the fused ops run the same stages (``opdistill.parallel.stages``), so their counts follow
from one table (docs/parallel.md): ``lse_and_gather`` = all-reduce MAX + all-reduce SUM, ``global_topk`` = one
all_gather, the JSD totals = one more all-reduce, ``logit_grad`` = none; a fused call adds one all_gather of the
shard widths (once per call, not per chunk) and one all-reduce of the hidden-state gradient.  Each collective is
recorded by name and reduce op while it still runs (``Recorder``), so a count that grows fails here.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from opdistill.fused import fused_token_logprobs, fused_topk_divergence, fused_topk_loss
from opdistill.parallel import (
    VocabRows,
    vocab_parallel_generalized_jsd,
    vocab_parallel_token_logprobs,
    vocab_parallel_topk_divergence,
)

from .parallel_launch import COLLECTIVES, CollectiveCounter, launch

N, H, V, K = 10, 6, 22, 3
MAX, SUM = "all_reduce:MAX", "all_reduce:SUM"


class Recorder:
    """Wrap every torch.distributed collective: record ``name`` (``all_reduce:OP`` for all-reduces), then run it."""

    def __init__(self):
        self.calls: list[str] = []

    def __enter__(self):
        self._saved = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
        for n, f in self._saved.items():
            setattr(dist, n, functools.partial(self._record, n, f))
        return self

    def _record(self, name, fn, *args, **kwargs):
        if name == "all_reduce":
            op = kwargs.get("op", args[1] if len(args) > 1 else dist.ReduceOp.SUM)
            name = f"all_reduce:{'MAX' if op == dist.ReduceOp.MAX else 'SUM' if op == dist.ReduceOp.SUM else op}"
        self.calls.append(name)
        return fn(*args, **kwargs)

    def __exit__(self, *exc):
        for n, f in self._saved.items():
            setattr(dist, n, f)
        return False

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls


def _inputs(rank: int):
    g = torch.Generator().manual_seed(0)  # the same tensors on every rank
    x = torch.randn(N, V, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])
    lp = torch.log_softmax(torch.randn(N, V, generator=g, dtype=torch.float64), -1).gather(1, ids)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    cols = slice(0, V // 2) if rank == 0 else slice(V // 2, V)
    return x, ids, lp, h, w, cols


def _worker(rank: int, world: int, out_dir: str) -> None:
    x, ids, lp, h, w, cols = _inputs(rank)
    group = dist.group.WORLD
    rec = Recorder()
    with rec:
        # vocab-parallel: forward MAX + SUM (+ the top-K all_gather), backward nothing
        xl = x[:, cols].clone().requires_grad_(True)
        res = vocab_parallel_topk_divergence(xl, ids, lp, group=group, support="tail", divergence="jsd")
        assert rec.take() == [MAX, SUM, "all_gather"]
        res.loss.sum().backward()
        assert rec.take() == []
        s = vocab_parallel_token_logprobs(xl, ids[:, 0], group=group)
        assert rec.take() == [MAX, SUM]
        s.sum().backward()
        assert rec.take() == []
        j = vocab_parallel_generalized_jsd(xl, x[:, cols] * 0.5, group=group, beta=0.3)
        assert rec.take() == [MAX, SUM, SUM]
        j.sum().backward()
        assert rec.take() == []
        # fused, 3 chunks of 4/4/2 tokens: the widths once, then per chunk top-K + MAX + SUM; backward: grad hidden
        hs, ws = h.clone().requires_grad_(True), w[cols].clone().requires_grad_(True)
        res = fused_topk_divergence(hs, ws, ids, lp, chunk_size=4, group=group, support="tail", divergence="reverse")
        assert rec.take() == ["all_gather_into_tensor"] + ["all_gather", MAX, SUM] * 3
        res.loss.sum().backward()
        assert rec.take() == [SUM]
        s, e = fused_token_logprobs(hs, ws, ids[:, 0], chunk_size=4, group=group, return_entropy=True)
        assert rec.take() == ["all_gather_into_tensor"] + [MAX, SUM] * 3  # the entropy rides in the SUM
        (s.sum() + e.sum()).backward()
        assert rec.take() == [SUM]
        total, _ = fused_topk_loss(hs, ws, ids, lp, torch.ones(N, dtype=torch.float64), chunk_size=4, group=group)
        assert rec.take() == ["all_gather_into_tensor"] + ["all_gather", MAX, SUM] * 3 + [SUM]  # gradients in forward
        total.backward()
        assert rec.take() == []
        # decoding by vocabulary rows (forward only): the widths once; per call the counts, the inputs, one exchange
        rows = VocabRows(w[cols], group)
        assert rec.take() == ["all_gather_into_tensor"]
        rows.lookup(ids[: rank + 2, 0])  # each rank its own number of ids
        assert rec.take() == ["all_gather_into_tensor"] * 2 + ["reduce_scatter_tensor"]
        rows.logits(h[: rank + 2])
        assert rec.take() == ["all_gather_into_tensor"] * 2 + ["all_to_all_single"]
    _check_zero_masked_rows_dtensor(x)
    dist.barrier()


def _check_zero_masked_rows_dtensor(x: torch.Tensor) -> None:
    """DistillationLoss zeroes masked rows of DTensor logits too (policy gradient with ColwiseParallel logits)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from opdistill.parallel.shard import zero_masked_rows

    keep = torch.arange(N) % 3 != 0
    bad = x.clone()
    bad[~keep] = float("nan")
    xd = distribute_tensor(bad, init_device_mesh("cpu", (2,)), [Shard(-1)]).requires_grad_(True)
    out = zero_masked_rows(xd, keep)
    assert torch.equal(out.full_tensor(), torch.where(keep[:, None], bad, 0.0))
    out.full_tensor().sum().backward()
    assert torch.equal(xd.grad.full_tensor(), keep[:, None].expand(N, V).to(x.dtype))


def test_collectives_per_call_two_ranks(tmp_path):
    launch("tests.test_collectives:_worker", 2, str(tmp_path))


def test_fused_ops_without_a_group_run_no_collective():
    """The plain path is the one-shard case of the same stages: no collective at all."""
    x, ids, lp, h, w, _ = _inputs(0)
    hs, ws = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with CollectiveCounter() as counter:
        fused_topk_divergence(hs, ws, ids, lp, chunk_size=4, support="tail").loss.sum().backward()
        s, e = fused_token_logprobs(hs, ws, ids[:, 0], chunk_size=4, return_entropy=True)
        (s.sum() + e.sum()).backward()
        fused_topk_loss(hs, ws, ids, lp, torch.ones(N, dtype=torch.float64), chunk_size=4)[0].backward()
    assert counter.calls == []
