"""What the teacher sends per position, validated at construction: ``TeacherTopK``, ``TeacherSampled``,
``TeacherLogits`` (the fused back-end's full-vocabulary teacher is ``opdistill.fused.TeacherHidden``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.checks import check_float, check_int


@dataclass(frozen=True)
class TeacherTopK:
    """The teacher's top-k next-token distribution per position: ids ``[..., K]`` (int), log-probs ``[..., K]``.

    ``validated``: the values were checked where they were made (ids distinct within a row and in the vocabulary,
    log-probs <= 0 with mass <= 1), as our own scorer does (``teacher.score_teacher``, ``teacher.load_cache``); the
    loss then skips those per-call checks (a sort and several device-to-host syncs) and still checks the student.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    validated: bool = False

    def __post_init__(self):
        check_int(self.ids, "TeacherTopK.ids")
        check_float(self.logprobs, "TeacherTopK.logprobs")
        if not isinstance(self.validated, bool):
            raise TypeError(f"TeacherTopK.validated must be a bool, got {self.validated!r}")


@dataclass(frozen=True)
class TeacherSampled:
    """The teacher's log-prob of the token the student sampled, per position ``[...]``."""

    logprobs: torch.Tensor

    def __post_init__(self):
        check_float(self.logprobs, "TeacherSampled.logprobs")


@dataclass(frozen=True)
class TeacherLogits:
    """The teacher's full logits per position ``[..., V]`` (in-process teacher; full-vocabulary JSD)."""

    logits: torch.Tensor

    def __post_init__(self):
        check_float(self.logits, "TeacherLogits.logits")


SIGNAL_FOR_MODE = {"topk": TeacherTopK, "sampled": TeacherSampled, "full": TeacherLogits}
