"""Full-vocabulary generalized Jensen-Shannon divergence, TRL-compatible (SPEC 3.3).

    pi = softmax(z_s / tau), nu = softmax(z_t / tau)      (both sides divided by tau, as TRL does)
    beta = 0:      KL(nu || pi)                           forward KL
    beta = 1:      KL(pi || nu)                           reverse KL
    otherwise:     beta KL(nu || M) + (1 - beta) KL(pi || M),   M = beta nu + (1 - beta) pi

The endpoints are special-cased exactly as TRL's ``generalized_jsd_loss`` does, so the value is discontinuous
there (the interior expression tends to 0 at both ends).  Per token, summed over the vocabulary; no reduction.
"""

from __future__ import annotations

import torch

from .checks import (
    check_finite_rows,
    check_logits,
    check_same_shape,
    check_temperature,
    check_unit_interval,
    compute_dtype,
)
from .divergence import divergence


def jsd_from_logprobs(s: torch.Tensor, t: torch.Tensor, beta: float) -> torch.Tensor:
    """The divergence from full log-prob rows s (student) and t (teacher), ``[..., V]`` -> ``[...]``: the one kernel
    (``divergence.divergence``) with every bucket valid."""
    return divergence(t, s, "jsd", beta)


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    validate: bool = True,
) -> torch.Tensor:
    """Per-token generalized JSD between teacher and student full distributions.

    Args:
        student_logits: ``[..., V]`` (differentiable). teacher_logits: ``[..., V]`` (same shape).
        beta: in [0, 1]; 0 = forward KL(teacher||student), 1 = reverse KL(student||teacher).
        temperature: divides both logits before the softmax.
        validate: refuse a row of either logits whose log-sum-exp is not finite (a NaN or +inf logit, or no finite
            logit) with a ``ValueError`` naming the first such position; False skips this value check (one
            device-to-host sync) for hot loops.  Zero masked rows first (``where``): the op has no mask.
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
    if validate:  # a row holds a NaN exactly when its log-sum-exp is not finite
        check_finite_rows(torch.isnan(s).any(-1), "student_logits")
        check_finite_rows(torch.isnan(t).any(-1), "teacher_logits")
    return jsd_from_logprobs(s, t, float(beta))
