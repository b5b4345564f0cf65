"""token_logprobs, sampled_token_kl (verl kl_penalty), generalized_jsd (TRL), ppo_clip_loss: references + gradcheck."""

import pytest
import torch
import torch.nn.functional as F

from opdistill import ESTIMATORS, generalized_jsd, ppo_clip_loss, sampled_token_kl, token_logprobs
from tests import reference as ref
from tests.conftest import assert_value_and_grad_match, ref_token_logprobs, seeded


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
    """bf16 logits are upcast before the log-softmax: the result equals the float64 reference on the same (rounded)
    logits to fp32 accuracy; a bf16 log-softmax would be off by ~2^-8 relative."""
    g = seeded(6)
    z = (torch.randn(4, 9, generator=g) * 3).bfloat16()
    ids = torch.randint(0, 9, (4,), generator=g)
    out = token_logprobs(z, ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_token_logprobs(z, ids), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_sampled_token_kl_equals_verl_kl_penalty(estimator, dtype, tol):
    g = torch.Generator().manual_seed(1)
    s = (-torch.rand(6, 7, generator=g, dtype=torch.float64) * 30).to(dtype)  # |d| up to 30
    t = (-torch.rand(6, 7, generator=g, dtype=torch.float64) * 30).to(dtype)
    assert_value_and_grad_match(lambda x: sampled_token_kl(x, t, estimator), lambda x: ref.verl_kl_penalty(x, t, estimator),
                                s, rtol=tol, atol=tol)


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
    zs = (torch.randn(2, 4, 31, generator=g, dtype=torch.float64) * 2).to(dtype)
    zt = (torch.randn(2, 4, 31, generator=g, dtype=torch.float64) * 2).to(dtype)
    assert_value_and_grad_match(lambda x: generalized_jsd(x, zt, beta=beta, temperature=tau),
                                lambda x: ref.trl_generalized_jsd(x, zt, beta=beta, temperature=tau), zs,
                                weights=torch.rand(2, 4, generator=g, dtype=dtype), rtol=tol, atol=tol)


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
    logp = -torch.rand(40, generator=g, dtype=torch.float64) * 2
    old = logp.detach() + torch.randn(40, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(40, generator=g, dtype=torch.float64) * 2
    old[0], adv[0] = logp[0].item() - 2.0, -1.0  # ratio e^2 > c with A < 0: the dual clip binds

    def op(x):
        return ppo_clip_loss(x, old, adv, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)

    assert_value_and_grad_match(lambda x: op(x).loss, lambda x: ref.ppo_reference(x, old, adv, 0.2, 0.28, 3.0), logp,
                                rtol=1e-12, atol=1e-14)
    res = op(logp)
    assert res.clipped.any() and (~res.clipped).any()
    assert res.dual_clipped.any()


def test_ppo_clip_gradcheck_away_from_kinks():
    logp = torch.tensor([-1.0, -0.5, -2.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.05, -0.45, -2.02], dtype=torch.float64)
    adv = torch.tensor([0.7, -1.3, 2.0], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: ppo_clip_loss(x, old, adv).loss, (logp,))
