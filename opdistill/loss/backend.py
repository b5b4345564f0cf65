"""The three loss back-ends behind one interface, and the one place that picks one: ``select_backend``.

    PlainBackend          logits [..., V]                                                      opdistill.ops
    VocabParallelBackend  this rank's logits shard [..., V/tp] over a group, or a DTensor     opdistill.parallel
    FusedBackend          StudentHidden: hidden states + lm_head (group: this rank's rows)     opdistill.fused

Every method takes the student first and returns what the plain op returns for the same logits (per token):

    tokens(student) -> the token dims (validates the student: what the mask must match)
    topk(student, ids, lp, *, temperature, support, divergence, beta, log_prob_min_clamp, validate) -> TopKResult
    token_logprobs(student, ids, *, temperature) -> [...]
    masked_token_logprobs(student, ids, keep, *, temperature) -> [...], 0 where keep is False
    jsd(student, teacher, keep, *, beta, temperature) -> [...]   teacher: TeacherLogits, or TeacherHidden (the
                                                                  teacher's hidden states and lm_head: the unfused
                                                                  back-ends build its logits, the fused one never)
    weighted_topk(student, ids, lp, weights, ...) -> (sum_t w_t clamp(L_t), TopKResult)
    weighted_jsd(student, teacher, keep, weights, ...) -> (sum_t w_t clamp(J_t), J)
        the fused back-end only (``None`` on the others): the gradient of a known linear aggregation is computed in
        the forward pass, while each chunk's logits are alive.

Masked positions may hold anything (padding ids, NaN logits or hidden states): ``zero_rows`` replaces them before an
op reads them, so nothing there reaches a value or a gradient.
"""

from __future__ import annotations

import dataclasses

import torch

from ..fused import (StudentHidden, TeacherHidden, fused_generalized_jsd, fused_jsd_loss, fused_token_logprobs,
                     fused_topk_divergence, fused_topk_loss)
from ..ops import generalized_jsd, token_logprobs, topk_divergence
from ..ops.checks import check_float
from ..parallel import vocab_parallel_generalized_jsd, vocab_parallel_token_logprobs, vocab_parallel_topk_divergence
from ..parallel.shard import VocabShard, is_dtensor, resolve_shard, zero_masked_rows
from .signals import TeacherLogits

__all__ = ["Backend", "PlainBackend", "VocabParallelBackend", "FusedBackend", "PLAIN", "select_backend"]


class Backend:
    """The per-token ops of one back-end (module docstring). Subclasses implement the ops; ``masked_token_logprobs``
    is shared."""

    name = "backend"
    full_teachers: tuple = (TeacherLogits, TeacherHidden)  # what loss_mode 'full' accepts as the teacher
    weighted_topk = None  # the fused back-end's one-pass supervised top-k loss; None where it does not exist
    weighted_jsd = None  # ... and full-vocabulary JSD

    def tokens(self, student) -> torch.Size:
        raise NotImplementedError

    def zero_rows(self, student, keep: torch.Tensor):
        raise NotImplementedError

    def topk(self, student, ids, lp, **kw):
        raise NotImplementedError

    def token_logprobs(self, student, ids, *, temperature: float):
        raise NotImplementedError

    def jsd(self, student, teacher, keep, *, beta: float, temperature: float):
        raise NotImplementedError

    def masked_token_logprobs(self, student, ids: torch.Tensor, keep: torch.Tensor, *, temperature: float):
        """``token_logprobs`` where ``keep``, 0 elsewhere: masked rows are zeroed and their ids read as 0 first."""
        safe_ids = torch.where(keep, ids, torch.zeros_like(ids))
        lp = self.token_logprobs(self.zero_rows(student, keep), safe_ids, temperature=temperature)
        return torch.where(keep, lp, 0.0)


def _logit_tokens(student) -> torch.Size:
    check_float(student, "student")
    return student.shape[:-1]


def _teacher_logits(student: torch.Tensor, teacher) -> torch.Tensor:
    """The teacher's logits (or this rank's shard of them) for a logits student: given, or built from its hidden
    states and lm_head (TeacherHidden: the same columns as the student's shard)."""
    if isinstance(teacher, TeacherHidden):
        if teacher.hidden.shape[:-1] != student.shape[:-1]:
            raise ValueError(f"TeacherHidden.hidden must have shape {tuple(student.shape[:-1]) + ('H',)}, got "
                             f"{tuple(teacher.hidden.shape)}")
        logits = teacher.logits()
        if logits.shape[-1] != student.shape[-1]:
            raise ValueError(f"TeacherHidden.weight has {logits.shape[-1]} rows but student has {student.shape[-1]} "
                             f"logit columns; the JSD needs one shared vocabulary (on this rank)")
        return logits
    if teacher.logits.shape != student.shape:
        raise ValueError(f"TeacherLogits.logits must have the shape of student {tuple(student.shape)}, got "
                         f"{tuple(teacher.logits.shape)}")
    return teacher.logits


class PlainBackend(Backend):
    """Logits ``[..., V]`` on one device: ``opdistill.ops``."""

    name = "plain"

    def tokens(self, student) -> torch.Size:
        return _logit_tokens(student)

    def zero_rows(self, student, keep):
        return zero_masked_rows(student, keep)

    def topk(self, student, ids, lp, **kw):
        return topk_divergence(student, ids, lp, **kw)

    def token_logprobs(self, student, ids, *, temperature):
        return token_logprobs(student, ids, temperature=temperature)

    def jsd(self, student, teacher, keep, *, beta, temperature):
        t = _teacher_logits(student, teacher)
        return generalized_jsd(torch.where(keep, student, 0.0), torch.where(keep, t, 0.0), beta=beta,
                               temperature=temperature)


class VocabParallelBackend(Backend):
    """Logits sharded on the vocabulary over ``group`` (Megatron layout; ``vocab_size``: the true vocabulary when the
    shards are padded), or DTensor logits with ``group=None``: ``opdistill.parallel``."""

    name = "vocab-parallel"

    def __init__(self, group=None, vocab_size: int | None = None):
        self.group, self.vocab_size = group, vocab_size

    def tokens(self, student) -> torch.Size:
        return _logit_tokens(student)

    def zero_rows(self, student, keep):
        return zero_masked_rows(student, keep)

    def topk(self, student, ids, lp, **kw):
        return vocab_parallel_topk_divergence(student, ids, lp, group=self.group, vocab_size=self.vocab_size, **kw)

    def token_logprobs(self, student, ids, *, temperature):
        return vocab_parallel_token_logprobs(student, ids, group=self.group, vocab_size=self.vocab_size,
                                             temperature=temperature)

    def jsd(self, student, teacher, keep, *, beta, temperature):
        t = self._teacher_shard(student, teacher) if isinstance(teacher, TeacherHidden) else \
            _teacher_logits(student, teacher)
        return vocab_parallel_generalized_jsd(torch.where(keep, student, 0.0), torch.where(keep, t, 0.0),
                                              group=self.group, vocab_size=self.vocab_size, beta=beta,
                                              temperature=temperature)


    def _teacher_shard(self, student, teacher: TeacherHidden) -> torch.Tensor:
        """This rank's columns of the teacher's logits, from its hidden states and the same rows of its head (a head
        of all V rows is sliced here; padding columns hold 0 and are never read)."""
        if is_dtensor(student):
            raise ValueError("loss_mode='full' with a TeacherHidden needs plain logit shards with vocab_group (a "
                             "DTensor student would need a DTensor teacher); pass the teacher's logits as a DTensor")
        shard = resolve_shard(student, self.group, self.vocab_size, "student")
        rows = _head_rows(teacher, shard.start, shard.width, shard.vocab_size)
        z = rows.logits()
        return torch.nn.functional.pad(z, (0, shard.local_width - shard.width)) if shard.local_width > shard.width \
            else z


def _head_rows(teacher: TeacherHidden, start: int, width: int, vocab: int) -> TeacherHidden:
    """The teacher with only its head's rows [start, start + width) (a head of ``vocab`` rows is sliced, a head of
    ``width`` rows is taken as this rank's already)."""
    V = teacher.weight.shape[0]
    if V == width and (V != vocab or start == 0):
        return teacher
    if V != vocab:
        raise ValueError(f"TeacherHidden.weight has {V} rows; expected the whole vocabulary ({vocab}) or this rank's "
                         f"{width} rows")
    return TeacherHidden(teacher.hidden, teacher.weight[start:start + width], teacher.logit_scale,
                         None if teacher.bias is None else teacher.bias[start:start + width])


class FusedBackend(Backend):
    """A ``StudentHidden`` (hidden states + lm_head): ``opdistill.fused``. ``group``: the process group its weight
    (and bias) rows are sharded over, contiguous and in rank order (None: the whole vocabulary is here). The lm_head's
    logit multiplier is folded into the temperature (``StudentHidden.temperature``)."""

    name = "fused"
    full_teachers = (TeacherHidden,)

    def __init__(self, group=None):
        self.group = group

    def tokens(self, student: StudentHidden) -> torch.Size:
        return student.hidden.shape[:-1]

    def zero_rows(self, student: StudentHidden, keep):
        return dataclasses.replace(student, hidden=torch.where(keep.unsqueeze(-1), student.hidden, 0.0))

    def topk(self, student: StudentHidden, ids, lp, *, temperature, **kw):
        return fused_topk_divergence(student.hidden, student.weight, ids, lp, bias=student.bias, group=self.group,
                                     temperature=student.temperature(temperature), **kw)

    def weighted_topk(self, student: StudentHidden, ids, lp, weights, *, temperature, **kw):
        return fused_topk_loss(student.hidden, student.weight, ids, lp, weights, bias=student.bias, group=self.group,
                               temperature=student.temperature(temperature), **kw)

    def token_logprobs(self, student: StudentHidden, ids, *, temperature):
        return fused_token_logprobs(student.hidden, student.weight, ids, bias=student.bias, group=self.group,
                                    temperature=student.temperature(temperature))

    def _pair(self, student: StudentHidden, teacher: TeacherHidden, keep):
        """The two sides with masked rows zeroed, the teacher's logit scale folded to the student's (one
        temperature for both), as keyword arguments of the fused JSD ops."""
        if teacher.hidden.shape[:-1] != keep.shape[:-1]:
            raise ValueError(f"TeacherHidden.hidden must have shape {tuple(keep.shape[:-1]) + ('H',)}, got "
                             f"{tuple(teacher.hidden.shape)}")
        t = teacher.scaled_to(student.logit_scale)
        if self.group is not None:  # the student's head rows on this rank: the teacher's same rows
            shard = VocabShard.for_rows(student.weight.shape[0], self.group, student.weight.device)
            t = _head_rows(t, shard.start, shard.width, shard.vocab_size)
        return dict(student_hidden=torch.where(keep, student.hidden, 0.0), student_weight=student.weight,
                    teacher_hidden=torch.where(keep, t.hidden, 0.0), teacher_weight=t.weight, student_bias=student.bias,
                    teacher_bias=t.bias, group=self.group)

    def jsd(self, student: StudentHidden, teacher: TeacherHidden, keep, *, beta, temperature):
        return fused_generalized_jsd(**self._pair(student, teacher, keep), beta=beta,
                                     temperature=student.temperature(temperature))

    def weighted_jsd(self, student: StudentHidden, teacher: TeacherHidden, keep, weights, *, beta, temperature,
                     loss_max_clamp=None):
        return fused_jsd_loss(**self._pair(student, teacher, keep), token_weights=weights, beta=beta,
                              temperature=student.temperature(temperature), loss_max_clamp=loss_max_clamp)


PLAIN = PlainBackend()


def select_backend(student, *, vocab_group=None, vocab_size: int | None = None) -> Backend:
    """THE dispatch: a ``StudentHidden`` -> fused (weight rows sharded over ``vocab_group`` when given); logits with
    ``vocab_group`` or ``vocab_size``, or a DTensor -> vocab-parallel; other logits -> plain."""
    if isinstance(student, StudentHidden):
        if vocab_size is not None:
            raise ValueError(
                f"vocab_size={vocab_size} describes padded logit shards; a StudentHidden's vocabulary is its weight's "
                "rows (over vocab_group): drop vocab_size")
        return FusedBackend(vocab_group)
    if not isinstance(student, torch.Tensor):
        raise TypeError(f"student must be logits (a torch.Tensor or DTensor) or a StudentHidden, got "
                        f"{type(student).__name__}")
    if vocab_group is not None or vocab_size is not None or is_dtensor(student):
        return VocabParallelBackend(vocab_group, vocab_size)
    return PLAIN
