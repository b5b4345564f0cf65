"""Input types that stand in for logits when the loss is fused with the lm_head: ``StudentHidden``, ``TeacherHidden``.

Passing a ``StudentHidden`` where logits would go selects the fused back-end (``opdistill.loss.select_backend``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ops.checks import check_temperature, compute_dtype
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
    """The teacher as final hidden states plus its lm_head, in place of its logits (loss_mode ``full``); no gradient.

    hidden ``[..., H_t]`` (after the teacher's final norm: what a teacher sends with the hidden payload), weight
    ``[V, H_t]`` (this rank's contiguous rows with a vocabulary group), bias ``[V]`` or None, ``logit_scale``: the
    constant the teacher multiplies its logits by. Its logits are ``logit_scale * (hidden @ weight.T + bias)``;
    ``logits`` builds them (the unfused back-ends), ``scaled_to`` folds the scale into hidden and bias for a student
    of another scale (the fused back-end applies one temperature to both sides). The tensors are held detached: a
    teacher model's own ``lm_head.weight`` (a Parameter) may be passed as it is, and no graph reaches it."""

    hidden: torch.Tensor
    weight: torch.Tensor
    logit_scale: float = 1.0
    bias: torch.Tensor | None = None

    def __post_init__(self):
        _check_head(self, self.bias)
        for name in ("hidden", "weight", "bias"):
            x = getattr(self, name)
            if x is not None and x.requires_grad:
                object.__setattr__(self, name, x.detach())

    def logits(self) -> torch.Tensor:
        """``[..., V]`` the teacher's logits (fp32, fp64 for fp64), the GEMM in the weight's dtype."""
        z = torch.nn.functional.linear(self.hidden.to(self.weight.dtype), self.weight, self.bias)
        z = z.to(compute_dtype(self.hidden.dtype))
        return z * self.logit_scale if self.logit_scale != 1.0 else z

    def scaled_to(self, logit_scale: float) -> "TeacherHidden":
        """The same logits with ``logit_scale`` (hidden and bias multiplied by logit_scale / its own)."""
        c = self.logit_scale / logit_scale
        if c == 1.0:
            return self
        return TeacherHidden(self.hidden * c, self.weight, logit_scale, None if self.bias is None else self.bias * c)
