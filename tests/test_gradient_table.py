"""The expected-gradient table of docs/losses.md, checked exactly by enumerating the sampled token.

For one position with student pi = softmax(z) and teacher nu, the expectation over y ~ pi of a per-sample
gradient g(y) is sum_y pi(y) g(y): no Monte Carlo, so the claims hold to rounding.  The per-sample gradients come
from opdistill's own ops and PPO surrogate (ratio 1: on-policy, first update); the divergence gradients come from
autograd on the plain full-vocabulary formulas.
"""

import pytest
import torch

from opdistill import ppo_clip_loss, sampled_token_kl, token_logprobs

V = 6


def setup():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(V, generator=g, dtype=torch.float64)
    log_nu = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)
    return z, log_nu


def div_grad(z, log_nu, kind):
    """Gradient w.r.t. z of KL(pi||nu) ('reverse'), KL(nu||pi) ('forward') or sum |pi - nu| ('l1')."""
    z = z.clone().requires_grad_(True)
    log_pi = torch.log_softmax(z, -1)
    if kind == "reverse":
        val = (log_pi.exp() * (log_pi - log_nu)).sum()
    elif kind == "forward":
        val = (log_nu.exp() * (log_nu - log_pi)).sum()
    else:
        val = (log_pi.exp() - log_nu.exp()).abs().sum()
    (grad,) = torch.autograd.grad(val, z)
    return grad


def expected_grad(z, log_nu, estimator, rule):
    """sum_y pi(y) * d/dz [per-sample loss of token y] under the 'supervised' or 'pg' update rule."""
    pi = torch.softmax(z, -1)
    total = torch.zeros(V, dtype=torch.float64)
    for y in range(V):
        zz = z.clone().requires_grad_(True)
        ids = torch.tensor([y])
        logp = token_logprobs(zz[None], ids)  # [1]
        per_token = sampled_token_kl(logp, log_nu[ids], estimator)
        if rule == "supervised":
            loss = per_token.sum()
        else:  # PPO-clip with ratio 1 (on-policy), advantage = -stopgrad(per-token loss)
            loss = ppo_clip_loss(logp, logp.detach(), -per_token.detach()).loss.sum()
        (grad,) = torch.autograd.grad(loss, zz)
        total += pi[y] * grad
    return total


@pytest.mark.parametrize(
    "estimator,rule,expect",
    [
        ("k1", "supervised", "zero"),
        ("k2", "supervised", "reverse"),
        ("k3", "supervised", "forward"),
        ("abs", "supervised", "l1"),
        ("k1", "pg", "reverse"),
        ("k3", "pg", "reverse-minus-forward"),
    ],
)
def test_expected_gradient_table(estimator, rule, expect):
    z, log_nu = setup()
    got = expected_grad(z, log_nu, estimator, rule)
    if expect == "zero":
        want = torch.zeros(V, dtype=torch.float64)
    elif expect == "reverse-minus-forward":
        want = div_grad(z, log_nu, "reverse") - div_grad(z, log_nu, "forward")
    else:
        want = div_grad(z, log_nu, expect)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_prefix_only_advantage_has_zero_expected_gradient():
    """A top-k (or full) divergence at position t is a function of the prefix only, so as a per-token PG
    advantage it is constant in y_t: the expected policy gradient at t is exactly 0."""
    z, _ = setup()
    pi = torch.softmax(z, -1)
    L_t = torch.tensor([0.37], dtype=torch.float64)  # any value that does not depend on the sampled token
    total = torch.zeros(V, dtype=torch.float64)
    for y in range(V):
        zz = z.clone().requires_grad_(True)
        logp = token_logprobs(zz[None], torch.tensor([y]))
        loss = ppo_clip_loss(logp, logp.detach(), -L_t).loss.sum()
        (grad,) = torch.autograd.grad(loss, zz)
        total += pi[y] * grad
    torch.testing.assert_close(total, torch.zeros(V, dtype=torch.float64), rtol=0, atol=1e-14)
