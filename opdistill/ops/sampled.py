"""Sampled-token signals (SPEC 3.2): the student's log-prob of a token, and single-sample KL estimators.

With d = log pi(y_t) - l_t (student minus teacher log-prob of the token the student sampled):

    k1 = d        abs = |d|        k2 = d^2 / 2        k3 = e^r - r - 1,  r = clamp(-d, -20, 20), then clamp to [-10, 10]

aliases kl = k1, mse = k2, low_var_kl = k3 -- the same numbers as verl's ``kl_penalty`` for those modes.  Which
gradient each estimator follows in expectation is tabulated in docs/losses.md.
"""

from __future__ import annotations

import torch

from .checks import (
    check_choice,
    check_finite_rows,
    check_float,
    check_ids_in_range,
    check_int,
    check_logits,
    check_same_shape,
    check_teacher_logprobs,
    check_temperature,
    compute_dtype,
)
from .topk import student_logprobs_at

ESTIMATORS = ("k1", "k2", "k3", "abs", "kl", "mse", "low_var_kl")
_CANONICAL = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def canonical_estimator(name: str) -> str:
    """Map verl's aliases onto k1/k2/k3/abs."""
    check_choice(name, "estimator", ESTIMATORS)
    return _CANONICAL.get(name, name)


def token_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, *, temperature: float = 1.0, validate: bool = True
) -> torch.Tensor:
    """log_softmax(logits / temperature) at ``ids``: ``[..., V]`` x ``[...]`` -> ``[...]`` (fp32; fp64 stays fp64).

    ``validate``: refuse a row with a NaN/+inf logit (or no finite logit) with a ``ValueError`` naming the first
    such position; False skips the value checks (this one and ids in range) for hot loops.  The op has no mask:
    zero masked rows first."""
    V = check_logits(logits, "logits")
    check_int(ids, "ids")
    if tuple(ids.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"ids must have the leading shape of logits {tuple(logits.shape[:-1])}, got {tuple(ids.shape)}"
        )
    if validate:
        check_ids_in_range(ids, V, "ids")
    check_temperature(temperature)
    s, lse = student_logprobs_at(logits, ids.long().unsqueeze(-1), temperature)
    if validate:
        check_finite_rows(~torch.isfinite(lse), "logits")
    return s.squeeze(-1)


def kl_estimator(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """The estimator formulas on already-validated inputs (shared with the fused/parallel paths)."""
    d = student_logprobs - teacher_logprobs
    if estimator == "k1":
        return d
    if estimator == "abs":
        return d.abs()
    if estimator == "k2":
        return 0.5 * d.square()
    r = torch.clamp(-d, min=-20.0, max=20.0)  # log(nu/pi), clamped for stability as verl does
    return torch.clamp(torch.exp(r) - r - 1.0, min=-10.0, max=10.0)


def sampled_token_kl(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, estimator: str = "k3", *, validate: bool = True
) -> torch.Tensor:
    """Per-token single-sample estimate of KL(pi || nu) at the student's sampled token.

    Args:
        student_logprobs: ``[...]`` log pi(y_t) (differentiable; e.g. from ``token_logprobs``).
        teacher_logprobs: ``[...]`` l_t = log nu(y_t); finite and <= 0.
        estimator: k1 | k2 | k3 | abs (aliases kl, mse, low_var_kl).
        validate: refuse a non-finite student log-prob (``ValueError`` naming the first position); False skips the
            value checks (this one and those of the teacher log-probs).
    Returns ``[...]`` in fp32 (fp64 for fp64 inputs).
    """
    est = canonical_estimator(estimator)
    check_float(student_logprobs, "student_logprobs")
    check_float(teacher_logprobs, "teacher_logprobs")
    if validate:
        check_teacher_logprobs(teacher_logprobs, "teacher_logprobs", allow_neg_inf=False)
    check_same_shape(student_logprobs, "student_logprobs", teacher_logprobs, "teacher_logprobs")
    if validate:
        check_finite_rows(~torch.isfinite(student_logprobs), "student_logprobs")
    dtype = compute_dtype(student_logprobs.dtype)
    return kl_estimator(student_logprobs.to(dtype), teacher_logprobs.to(dtype), est)
