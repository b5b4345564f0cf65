"""``fused_generalized_jsd``: TRL's generalized JSD from student and teacher hidden states, chunked over tokens.

Per chunk: z_s = h_s W_s^T, z_t = h_t W_t^T (fp32), s = log_softmax(z_s / tau), t = log_softmax(z_t / tau), and the
per-token divergence is ``ops.jsd.jsd_from_logprobs(s, t, beta)`` -- the unfused op's own stage.  Forward keeps only
the per-token loss; backward recomputes each chunk and differentiates that chunk through ``jsd_from_logprobs``
with the incoming per-token gradient, then

    grad_h_s[chunk] = dL/dz_s @ W_s,    grad_W_s += dL/dz_s^T @ h_s[chunk]

so at most one chunk of student and teacher logits (and their autograd buffers) is alive.  The teacher gets no
gradient (as in TRL, where the teacher runs under no_grad); inputs that require one are refused.
"""

from __future__ import annotations

import torch

from ..ops.checks import check_finite_rows, check_temperature, check_unit_interval
from ..ops.jsd import jsd_from_logprobs
from ._chunks import (
    MIN_CHUNK_ROWS,
    check_chunk_size,
    chunk_logits,
    default_chunk_size,
    grad_hidden_mm,
    grad_weight_addmm_,
    needs_upcast,
)
from .logprobs import check_linear_inputs


def _chunk_logprobs(h, w, b, temperature):
    return torch.log_softmax(chunk_logits(h, w, b, temperature), dim=-1)


class FusedJSD(torch.autograd.Function):
    """-> (per-token JSD [N], bad [N, 2]: the student / teacher row holds a NaN log-prob, i.e. a non-finite
    log-sum-exp; non-differentiable, for ``validate``)."""

    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, beta, temperature, chunk_size):
        N = hs.shape[0]
        loss = torch.empty(N, dtype=torch.float64 if hs.dtype == torch.float64 else torch.float32, device=hs.device)
        bad = torch.empty((N, 2), dtype=torch.bool, device=hs.device)
        with torch.no_grad():
            for a in range(0, N, chunk_size):
                b = min(a + chunk_size, N)
                t = _chunk_logprobs(ht[a:b], wt, None, temperature)
                s = _chunk_logprobs(hs[a:b], ws, bs, temperature)
                loss[a:b] = jsd_from_logprobs(s, t, beta)
                bad[a:b, 0], bad[a:b, 1] = torch.isnan(s).any(-1), torch.isnan(t).any(-1)
                del s, t
        ctx.save_for_backward(hs, ws, bs, ht, wt)
        ctx.cfg = (beta, temperature, chunk_size)
        ctx.mark_non_differentiable(bad)
        return loss, bad

    @staticmethod
    def backward(ctx, grad_loss, _grad_bad):
        hs, ws, bs, ht, wt = ctx.saved_tensors
        beta, temperature, chunk_size = ctx.cfg
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        cd = grad_loss.dtype
        grad_h = torch.zeros(hs.shape, dtype=cd, device=hs.device) if need_h else None
        grad_w = torch.zeros(ws.shape, dtype=cd, device=ws.device) if need_w else None
        grad_b = torch.zeros(bs.shape, dtype=cd, device=bs.device) if need_b else None
        for a in range(0, hs.shape[0], chunk_size):
            b = min(a + chunk_size, hs.shape[0])
            with torch.no_grad():
                t = _chunk_logprobs(ht[a:b], wt, None, temperature)
                z = chunk_logits(hs[a:b], ws, bs, 1.0)
            z.requires_grad_(True)
            with torch.enable_grad():
                s = torch.log_softmax(z / temperature if temperature != 1.0 else z, dim=-1)
                (dz,) = torch.autograd.grad(jsd_from_logprobs(s, t, beta), z, grad_loss[a:b])  # [c, V] dL/dz_s
            del s, t, z
            with torch.no_grad():
                if need_h:
                    grad_h[a:b] = grad_hidden_mm(dz, ws)
                if need_w:
                    grad_weight_addmm_(grad_w, dz, hs[a:b], ws.dtype)
                if need_b:
                    grad_b += dz.sum(0)
            del dz
        return (grad_h.to(hs.dtype) if need_h else None, grad_w.to(ws.dtype) if need_w else None,
                grad_b.to(bs.dtype) if need_b else None, None, None, None, None, None)


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
    check_chunk_size(chunk_size)
    lead = tuple(student_hidden.shape[:-1])
    hs = student_hidden.reshape(-1, student_hidden.shape[-1])
    ht = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    if chunk_size is None:
        # a chunk holds student and teacher logits, their log-softmaxes and the JSD's autograd temporaries
        # (about four times the buffers of the top-k path): a quarter of the default rows
        rows = default_chunk_size(hs.shape[0], Vs, max(hs.shape[1], ht.shape[1]),
                                  upcast=needs_upcast(hs, student_weight))
        chunk_size = max(1, min(hs.shape[0], max(rows // 4, MIN_CHUNK_ROWS)))
    loss, bad = FusedJSD.apply(hs, student_weight, student_bias, ht, teacher_weight, float(beta), float(temperature),
                               int(chunk_size))
    if validate:
        check_finite_rows(bad[:, 0].reshape(lead), "student_hidden")
        check_finite_rows(bad[:, 1].reshape(lead), "teacher_hidden")
    return loss.reshape(lead)
