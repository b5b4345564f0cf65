"""fused_topk_divergence == topk_divergence on hidden @ W.T (+ b): values, diagnostics, gradients of hidden, weight
and bias, every support x divergence, odd chunkings, N = 0, masked rows; gradcheck in float64."""

import math

import pytest
import torch

from opdistill.fused import fused_topk_divergence
from opdistill.ops.topk import topk_divergence
from tests.conftest import COMBOS, random_teacher_topk, seeded

TOL = dict(rtol=1e-5, atol=1e-5)


def make(lead=(5, 7), H=12, V=97, K=6, dtype=torch.float32, seed=0, bias=True, masked_rows=()):
    g = seeded(seed)
    n = math.prod(lead)
    h = (torch.randn(*lead, H, generator=g, dtype=torch.float64) * 0.6).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.6).to(dtype).requires_grad_(True)
    b = (torch.randn(V, generator=g, dtype=torch.float64) * 0.3).to(dtype).requires_grad_(True) if bias else None
    ids, lp = random_teacher_topk(g, n, V, K, scale=2, dtype=torch.float64)
    lp = lp.to(dtype)
    for r in masked_rows:
        lp[r] = float("-inf")  # an all-empty row: what DistillationLoss makes of a masked position
    return h, w, b, ids.reshape(*lead, K), lp.reshape(*lead, K)


def unfused(h, w, b, ids, lp, **kw):
    return topk_divergence(torch.nn.functional.linear(h, w, b), ids, lp, **kw)


def grads(res, inputs, seed=1):
    # a non-uniform per-token weighting, so per-row gradient scaling is exercised
    wts = torch.rand(res.loss.shape, generator=torch.Generator().manual_seed(seed), dtype=res.loss.dtype)
    inputs = [x for x in inputs if x is not None]
    return torch.autograd.grad((res.loss * wts).sum(), inputs, allow_unused=True)


def assert_same(r1, r2, g1, g2):
    torch.testing.assert_close(r2.loss, r1.loss, **TOL)
    torch.testing.assert_close(r2.student_mass, r1.student_mass, **TOL)
    torch.testing.assert_close(r2.teacher_mass, r1.teacher_mass, **TOL)
    torch.testing.assert_close(r2.overlap_count, r1.overlap_count)
    torch.testing.assert_close(r2.overlap_token_advantage, r1.overlap_token_advantage, **TOL)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(b, a, **TOL)


@pytest.mark.parametrize("support,divergence", COMBOS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_unfused_every_combo(support, divergence, temperature):
    h, w, b, ids, lp = make(masked_rows=(3,))
    kw = dict(support=support, divergence=divergence, temperature=temperature, beta=0.3)
    r1 = unfused(h, w, b, ids, lp, **kw)
    r2 = fused_topk_divergence(h, w, ids, lp, bias=b, chunk_size=8, **kw)  # 8 does not divide N = 35
    assert r2.loss.shape == (5, 7) and r2.loss.dtype == torch.float32
    assert_same(r1, r2, grads(r1, (h, w, b)), grads(r2, (h, w, b)))


@pytest.mark.parametrize("beta", [0.0, 1e-3, 0.5, 1 - 1e-3, 1.0])
def test_jsd_betas_and_clamp(beta):
    h, w, b, ids, lp = make(lead=(11,), bias=False)
    for support in ("tail", "renormalized"):
        kw = dict(support=support, divergence="jsd", beta=beta)
        r1, r2 = unfused(h, w, None, ids, lp, **kw), fused_topk_divergence(h, w, ids, lp, chunk_size=4, **kw)
        assert_same(r1, r2, grads(r1, (h, w)), grads(r2, (h, w)))
    kw = dict(support="truncated", divergence="forward", log_prob_min_clamp=-3.0)
    r1, r2 = unfused(h, w, None, ids, lp, **kw), fused_topk_divergence(h, w, ids, lp, chunk_size=4, **kw)
    assert_same(r1, r2, grads(r1, (h, w)), grads(r2, (h, w)))


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 35, 36, 1000])
def test_chunkings(chunk_size):
    h, w, b, ids, lp = make(masked_rows=(0, 34))
    kw = dict(support="tail", divergence="reverse")
    r1 = unfused(h, w, b, ids, lp, **kw)
    r2 = fused_topk_divergence(h, w, ids, lp, bias=b, chunk_size=chunk_size, **kw)
    assert_same(r1, r2, grads(r1, (h, w, b)), grads(r2, (h, w, b)))


def test_n_zero():
    h, w, b, ids, lp = make(lead=(0,))
    r = fused_topk_divergence(h, w, ids, lp, bias=b, support="tail", divergence="forward")
    assert r.loss.shape == (0,) and r.overlap_count.shape == (0,)
    gh, gw, gb = torch.autograd.grad(r.loss.sum(), (h, w, b))
    assert gh.shape == h.shape and torch.equal(gw, torch.zeros_like(w)) and torch.equal(gb, torch.zeros_like(b))


def test_all_rows_masked_gives_zero_and_zero_grad():
    h, w, b, ids, lp = make(lead=(4,), masked_rows=range(4))
    r = fused_topk_divergence(h, w, ids, lp, bias=b, support="tail", divergence="jsd", chunk_size=3)
    assert torch.equal(r.loss, torch.zeros(4)) and torch.equal(r.overlap_count, torch.zeros(4, dtype=torch.int64))
    for g in torch.autograd.grad(r.loss.sum(), (h, w, b)):
        assert torch.equal(g, torch.zeros_like(g))


def test_duplicate_ids_truncated_scatter_add():
    # truncated allows repeated ids: both slots' gradients must land on the same logit
    h, w, b, ids, lp = make(lead=(6,), K=4)
    ids = ids.clone()
    ids[:, 1] = ids[:, 0]
    lp = lp - math.log(2)
    r1 = unfused(h, w, b, ids, lp, support="truncated", divergence="forward")
    r2 = fused_topk_divergence(h, w, ids, lp, bias=b, chunk_size=4, support="truncated", divergence="forward")
    assert_same(r1, r2, grads(r1, (h, w, b)), grads(r2, (h, w, b)))


def test_no_grad_for_frozen_weight():
    h, w, b, ids, lp = make(lead=(9,))
    w.requires_grad_(False)
    r = fused_topk_divergence(h, w, ids, lp, bias=b, support="tail", divergence="forward", chunk_size=4)
    gh = torch.autograd.grad(r.loss.sum(), h)[0]
    r1 = unfused(h, w, b, ids, lp, support="tail", divergence="forward")
    torch.testing.assert_close(gh, torch.autograd.grad(r1.loss.sum(), h)[0], **TOL)


@pytest.mark.parametrize("support,divergence", [("truncated", "forward"), ("tail", "jsd"), ("renormalized", "reverse")])
def test_gradcheck_float64(support, divergence):
    h, w, b, ids, lp = make(lead=(5,), H=3, V=11, K=3, dtype=torch.float64)
    lp = lp.detach()

    def f(h, w, b):
        return fused_topk_divergence(h, w, ids, lp, bias=b, chunk_size=2, support=support, divergence=divergence,
                                     temperature=0.9).loss

    assert torch.autograd.gradcheck(f, (h, w, b), eps=1e-6, atol=1e-7)


def test_does_not_mutate_inputs():
    h, w, b, ids, lp = make(lead=(7,))
    copies = [x.detach().clone() for x in (h, w, b, ids, lp)]
    r = fused_topk_divergence(h, w, ids, lp, bias=b, chunk_size=3, support="tail", divergence="forward", temperature=0.5)
    r.loss.sum().backward()
    for x, c in zip((h, w, b, ids, lp), copies):
        assert torch.equal(x.detach(), c)
