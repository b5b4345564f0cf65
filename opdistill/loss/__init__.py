"""The distillation loss: teacher signals (``signals``), ``DistillationConfig`` (``config``), the back-ends and the
one place that picks one (``backend``), ``DistillationLoss``, ``PolicyGradientLoss`` and ``policy_gradient_loss``
(``distillation``)."""

from .backend import PLAIN, Backend, FusedBackend, PlainBackend, VocabParallelBackend, select_backend
from .config import LOSS_MODES, DistillationConfig
from .distillation import DistillationLoss, PolicyGradientLoss, policy_gradient_loss
from .signals import GroupedScores, TeacherLogits, TeacherSampled, TeacherScores, TeacherTopK

__all__ = ["LOSS_MODES", "PLAIN", "Backend", "DistillationConfig", "DistillationLoss", "FusedBackend", "GroupedScores", "PlainBackend",
           "PolicyGradientLoss", "TeacherLogits", "TeacherSampled", "TeacherScores", "TeacherTopK",
           "VocabParallelBackend", "policy_gradient_loss", "select_backend"]
