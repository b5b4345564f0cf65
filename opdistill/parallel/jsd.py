"""Vocab-parallel ``generalized_jsd``: student and teacher logits sharded the same way on the vocabulary dim.

The per-column math is the one divergence kernel (``ops.divergence``) applied to each chunk of columns (its sum over
the vocabulary splits into per-shard sums), run by the stages ``lse_and_gather``, ``jsd_totals`` and
``jsd_logit_grad`` (the fused two-head ops, which own their chunks, run the one-pass ``divergence_step``); only the log-softmax normalisers and the per-token totals cross ranks.
"""

from __future__ import annotations

import torch

from ..ops.checks import (check_finite_rows, check_logits, check_same_shape, check_temperature, check_unit_interval,
                          compute_dtype)
from .shard import VocabShard, resolve_shard
from .stages import jsd_logit_grad, jsd_totals, lse_and_gather


class VocabParallelGeneralizedJSD(torch.autograd.Function):
    """Per-token generalized JSD between full-vocabulary teacher nu and student pi, both sharded.

    Forward (xs, xt = this rank's student / teacher logits [N, Vl], s = log pi, t = log nu, both over z/tau):
        lse_s, lse_t   ``stages.lse_and_gather`` on (xs, xt): all-reduce MAX [N, 2], all-reduce SUM [N, 2]
        J, A           ``stages.jsd_totals``: all-reduce SUM [N, 2] of sum_j phi(s_j, t_j) and sum_j d phi / d s_j
    Backward (grad [N]):
        dJ/dxs_j = grad * (1/tau) * (a_j - pi_j * A)      ``stages.jsd_logit_grad``, from the saved logits
    The teacher is a constant: its logits get no gradient.  Saved: xs, xt (own dtype), lse [N, 2], A [N].
    Returns (J, lse) with lse non-differentiable (for validation).
    """

    @staticmethod
    def forward(ctx, xs, xt, shard: VocabShard, tau: float, beta: float):
        lse, _, _ = lse_and_gather(shard, (xs, xt), None, tau, compute_dtype(xs.dtype))  # [N, 2]: student, teacher
        totals = jsd_totals(shard, xs, xt, lse, tau, beta)  # [N, 2]: J, A
        ctx.save_for_backward(xs, xt, lse, totals[:, 1].clone())
        ctx.shard, ctx.tau, ctx.beta = shard, tau, beta
        ctx.mark_non_differentiable(lse)
        return totals[:, 0].clone(), lse

    @staticmethod
    def backward(ctx, grad, _grad_lse):
        xs, xt, lse, A = ctx.saved_tensors
        return jsd_logit_grad(ctx.shard, xs, xt, lse, A, grad, ctx.tau, ctx.beta), None, None, None, None


def vocab_parallel_generalized_jsd(
    local_student_logits: torch.Tensor,
    local_teacher_logits: torch.Tensor,
    *,
    group=None,
    vocab_size: int | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    validate: bool = True,
) -> torch.Tensor:
    """``generalized_jsd`` with both logits sharded the same way on the vocab dim; ``[..., V/tp]`` -> ``[...]``.

    beta = 0 is forward KL(teacher || student), beta = 1 reverse KL (TRL's endpoints).  Plain shards or DTensors
    (both the same kind and layout); ``group`` and ``vocab_size`` as in ``vocab_parallel_topk_divergence``.
    The teacher logits are treated as constants (no gradient).  ``validate`` as ``generalized_jsd`` (the op has no
    mask: zero masked rows first).  Returns fp32 (fp64 for fp64), same on every rank.
    """
    shard = resolve_shard(local_student_logits, group, vocab_size, "local_student_logits")
    t_shard = resolve_shard(local_teacher_logits, group, vocab_size, "local_teacher_logits")
    xs, xt = shard.local, t_shard.local.detach()
    check_logits(xs, "local_student_logits")
    check_logits(xt, "local_teacher_logits")
    check_same_shape(xs, "local_student_logits", xt, "local_teacher_logits")
    if (t_shard.start, t_shard.width, t_shard.size) != (shard.start, shard.width, shard.size):
        raise ValueError(
            "local_student_logits and local_teacher_logits must be sharded the same way: student columns "
            f"[{shard.start}, {shard.start + shard.width}) of {shard.size} shards, teacher "
            f"[{t_shard.start}, {t_shard.start + t_shard.width}) of {t_shard.size}"
        )
    check_unit_interval(beta, "beta")
    check_temperature(temperature)
    lead, v = tuple(xs.shape[:-1]), xs.shape[-1]
    out, lse = VocabParallelGeneralizedJSD.apply(
        xs.reshape(-1, v), xt.reshape(-1, v), shard, float(temperature), float(beta)
    )
    if validate:
        bad = ~torch.isfinite(lse)
        check_finite_rows(bad[:, 0].reshape(lead), "local_student_logits")
        check_finite_rows(bad[:, 1].reshape(lead), "local_teacher_logits")
    return out.reshape(lead)
