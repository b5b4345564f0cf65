"""Input types that stand in for logits when the loss is fused with the lm_head: ``StudentHidden``, ``TeacherHidden``.

Passing a ``StudentHidden`` where logits would go selects the fused back-end (``opdistill.loss.select_backend``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ops.checks import check_temperature
from .logprobs import check_linear_inputs


def _check_head(x, bias) -> None:
    """hidden, weight (and bias) as ``check_linear_inputs``, and the logit scale, named after the class."""
    name = type(x).__name__
    check_linear_inputs(x.hidden, x.weight, bias, hidden_name=f"{name}.hidden", weight_name=f"{name}.weight",
                        bias_name=f"{name}.bias")
    c = x.logit_scale
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
        raise ValueError(f"{name}.logit_scale must be a finite number > 0, got {c!r}")


@dataclass(frozen=True)
class StudentHidden:
    """The student as final hidden states plus its lm_head, in place of logits.

    hidden ``[..., H]`` (after the model's final norm), weight ``[V, H]``, bias ``[V]`` or None; ``logit_scale`` is a
    constant the model multiplies its logits by (1 for most models), folded into the temperature by ``temperature``.
    ``weight``/``bias`` may be this rank's contiguous vocabulary shard: say so with ``DistillationLoss(vocab_group=)``.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    logit_scale: float = 1.0

    def __post_init__(self):
        _check_head(self, self.bias)

    def temperature(self, tau: float = 1.0) -> float:
        """The temperature to give the fused ops so that they see logits * logit_scale / tau."""
        check_temperature(tau)
        return float(tau) / float(self.logit_scale)


@dataclass(frozen=True)
class TeacherHidden:
    """An in-process teacher as final hidden states plus lm_head (for the fused full-vocabulary JSD); no gradient."""

    hidden: torch.Tensor
    weight: torch.Tensor
    logit_scale: float = 1.0

    def __post_init__(self):
        _check_head(self, None)
