"""``fused_topk_divergence``: the top-k divergences of ``ops.topk`` from hidden states and the lm_head weight.

The same named stages as ``topk_divergence``, with stage 1 (``student_logprobs_at``) replaced by the chunked
``FusedLogprobs`` (the vocab-sharded stages on each chunk of z = h W^T): s = log pi(T) ``[N, K]``, plus the student's
own top-K ids for the overlap metric.  ``topk_loss_from_logprobs`` and ``finish_topk`` run unchanged on ``[N, K]``
tensors, so every support x divergence, the clamps and the diagnostics are the unfused op's by construction.
Masked rows (all K slots empty) are zeroed in hidden before the chunks: they reach no gradient of hidden or weight.
"""

from __future__ import annotations

import torch

from ..ops.checks import check_topk_inputs
from ..ops.topk import TopKResult, finish_topk, topk_loss_from_logprobs
from ._chunks import check_chunk_size
from .logprobs import check_fused_rows, check_linear_inputs, fused_logprobs, weight_shard


def topk_inputs(hidden, weight, bias, teacher_ids, teacher_logprobs, chunk_size, group, temperature, validate, kw):
    """Every check of the fused top-k ops, then (shard, lead, hidden [N, H] with the masked rows zeroed, ids [N, K],
    teacher log-probs [N, K], live [N]: the rows with a non-empty slot; the others reach no gradient)."""
    check_linear_inputs(hidden, weight, bias)
    check_chunk_size(chunk_size)
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
    return shard, lead, h2, teacher_ids.reshape(-1, K).long(), t, live


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
            first such position); False skips this value check for hot loops.
    bf16/fp16 inputs: logits are accumulated and kept in fp32 (never rounded to bf16 first), gradients are
    accumulated in fp32 and returned in the input dtype.  Returns a ``TopKResult`` of per-token tensors; ``loss``
    is differentiable with respect to hidden, weight and bias.
    """
    kw = dict(support=support, divergence=divergence, beta=beta, log_prob_min_clamp=log_prob_min_clamp)
    shard, lead, h2, ids, t, live = topk_inputs(hidden, weight, bias, teacher_ids, teacher_logprobs, chunk_size, group,
                                                temperature, validate, kw)
    s, _, student_top, lse = fused_logprobs(
        h2, weight, bias, ids, shard, live=live, temperature=temperature, chunk_size=chunk_size,
        want_entropy=False, student_topk=ids.shape[1],
    )  # [N, K] log pi(T), [N, K] the student's own top-K ids
    if validate:
        check_fused_rows(lse, live, h2, lead)
    t = t.to(s.dtype)
    loss = topk_loss_from_logprobs(s, t, **kw)
    return finish_topk(loss, s, t, ids, student_top, log_prob_min_clamp, lead)
