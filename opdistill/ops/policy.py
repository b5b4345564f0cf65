"""PPO-clip surrogate for policy-gradient distillation and task rewards (SPEC 3.4).

    r = exp(clamp(log pi - log pi_old, -20, 20))
    pg = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
    pg = min(pg, -A c)   where A < 0  (dual clip, c = clip_ratio_c)

For distillation the advantage is A_t = -stopgrad(L_t): the per-token divergence acts as a negative reward
(Thinking Machines' on-policy distillation).  Per token; the caller aggregates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import check_float, check_same_shape, compute_dtype


@dataclass(frozen=True)
class PolicyLossResult:
    loss: torch.Tensor  # [...] per-token surrogate (differentiable through logprobs)
    clipped: torch.Tensor  # [...] bool: the clip(r) branch was the larger one (verl's pg_clipfrac)
    dual_clipped: torch.Tensor  # [...] bool: the dual clip -A c was active (A < 0)


def check_clip_ratios(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float) -> None:
    for name, v in (("clip_ratio_low", clip_ratio_low), ("clip_ratio_high", clip_ratio_high)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1e6:
            raise ValueError(f"{name} must be a number >= 0, got {v!r}")
    if clip_ratio_low >= 1.0:
        raise ValueError(f"clip_ratio_low must be < 1 (the ratio is clipped at 1 - clip_ratio_low), got {clip_ratio_low}")
    if isinstance(clip_ratio_c, bool) or not isinstance(clip_ratio_c, (int, float)) or not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be a number > 1 (dual-clip bound), got {clip_ratio_c!r}")


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                  clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                  clip_ratio_c: float = 3.0) -> PolicyLossResult:
    """Per-token dual-clip PPO surrogate; see the module docstring for the formula."""
    check_float(logprobs, "logprobs")
    check_float(old_logprobs, "old_logprobs")
    check_float(advantages, "advantages")
    check_same_shape(logprobs, "logprobs", old_logprobs, "old_logprobs")
    check_same_shape(logprobs, "logprobs", advantages, "advantages")
    check_clip_ratios(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    dtype = compute_dtype(logprobs.dtype)
    logp, old, adv = logprobs.to(dtype), old_logprobs.to(dtype).detach(), advantages.to(dtype).detach()
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg = torch.maximum(pg1, pg2)
    pg3 = -adv * clip_ratio_c
    negative = adv < 0
    loss = torch.where(negative, torch.minimum(pg, pg3), pg)
    return PolicyLossResult(loss, (pg2 > pg1).detach(), (negative & (pg > pg3)).detach())
