"""``fused_generalized_jsd`` and ``fused_jsd_loss``: TRL's generalized JSD (reverse and forward KL at beta = 1, 0)
between a student and a teacher given as hidden states and lm_heads, chunked over tokens, no ``[N, V]`` buffer.

Per chunk: z_s = h_s W_s^T (+ b_s), z_t = h_t W_t^T (+ b_t) (fp32), then ``parallel.stages.divergence_step`` on the
two chunks: both normalisers, J = sum_j phi(s_j, t_j) (the divergence of ``ops.divergence``) and, when asked, the
logit gradient in the student's chunk buffer, two exps per element and the rest in place. Both heads may be this
rank's contiguous vocabulary shard (``group``): the step all-reduces what crosses ranks (3 collectives per chunk),
and the hidden state's gradient is all-reduced once.

    dL/dz_s = grad * (1/tau) * (a - pi A),  a_j = d phi / d s_j,  A = sum_j a_j    (in place in the chunk buffer)
    grad_h_s[chunk] = dL/dz_s @ W_s,   grad_W_s += dL/dz_s^T @ h_s[chunk],   grad_b_s += sum_rows dL/dz_s

``fused_generalized_jsd`` keeps per token only J and the two lse and recomputes each chunk in backward (exact for
any use of the per-token values: 6 GEMMs per chunk). ``fused_jsd_loss`` is the supervised objective
sum_t w_t clamp(J_t) with the weights known in forward (the aggregation's, ``DistillationLoss``): the gradient is
computed while each chunk's logits are alive and only scaled in backward (Liger-Kernel's contract), so a chunk costs
the floor: the two logit GEMMs and the two gradient GEMMs. The teacher gets no gradient (as in TRL, where the teacher
runs under no_grad); inputs that require one are refused.
"""

from __future__ import annotations

import torch

from ..ops.checks import check_finite_rows, check_float, check_temperature, check_unit_interval, compute_dtype
from ..ops.divergence import canonical
from ..parallel.stages import divergence_step
from ._chunks import GEMM_ROWS, GEMM_ROWS_UPCAST, LinearGrads, chunk_logits, chunk_rows, needs_upcast
from .logprobs import check_linear_inputs, weight_shard


def _chunk(hs, ws, bs, ht, wt, bt, shard, a, b, temperature, beta, grad=None):
    """Rows [a, b) through ``divergence_step``: (J [c], lse [c, 2], dJ/dz_s [c, V] times ``grad``, or None)."""
    zs, zt = chunk_logits(hs[a:b], ws, bs, 1.0), chunk_logits(ht[a:b], wt, bt, 1.0)
    J, lse = divergence_step(shard, zs, zt, temperature, canonical("jsd", beta), beta, grad)
    return J, lse, (zs if grad is not None else None)


def _chunk_grads(grads, hs, ws, bs, ht, wt, bt, shard, g, beta, temperature, chunk_size):
    """Sum into ``grads`` every chunk's gradient for the incoming per-token gradient ``g`` [N] (logits recomputed)."""
    with torch.no_grad():
        for a in range(0, hs.shape[0], chunk_size):
            b = min(a + chunk_size, hs.shape[0])
            grads.add(slice(a, b), _chunk(hs, ws, bs, ht, wt, bt, shard, a, b, temperature, beta,
                                          lambda _J, a=a, b=b: g[a:b])[2])


class FusedJSD(torch.autograd.Function):
    """-> (per-token JSD [N], lse [N, 2] of the student / teacher logits over tau, non-differentiable)."""

    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, shard, beta, temperature, chunk_size):
        N, cd = hs.shape[0], compute_dtype(hs.dtype)
        J = torch.empty(N, dtype=cd, device=hs.device)
        lse = torch.empty((N, 2), dtype=cd, device=hs.device)
        with torch.no_grad():
            for a in range(0, N, chunk_size):
                b = min(a + chunk_size, N)
                J[a:b], lse[a:b], _ = _chunk(hs, ws, bs, ht, wt, bt, shard, a, b, temperature, beta)
        ctx.save_for_backward(hs, ws, bs, ht, wt, bt)
        ctx.cfg = (beta, temperature, chunk_size, shard, cd)
        ctx.mark_non_differentiable(lse)
        return J, lse

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse):
        hs, ws, bs, ht, wt, bt = ctx.saved_tensors
        beta, temperature, chunk_size, shard, cd = ctx.cfg
        grads = LinearGrads(hs, ws, bs, ctx.needs_input_grad[:3], cd)
        _chunk_grads(grads, hs, ws, bs, ht, wt, bt, shard, grad_loss.to(cd), beta, temperature, chunk_size)
        return grads.result(shard) + (None,) * 7


class FusedJSDLoss(torch.autograd.Function):
    """(o [N] = w_t clamp(J_t), J [N], lse [N, 2]): the gradient of sum_t o_t computed in forward (module docstring);
    backward scales it by the incoming gradient when that is one value on every live row, else recomputes."""

    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, weights, shard, live, beta, temperature, chunk_size, clamp):
        N, cd = hs.shape[0], compute_dtype(hs.dtype)
        grads = LinearGrads(hs, ws, bs, ctx.needs_input_grad[:3], cd)
        J = torch.empty(N, dtype=cd, device=hs.device)
        g = torch.zeros(N, dtype=cd, device=hs.device)  # d o_t / d J_t
        lse = torch.empty((N, 2), dtype=cd, device=hs.device)
        need = any(ctx.needs_input_grad[:3])
        with torch.no_grad():
            for a in range(0, N, chunk_size):
                b = min(a + chunk_size, N)

                def g_of(j, a=a, b=b):  # d (w clamp(J)) / dJ, once J is known
                    inside = torch.ones_like(j, dtype=torch.bool) if clamp is None else j.abs() <= clamp
                    g[a:b] = torch.where(live[a:b] & inside, weights[a:b], 0.0)
                    return g[a:b]

                J[a:b], lse[a:b], dz = _chunk(hs, ws, bs, ht, wt, bt, shard, a, b, temperature, beta,
                                              g_of if need else None)
                if need:
                    grads.add(slice(a, b), dz)
                del dz
        o = weights * (J if clamp is None else J.clamp(-clamp, clamp))
        ctx.grads = grads
        ctx.save_for_backward(hs, ws, bs, ht, wt, bt, g, live)
        ctx.cfg = (beta, temperature, chunk_size, shard, cd)
        ctx.mark_non_differentiable(J, lse)
        return o, J, lse

    @staticmethod
    def backward(ctx, grad_o, _grad_J, _grad_lse):
        hs, ws, bs, ht, wt, bt, g, live = ctx.saved_tensors
        beta, temperature, chunk_size, shard, cd = ctx.cfg
        grads, ctx.grads = ctx.grads, None  # this Function's own buffers, used once: scaled in place
        u = grad_o[live]
        if grads is not None and (not u.numel() or bool((u == u[0]).all())):
            c = u[0] if u.numel() else grad_o.new_zeros(())
            for x in grads.grads:
                if x is not None:
                    x.mul_(c.to(x.dtype))
            return grads.result(shard) + (None,) * 10
        grads = LinearGrads(hs, ws, bs, ctx.needs_input_grad[:3], cd)
        _chunk_grads(grads, hs, ws, bs, ht, wt, bt, shard, g * torch.where(live, grad_o, 0.0).to(cd), beta,
                     temperature, chunk_size)
        return grads.result(shard) + (None,) * 10


def _jsd_inputs(student_hidden, student_weight, teacher_hidden, teacher_weight, student_bias, teacher_bias, beta,
                temperature, chunk_size, group):
    """Every check, then (shard, lead, hs [N, H_s], ht [N, H_t], chunk size)."""
    Vs = check_linear_inputs(student_hidden, student_weight, student_bias, hidden_name="student_hidden",
                             weight_name="student_weight", bias_name="student_bias")
    Vt = check_linear_inputs(teacher_hidden, teacher_weight, teacher_bias, hidden_name="teacher_hidden",
                             weight_name="teacher_weight", bias_name="teacher_bias")
    if Vs != Vt:
        raise ValueError(
            f"student_weight has V={Vs} rows but teacher_weight has V={Vt}; the JSD needs one shared vocabulary"
            + (" (with a group: the same rows of it on this rank)" if group is not None else "")
        )
    if tuple(student_hidden.shape[:-1]) != tuple(teacher_hidden.shape[:-1]):
        raise ValueError(
            f"student_hidden and teacher_hidden must have the same leading dims, got {tuple(student_hidden.shape)} "
            f"and {tuple(teacher_hidden.shape)}"
        )
    if compute_dtype(student_hidden.dtype) != compute_dtype(teacher_hidden.dtype):
        raise TypeError(f"teacher_hidden dtype {teacher_hidden.dtype} and student_hidden dtype {student_hidden.dtype}: "
                        f"float64 only with float64 (bf16/fp16/fp32 may mix; they are computed in fp32)")
    for name, x in (("teacher_hidden", teacher_hidden), ("teacher_weight", teacher_weight),
                    ("teacher_bias", teacher_bias)):
        if x is not None and x.requires_grad:
            raise ValueError(
                f"{name} requires grad, but the teacher gets no gradient from this loss; pass {name}.detach() "
                "(or compute the teacher under torch.no_grad())"
            )
    check_unit_interval(beta, "beta")
    check_temperature(temperature)
    # a chunk holds student and teacher logits and one or two exps (at V = 151,936 and the automatic 512 rows:
    # 1.2 GiB); the chunk is tall enough for the GEMMs to run at their rate (GEMM_ROWS)
    tall = GEMM_ROWS_UPCAST if needs_upcast(student_hidden, student_weight) else GEMM_ROWS
    chunk_size = chunk_rows(chunk_size, student_hidden, student_weight,
                            max(student_hidden.shape[-1], teacher_hidden.shape[-1]), buffers=2, min_rows=tall)
    shard = weight_shard(student_weight, group)
    lead = tuple(student_hidden.shape[:-1])
    return (shard, lead, student_hidden.reshape(-1, student_hidden.shape[-1]),
            teacher_hidden.reshape(-1, teacher_hidden.shape[-1]), chunk_size)


def _validate(lse, lead, live=None):
    bad = ~torch.isfinite(lse)
    if live is not None:
        bad = bad & live[:, None]
    check_finite_rows(bad[:, 0].reshape(lead), "student_hidden")
    check_finite_rows(bad[:, 1].reshape(lead), "teacher_hidden")


def fused_generalized_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    group=None,
    validate: bool = True,
) -> torch.Tensor:
    """``generalized_jsd(student_hidden @ student_weight.T + b_s, teacher_hidden @ teacher_weight.T + b_t, beta,
    temperature)`` per token, without a ``[N, V]`` buffer.

    Args:
        student_hidden: ``[..., H_s]``; student_weight: ``[V, H_s]`` (differentiable).
        teacher_hidden: ``[..., H_t]`` (same leading dims); teacher_weight: ``[V, H_t]`` (same V; no gradient).
        beta: 0 = forward KL(teacher || student), 1 = reverse KL(student || teacher), TRL's mixture in between.
        temperature: divides both logits.  student_bias / teacher_bias: ``[V]`` lm_head biases or None.
        chunk_size: tokens per chunk (None: automatic).
        group: the process group both weights' rows are sharded over, contiguous and in rank order (None: the whole
            vocabulary is here).
        validate: refuse a row whose student (``student_hidden``) or teacher (``teacher_hidden``) logits are not
            finite, naming the first such position; False skips this check.  No mask: zero masked rows first.
    Returns ``[...]`` in fp32 (fp64 for fp64 inputs), the same on every rank of ``group``.
    """
    shard, lead, hs, ht, chunk_size = _jsd_inputs(student_hidden, student_weight, teacher_hidden, teacher_weight,
                                                  student_bias, teacher_bias, beta, temperature, chunk_size, group)
    loss, lse = FusedJSD.apply(hs, student_weight, student_bias, ht, teacher_weight, teacher_bias, shard, float(beta),
                               float(temperature), int(chunk_size))
    if validate:
        _validate(lse, lead)
    return loss.reshape(lead)


def fused_jsd_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    token_weights: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    loss_max_clamp: float | None = None,
    chunk_size: int | None = None,
    group=None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_t token_weights_t * clamp(J_t, -c, c), the per-token J ``[...]`` detached), J as
    ``fused_generalized_jsd``; the gradient of the objective (w.r.t. the student's hidden states, weight and bias)
    is computed in the forward pass, chunk by chunk, and only scaled in backward.

    ``token_weights`` ``[...]``: each token's weight in the objective (the aggregation's: mask * D / N for
    token-mean, ...; 0 at masked rows, which reach no gradient); not differentiated. ``loss_max_clamp``: clamp each
    per-token J to [-c, c] before weighting (None: off).
    """
    shard, lead, hs, ht, chunk_size = _jsd_inputs(student_hidden, student_weight, teacher_hidden, teacher_weight,
                                                  student_bias, teacher_bias, beta, temperature, chunk_size, group)
    check_float(token_weights, "token_weights")
    if tuple(token_weights.shape) != lead:
        raise ValueError(f"token_weights must have shape {lead} (the leading dims of student_hidden), got "
                         f"{tuple(token_weights.shape)}")
    if loss_max_clamp is not None and (isinstance(loss_max_clamp, bool) or not isinstance(loss_max_clamp, (int, float))
                                       or not loss_max_clamp > 0 or loss_max_clamp == float("inf")):
        raise ValueError(f"loss_max_clamp must be a finite number > 0 or None, got {loss_max_clamp!r}")
    w = token_weights.reshape(-1).detach().to(compute_dtype(hs.dtype))
    live = w != 0
    o, J, lse = FusedJSDLoss.apply(hs, student_weight, student_bias, ht, teacher_weight, teacher_bias, w, shard, live,
                                   float(beta), float(temperature), int(chunk_size),
                                   None if loss_max_clamp is None else float(loss_max_clamp))
    if validate:
        _validate(lse, lead, live)
    return o.sum(), J.reshape(lead)
