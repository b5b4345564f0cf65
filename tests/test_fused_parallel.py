"""Fused ops with a vocabulary-sharded lm_head over a real 2-process gloo group (uneven shards) == the unfused ops
on the full weight: values, overlap diagnostics, entropy, and the gradients (hidden: full; weight/bias: own rows)."""

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

N, H, V, K = 13, 6, 53, 5
SPLIT = 27  # rank 0 owns ids [0, 27), rank 1 owns [27, 53)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _worker(rank: int, world: int, port: int, errors) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.set_num_threads(1)
        from opdistill.fused import fused_token_logprobs, fused_topk_divergence
        from opdistill.ops.sampled import token_logprobs
        from opdistill.ops.topk import topk_divergence

        g = torch.Generator().manual_seed(0)  # same data on both ranks
        h = torch.randn(N, H, generator=g) * 0.7
        w = torch.randn(V, H, generator=g) * 0.7
        b = torch.randn(V, generator=g) * 0.2
        ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])
        ids[0] = torch.tensor([SPLIT - 1, SPLIT, 0, V - 1, 3])  # ids on both sides of the boundary
        lp = torch.log_softmax(torch.randn(N, V, generator=g) * 2, -1).gather(-1, ids)
        lp[4] = float("-inf")  # a masked row
        sampled = torch.randint(0, V, (N,), generator=g)
        wts = torch.rand(N, generator=g)
        rows = slice(0, SPLIT) if rank == 0 else slice(SPLIT, V)

        for support, div in (("truncated", "forward"), ("tail", "jsd"), ("renormalized", "reverse")):
            kw = dict(support=support, divergence=div, temperature=0.8)
            hf, wf, bf = (x.clone().requires_grad_(True) for x in (h, w, b))
            ref = topk_divergence(torch.nn.functional.linear(hf, wf, bf), ids, lp, **kw)
            g_ref = torch.autograd.grad((ref.loss * wts).sum(), (hf, wf, bf))
            hs, ws, bs = h.clone().requires_grad_(True), w[rows].clone().requires_grad_(True), b[rows].clone().requires_grad_(True)
            res = fused_topk_divergence(hs, ws, ids, lp, bias=bs, chunk_size=4, group=dist.group.WORLD, **kw)
            g_res = torch.autograd.grad((res.loss * wts).sum(), (hs, ws, bs))
            for f in ("loss", "student_mass", "teacher_mass", "overlap_token_advantage"):
                _close(getattr(res, f), getattr(ref, f), f"{support}/{div} {f}")
            assert torch.equal(res.overlap_count, ref.overlap_count), (res.overlap_count, ref.overlap_count)
            _close(g_res[0], g_ref[0], "grad hidden")
            _close(g_res[1], g_ref[1][rows], "grad weight shard")
            _close(g_res[2], g_ref[2][rows], "grad bias shard")

        hf, wf = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        logits = hf @ wf.T
        s_ref = token_logprobs(logits, sampled)
        logp = torch.log_softmax(logits, -1)
        e_ref = -(logp.exp() * logp).sum(-1)
        g_ref = torch.autograd.grad((s_ref * wts).sum() + e_ref.sum(), (hf, wf))
        hs, ws = h.clone().requires_grad_(True), w[rows].clone().requires_grad_(True)
        s, e = fused_token_logprobs(hs, ws, sampled, return_entropy=True, chunk_size=5, group=dist.group.WORLD)
        _close(s, s_ref, "token logprobs")
        _close(e, e_ref, "entropy")
        g_res = torch.autograd.grad((s * wts).sum() + e.sum(), (hs, ws))
        _close(g_res[0], g_ref[0], "token grad hidden")
        _close(g_res[1], g_ref[1][rows], "token grad weight shard")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def test_fused_vocab_parallel_two_processes():
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    assert not msgs, "\n".join(msgs)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
