"""The distillation loss: teacher signals (``signals``), ``DistillationConfig`` (``config``), the back-ends and the
one place that picks one (``backend``), ``DistillationLoss`` and ``policy_gradient_loss`` (``distillation``)."""

from .backend import PLAIN, Backend, fused_backend, select_backend, vocab_parallel_backend
from .config import LOSS_MODES, DistillationConfig
from .distillation import DistillationLoss, policy_gradient_loss
from .signals import TeacherLogits, TeacherSampled, TeacherTopK

__all__ = ["LOSS_MODES", "PLAIN", "Backend", "DistillationConfig", "DistillationLoss", "TeacherLogits", "TeacherSampled",
           "TeacherTopK", "fused_backend", "policy_gradient_loss", "select_backend", "vocab_parallel_backend"]
