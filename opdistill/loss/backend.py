"""The three loss back-ends behind one interface, and the one place that picks one: ``select_backend``.

    plain            logits [..., V]                                                       opdistill.ops
    vocab-parallel   this rank's logits shard [..., V/tp] over vocab_group, or a DTensor   opdistill.parallel
    fused            StudentHidden: hidden states + lm_head (vocab_group: this rank's rows) opdistill.fused

Every op takes the student first and returns what the plain op returns for the same logits (per token):

    topk(student, ids, lp, *, temperature, support, divergence, beta, log_prob_min_clamp) -> TopKResult
    token_logprobs(student, ids, *, temperature) -> [...]
    jsd(student, teacher, keep, *, beta, temperature) -> [...]    teacher: a ``full_teacher``; masked rows (keep
                                                                  [..., 1] False) are zeroed on both sides first
    weighted_topk(student, ids, lp, weights, *, temperature, loss_max_clamp, ...) -> (sum_t w_t clamp(L_t), TopKResult)
        fused only (None elsewhere): the gradient of a known linear aggregation is computed in the forward pass.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from ..fused import (StudentHidden, TeacherHidden, fused_generalized_jsd, fused_token_logprobs, fused_topk_divergence,
                     fused_topk_loss)
from ..ops import generalized_jsd, token_logprobs, topk_divergence
from ..ops.checks import check_float
from ..parallel.shard import is_dtensor, zero_masked_rows
from ..parallel import vocab_parallel_generalized_jsd, vocab_parallel_token_logprobs, vocab_parallel_topk_divergence
from .signals import TeacherLogits


@dataclass(frozen=True)
class Backend:
    """The per-token ops of one back-end (module docstring); ``tokens(student)`` validates the student and returns
    its token dims (what the mask must match); ``full_teacher`` is the teacher signal type of loss_mode 'full'."""

    name: str
    tokens: Callable
    topk: Callable
    token_logprobs: Callable
    jsd: Callable
    full_teacher: type
    zero_rows: Callable
    weighted_topk: Callable | None = None

    def masked_token_logprobs(self, student, ids: torch.Tensor, keep: torch.Tensor, *, temperature: float):
        """``token_logprobs`` where ``keep``, 0 elsewhere. Masked positions may hold anything (padding ids, NaN
        logits or hidden states): their rows are zeroed and their ids read as 0 before the op, so nothing there
        reaches a value or a gradient."""
        safe_ids = torch.where(keep, ids, torch.zeros_like(ids))
        lp = self.token_logprobs(self.zero_rows(student, keep), safe_ids, temperature=temperature)
        return torch.where(keep, lp, 0.0)


# -- logits: plain and vocab-parallel --------------------------------------------------------------------------
def _logit_tokens(student) -> torch.Size:
    check_float(student, "student")
    return student.shape[:-1]


def _logits_jsd(op):
    def jsd(student, teacher: TeacherLogits, keep, *, beta, temperature):
        t = teacher.logits
        if t.shape != student.shape:
            raise ValueError(
                f"TeacherLogits.logits must have the shape of student {tuple(student.shape)}, got {tuple(t.shape)}"
            )
        return op(torch.where(keep, student, 0.0), torch.where(keep, t, 0.0), beta=beta, temperature=temperature)

    return jsd


PLAIN = Backend("plain", _logit_tokens, topk_divergence, token_logprobs, _logits_jsd(generalized_jsd), TeacherLogits,
                zero_masked_rows)


def vocab_parallel_backend(group=None, vocab_size: int | None = None) -> Backend:
    """Logits sharded on the vocabulary over ``group`` (Megatron layout; ``vocab_size``: the true vocabulary when the
    shards are padded), or DTensor logits with ``group=None``."""
    bind = dict(group=group, vocab_size=vocab_size)
    return Backend("vocab-parallel", _logit_tokens, functools.partial(vocab_parallel_topk_divergence, **bind),
                   functools.partial(vocab_parallel_token_logprobs, **bind),
                   _logits_jsd(functools.partial(vocab_parallel_generalized_jsd, **bind)), TeacherLogits,
                   zero_masked_rows)


# -- hidden states x lm_head: fused --------------------------------------------------------------------------------
def _on_hidden(op, group):
    """``op(hidden, weight, *args, bias=, group=, temperature=)`` as an op on a ``StudentHidden``, the lm_head's logit
    multiplier folded into the temperature."""
    return lambda s, *args, temperature, **kw: op(s.hidden, s.weight, *args, bias=s.bias, group=group,
                                                  temperature=s.temperature(temperature), **kw)


def _zero_hidden_rows(s: StudentHidden, keep: torch.Tensor) -> StudentHidden:
    return dataclasses.replace(s, hidden=torch.where(keep.unsqueeze(-1), s.hidden, 0.0))


def _fused_jsd(s: StudentHidden, t: TeacherHidden, keep, *, beta, temperature, group):
    if group is not None:
        raise ValueError(
            "loss_mode='full' with a vocabulary-sharded StudentHidden (vocab_group set) is not supported by the fused "
            "JSD; pass the sharded logits instead (the vocab-parallel back-end)"
        )
    if t.hidden.shape[:-1] != keep.shape[:-1]:
        raise ValueError(f"TeacherHidden.hidden must have shape {tuple(keep.shape[:-1]) + ('H',)}, got {tuple(t.hidden.shape)}")
    if s.logit_scale != t.logit_scale:
        raise ValueError(
            f"StudentHidden.logit_scale={s.logit_scale} and TeacherHidden.logit_scale={t.logit_scale} differ; the "
            "fused JSD applies one temperature to both sides"
        )
    return fused_generalized_jsd(torch.where(keep, s.hidden, 0.0), s.weight, torch.where(keep, t.hidden, 0.0),
                                 t.weight, beta=beta, temperature=s.temperature(temperature), student_bias=s.bias)


def fused_backend(group=None) -> Backend:
    """A ``StudentHidden`` student; ``group``: the process group its weight (and bias) rows are sharded over,
    contiguous and in rank order (None: the whole vocabulary is here)."""
    return Backend("fused", lambda s: s.hidden.shape[:-1], _on_hidden(fused_topk_divergence, group),
                   _on_hidden(fused_token_logprobs, group), functools.partial(_fused_jsd, group=group), TeacherHidden,
                   _zero_hidden_rows, _on_hidden(fused_topk_loss, group))


# -- the one dispatch ----------------------------------------------------------------------------------------------
def select_backend(student, *, vocab_group=None, vocab_size: int | None = None) -> Backend:
    """The back-end for ``student``: a ``StudentHidden`` -> fused (weight rows sharded over ``vocab_group`` when
    given); logits with ``vocab_group`` or ``vocab_size``, or a DTensor -> vocab-parallel; other logits -> plain."""
    if isinstance(student, StudentHidden):
        if vocab_size is not None:
            raise ValueError(
                f"vocab_size={vocab_size} describes padded logit shards; a StudentHidden's vocabulary is its weight's "
                "rows (over vocab_group): drop vocab_size"
            )
        return fused_backend(vocab_group)
    if not isinstance(student, torch.Tensor):
        raise TypeError(f"student must be logits (a torch.Tensor or DTensor) or a StudentHidden, got {type(student).__name__}")
    if vocab_group is not None or vocab_size is not None or is_dtensor(student):
        return vocab_parallel_backend(vocab_group, vocab_size)
    return PLAIN
