"""opdistill: exact, memory-lean on-policy distillation of language models.

Layers, lowest first; each imports only the layers before it (docs/architecture.md, tests/test_layering.py):
``ops`` (per-token math) -> ``batch``/``metrics`` (aggregation over one optimizer step) and ``parallel``/``fused``
(variants of the ops) -> ``loss`` (teacher signals, config, the back-end dispatch, the loss) and this package root
-> models, data, engines, teachers -> runs -> ``train``, ``serve`` -> ``demo`` -> ``cli``.
"""

from .fused import StudentHidden, TeacherHidden
from .batch import AGG_MODES, GlobalBatch, aggregate, pack, response_logits_slice, shift_for_next_token, unpack
from .loss import (
    DistillationConfig,
    DistillationLoss,
    PolicyGradientLoss,
    TeacherLogits,
    TeacherSampled,
    TeacherScores,
    TeacherTopK,
    policy_gradient_loss,
)
from .metrics import MetricSums
from .ops import (
    ESTIMATORS,
    TAIL_MASS_EPS,
    TopKResult,
    generalized_jsd,
    ppo_clip_loss,
    sampled_token_kl,
    token_logprobs,
    topk_divergence,
)

__version__ = "0.1.0"

__all__ = [
    "AGG_MODES",
    "DistillationConfig",
    "DistillationLoss",
    "ESTIMATORS",
    "GlobalBatch",
    "MetricSums",
    "PolicyGradientLoss",
    "TAIL_MASS_EPS",
    "TeacherLogits",
    "TeacherSampled",
    "TeacherScores",
    "TeacherTopK",
    "StudentHidden",
    "TeacherHidden",
    "TopKResult",
    "aggregate",
    "generalized_jsd",
    "pack",
    "policy_gradient_loss",
    "ppo_clip_loss",
    "response_logits_slice",
    "sampled_token_kl",
    "shift_for_next_token",
    "token_logprobs",
    "topk_divergence",
    "unpack",
]
