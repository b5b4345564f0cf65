"""``fused_topk_divergence`` and ``fused_topk_loss``: the top-k divergences of ``ops.topk`` from hidden states and the
lm_head weight, gradients computed in the forward pass.

The same named stages as ``topk_divergence``, with stage 1 (``student_logprobs_at``) replaced by the vocab-sharded
stages on each chunk of z = h W^T (``chunk_stages``): s = log pi(T) ``[N, K]`` and the student's own top-K ids.
``topk_loss_from_logprobs`` and ``finish_topk`` run unchanged on ``[N, K]`` tensors, so every support x divergence,
the clamps and the diagnostics are the unfused op's by construction.  Masked rows (all K slots empty) are zeroed in
hidden before the chunks: they reach no gradient of hidden or weight.

The gradient of every chunk is computed while its logits are alive (Liger-Kernel's contract), for a per-token
objective o_t (L_t; for ``fused_topk_loss``, w_t clamp(L_t)) and an incoming gradient u_t = 1:

    forward, per chunk:  z, lse, s = log pi(T);  g = d o_t / ds_t  (autograd on [c, K]);
                         dL/dz = (1/tau) (scatter(g) - (sum_k g_k) pi)  in place;
                         tail: the rest log(1 - Q) = log sum_{j not in T} e^{z_j - m} - log S is one more per-row
                         sum of the chunk pass; g_r = d o_t / d log(1 - Q) adds
                         (1/tau) g_r ([j not in T] pi_j / (1 - Q) - pi_j)
                         grad_h[chunk] = dL/dz W,   grad_W += dL/dz^T h,   grad_b += sum_rows dL/dz
    backward:            u is one value c on every live row (a sum or mean of the per-token losses, the weighted
                         objective): the stored gradients times c, no GEMM;  otherwise each chunk is recomputed with
                         g_t u_t (``recompute_grads``, one GEMM more per chunk: exact for any use of the loss)

Three GEMMs per chunk (the floor) for a sum or mean.  Call it under ``torch.no_grad()`` when the loss is not
differentiated (metrics, advantages): the forward then does no gradient work.
"""

from __future__ import annotations

import torch

from ..ops.checks import check_float, check_topk_inputs, compute_dtype
from ..ops.topk import TopKResult, finish_topk, topk_loss_from_logprobs
from ..parallel.stages import logit_grad
from ._chunks import LinearGrads, chunk_rows
from .logprobs import check_fused_rows, check_linear_inputs, chunk_stages, recompute_grads, weight_shard


class FusedTopKObjective(torch.autograd.Function):
    """(hidden [N, H], weight, bias, ids [N, K]) -> (o [N], s [N, K], top ids [N, k], lse [N]), the last three
    detached; ``objective(s, a, b, rest)`` is o of rows [a, b) from their s and (``tail``) their rest log-mass
    log(1 - Q), summed directly outside T in the chunk pass (else None) (module docstring).  ``reduced``: the caller
    sums o (its incoming gradient is uniform), so the gradients are reduced over the group and cast in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, shard, live, objective, temperature, chunk_size, student_topk, reduced,
                slots, tail):
        N, cd = hidden.shape[0], compute_dtype(hidden.dtype)
        grads = LinearGrads(hidden, weight, bias, ctx.needs_input_grad[:3], cd)
        out = torch.empty(N, dtype=cd, device=hidden.device)
        s_all, g_all = torch.empty(ids.shape, dtype=cd, device=hidden.device), torch.zeros_like(ids, dtype=cd)
        lse_all = torch.empty(N, dtype=cd, device=hidden.device)
        rest_all = torch.empty(N if tail else 0, dtype=cd, device=hidden.device)  # log(1 - Q) [N]
        g_rest_all = torch.zeros(N if tail else 0, dtype=cd, device=hidden.device)  # d o_t / d log(1 - Q)
        top = torch.empty((N, student_topk), dtype=torch.int64, device=hidden.device)
        for a in range(0, N, chunk_size):
            b = min(a + chunk_size, N)
            scale = torch.empty(b - a, dtype=cd, device=hidden.device)  # pi = z * scale after the stages
            with torch.no_grad():
                z, top[a:b], lse_all[a:b], s_all[a:b], _ = chunk_stages(shard, hidden[a:b], weight, bias, ids[a:b],
                                                                        temperature, cd, student_topk, keep_exp=scale,
                                                                        rest_slots=slots[a:b] if tail else None,
                                                                        rest_out=rest_all[a:b] if tail else None)
            need = any(ctx.needs_input_grad[:3])
            s = s_all[a:b].clone().requires_grad_(need)
            r = rest_all[a:b].clone().requires_grad_(need) if tail else None
            with torch.enable_grad():
                o = objective(s, a, b, r)
                if s.requires_grad:  # [c, K] d o_t / d s_t, [c] d o_t / d log(1 - Q_t); dead rows: none
                    gs = torch.autograd.grad(o.sum(), [s, r] if tail else [s], allow_unused=True)
                    g_all[a:b] = torch.where(live[a:b, None], gs[0], 0.0)
                    if tail and gs[1] is not None:
                        g_rest_all[a:b] = torch.where(live[a:b], gs[1], 0.0)
            out[a:b] = o.detach()
            if s.requires_grad:
                with torch.no_grad():  # dL/dz in place in the chunk buffer [c, V_local]
                    grads.add(slice(a, b), logit_grad(shard, z, ids[a:b], lse_all[a:b], g_all[a:b], temperature,
                                                      out=z, pi_scale=scale,
                                                      g_rest=g_rest_all[a:b] if tail else None,
                                                      log_rest=rest_all[a:b] if tail else None,
                                                      rest_slots=slots[a:b] if tail else None))
            del z
        ctx.grads = grads.result(shard) if reduced else grads
        ctx.save_for_backward(hidden, weight, bias, ids, lse_all, g_all, live, rest_all, g_rest_all, slots)
        ctx.cfg = (shard, temperature, chunk_size, tail)
        ctx.mark_non_differentiable(s_all, top, lse_all, rest_all)
        return out, s_all, top, lse_all, rest_all

    @staticmethod
    def backward(ctx, grad_out, _grad_s, _grad_top, _grad_lse, _grad_rest):
        hidden, weight, bias, ids, lse, g, live, rest, g_rest, slots = ctx.saved_tensors
        shard, temperature, chunk_size, tail = ctx.cfg
        grads, ctx.grads = ctx.grads, None  # this Function's own buffers, used once: scaled in place
        u = grad_out[live]
        if grads is not None and (not u.numel() or bool((u == u[0]).all())):
            c = u[0] if u.numel() else grad_out.new_zeros(())
            if isinstance(grads, tuple):
                return tuple(None if x is None else x.mul_(c.to(x.dtype)) for x in grads) + (None,) * 10
            for x in grads.grads:
                if x is not None:
                    x.mul_(c.to(x.dtype))
            return grads.result(shard) + (None,) * 10
        # per-token gradients that differ between rows (or a second backward): recompute with g_t u_t
        grads = LinearGrads(hidden, weight, bias, ctx.needs_input_grad[:3], lse.dtype)
        u = torch.where(live, grad_out, 0.0).to(g.dtype)
        recompute_grads(grads, shard, ids, lse, g * u[:, None], temperature, chunk_size,
                        g_rest=g_rest * u if tail else None, log_rest=rest if tail else None,
                        rest_slots=slots if tail else None)
        return grads.result(shard) + (None,) * 10


def topk_inputs(hidden, weight, bias, teacher_ids, teacher_logprobs, chunk_size, group, temperature, validate, kw):
    """Every check of the fused top-k ops, then (shard, lead, hidden [N, H] with the masked rows zeroed, ids [N, K],
    teacher log-probs [N, K] (compute dtype), live [N]: the rows with a non-empty slot; the others reach no
    gradient, chunk size)."""
    check_linear_inputs(hidden, weight, bias)
    chunk_size = chunk_rows(chunk_size, hidden, weight)
    shard = weight_shard(weight, group)
    check_topk_inputs(None, teacher_ids, teacher_logprobs, temperature=temperature, vocab_size=shard.vocab_size,
                      validate=validate, **kw)
    lead = tuple(hidden.shape[:-1])
    if teacher_ids.dim() != hidden.dim() or tuple(teacher_ids.shape[:-1]) != lead:
        raise ValueError(
            f"teacher_ids must have shape {lead + ('K',)} (the leading dims of hidden {tuple(hidden.shape)} plus K), "
            f"got {tuple(teacher_ids.shape)}"
        )
    K = teacher_ids.shape[-1]
    t = teacher_logprobs.reshape(-1, K)
    live = (t > float("-inf")).any(-1)
    h2 = torch.where(live[:, None], hidden.reshape(-1, hidden.shape[-1]), 0.0)
    return shard, lead, h2, teacher_ids.reshape(-1, K).long(), t.to(compute_dtype(hidden.dtype)), live, chunk_size


def _run(objective, reduced, hidden, weight, bias, ids, shard, live, lead, chunk_size, temperature, validate, t, tail):
    """The Function on checked inputs -> (o [N], s, top ids, rest log-mass [N] (empty unless ``tail``)); refuses
    non-finite live rows when ``validate``."""
    if not torch.is_grad_enabled():  # evaluation: no gradient work in the forward pass
        hidden, weight = hidden.detach(), weight.detach()
        bias = None if bias is None else bias.detach()
    o, s, top, lse, rest = FusedTopKObjective.apply(hidden, weight, bias, ids, shard, live, objective,
                                                    float(temperature), int(chunk_size), ids.shape[1], reduced,
                                                    t > float("-inf"), tail)
    if validate:
        check_fused_rows(lse, live, hidden, lead)
    return o, s, top, (rest if tail else None)


def fused_topk_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    support: str = "truncated",
    divergence: str = "forward",
    beta: float = 0.5,
    log_prob_min_clamp: float | None = None,
    temperature: float = 1.0,
    group=None,
    validate: bool | str = True,
) -> TopKResult:
    """``topk_divergence(hidden @ weight.T + bias, teacher_ids, teacher_logprobs, ...)`` without a ``[N, V]`` buffer.

    Args:
        hidden: ``[..., H]`` student final hidden states (any leading dims, matching the teacher's).
        weight: student lm_head weight ``[V, H]`` (tied embeddings: the embedding matrix); with ``group``, this
            rank's contiguous vocabulary shard ``[V_local, H]``, ranks in order.
        teacher_ids, teacher_logprobs: ``[..., K]`` as for ``topk_divergence`` (``-inf`` = empty slot).
        bias: ``[V]`` lm_head bias or None.
        chunk_size: tokens per chunk; None picks ``default_chunk_size(N, V, H)`` (about 128 MiB of fp32 logits).
        support, divergence, beta, log_prob_min_clamp, temperature: exactly as ``topk_divergence``.
        group: process group the weight is vocabulary-sharded over (None: the whole vocabulary is here).
        validate: refuse non-finite logits in a row with a non-empty slot (``ValueError`` naming ``hidden`` and the
            first such position); False skips this value check for hot loops; as ``topk_divergence`` otherwise.
    bf16/fp16 inputs: logits are accumulated and kept in fp32 (never rounded to bf16 first), gradients are
    accumulated in fp32 and returned in the input dtype.  Returns a ``TopKResult`` of per-token tensors; ``loss``
    is differentiable with respect to hidden, weight and bias (see the module docstring for what a backward costs).
    """
    kw = dict(support=support, divergence=divergence, beta=beta, log_prob_min_clamp=log_prob_min_clamp)
    shard, lead, h2, ids, t, live, chunk_size = topk_inputs(hidden, weight, bias, teacher_ids, teacher_logprobs,
                                                            chunk_size, group, temperature, validate, kw)
    loss, s, top, _ = _run(lambda s, a, b, r: topk_loss_from_logprobs(s, t[a:b], student_rest=r, **kw), False, h2,
                           weight, bias, ids, shard, live, lead, chunk_size, temperature, validate, t,
                           support == "tail")
    return finish_topk(loss, s, t, ids, top, log_prob_min_clamp, lead)


def fused_topk_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    token_weights: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    support: str = "truncated",
    divergence: str = "forward",
    beta: float = 0.5,
    log_prob_min_clamp: float | None = None,
    temperature: float = 1.0,
    loss_max_clamp: float | None = None,
    group=None,
    validate: bool | str = True,
) -> tuple[torch.Tensor, TopKResult]:
    """(sum_t token_weights_t * clamp(L_t, -c, c), per-token ``TopKResult``), L_t as ``fused_topk_divergence``.

    The objective ``aggregate`` computes in supervised mode (weights = D / N on valid tokens for token-mean, etc.).
    Args: as ``fused_topk_divergence``, plus
        token_weights: ``[...]`` (the leading dims of hidden) weight of each token in the objective, e.g.
            mask * D / N for token-mean; not differentiated.
        loss_max_clamp: clamp each per-token loss to [-c, c] before weighting (None: off).
    Returns the scalar objective (differentiable w.r.t. hidden, weight, bias; its gradient was computed in the
    forward pass and reduced over ``group`` there) and the detached per-token results (``loss`` unclamped).
    """
    kw = dict(support=support, divergence=divergence, beta=beta, log_prob_min_clamp=log_prob_min_clamp)
    shard, lead, h2, ids, t, live, chunk_size = topk_inputs(hidden, weight, bias, teacher_ids, teacher_logprobs,
                                                            chunk_size, group, temperature, validate, kw)
    check_float(token_weights, "token_weights")
    if tuple(token_weights.shape) != lead:
        raise ValueError(f"token_weights must have shape {lead} (the leading dims of hidden), got {tuple(token_weights.shape)}")
    if loss_max_clamp is not None and (isinstance(loss_max_clamp, bool) or not isinstance(loss_max_clamp, (int, float))
                                       or not loss_max_clamp > 0 or loss_max_clamp == float("inf")):
        raise ValueError(f"loss_max_clamp must be a finite number > 0 or None, got {loss_max_clamp!r}")
    w = torch.where(live, token_weights.reshape(-1).detach().to(t.dtype), 0.0)  # masked rows: no contribution

    def objective(s, a, b, r):  # per-token contributions of rows [a, b); r: their log(1 - Q) (tail) or None
        L = topk_loss_from_logprobs(s, t[a:b], student_rest=r, **kw)
        return (L if loss_max_clamp is None else L.clamp(-loss_max_clamp, loss_max_clamp)) * w[a:b]

    o, s, top, rest = _run(objective, True, h2, weight, bias, ids, shard, live, lead, chunk_size, temperature,
                           validate, t, support == "tail")
    with torch.no_grad():
        loss = topk_loss_from_logprobs(s, t, student_rest=rest, **kw)
    return o.sum(), finish_topk(loss, s, t, ids, top, log_prob_min_clamp, lead)
