"""GlobalBatch.from_masks and MetricSums.reduce over a real 2-process gloo group (one launch for all checks)."""

import torch
import torch.distributed as dist

from tests.parallel_launch import launch


def _worker(rank: int, world: int, out_dir: str) -> None:
    """Runs on each of the 2 gloo ranks (tests/parallel_launch.py initialises the group)."""
    from opdistill import GlobalBatch, MetricSums, aggregate

    group = dist.group.WORLD
    # rank 0: two micro-batches (3 + 0 tokens, 1 + 0 sequences); rank 1: one micro-batch with 4 tokens in 2 rows
    masks = [[torch.tensor([[1, 1, 1, 0]]), torch.zeros(1, 4)], [torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0]])]][rank]
    gb = GlobalBatch.from_masks(masks, group=group)
    assert (gb.num_tokens, gb.num_seqs, gb.dp_size) == (7, 3, 2), gb

    # the refusal of an ambiguous group=None in a multi-process run
    try:
        GlobalBatch.from_masks(masks)
        raise AssertionError("group=None should be refused")
    except ValueError as e:
        assert "pass the data-parallel process group" in str(e)

    # token-mean: each rank's loss * D / N, DDP averages over ranks -> global token mean
    values = [torch.tensor([[1.0, 2.0, 3.0, 0.0]]), torch.tensor([[10.0, 20.0, 0.0, 0.0], [0.0, 30.0, 40.0, 0.0]])]
    local = aggregate(values[rank], masks[0] if rank == 0 else masks[0], "token-mean", gb, group=group)
    total = local.detach().clone()
    dist.all_reduce(total)
    assert abs(total.item() / 2 - (1 + 2 + 3 + 10 + 20 + 30 + 40) / 7) < 1e-5, total.item()

    m = MetricSums()
    m.add_mean("x", values[rank], masks[0])
    m.add_extrema("x", values[rank], masks[0])
    m.add_ratio("r", rank + 1, 4)
    out = m.reduce(group)
    assert out["x"] == (1 + 2 + 3 + 10 + 20 + 30 + 40) / 7, out
    assert (out["x_min"], out["x_max"]) == (1.0, 40.0), out
    assert out["r"] == 3 / 8, out

    bad = MetricSums()
    bad.add_mean("only_on_rank0" if rank == 0 else "only_on_rank1", torch.ones(2))
    try:
        bad.reduce(group)
        raise AssertionError("mismatched metric names should be refused")
    except ValueError as e:
        assert "ranks recorded different metrics" in str(e)
    dist.barrier()


def test_global_batch_and_metrics_over_two_processes(tmp_path):
    launch("tests.test_distributed_core:_worker", 2, str(tmp_path))
