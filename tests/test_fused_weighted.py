"""fused_topk_loss (gradients computed in forward for a known per-token weighting) == the weighted, clamped sum of
topk_divergence on hidden @ W.T: value, gradients, diagnostics; chunkings, N = 0, a vocab group of size 1."""

import pytest
import torch

from opdistill.fused import fused_topk_loss
from opdistill.ops.topk import topk_divergence
from tests.test_fused_topk import COMBOS, TOL, make


@pytest.mark.parametrize("support,divergence", COMBOS)
@pytest.mark.parametrize("clamp", [None, 0.05])
def test_matches_weighted_unfused(support, divergence, clamp):
    h, w, b, ids, lp = make(masked_rows=(2,))
    wts = torch.rand(h.shape[:-1], generator=torch.Generator().manual_seed(3))
    kw = dict(support=support, divergence=divergence, temperature=0.9)
    ref = topk_divergence(torch.nn.functional.linear(h, w, b), ids, lp, **kw)
    L = ref.loss if clamp is None else ref.loss.clamp(-clamp, clamp)
    total_ref = (L * wts).sum()
    g_ref = torch.autograd.grad(total_ref * 2.5, (h, w, b))
    total, res = fused_topk_loss(h, w, ids, lp, wts, bias=b, chunk_size=6, loss_max_clamp=clamp, **kw)
    g = torch.autograd.grad(total * 2.5, (h, w, b))  # a non-unit incoming gradient
    torch.testing.assert_close(total, total_ref, **TOL)
    torch.testing.assert_close(res.loss, ref.loss.detach(), **TOL)
    torch.testing.assert_close(res.overlap_count, ref.overlap_count)
    torch.testing.assert_close(res.overlap_token_advantage, ref.overlap_token_advantage, **TOL)
    for a, c in zip(g_ref, g):
        torch.testing.assert_close(c, a, **TOL)


@pytest.mark.parametrize("chunk_size", [None, 1, 1000])
def test_chunkings_bf16_and_n_zero(chunk_size):
    h, w, b, ids, lp = make(lead=(9,))
    wts = torch.full((9,), 1 / 9)
    ref = topk_divergence(torch.nn.functional.linear(h, w, b), ids, lp, support="tail", divergence="forward")
    g_ref = torch.autograd.grad((ref.loss * wts).sum(), (h, w, b))
    total, _ = fused_topk_loss(h, w, ids, lp, wts, bias=b, chunk_size=chunk_size, support="tail", divergence="forward")
    for a, c in zip(g_ref, torch.autograd.grad(total, (h, w, b))):
        torch.testing.assert_close(c, a, **TOL)
    hb, wb = h.detach().bfloat16().requires_grad_(True), w.detach().bfloat16().requires_grad_(True)
    total, _ = fused_topk_loss(hb, wb, ids, lp, wts, chunk_size=chunk_size, support="tail", divergence="forward")
    gh, gw = torch.autograd.grad(total, (hb, wb))
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    h0, w0, b0, ids0, lp0 = make(lead=(0,))
    total, res = fused_topk_loss(h0, w0, ids0, lp0, torch.zeros(0), bias=b0, chunk_size=chunk_size, support="tail",
                                 divergence="forward")
    assert float(total.detach()) == 0.0 and res.loss.shape == (0,)


def test_bad_weights():
    h, w, b, ids, lp = make(lead=(4,))
    with pytest.raises(ValueError, match=r"token_weights must have shape \(4,\)"):
        fused_topk_loss(h, w, ids, lp, torch.ones(5), support="tail", divergence="forward")
    with pytest.raises(TypeError, match="token_weights must be a floating-point tensor"):
        fused_topk_loss(h, w, ids, lp, torch.ones(4, dtype=torch.long), support="tail", divergence="forward")
    with pytest.raises(ValueError, match="loss_max_clamp must be a finite number > 0"):
        fused_topk_loss(h, w, ids, lp, torch.ones(4), support="tail", divergence="forward", loss_max_clamp=0)


def test_no_grad_and_frozen_weight():
    h, w, b, ids, lp = make(lead=(6,))
    wts = torch.rand(6)
    with torch.no_grad():
        total, res = fused_topk_loss(h, w, ids, lp, wts, bias=b, support="tail", divergence="forward")
    assert not total.requires_grad
    ref = topk_divergence(torch.nn.functional.linear(h, w, b), ids, lp, support="tail", divergence="forward")
    torch.testing.assert_close(total, (ref.loss * wts).sum().detach(), **TOL)
    w.requires_grad_(False)
    total, _ = fused_topk_loss(h, w, ids, lp, wts, bias=b, chunk_size=4, support="tail", divergence="forward")
    gh, gb = torch.autograd.grad(total, (h, b))
    rh, rb = torch.autograd.grad((ref.loss * wts).sum(), (h, b))
    torch.testing.assert_close(gh, rh, **TOL)
    torch.testing.assert_close(gb, rb, **TOL)
