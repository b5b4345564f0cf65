"""The off-policy correction of sampled tokens (SPEC 6.2, 6.5): per-token ratios of the trainer's to the sampler's
probability, per token or one per sequence, truncated importance-sampling weights and ICE-POP masks. Detached: they
weigh each token's loss, they carry no gradient (the trainer's step applies them: opdistill/train/steps/step.py)."""
from __future__ import annotations

import torch

__all__ = ["icepop_weights", "sequence_log_ratio", "tis_weights"]


def sequence_log_ratio(train_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                       level: str) -> torch.Tensor:
    """``log pi_train - log pi_sampler`` per token (``level`` "token"), or one value per row (a sequence) broadcast
    over its tokens (SPEC 6.5): "sequence", the sum over the row's response tokens (the log of the sampled
    sequence's probability ratio); "geometric", that sum over their count (the per-token geometric mean). Detached;
    0 off ``mask``."""
    lr = torch.where(mask, train_logprobs.detach() - sampler_logprobs.detach(), 0.0)
    if level == "token":
        return lr
    if level not in ("sequence", "geometric"):
        raise ValueError(f"sequence_log_ratio: level must be token, sequence or geometric, got {level!r}")
    row = lr.sum(-1, keepdim=True)
    if level == "geometric":
        row = row / mask.sum(-1, keepdim=True).clamp(min=1)
    return torch.where(mask, row.expand_as(lr), 0.0)


def tis_weights(train_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance-sampling weights ``min(exp(log pi_train - log pi_sampler), cap)``, detached (verl's and
    TRL's TIS): the per-token correction for tokens drawn by a sampler whose numerics differ from the trainer's."""
    return torch.exp(train_logprobs.detach() - sampler_logprobs.detach()).clamp(max=cap)


def icepop_weights(train_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, band: tuple[float, float]
                   ) -> torch.Tensor:
    """ICE-POP-style masking: 1 where ``lo <= exp(log pi_train - log pi_sampler) <= hi``, else 0 (the token's
    contribution to every loss is dropped), detached (SPEC 6.5)."""
    lo, hi = band
    ratio = torch.exp(train_logprobs.detach() - sampler_logprobs.detach())
    return ((ratio >= lo) & (ratio <= hi)).to(train_logprobs.dtype)
