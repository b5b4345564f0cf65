"""Vocab-parallel top-k divergence: ``ops.topk.topk_divergence`` on logits sharded over the vocabulary.

Same arguments, same ``TopKResult``, same numbers (up to the summation order of the log-sum-exp).  The per-token
math is the single-device stages, unchanged: ``topk_loss_from_logprobs`` and ``finish_topk``; only s_k = log pi(i_k)
(``stages.lse_and_gather``), its logit gradient (``stages.logit_grad``) and the student's top-K
(``stages.global_topk``) know about the shards.  Collectives per call: all-reduce MAX [N + 2], all-reduce SUM
[N, 1 + K (+ 1 for tail: the rest mass)], all_gather [N, 2K] (the overlap metric); none in backward; none at all
for a group of one rank.
"""

from __future__ import annotations

import torch

from ..ops.checks import check_finite_rows, check_topk_inputs, compute_dtype
from ..ops.topk import TopKResult, finish_topk, topk_loss_from_logprobs
from .shard import VocabShard, resolve_shard
from .stages import global_topk, logit_grad, lse_and_gather


class VocabParallelTopKLoss(torch.autograd.Function):
    """Per-token top-k divergence L(s, l) from a vocabulary shard of the student logits.

    Forward (x = this rank's logits [N, Vl], ids/l = teacher top-k [N, K], live [N] = rows with a non-empty slot):
        lse, z_ik   = all-reduced log-sum-exp and gathered logits (``stages.lse_and_gather``)
        s_k         = z_ik - lse                                    log pi(i_k), [N, K], same on every rank
        log(1-Q)    = log sum_{j not in T} exp(z_j - m) - log S   (tail only: one more column of the SUM message)
        L           = topk_loss_from_logprobs(s, l; support, divergence, beta, clamp; log(1-Q))          [N]
    Backward (dL_total/dL = grad [N]):
        g_k         = grad * dL/ds_k          autograd through the small [N, K] function ``topk_loss_from_logprobs``
        dL/dx_j     = (1/tau)(sum_k g_k [i_k = j] - (sum_k g_k) pi_j)   ``stages.logit_grad``, this rank's columns
                      + (1/tau) g_r ([j not in T] pi_j / (1 - Q) - pi_j)   (tail: g_r = dL/d log(1-Q))
    For truncated forward without clamp, g_k = -nu_k on active tokens, so dL/dx_j = (1/tau)(P pi_j - nu_j [j in T])
    (SPEC 5's m_A pi_j - nu_j 1[j in A]).  Saved: x (its own dtype, not copied), lse [N], ids, s, l [N, K], live [N];
    no [N, Vl] fp32 tensor.  Returns (L, s, lse) with s and lse non-differentiable (diagnostics, validation).
    """

    @staticmethod
    def forward(ctx, x, ids, t, shard: VocabShard, tau: float, loss_kwargs: dict):
        dtype = compute_dtype(x.dtype)
        t = t.to(dtype)
        live = (t > float("-inf")).any(-1)  # [N] masked rows hold only empty slots
        tail = loss_kwargs["support"] == "tail"
        rest = torch.empty(x.shape[0], dtype=dtype, device=x.device) if tail else None  # log(1 - Q), direct
        slots = t > float("-inf")  # [N, K] the slots in T
        lse, z_at, _ = lse_and_gather(shard, (x,), ids, tau, dtype, live=live, rest_slots=slots, rest_out=rest)
        lse = lse[:, 0]
        s = z_at - lse[:, None]  # [N, K]
        loss = topk_loss_from_logprobs(s, t, student_rest=rest, **loss_kwargs)  # [N]
        ctx.save_for_backward(x, ids, lse, s, t, live, rest)
        ctx.shard, ctx.tau, ctx.loss_kwargs = shard, tau, loss_kwargs
        ctx.mark_non_differentiable(s, lse)
        return loss, s, lse

    @staticmethod
    def backward(ctx, grad_loss, _grad_s, _grad_lse):
        x, ids, lse, s, t, live, rest = ctx.saved_tensors
        with torch.enable_grad():
            s_req = s.detach().requires_grad_(True)
            r_req = None if rest is None else rest.detach().requires_grad_(True)
            loss = topk_loss_from_logprobs(s_req, t, student_rest=r_req, **ctx.loss_kwargs)
            # g_k = grad * dL/ds_k [N, K];  g_r = grad * dL/d log(1 - Q) [N] (tail)
            grads = torch.autograd.grad(loss, [s_req] + ([r_req] if rest is not None else []),
                                        grad_loss.to(loss.dtype))
        g, g_rest = grads[0], (grads[1] if rest is not None else None)
        dx = logit_grad(ctx.shard, x, ids, lse, g, ctx.tau, live=live, g_rest=g_rest, log_rest=rest,
                        rest_slots=t > float("-inf"))
        return dx, None, None, None, None, None


def vocab_parallel_topk_divergence(
    local_logits: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    group=None,
    vocab_size: int | None = None,
    support: str = "truncated",
    divergence: str = "forward",
    beta: float = 0.5,
    log_prob_min_clamp: float | None = None,
    temperature: float = 1.0,
    validate: bool | str = True,
) -> TopKResult:
    """``topk_divergence`` with the student logits sharded on the vocabulary dim over ``group``.

    Args:
        local_logits: this rank's ``[..., V/tp]`` shard (rank r holds columns ``[r*V/tp, (r+1)*V/tp)``), or a
            DTensor sharded on its last dim (then ``group`` must be None: the mesh gives it).
        teacher_ids, teacher_logprobs: ``[..., K]``, the full (unsharded) teacher top-k, identical on every rank.
        group: the tensor-parallel process group; None on a single process.
        vocab_size: the true vocabulary when the shards are padded (columns >= vocab_size get no mass and no
            gradient); default: all columns are real.
        support, divergence, beta, log_prob_min_clamp, temperature, validate: as ``topk_divergence`` (the
            finiteness check reads the all-reduced log-sum-exp, so every rank raises alike).

    Returns the ``TopKResult`` of ``topk_divergence`` on the gathered logits, per token, identical on every rank
    of the group; the gradient reaches each rank's shard only.
    """
    shard = resolve_shard(local_logits, group, vocab_size)
    x = shard.local
    kwargs = dict(support=support, divergence=divergence, beta=float(beta), log_prob_min_clamp=log_prob_min_clamp)
    check_topk_inputs(x, teacher_ids, teacher_logprobs, temperature=temperature, vocab_size=shard.vocab_size,
                      validate=validate, **kwargs)
    lead, K = tuple(x.shape[:-1]), teacher_ids.shape[-1]
    x2, ids, t = x.reshape(-1, x.shape[-1]), teacher_ids.reshape(-1, K).long(), teacher_logprobs.reshape(-1, K)
    loss, s, lse = VocabParallelTopKLoss.apply(x2, ids, t, shard, float(temperature), kwargs)
    if validate:
        check_finite_rows((~torch.isfinite(lse) & (t > float("-inf")).any(-1)).reshape(lead), "local_logits")
    return finish_topk(loss, s, t, ids, global_topk(shard, x2.detach(), K), log_prob_min_clamp, lead)
