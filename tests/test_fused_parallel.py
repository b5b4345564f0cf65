"""Fused ops with a vocabulary-sharded lm_head over a real 2-process gloo group (uneven shards) == the unfused ops
on the full weight: values, overlap diagnostics, entropy, and the gradients (hidden: full; weight/bias: own rows)."""

import torch
import torch.distributed as dist

from tests.parallel_launch import launch

N, H, V, K = 13, 6, 53, 5
SPLIT = 27  # rank 0 owns ids [0, 27), rank 1 owns [27, 53)


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _worker(rank: int, world: int, out_dir: str) -> None:
    """Runs on each of the 2 gloo ranks (tests/parallel_launch.py initialises the group)."""
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
    # DistillationLoss(vocab_group=) with a vocabulary-sharded StudentHidden == with the full logits (supervised
    # top-k takes the forward-gradient path; policy gradient takes the recompute path plus fused token log-probs)
    from opdistill import DistillationConfig, DistillationLoss, GlobalBatch, TeacherTopK
    from opdistill.fused import StudentHidden

    mask = torch.ones(1, N, dtype=torch.bool)  # one padded sequence [1, N]
    mask[0, 4] = False
    t1 = TeacherTopK(ids[None], lp[None])
    dp = [dist.new_group([r]) for r in range(world)][rank]  # pure tensor parallelism: data-parallel size 1
    batch = GlobalBatch.from_masks(mask, group=dp)
    old = -torch.rand(1, N, generator=g) * 3
    for cfg in (DistillationConfig(loss_mode="topk", support="tail", divergence="reverse", loss_max_clamp=0.5),
                DistillationConfig(loss_mode="topk", support="tail", use_policy_gradient=True)):
        hf, wf, bf = (x.clone().requires_grad_(True) for x in (h, w, b))
        l_ref, m_ref = DistillationLoss(cfg)(torch.nn.functional.linear(hf, wf, bf)[None], t1, mask, batch,
                               sampled_ids=sampled[None], old_logprobs=old, group=dp)
        g_ref = torch.autograd.grad(l_ref, (hf, wf, bf))
        hs, ws, bs = h.clone().requires_grad_(True), w[rows].clone().requires_grad_(True), b[rows].clone().requires_grad_(True)
        student = StudentHidden(hs[None], ws, bs)
        l_res, m_res = DistillationLoss(cfg, vocab_group=dist.group.WORLD)(student, t1, mask, batch, sampled_ids=sampled[None], old_logprobs=old, group=dp)
        g_res = torch.autograd.grad(l_res, (hs, ws, bs))
        _close(l_res, l_ref, "DistillationLoss loss")
        _close(g_res[0], g_ref[0], "DistillationLoss grad hidden")
        _close(g_res[1], g_ref[1][rows], "DistillationLoss grad weight shard")
        _close(g_res[2], g_ref[2][rows], "DistillationLoss grad bias shard")
        r_ref, r_res = m_ref.reduce(group=dp), m_res.reduce(group=dp)
        assert r_ref.keys() == r_res.keys()
        for k in r_ref:
            assert abs(r_ref[k] - r_res[k]) <= 1e-5 * max(1.0, abs(r_ref[k])), (k, r_ref[k], r_res[k])
    dist.barrier()


def test_fused_vocab_parallel_two_processes(tmp_path):
    launch("tests.test_fused_parallel:_worker", 2, str(tmp_path))
