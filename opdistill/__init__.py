"""opdistill: exact, memory-lean on-policy distillation of language models.

Layers, lowest first; each imports only the layers before it (docs/architecture.md, tests/test_layering.py):
``ops`` (per-token math) -> ``batch``/``metrics`` (aggregation over one optimizer step) and ``parallel``/``fused``
(variants of the ops) -> ``loss`` (teacher signals, config, the back-end dispatch, the loss) and this package root
-> models, data, engines, teachers -> runs -> ``train``, ``serve`` -> ``demo`` -> ``cli``.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the names below are; imported on first use (``__getattr__``), so ``import opdistill.cli``
    # (the command line: its help, its errors, a Ctrl-C while it starts) does not wait for torch
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

_HOMES = {name: home for home, names in {
    ".fused": ("StudentHidden", "TeacherHidden"),
    ".batch": ("AGG_MODES", "GlobalBatch", "aggregate", "pack", "response_logits_slice", "shift_for_next_token",
               "unpack"),
    ".loss": ("DistillationConfig", "DistillationLoss", "PolicyGradientLoss", "TeacherLogits", "TeacherSampled",
              "TeacherScores", "TeacherTopK", "policy_gradient_loss"),
    ".metrics": ("MetricSums",),
    ".ops": ("ESTIMATORS", "TAIL_MASS_EPS", "TopKResult", "generalized_jsd", "ppo_clip_loss", "sampled_token_kl",
             "token_logprobs", "topk_divergence"),
}.items() for name in names}


def __getattr__(name: str):
    """The package root's names, each imported from its home module on first use (PEP 562); a subpackage not
    imported yet (``opdistill.loss`` after a bare ``import opdistill``), imported."""
    home = _HOMES.get(name)
    if home is None:
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'opdistill' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


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
