"""The student's rest mass 1 - Q of the tail support where the student is confident (docs/losses.md, "Precision of
the tail rest mass"): fp32 loss and gradient of tail forward/reverse/jsd against the float64 SPEC reference
(tests/reference.py) in every back-end, at 1 - Q from 1e-7 to 1e-3 with logits ~25; gradcheck of the direct path.

Before the rest was summed directly (log(1 - sum_k exp(s_k)) from fp32 log-probs), the forward loss was off by up to
~0.3 relative here and its gradient by more: these tests failed on that code.  The vocab-parallel check on a real
2-rank gloo group is ``parallel_op_checks.check_confident_tail``, run by tests/test_parallel_dist.py's launch.
"""

from __future__ import annotations

import pytest
import torch

from opdistill.fused import fused_topk_divergence, fused_topk_loss
from opdistill.ops import topk_divergence
from opdistill.parallel import vocab_parallel_topk_divergence

from .parallel_op_checks import assert_rel_close, check_confident_tail, confident_tail_case
from .reference import topk_reference

DIVS = [("forward", 0.5), ("reverse", 0.5), ("jsd", 0.5), ("jsd", 0.0)]


def _reference(x, ids, lp, div, beta):
    zr = x.double().requires_grad_(True)
    ref = topk_reference(zr, ids, lp.double(), "tail", div, beta)
    ref.sum().backward()
    return ref.detach(), zr.grad


def test_case_spans_the_confident_range():
    x, ids, _ = confident_tail_case()
    rest = 1 - torch.softmax(x.double(), -1).gather(1, ids).sum(-1)
    assert 5e-8 < rest.min() < 2e-7 and 5e-4 < rest.max() < 2e-3
    assert 20 < x.max() < 30


@pytest.mark.parametrize("div,beta", DIVS)
def test_plain_fp32_equals_float64_reference(div, beta):
    x, ids, lp = confident_tail_case()
    ref, ref_grad = _reference(x, ids, lp, div, beta)
    xx = x.clone().requires_grad_(True)
    got = topk_divergence(xx, ids, lp, support="tail", divergence=div, beta=beta)
    got.loss.sum().backward()
    assert_rel_close(got.loss, ref, f"plain tail/{div} loss")
    assert_rel_close(xx.grad, ref_grad, f"plain tail/{div} grad", scale=ref_grad.abs().amax(-1, keepdim=True))
    # the diagnostic is still Q = sum_k pi(i_k)
    pi_t = xx.detach().double().softmax(-1).gather(1, ids)
    q = torch.where(lp > float("-inf"), pi_t, 0.0).sum(-1)  # over the non-empty slots
    torch.testing.assert_close(got.student_mass.double(), q, rtol=0, atol=1e-5)


def test_vocab_parallel_single_process_equals_float64_reference():
    assert check_confident_tail(0, 1, None) == 3


@pytest.mark.parametrize("div,beta", DIVS)
@pytest.mark.parametrize("chunk", [4, 9])
def test_fused_fp32_equals_float64_reference(div, beta, chunk):
    x, ids, lp = confident_tail_case()
    n, V = x.shape
    # logits = hidden @ weight.T exactly: weight = identity, hidden = the fp32 logits
    w = torch.eye(V)
    ref, ref_grad = _reference(x, ids, lp, div, beta)
    h = x.clone().requires_grad_(True)
    got = fused_topk_divergence(h, w, ids, lp, support="tail", divergence=div, beta=beta, chunk_size=chunk)
    (got.loss * torch.linspace(0.5, 1.5, n)).sum().backward()  # per-row weights: the recompute backward
    ref_w, ref_grad_w = _reference_weighted(x, ids, lp, div, beta, torch.linspace(0.5, 1.5, n, dtype=torch.float64))
    assert_rel_close(got.loss, ref, f"fused tail/{div} loss")
    assert_rel_close(h.grad, ref_grad_w, f"fused tail/{div} grad", scale=ref_grad_w.abs().amax(-1, keepdim=True))
    h2 = x.clone().requires_grad_(True)
    obj, _ = fused_topk_loss(h2, w, ids, lp, torch.ones(n), support="tail", divergence=div, beta=beta, chunk_size=chunk)
    obj.backward()  # uniform weights: the gradient computed in the forward pass
    assert_rel_close(obj, ref.sum(), f"fused_topk_loss tail/{div} objective")
    assert_rel_close(h2.grad, ref_grad, f"fused_topk_loss tail/{div} grad", scale=ref_grad.abs().amax(-1, keepdim=True))


def _reference_weighted(x, ids, lp, div, beta, weights):
    zr = x.double().requires_grad_(True)
    ref = topk_reference(zr, ids, lp.double(), "tail", div, beta)
    (ref * weights).sum().backward()
    return ref.detach(), zr.grad


@pytest.mark.parametrize("div,beta", [("forward", 0.5), ("reverse", 0.5), ("jsd", 0.3)])
def test_gradcheck_float64_direct_rest(div, beta):
    # fp64, moderately confident rows (1 - Q ~ 1e-3..1e-2, above the eps floor so the rest term is live)
    g = torch.Generator().manual_seed(3)
    z = torch.randn(3, 12, generator=g, dtype=torch.float64)
    ids = torch.tensor([[0, 5, 7], [1, 2, 11], [4, 9, 3]])
    z.scatter_(1, ids, z.gather(1, ids) + 6.0)
    lp = torch.log_softmax(torch.randn(3, 3, generator=g, dtype=torch.float64), -1) + torch.log(torch.tensor(0.9))
    lp[2, 1] = float("-inf")
    kw = dict(support="tail", divergence=div, beta=beta, temperature=0.8)
    zz = z.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a: topk_divergence(a, ids, lp, **kw).loss, (zz,), eps=1e-6, atol=1e-7)
    assert torch.autograd.gradcheck(lambda a: vocab_parallel_topk_divergence(a, ids, lp, **kw).loss, (zz,), eps=1e-6,
                                    atol=1e-7)
    w = torch.eye(12, dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: fused_topk_divergence(a, b, ids, lp, chunk_size=2, **kw).loss,
                                    (zz, w), eps=1e-6, atol=1e-7)
