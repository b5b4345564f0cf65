"""``fused_generalized_jsd``: TRL's generalized JSD from student and teacher hidden states, chunked over tokens.

Per chunk: z_s = h_s W_s^T (+ b), z_t = h_t W_t^T (fp32), then the vocab-sharded stages that the vocab-parallel JSD
runs, on a one-shard ``VocabShard`` (no collective): ``lse_and_gather`` on (z_s, z_t) for both normalisers,
``jsd_totals`` for J = sum_j phi(s_j, t_j) and A = sum_j d phi / d s_j (the one kernel of ``ops.divergence``).
Forward keeps per token only J, A and the two lse; backward recomputes each chunk and applies the analytic gradient
(``jsd_logit_grad``, in place in the chunk buffer), then

    dL/dz_s = grad * (1/tau) * (a - pi A),   grad_h_s[chunk] = dL/dz_s @ W_s,    grad_W_s += dL/dz_s^T @ h_s[chunk]

so at most one chunk of student and teacher logits is alive.  The teacher gets no gradient (as in TRL, where the
teacher runs under no_grad); inputs that require one are refused.
"""

from __future__ import annotations

import torch

from ..ops.checks import check_finite_rows, check_temperature, check_unit_interval, compute_dtype
from ..parallel.shard import VocabShard
from ..parallel.stages import jsd_logit_grad, jsd_totals, lse_and_gather
from ._chunks import LinearGrads, chunk_logits, chunk_rows
from .logprobs import check_linear_inputs


class FusedJSD(torch.autograd.Function):
    """-> (per-token JSD [N], lse [N, 2] of the student / teacher logits over tau, non-differentiable)."""

    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, beta, temperature, chunk_size):
        N, cd = hs.shape[0], compute_dtype(hs.dtype)
        shard = VocabShard.for_rows(ws.shape[0], None, ws.device)  # the whole vocabulary: no collective
        totals = torch.empty((N, 2), dtype=cd, device=hs.device)  # J, A
        lse = torch.empty((N, 2), dtype=cd, device=hs.device)
        with torch.no_grad():
            for a in range(0, N, chunk_size):
                b = min(a + chunk_size, N)
                zs, zt = chunk_logits(hs[a:b], ws, bs, 1.0), chunk_logits(ht[a:b], wt, None, 1.0)
                lse[a:b] = lse_and_gather(shard, (zs, zt), None, temperature, cd)[0]
                totals[a:b] = jsd_totals(shard, zs, zt, lse[a:b], temperature, beta)
                del zs, zt
        ctx.save_for_backward(hs, ws, bs, ht, wt, lse, totals[:, 1].clone())
        ctx.cfg = (beta, temperature, chunk_size, shard)
        ctx.mark_non_differentiable(lse)
        return totals[:, 0].clone(), lse

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse):
        hs, ws, bs, ht, wt, lse, A = ctx.saved_tensors
        beta, temperature, chunk_size, shard = ctx.cfg
        grads = LinearGrads(hs, ws, bs, ctx.needs_input_grad[:3], lse.dtype)
        with torch.no_grad():
            for a in range(0, hs.shape[0], chunk_size):
                b = min(a + chunk_size, hs.shape[0])
                zs, zt = chunk_logits(hs[a:b], ws, bs, 1.0), chunk_logits(ht[a:b], wt, None, 1.0)
                dz = jsd_logit_grad(shard, zs, zt, lse[a:b], A[a:b], grad_loss[a:b], temperature, beta,
                                    out=zs)  # [c, V] dL/dz_s
                grads.add(slice(a, b), dz)
                del zs, zt, dz
        return grads.result() + (None,) * 5


def fused_generalized_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    student_bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """``generalized_jsd(student_hidden @ student_weight.T, teacher_hidden @ teacher_weight.T, beta, temperature)``
    per token, without a ``[N, V]`` buffer.

    Args:
        student_hidden: ``[..., H_s]``; student_weight: ``[V, H_s]`` (differentiable).
        teacher_hidden: ``[..., H_t]`` (same leading dims); teacher_weight: ``[V, H_t]`` (same V; no gradient).
        beta: 0 = forward KL(teacher || student), 1 = reverse KL(student || teacher), TRL's mixture in between.
        temperature: divides both logits.  student_bias: ``[V]`` lm_head bias or None (differentiable).
        chunk_size: tokens per chunk (None: automatic).
        validate: refuse a row whose student (``student_hidden``) or teacher (``teacher_hidden``) logits are not
            finite, naming the first such position; False skips this check.  No mask: zero masked rows first.
    Returns ``[...]`` in fp32 (fp64 for fp64 inputs).
    """
    Vs = check_linear_inputs(student_hidden, student_weight, student_bias, hidden_name="student_hidden",
                             weight_name="student_weight", bias_name="student_bias")
    Vt = check_linear_inputs(teacher_hidden, teacher_weight, None, hidden_name="teacher_hidden",
                             weight_name="teacher_weight")
    if Vs != Vt:
        raise ValueError(
            f"student_weight has V={Vs} rows but teacher_weight has V={Vt}; the JSD needs one shared vocabulary"
        )
    if tuple(student_hidden.shape[:-1]) != tuple(teacher_hidden.shape[:-1]):
        raise ValueError(
            f"student_hidden and teacher_hidden must have the same leading dims, got {tuple(student_hidden.shape)} "
            f"and {tuple(teacher_hidden.shape)}"
        )
    if student_hidden.dtype != teacher_hidden.dtype:
        raise TypeError(f"teacher_hidden dtype {teacher_hidden.dtype} must match student_hidden dtype {student_hidden.dtype}")
    for name, x in (("teacher_hidden", teacher_hidden), ("teacher_weight", teacher_weight)):
        if x.requires_grad:
            raise ValueError(
                f"{name} requires grad, but the teacher gets no gradient from this loss; pass {name}.detach() "
                "(or compute the teacher under torch.no_grad())"
            )
    check_unit_interval(beta, "beta")
    check_temperature(temperature)
    # a chunk holds student and teacher logits: two chunk-sized buffers where the top-k path holds one
    chunk_size = chunk_rows(chunk_size, student_hidden, student_weight,
                            max(student_hidden.shape[-1], teacher_hidden.shape[-1]), buffers=2)
    lead = tuple(student_hidden.shape[:-1])
    hs = student_hidden.reshape(-1, student_hidden.shape[-1])
    ht = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    loss, lse = FusedJSD.apply(hs, student_weight, student_bias, ht, teacher_weight, float(beta), float(temperature),
                               int(chunk_size))
    if validate:
        bad = ~torch.isfinite(lse)
        check_finite_rows(bad[:, 0].reshape(lead), "student_hidden")
        check_finite_rows(bad[:, 1].reshape(lead), "teacher_hidden")
    return loss.reshape(lead)
