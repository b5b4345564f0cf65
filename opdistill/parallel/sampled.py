"""Vocab-parallel ``token_logprobs``: log pi(y_t) from a vocabulary shard (sampled-token estimators, policy gradient).

The K = 1 case of the top-k stages (``stages.lse_and_gather``, ``stages.logit_grad``): all-reduce MAX [N + 2],
all-reduce SUM [N, 2], nothing in backward.
"""

from __future__ import annotations

import torch

from ..ops.checks import check_finite_rows, check_ids_in_range, check_int, check_logits, check_temperature, compute_dtype
from .shard import VocabShard, resolve_shard
from .stages import logit_grad, lse_and_gather


class VocabParallelLogProbs(torch.autograd.Function):
    """s = log softmax(z / tau)[y] over the whole vocabulary, from this rank's shard x [N, Vl], ids y [N].

    Forward:   s = z_y/tau - lse,  lse = all-reduced log-sum-exp of z/tau          [N], same on every rank
    Backward:  dL/dx_j = (1/tau) * g * ([y = j] - pi_j)  for the columns j this rank owns, g = dL/ds [N]
    Saved: x (own dtype), ids [N, 1], lse [N].  Returns (s, lse), lse non-differentiable (for validation).
    """

    @staticmethod
    def forward(ctx, x, ids, shard: VocabShard, tau: float):
        lse, z_at, _ = lse_and_gather(shard, (x,), ids, tau, compute_dtype(x.dtype))
        lse = lse[:, 0]
        ctx.save_for_backward(x, ids, lse)
        ctx.shard, ctx.tau = shard, tau
        ctx.mark_non_differentiable(lse)
        return z_at[:, 0] - lse, lse

    @staticmethod
    def backward(ctx, grad, _grad_lse):
        x, ids, lse = ctx.saved_tensors
        return logit_grad(ctx.shard, x, ids, lse, grad[:, None], ctx.tau), None, None, None


def vocab_parallel_token_logprobs(
    local_logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    group=None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    validate: bool = True,
) -> torch.Tensor:
    """``token_logprobs`` with the logits sharded on the vocab dim: ``[..., V/tp]`` x ``[...]`` -> ``[...]``.

    ``ids`` are global token ids, identical on every rank; ``group``, ``vocab_size`` and DTensor input as in
    ``vocab_parallel_topk_divergence``; ``validate`` as ``token_logprobs`` (the op has no mask: zero masked rows
    first).  fp32 result (fp64 for fp64 logits), identical on every rank.
    """
    shard = resolve_shard(local_logits, group, vocab_size, "local_logits")
    x = shard.local
    check_logits(x, "local_logits")
    check_int(ids, "ids")
    if tuple(ids.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"ids must have the leading shape of local_logits {tuple(x.shape[:-1])}, got {tuple(ids.shape)}"
        )
    if validate:
        check_ids_in_range(ids, shard.vocab_size, "ids")
    check_temperature(temperature)
    lead = tuple(x.shape[:-1])
    out, lse = VocabParallelLogProbs.apply(x.reshape(-1, x.shape[-1]), ids.reshape(-1, 1).long(), shard, float(temperature))
    if validate:
        check_finite_rows(~torch.isfinite(lse).reshape(lead), "local_logits")
    return out.reshape(lead)
