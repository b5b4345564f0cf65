"""GlobalBatch.from_masks and MetricSums.reduce over a real 2-process gloo group (one launch for all checks)."""

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, errors) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.set_num_threads(1)
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
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def test_global_batch_and_metrics_over_two_processes():
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    assert not msgs, "\n".join(msgs)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
