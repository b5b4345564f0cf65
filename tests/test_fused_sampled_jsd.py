"""fused_token_logprobs (+ entropy, + the sampled-token estimators) and fused_generalized_jsd against the unfused
ops on hidden @ W.T: values and gradients, odd chunkings, N = 0; gradcheck in float64."""

import pytest
import torch

from opdistill.fused import fused_generalized_jsd, fused_token_logprobs
from opdistill.ops.jsd import generalized_jsd
from opdistill.ops.sampled import sampled_token_kl, token_logprobs

TOL = dict(rtol=1e-5, atol=1e-5)


def make(n=23, H=10, V=83, dtype=torch.float32, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, H, generator=g, dtype=torch.float64) * 0.6).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.6).to(dtype).requires_grad_(True)
    b = (torch.randn(V, generator=g, dtype=torch.float64) * 0.3).to(dtype).requires_grad_(True) if bias else None
    ids = torch.randint(0, V, (n,), generator=g)
    teacher = -torch.rand(n, generator=g, dtype=torch.float64).to(dtype) * 4
    wts = torch.rand(n, generator=g, dtype=torch.float64).to(dtype)
    return h, w, b, ids, teacher, wts


def entropy_reference(logits, tau):
    logp = torch.log_softmax(logits.double() / tau, -1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
@pytest.mark.parametrize("chunk_size", [1, 5, 100])
def test_estimators_match_unfused(estimator, chunk_size):
    h, w, b, ids, teacher, wts = make()
    s1 = token_logprobs(torch.nn.functional.linear(h, w, b), ids, temperature=0.8)
    s2 = fused_token_logprobs(h, w, ids, bias=b, temperature=0.8, chunk_size=chunk_size)
    torch.testing.assert_close(s2, s1, **TOL)
    l1, l2 = sampled_token_kl(s1, teacher, estimator), sampled_token_kl(s2, teacher, estimator)
    torch.testing.assert_close(l2, l1, **TOL)
    g1 = torch.autograd.grad((l1 * wts).sum(), (h, w, b))
    g2 = torch.autograd.grad((l2 * wts).sum(), (h, w, b))
    for a, c in zip(g1, g2):
        torch.testing.assert_close(c, a, **TOL)


def test_entropy_value_and_gradient():
    h, w, b, ids, _, wts = make(n=17)
    logits = torch.nn.functional.linear(h, w, b)
    e1 = entropy_reference(logits, 0.7).float()
    s1 = token_logprobs(logits, ids, temperature=0.7)
    s2, e2 = fused_token_logprobs(h, w, ids, bias=b, temperature=0.7, return_entropy=True, chunk_size=4)
    torch.testing.assert_close(e2, e1, **TOL)
    torch.testing.assert_close(s2, s1, **TOL)
    # entropy alone, and entropy mixed with the log-prob
    for f1, f2 in (((e1 * wts).sum(), (e2 * wts).sum()), ((s1 - 0.3 * e1 * wts).sum(), (s2 - 0.3 * e2 * wts).sum())):
        g1 = torch.autograd.grad(f1, (h, w, b), retain_graph=True)
        g2 = torch.autograd.grad(f2, (h, w, b), retain_graph=True)
        for a, c in zip(g1, g2):
            torch.testing.assert_close(c, a, **TOL)


def test_token_logprobs_leading_dims_and_n_zero():
    h, w, b, ids, _, _ = make(n=12)
    s = fused_token_logprobs(h.reshape(3, 4, -1), w, ids.reshape(3, 4), bias=b)
    torch.testing.assert_close(s.reshape(-1), token_logprobs(torch.nn.functional.linear(h, w, b), ids), **TOL)
    h0, w0, b0, ids0, _, _ = make(n=0)
    s0, e0 = fused_token_logprobs(h0, w0, ids0, bias=b0, return_entropy=True)
    assert s0.shape == (0,) and e0.shape == (0,)
    gw = torch.autograd.grad(s0.sum() + e0.sum(), w0)[0]
    assert torch.equal(gw, torch.zeros_like(w0))


def test_token_logprobs_gradcheck_float64():
    h, w, b, ids, _, _ = make(n=5, H=3, V=7, dtype=torch.float64)

    def f(h, w, b):
        s, e = fused_token_logprobs(h, w, ids, bias=b, temperature=1.3, return_entropy=True, chunk_size=2)
        return s + 0.5 * e

    assert torch.autograd.gradcheck(f, (h, w, b), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("beta", [0.0, 1e-3, 0.5, 1 - 1e-3, 1.0])
@pytest.mark.parametrize("chunk_size", [3, 64])
def test_jsd_matches_unfused(beta, chunk_size):
    hs, ws, bs, _, _, wts = make(n=19)
    g = torch.Generator().manual_seed(7)
    ht = torch.randn(19, 6, generator=g) * 0.6  # a teacher with another hidden size
    wt = torch.randn(83, 6, generator=g) * 0.6
    j1 = generalized_jsd(torch.nn.functional.linear(hs, ws, bs), ht @ wt.T, beta=beta, temperature=0.9)
    j2 = fused_generalized_jsd(hs, ws, ht, wt, beta=beta, temperature=0.9, student_bias=bs, chunk_size=chunk_size)
    torch.testing.assert_close(j2, j1, **TOL)
    params = (hs, ws, bs)
    for a, c in zip(torch.autograd.grad((j1 * wts).sum(), params), torch.autograd.grad((j2 * wts).sum(), params)):
        torch.testing.assert_close(c, a, **TOL)


def test_jsd_n_zero_and_gradcheck():
    hs, ws, _, _, _, _ = make(n=0, bias=False)
    j = fused_generalized_jsd(hs, ws, torch.zeros(0, 4), torch.randn(83, 4), beta=0.5)
    assert j.shape == (0,)
    hs, ws, _, _, _, _ = make(n=4, H=3, V=7, dtype=torch.float64, bias=False)
    ht, wt = torch.randn(4, 2, dtype=torch.float64), torch.randn(7, 2, dtype=torch.float64)
    f = lambda hs, ws: fused_generalized_jsd(hs, ws, ht, wt, beta=0.4, temperature=1.1, chunk_size=3)  # noqa: E731
    assert torch.autograd.gradcheck(f, (hs, ws), eps=1e-6, atol=1e-7)
