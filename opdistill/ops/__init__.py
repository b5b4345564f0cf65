"""Per-token math on tensors: knows nothing of models, processes or config files."""

from .correction import icepop_weights, sequence_log_ratio, tis_weights
from .jsd import generalized_jsd
from .policy import PolicyLossResult, ppo_clip_loss
from .sampled import ESTIMATORS, sampled_token_kl, token_logprobs
from .topk import TAIL_MASS_EPS, TopKResult, topk_divergence, union_support

__all__ = [
    "ESTIMATORS",
    "PolicyLossResult",
    "TAIL_MASS_EPS",
    "TopKResult",
    "generalized_jsd",
    "icepop_weights",
    "ppo_clip_loss",
    "sampled_token_kl",
    "sequence_log_ratio",
    "tis_weights",
    "token_logprobs",
    "topk_divergence",
    "union_support",
]
