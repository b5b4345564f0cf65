"""Vocab-parallel log-softmax stages: the math of ``ops.topk.student_logprobs_at`` over a sharded vocabulary.

With z the logits divided by tau, rank r holding the columns ``[start, start + width)``:

    m      = max_j z_j                              all-reduce MAX  of the local maxima          [N]
    S      = sum_j exp(z_j - m)                     all-reduce SUM  of the local sums            [N]
    z_ik   = z at the teacher id i_k                 (same all-reduce: only the owning rank contributes)  [N, K]
    lse    = m + log S,    s_k = z_ik - lse         = log pi(i_k), identical on every rank

Gradient, for any per-token loss that depends on the logits only through s (g_k = dL/ds_k):

    dL/dz_j = (1/tau) * (sum_k g_k [i_k = j]  -  (sum_k g_k) * pi_j),     pi_j = exp(z_j/tau - lse)

It needs no collective: g is the same on every rank, pi_j is recomputed chunk-wise from the saved logits (their own
dtype) and lse, and each rank scatter-adds only the g_k of the ids it owns.  Ids owned by another rank gather and
scatter at local index 0 with a zero weight (``where(owned, ., 0)``), so a real token at local index 0 is never
disturbed, and duplicate ids add up (scatter-add), exactly as the single-device gather's backward does.
Padding columns (global id >= vocab_size) are never read: no mass, and their gradient is 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .shard import VocabShard, all_gather_cat, all_reduce_, all_reduce_max_checked, row_chunks


def _scaled(x: torch.Tensor, tau: float, dtype: torch.dtype) -> torch.Tensor:
    z = x.to(dtype)
    return z / tau if tau != 1.0 else z  # same arithmetic as student_logprobs_at


def owned_local_ids(shard: VocabShard, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(owned [N, K] bool, local index [N, K]): ids not in this rank's real columns map to local index 0."""
    owned = (ids >= shard.start) & (ids < shard.start + shard.width)
    return owned, torch.where(owned, ids - shard.start, 0)


def logsumexp_and_gather(
    shard: VocabShard, x: torch.Tensor, ids: torch.Tensor, tau: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse [N], z at ids [N, K]) over the whole vocabulary, from this rank's ``x [N, Vl]``.  Two all-reduces."""
    n, w = x.shape[0], shard.width
    owned, local = owned_local_ids(shard, ids)
    m = torch.full((n,), float("-inf"), dtype=dtype, device=x.device)
    picked = torch.zeros(ids.shape, dtype=dtype, device=x.device)  # [N, K]
    if w > 0:
        for rows in row_chunks(n, w):
            m[rows] = _scaled(x[rows, :w], tau, dtype).amax(-1)
        picked = torch.where(owned, _scaled(x.gather(1, local), tau, dtype), 0.0)
    m = all_reduce_max_checked(m[:, None], shard)[:, 0]  # collective 1: the global max (and the layout check)
    buf = torch.zeros((n, 1 + ids.shape[1]), dtype=dtype, device=x.device)  # [N, 1 + K]: S, then z at ids
    buf[:, 1:] = picked
    if w > 0:
        for rows in row_chunks(n, w):
            buf[rows, 0] = torch.exp(_scaled(x[rows, :w], tau, dtype) - m[rows, None]).sum(-1)
    all_reduce_(buf, dist.ReduceOp.SUM, shard)  # collective 2: sum-exp and the owned logits, one message
    return m + torch.log(buf[:, 0]), buf[:, 1:]


def logit_grad(
    shard: VocabShard, x: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, tau: float
) -> torch.Tensor:
    """dL/dx [N, Vl] in x's dtype from g = dL/ds [N, K]: (1/tau)(scatter_k g_k - (sum_k g_k) pi), chunk by chunk."""
    out = torch.zeros_like(x)
    w = shard.width
    if w == 0 or x.shape[0] == 0:
        return out
    owned, local = owned_local_ids(shard, ids)
    g_owned = torch.where(owned, g, 0.0)  # [N, K] other ranks' ids add 0 at local index 0
    g_sum = g.sum(-1, keepdim=True)  # [N, 1]
    for rows in row_chunks(x.shape[0], w):
        pi = torch.exp(_scaled(x[rows, :w], tau, g.dtype) - lse[rows, None])  # [n, w] one chunk only
        grad = (-g_sum[rows]) * pi
        grad.scatter_add_(1, local[rows], g_owned[rows])  # duplicates add up, as in gather's backward
        if tau != 1.0:
            grad = grad / tau
        out[rows, :w] = grad.to(x.dtype)
    return out  # padding columns [w:] stay 0


def global_topk_ids(shard: VocabShard, x: torch.Tensor, k: int) -> torch.Tensor:
    """The student's own top-k ids [N, k] over the whole vocabulary: local top-k, one all_gather, global top-k.

    Values and ids travel in one message of the compute dtype: fp32 holds bf16/fp16/fp32 logits exactly and ids
    below 2**24; fp64 logits or a larger vocabulary use fp64.  Ties between equal logits may pick a different id
    than a single-device ``torch.topk`` would (its tie order is unspecified as well).
    """
    n, w = x.shape[0], shard.width
    exact = torch.float32 if x.dtype != torch.float64 and shard.vocab_size <= 1 << 24 else torch.float64
    local = torch.full((n, 2 * k), float("-inf"), dtype=exact, device=x.device)  # [values | ids]
    local[:, k:] = -1.0
    kl = min(k, w)
    if kl > 0:
        for rows in row_chunks(n, w):
            v, i = torch.topk(x[rows, :w], kl, dim=-1)
            local[rows, :kl] = v.to(exact)
            local[rows, k : k + kl] = (i + shard.start).to(exact)
    both = all_gather_cat(local.unsqueeze(0), shard, dim=0)  # collective 3: [P, N, 2k]
    values = both[..., :k].permute(1, 0, 2).reshape(n, shard.size * k)  # [N, P*k]
    ids = both[..., k:].permute(1, 0, 2).reshape(n, shard.size * k)
    best = torch.topk(values, k, dim=-1).indices
    return ids.gather(1, best).long()
