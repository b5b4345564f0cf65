"""Full-vocabulary generalized Jensen-Shannon divergence, TRL-compatible (SPEC 3.3).

    pi = softmax(z_s / tau), nu = softmax(z_t / tau)      (both sides divided by tau, as TRL does)
    beta = 0:      KL(nu || pi)                           forward KL
    beta = 1:      KL(pi || nu)                           reverse KL
    otherwise:     beta KL(nu || M) + (1 - beta) KL(pi || M),   M = beta nu + (1 - beta) pi

The endpoints are special-cased exactly as TRL's ``generalized_jsd_loss`` does, so the value is discontinuous
there (the interior expression tends to 0 at both ends).  Per token, summed over the vocabulary; no reduction.
"""

from __future__ import annotations

import math

import torch

from .checks import check_logits, check_same_shape, check_temperature, check_unit_interval, compute_dtype


def jsd_from_logprobs(s: torch.Tensor, t: torch.Tensor, beta: float) -> torch.Tensor:
    """The divergence from full log-prob rows s (student) and t (teacher), ``[..., V]`` -> ``[...]``."""

    def kl(p_log, q_log):  # sum p (log p - q); underflowed p (log p = -inf) contributes 0
        keep = p_log > float("-inf")
        p_log = torch.where(keep, p_log, 0.0)
        return torch.where(keep, p_log.exp() * (p_log - q_log), 0.0).sum(-1)

    if beta == 0.0:
        return kl(t, s)
    if beta == 1.0:
        return kl(s, t)
    m = torch.logaddexp(t + math.log(beta), s + math.log1p(-beta))
    return beta * kl(t, m) + (1.0 - beta) * kl(s, m)


def generalized_jsd(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, beta: float = 0.5, temperature: float = 1.0
) -> torch.Tensor:
    """Per-token generalized JSD between teacher and student full distributions.

    Args:
        student_logits: ``[..., V]`` (differentiable). teacher_logits: ``[..., V]`` (same shape).
        beta: in [0, 1]; 0 = forward KL(teacher||student), 1 = reverse KL(student||teacher).
        temperature: divides both logits before the softmax.
    Returns ``[...]`` in fp32 (fp64 for fp64 inputs).
    """
    check_logits(student_logits, "student_logits")
    check_logits(teacher_logits, "teacher_logits")
    check_same_shape(student_logits, "student_logits", teacher_logits, "teacher_logits")
    check_unit_interval(beta, "beta")
    check_temperature(temperature)
    dtype = compute_dtype(student_logits.dtype)
    s = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    t = torch.log_softmax(teacher_logits.to(dtype) / temperature, dim=-1)
    return jsd_from_logprobs(s, t, float(beta))
