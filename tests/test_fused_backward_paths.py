"""``fused_topk_divergence`` computes its gradients in the forward pass and, in backward, scales them when the
incoming per-token gradient is one value on every live row (a sum or mean), else recomputes each chunk.  Both paths
against the float64 SPEC reference (``tests/reference.py``), and the GEMMs each path runs."""

import pytest
import torch

import opdistill.fused.logprobs as fused_logprobs_module
from opdistill.fused import fused_topk_divergence
from tests import reference as ref
from tests.conftest import random_teacher_topk, seeded

N, H, V, K = 9, 6, 31, 4
MASKED = (2, 7)


def _inputs():
    g = seeded(3)
    h = (torch.randn(N, H, generator=g, dtype=torch.float64) * 0.7).requires_grad_(True)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7).requires_grad_(True)
    b = (torch.randn(V, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True)
    ids, lp = random_teacher_topk(g, N, V, K, scale=2, dtype=torch.float64)
    lp[list(MASKED)] = float("-inf")  # masked rows: their incoming gradient may be anything
    return h, w, b, ids, lp


REDUCTIONS = {
    "sum": lambda L: L.sum(),
    "mean": lambda L: L.mean(),
    "scaled sum, masked rows weighted apart": lambda L: 0.25 * L.sum() + 5.0 * L[list(MASKED)].sum(),
    "weighted": lambda L: (L * torch.linspace(0.1, 2.0, N, dtype=L.dtype)).sum(),
    "one row": lambda L: L[4],
}


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradients_of_any_reduction_match_the_reference(reduction):
    h, w, b, ids, lp = _inputs()
    f = REDUCTIONS[reduction]
    got = torch.autograd.grad(f(fused_topk_divergence(h, w, ids, lp, bias=b, chunk_size=4, support="tail",
                                                      divergence="jsd", beta=0.3).loss), (h, w, b))
    z = torch.nn.functional.linear(h, w, b)
    want = torch.autograd.grad(f(ref.topk_reference(z, ids, lp, "tail", "jsd", 0.3)), (h, w, b))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_a_second_backward_through_the_same_graph():
    h, w, b, ids, lp = _inputs()
    loss = fused_topk_divergence(h, w, ids, lp, bias=b, chunk_size=4, support="renormalized").loss
    first = torch.autograd.grad(loss.sum(), (h, w), retain_graph=True)
    second = torch.autograd.grad(loss.sum(), (h, w))  # the stored gradients were used: recomputed, same values
    for a, c in zip(first, second):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-14)


def _backward_gemms(monkeypatch, reduction):
    h, w, b, ids, lp = _inputs()
    loss = REDUCTIONS[reduction](fused_topk_divergence(h, w, ids, lp, bias=b, chunk_size=4, support="tail").loss)
    calls = []
    real = fused_logprobs_module.chunk_logits
    monkeypatch.setattr(fused_logprobs_module, "chunk_logits", lambda *a: calls.append(1) or real(*a))
    loss.backward()
    return len(calls)


def test_a_sum_or_mean_recomputes_no_logits_in_backward(monkeypatch):
    assert _backward_gemms(monkeypatch, "sum") == 0
    assert _backward_gemms(monkeypatch, "mean") == 0
    assert _backward_gemms(monkeypatch, "scaled sum, masked rows weighted apart") == 0  # only live rows count
    assert _backward_gemms(monkeypatch, "weighted") == 3  # 9 rows in chunks of 4: each chunk recomputed once
