"""Vocab-parallel ``generalized_jsd``: student and teacher logits sharded the same way on the vocabulary dim.

The per-column math is ``ops.jsd.jsd_from_logprobs`` applied to each chunk of columns (its sum over the vocabulary
splits into per-shard sums); only the log-softmax normalisers and the per-token totals cross ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops.checks import (
    check_finite_rows,
    check_logits,
    check_same_shape,
    check_temperature,
    check_unit_interval,
    compute_dtype,
)
from ..ops.divergence import divergence_grad
from ..ops.jsd import jsd_from_logprobs
from .shard import VocabShard, all_reduce_, resolve_shard, row_chunks
from .stages import lse_and_gather, scaled


def jsd_logprob_grad(s: torch.Tensor, t: torch.Tensor, beta: float) -> torch.Tensor:
    """a_j = d/ds_j of the summand of ``jsd_from_logprobs(s, t, beta)``: ``ops.divergence.divergence_grad``."""
    return divergence_grad(t, s, "jsd", beta)


def _chunk_terms(xs, xt, lse, rows, w, tau, dtype, beta):
    """(per-token JSD of this chunk's columns [n], a = d(that)/ds [n, w], s [n, w]) via the single-device kernel."""
    s = scaled(xs[rows, :w], tau, dtype) - lse[rows, 0:1]
    t = scaled(xt[rows, :w], tau, dtype) - lse[rows, 1:2]
    return jsd_from_logprobs(s, t, beta), jsd_logprob_grad(s, t, beta), s


class VocabParallelGeneralizedJSD(torch.autograd.Function):
    """Per-token generalized JSD between full-vocabulary teacher nu and student pi, both sharded.

    Forward (xs, xt = this rank's student / teacher logits [N, Vl], s = log pi, t = log nu, both over z/tau):
        lse_s, lse_t   ``stages.lse_and_gather`` on (xs, xt): all-reduce MAX [N, 2], all-reduce SUM [N, 2]
        J              = all-reduce SUM over ranks of sum_{j local} phi(s_j, t_j)                   [N]
        A              = all-reduce SUM of sum_{j local} a_j,  a_j = d phi / d s_j              (same message as J)
    phi is the summand of ``jsd_from_logprobs`` and a_j its partial in s_j (``ops.divergence.divergence_grad``).
    Backward (grad [N]):
        dJ/dxs_j = grad * (1/tau) * (a_j - pi_j * A)      chunk-wise from the saved logits; no collective
    The teacher is a constant: its logits get no gradient.  Saved: xs, xt (own dtype), lse [N, 2], A [N].
    Returns (J, lse) with lse non-differentiable (for validation).
    """

    @staticmethod
    def forward(ctx, xs, xt, shard: VocabShard, tau: float, beta: float):
        dtype = compute_dtype(xs.dtype)
        n, w = xs.shape[0], shard.width
        lse, _, _ = lse_and_gather(shard, (xs, xt), None, tau, dtype)  # [N, 2]: student, teacher
        totals = torch.zeros((n, 2), dtype=dtype, device=xs.device)  # [N, 2]: J, A
        for rows in row_chunks(n, w) if w > 0 else ():
            val, a, _ = _chunk_terms(xs, xt, lse, rows, w, tau, dtype, beta)
            totals[rows, 0] = val
            totals[rows, 1] = a.sum(-1)
        all_reduce_(totals, dist.ReduceOp.SUM, shard)  # collective 3
        ctx.save_for_backward(xs, xt, lse, totals[:, 1].clone())
        ctx.shard, ctx.tau, ctx.beta = shard, tau, beta
        ctx.mark_non_differentiable(lse)
        return totals[:, 0].clone(), lse

    @staticmethod
    def backward(ctx, grad, _grad_lse):
        xs, xt, lse, A = ctx.saved_tensors
        shard, tau, w = ctx.shard, ctx.tau, ctx.shard.width
        out = torch.zeros_like(xs)
        if w > 0:
            grad = grad.to(lse.dtype)
            for rows in row_chunks(xs.shape[0], w):
                _, a, s = _chunk_terms(xs, xt, lse, rows, w, tau, lse.dtype, ctx.beta)
                g = grad[rows, None] * (a - torch.exp(s) * A[rows, None])  # log-softmax backward, A all-reduced
                if tau != 1.0:
                    g = g / tau
                out[rows, :w] = g.to(xs.dtype)
        return out, None, None, None, None


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
