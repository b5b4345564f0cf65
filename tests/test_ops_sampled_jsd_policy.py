"""token_logprobs, sampled_token_kl (verl kl_penalty), generalized_jsd (TRL), ppo_clip_loss: references + gradcheck."""

import pytest
import torch
import torch.nn.functional as F

from opdistill import ESTIMATORS, generalized_jsd, ppo_clip_loss, sampled_token_kl, token_logprobs
from tests import reference as ref


def test_token_logprobs_matches_log_softmax_gather():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 5, 17, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 17, (3, 5), generator=g)
    for tau in (1.0, 0.6):
        expect = F.log_softmax(z / tau, -1).gather(-1, ids[..., None])[..., 0]
        torch.testing.assert_close(token_logprobs(z, ids, temperature=tau), expect, rtol=1e-12, atol=1e-14)
    z.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, ids, temperature=0.8), (z,))


def test_token_logprobs_bf16_is_fp32():
    z = torch.randn(4, 9).bfloat16()
    ids = torch.randint(0, 9, (4,))
    out = token_logprobs(z, ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.log_softmax(z.float(), -1).gather(-1, ids[:, None])[:, 0])


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_sampled_token_kl_equals_verl_kl_penalty(estimator, dtype, tol):
    g = torch.Generator().manual_seed(1)
    s = (-torch.rand(6, 7, generator=g, dtype=torch.float64) * 30).to(dtype).requires_grad_(True)  # |d| up to 30
    t = (-torch.rand(6, 7, generator=g, dtype=torch.float64) * 30).to(dtype)
    s2 = s.detach().clone().requires_grad_(True)
    got = sampled_token_kl(s, t, estimator)
    expect = ref.verl_kl_penalty(s2, t, estimator)
    torch.testing.assert_close(got, expect, rtol=tol, atol=tol)
    got.sum().backward()
    expect.sum().backward()
    torch.testing.assert_close(s.grad, s2.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_sampled_token_kl_gradcheck(estimator):
    g = torch.Generator().manual_seed(2)
    s = (-torch.rand(5, generator=g, dtype=torch.float64) * 3 - 0.1).requires_grad_(True)
    t = -torch.rand(5, generator=g, dtype=torch.float64) * 3 - 0.1
    assert torch.autograd.gradcheck(lambda x: sampled_token_kl(x, t, estimator), (s,))


@pytest.mark.parametrize("beta", [0.0, 1e-3, 0.5, 1 - 1e-3, 1.0])
@pytest.mark.parametrize("tau", [1.0, 2.0])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_generalized_jsd_equals_trl(beta, tau, dtype, tol):
    g = torch.Generator().manual_seed(3)
    zs = (torch.randn(2, 4, 31, generator=g, dtype=torch.float64) * 2).to(dtype).requires_grad_(True)
    zt = (torch.randn(2, 4, 31, generator=g, dtype=torch.float64) * 2).to(dtype)
    zs2 = zs.detach().clone().requires_grad_(True)
    got = generalized_jsd(zs, zt, beta=beta, temperature=tau)
    expect = ref.trl_generalized_jsd(zs2, zt, beta=beta, temperature=tau)
    torch.testing.assert_close(got, expect.to(got.dtype), rtol=tol, atol=tol)
    w = torch.rand(2, 4, dtype=dtype)
    (got * w).sum().backward()
    (expect * w).sum().backward()
    torch.testing.assert_close(zs.grad, zs2.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_generalized_jsd_gradcheck(beta):
    g = torch.Generator().manual_seed(4)
    zs = torch.randn(3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    zt = torch.randn(3, 6, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: generalized_jsd(x, zt, beta=beta, temperature=1.3), (zs,))


def test_generalized_jsd_zero_on_equal_distributions():
    z = torch.randn(5, 12, dtype=torch.float64)
    for beta in (0.0, 0.5, 1.0):
        assert generalized_jsd(z, z.clone(), beta=beta).abs().max().item() < 1e-14


def test_ppo_clip_matches_elementwise_reference():
    g = torch.Generator().manual_seed(5)
    logp = (-torch.rand(40, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    old = logp.detach() + torch.randn(40, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(40, generator=g, dtype=torch.float64) * 2
    old[0], adv[0] = logp[0].item() - 2.0, -1.0  # ratio e^2 > c with A < 0: the dual clip binds
    logp2 = logp.detach().clone().requires_grad_(True)
    res = ppo_clip_loss(logp, old, adv, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    expect = ref.ppo_reference(logp2, old, adv, 0.2, 0.28, 3.0)
    torch.testing.assert_close(res.loss, expect, rtol=1e-12, atol=1e-14)
    res.loss.sum().backward()
    expect.sum().backward()
    torch.testing.assert_close(logp.grad, logp2.grad, rtol=1e-12, atol=1e-14)
    assert res.clipped.any() and (~res.clipped).any()
    assert res.dual_clipped.any()


def test_ppo_clip_gradcheck_away_from_kinks():
    logp = torch.tensor([-1.0, -0.5, -2.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.05, -0.45, -2.02], dtype=torch.float64)
    adv = torch.tensor([0.7, -1.3, 2.0], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: ppo_clip_loss(x, old, adv).loss, (logp,))
