"""``fused_topk_loss``: the top-k loss already reduced with known per-token weights, gradients computed in forward.

``fused_topk_divergence`` returns per-token losses, so its backward cannot know the per-token gradient before it
arrives and must recompute each chunk's logits (four GEMMs per chunk in all).  When the caller already knows how the
per-token losses will be combined -- ``objective = sum_t weights_t * clamp(L_t)``, which is what ``aggregate`` does
in supervised mode (weights = D / N on valid tokens for token-mean, etc.) -- the gradient of every chunk can be
computed while its logits are alive (Liger-Kernel's contract: each chunk contributes a sum, one place divides):

    forward, per chunk:  z, lse, s = log pi(T);  g = d(sum_t w_t clamp(L_t)) / ds  (autograd on [c, K]);
                         dL/dz = (1/tau) (scatter(g) - (sum_k g_k) pi);  grad_h[chunk] = dL/dz W;  grad_W += dL/dz^T h
    backward:            the stored gradients times the incoming scalar gradient

Three GEMMs per chunk (the floor), exact for this objective.  Use it when the objective is that weighted sum;
anything else (policy gradient on the per-token loss, metrics that are differentiated) needs ``fused_topk_divergence``.
"""

from __future__ import annotations

import torch

from ..ops.checks import check_float, compute_dtype
from ..ops.topk import TopKResult, finish_topk, topk_loss_from_logprobs
from ..parallel.stages import logit_grad
from ._chunks import LinearGrads, default_chunk_size, needs_upcast
from .logprobs import check_fused_rows, chunk_stages
from .topk import topk_inputs


class FusedWeightedLoss(torch.autograd.Function):
    """(hidden [N, H], weight, bias, ids [N, K]) -> (sum_t objective_t, s [N, K], top ids [N, k], lse [N]), the last
    three detached.  Per chunk: the vocab-sharded stages (``chunk_stages``), then g = d objective / ds and
    ``logit_grad`` in place in the chunk buffer, then the gradient GEMMs (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, shard, live, objective, temperature, chunk_size, student_topk):
        N, cd = hidden.shape[0], compute_dtype(hidden.dtype)
        grads = LinearGrads(hidden, weight, bias, ctx.needs_input_grad[:3], cd)
        s_all = torch.empty(ids.shape, dtype=cd, device=hidden.device)
        lse_all = torch.empty(N, dtype=cd, device=hidden.device)
        top = torch.empty((N, student_topk), dtype=torch.int64, device=hidden.device)
        total = torch.zeros((), dtype=cd, device=hidden.device)
        for a in range(0, N, chunk_size):
            b = min(a + chunk_size, N)
            with torch.no_grad():
                z, top[a:b], lse, s, _ = chunk_stages(shard, hidden[a:b], weight, bias, ids[a:b], live[a:b],
                                                      temperature, cd, student_topk)
            s_all[a:b], lse_all[a:b] = s, lse
            s = s.requires_grad_(True)
            with torch.enable_grad():
                obj = objective(s, a, b).sum()
                (g,) = torch.autograd.grad(obj, s)  # [c, K] d objective / d s
            total += obj.detach()
            with torch.no_grad():
                dz = logit_grad(shard, z, ids[a:b], lse, g, temperature, live=live[a:b], out=z)  # [c, V_local] dL/dz
                grads.add(slice(a, b), dz)
            del z, dz
        ctx.grads = grads.result(shard)  # in the parameters' dtypes between forward and backward
        ctx.mark_non_differentiable(s_all, top, lse_all)
        return total, s_all, top, lse_all

    @staticmethod
    def backward(ctx, grad_total, _grad_s, _grad_top, _grad_lse):
        # scale in place: the stored gradients are this Function's own buffers and are used once
        grads = tuple(None if x is None else x.mul_(grad_total.to(x.dtype)) for x in ctx.grads)
        ctx.grads = None
        return grads + (None,) * 7


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

    Args: as ``fused_topk_divergence``, plus
        token_weights: ``[...]`` (the leading dims of hidden) weight of each token in the objective, e.g.
            mask * D / N for token-mean; not differentiated.
        loss_max_clamp: clamp each per-token loss to [-c, c] before weighting (None: off).
        validate: as ``fused_topk_divergence``.
    Returns the scalar objective (differentiable w.r.t. hidden, weight, bias; its gradient was computed in the
    forward pass) and the detached per-token results (``loss`` unclamped) for metrics.
    """
    kw = dict(support=support, divergence=divergence, beta=beta, log_prob_min_clamp=log_prob_min_clamp)
    shard, lead, h2, ids, t, live = topk_inputs(hidden, weight, bias, teacher_ids, teacher_logprobs, chunk_size, group,
                                                temperature, validate, kw)
    check_float(token_weights, "token_weights")
    if tuple(token_weights.shape) != lead:
        raise ValueError(f"token_weights must have shape {lead} (the leading dims of hidden), got {tuple(token_weights.shape)}")
    if loss_max_clamp is not None and (isinstance(loss_max_clamp, bool) or not isinstance(loss_max_clamp, (int, float))
                                       or not loss_max_clamp > 0 or loss_max_clamp == float("inf")):
        raise ValueError(f"loss_max_clamp must be a finite number > 0 or None, got {loss_max_clamp!r}")
    cd = compute_dtype(hidden.dtype)
    t = t.to(cd)
    w = torch.where(live, token_weights.reshape(-1).detach().to(cd), 0.0)  # masked rows: no contribution

    def objective(s, a, b):  # per-token contributions of rows [a, b)
        L = topk_loss_from_logprobs(s, t[a:b], **kw)
        if loss_max_clamp is not None:
            L = L.clamp(-loss_max_clamp, loss_max_clamp)
        return L * w[a:b]

    if chunk_size is None:
        chunk_size = default_chunk_size(h2.shape[0], weight.shape[0], h2.shape[1], upcast=needs_upcast(h2, weight))
    if not torch.is_grad_enabled():  # evaluation: no gradient work in the forward pass
        h2, weight = h2.detach(), weight.detach()
        bias = None if bias is None else bias.detach()
    total, s, top, lse = FusedWeightedLoss.apply(h2, weight, bias, ids, shard, live, objective, float(temperature),
                                                 int(chunk_size), ids.shape[1])
    if validate:
        check_fused_rows(lse, live, h2, lead)
    with torch.no_grad():
        loss = topk_loss_from_logprobs(s, t, **kw)
    return total, finish_topk(loss, s, t, ids, top, log_prob_min_clamp, lead)
