"""The one divergence kernel: KL or generalized JSD between a teacher and a student given as log-probs over buckets.

Buckets are the last dim: the whole vocabulary (``generalized_jsd`` and its parallel / fused variants, ``valid``
None) or the K teacher ids plus a rest bucket (``topk_divergence``'s tail / renormalized supports, ``valid`` marks
the non-empty slots).  With t = log nu (teacher) and s = log pi (student), per token:

    forward        KL(nu || pi) = sum_b nu_b (t_b - s_b)
    reverse        KL(pi || nu) = sum_b pi_b (s_b - t_b)
    jsd(beta)      beta KL(nu || M) + (1 - beta) KL(pi || M),   M = beta nu + (1 - beta) pi      (TRL's mixture)

Endpoint rules (the only place they live; TRL's ``generalized_jsd_loss``): jsd at beta = 0 *is* forward KL and at
beta = 1 *is* reverse KL, special-cased exactly, so the value is discontinuous there (the interior expression tends
to 0 at both ends).  ``canonical`` applies them; every caller asks it instead of testing beta itself.

A bucket with p = 0 (log p = -inf) contributes 0 (x log x -> 0).  Every input is sanitised with ``where`` before the
arithmetic, so no inf/NaN exists even in an unselected branch (it would still poison the backward of ``where``).
"""

from __future__ import annotations

import math

import torch

DIVERGENCES = ("forward", "reverse", "jsd")


def canonical(divergence: str, beta: float) -> str:
    """The divergence actually computed: jsd at beta = 0 is forward KL, at beta = 1 reverse KL (TRL)."""
    if divergence == "jsd" and beta == 0.0:
        return "forward"
    if divergence == "jsd" and beta == 1.0:
        return "reverse"
    return divergence


def kl(p_log: torch.Tensor, q_log: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """sum over valid buckets of p (log p - log q), ``[..., B] -> [...]``; buckets with p = 0 contribute 0."""
    keep = p_log > float("-inf")
    if valid is not None:
        keep = keep & valid
    p_log = torch.where(keep, p_log, 0.0)
    q_log = torch.where(keep, q_log, 0.0)
    return torch.where(keep, p_log.exp() * (p_log - q_log), 0.0).sum(-1)


def mixture_log(t: torch.Tensor, s: torch.Tensor, beta: float, valid: torch.Tensor | None = None) -> torch.Tensor:
    """log M = log(beta nu + (1 - beta) pi), for 0 < beta < 1; invalid buckets get -inf."""
    if valid is not None:
        t = torch.where(valid, t, float("-inf"))
        s = torch.where(valid, s, float("-inf"))
    return torch.logaddexp(t + math.log(beta), s + math.log1p(-beta))


def divergence(
    t: torch.Tensor, s: torch.Tensor, divergence: str, beta: float = 0.5, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """The divergence between teacher buckets ``t`` and student buckets ``s`` (log-probs, ``[..., B]``) -> ``[...]``.

    ``divergence`` is forward | reverse | jsd (with ``beta``); ``valid`` [..., B] bool restricts the sum (None: all).
    """
    kind = canonical(divergence, beta)
    if kind == "forward":
        return kl(t, s, valid)
    if kind == "reverse":
        return kl(s, t, valid)
    m = mixture_log(t, s, beta, valid)
    return beta * kl(t, m, valid) + (1.0 - beta) * kl(s, m, valid)


def divergence_grad(t: torch.Tensor, s: torch.Tensor, divergence: str, beta: float = 0.5) -> torch.Tensor:
    """a_b = d/ds_b of the summand phi_b of ``divergence(t, s, ...)`` with s, t held as free variables, ``[..., B]``.

        forward:    phi = nu (t - s)                                   a = -nu
        reverse:    phi = pi (s - t)                                   a = pi (s - t + 1)
        jsd(beta):  phi = beta nu (t - m) + (1 - beta) pi (s - m)      a = (1 - beta) pi (s - m)
                    (m = log M; the dm/ds terms cancel because beta nu + (1 - beta) pi = e^m)

    The analytic backward of the full-vocabulary JSD (vocab-parallel) uses it: with s = log_softmax(z / tau) and
    A = sum_b a_b, dJ/dz_b = (1/tau)(a_b - pi_b A).  Checked against autograd through ``divergence``.
    """
    kind = canonical(divergence, beta)
    if kind == "forward":
        return -torch.exp(t)
    if kind == "reverse":
        return torch.exp(s) * (s - t + 1.0)
    return (1.0 - beta) * torch.exp(s) * (s - mixture_log(t, s, beta))
