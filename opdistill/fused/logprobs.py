"""Fused ``log pi(ids)`` from hidden states and the lm_head weight, chunked over tokens (SPEC 5, "Fused linear").

The one autograd Function every fused top-k / sampled-token path goes through:

    z = h W^T + b  (fp32 accumulation and storage),  y = z / tau,  lse = logsumexp(y)
    s_k = y_{i_k} - lse                                   ``[N, K]``, the stage ``student_logprobs_at`` computes
    E   = -sum_j pi_j log pi_j                            (optional entropy, ``[N]``)
    S   = the student's own top-K ids                     (optional, for the overlap metric; not differentiable)

Everything downstream (``topk_loss_from_logprobs``, masses, estimators, PPO-clip) is plain autograd on ``[N, K]``
tensors, so one Function serves every support x divergence: the loss reaches the logits only through s (and E).

Forward keeps per token only lse and E (``[N]``); backward recomputes each chunk's logits (one extra GEMM per chunk,
against the naive path's ``[N, V]`` buffers) and applies, per chunk,

    dL/dz_j = (1/tau) * (sum_k g_k [i_k = j] - (sum_k g_k) pi_j - gE pi_j (log pi_j + E)),   g = dL/ds, gE = dL/dE
    grad_hidden[chunk] = dL/dz @ W,   grad_W += dL/dz^T @ hidden[chunk],   grad_b += sum_rows dL/dz

Exact for any downstream use of s (per-token weights, clamps, policy gradients) because nothing is precomputed
under an assumption about the incoming gradient.
"""

from __future__ import annotations

import torch

from ..ops.checks import check_float, check_ids_in_range, check_int, check_temperature, compute_dtype
from ._chunks import (
    Shard,
    check_chunk_size,
    chunk_gather,
    chunk_logit_grad,
    chunk_logits,
    chunk_logsumexp,
    chunk_topk,
    default_chunk_size,
    needs_upcast,
    grad_hidden_mm,
    grad_weight_addmm_,
)


class FusedLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V_local, H], bias [V_local] | None, ids [N, K]) -> (s [N, K], E [N], topk ids [N, k])."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temperature, chunk_size, want_entropy, student_topk, group):
        shard = Shard(weight, group)
        N, cd = hidden.shape[0], compute_dtype(hidden.dtype)
        s = torch.empty(ids.shape, dtype=cd, device=hidden.device)
        lse = torch.empty(N, dtype=cd, device=hidden.device)
        ent = torch.empty(N if want_entropy else 0, dtype=cd, device=hidden.device)
        top = torch.empty((N, student_topk), dtype=torch.int64, device=hidden.device)
        with torch.no_grad():
            for a in range(0, N, chunk_size):
                b = min(a + chunk_size, N)
                if student_topk:
                    raw = chunk_logits(hidden[a:b], weight, bias, 1.0)
                    top[a:b] = chunk_topk(raw, student_topk, shard)  # top-k of z == top-k of z / tau
                    z = raw.div_(temperature) if temperature != 1.0 else raw
                else:
                    z = chunk_logits(hidden[a:b], weight, bias, temperature)
                lse[a:b] = chunk_logsumexp(z, shard)
                s[a:b] = chunk_gather(z, ids[a:b], shard) - lse[a:b].unsqueeze(-1)
                if want_entropy:
                    logp = z.sub_(lse[a:b].unsqueeze(-1))
                    plogp = shard.all_reduce((logp.exp() * logp).sum(-1))
                    ent[a:b] = -plogp
                del z
        ctx.save_for_backward(hidden, weight, bias, ids, lse, ent)
        ctx.cfg = (temperature, chunk_size, want_entropy, group)
        ctx.mark_non_differentiable(top)
        return s, ent, top

    @staticmethod
    def backward(ctx, grad_s, grad_ent, _grad_top):
        hidden, weight, bias, ids, lse, ent = ctx.saved_tensors
        temperature, chunk_size, want_entropy, group = ctx.cfg
        shard = Shard(weight, group)
        N, cd = hidden.shape[0], lse.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros(hidden.shape, dtype=cd, device=hidden.device) if need_h else None
        # fp32 accumulator across chunks (bf16 weights would otherwise round once per chunk)
        grad_w = torch.zeros(weight.shape, dtype=cd, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=cd, device=bias.device) if need_b else None
        if not want_entropy or grad_ent is None or not bool(grad_ent.any()):
            grad_ent = None
        with torch.no_grad():
            for a in range(0, N, chunk_size):
                b = min(a + chunk_size, N)
                h = hidden[a:b]
                z = chunk_logits(h, weight, bias, temperature)  # recompute one chunk [c, V_local]
                gs = grad_s[a:b].to(cd) if grad_s is not None else None
                ge = grad_ent[a:b].to(cd) if grad_ent is not None else None
                if gs is None:
                    gs = torch.zeros(ids[a:b].shape, dtype=cd, device=z.device)
                dz = chunk_logit_grad(z, lse[a:b], ids[a:b], gs, ge, ent[a:b] if ge is not None else None,
                                      temperature, shard)  # [c, V_local] dL/dz
                if need_h:
                    grad_h[a:b] = grad_hidden_mm(dz, weight)  # dL/dh = dL/dz @ W
                if need_w:
                    grad_weight_addmm_(grad_w, dz, h, weight.dtype)  # dL/dW += dL/dz^T @ h
                if need_b:
                    grad_b += dz.sum(0)
                del z, dz
        if need_h and shard.parallel:
            # hidden is replicated over the group; each rank's shard contributes a partial gradient
            shard.all_reduce(grad_h)
        return (
            grad_h.to(hidden.dtype) if need_h else None,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b else None,
            None, None, None, None, None, None,
        )


def check_linear_inputs(hidden, weight, bias, *, hidden_name="hidden", weight_name="weight", bias_name="bias") -> int:
    """hidden ``[..., H]``, weight ``[V, H]``, bias ``[V]`` or None (the weight's dtype); returns V (local rows)."""
    check_float(hidden, hidden_name)
    check_float(weight, weight_name)
    if hidden.dim() < 2:
        raise ValueError(f"{hidden_name} must have shape [..., H] with at least one leading dim, got {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"{weight_name} must be the lm_head weight [V, H], got shape {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"{weight_name} has H={weight.shape[1]} columns but {hidden_name} has H={hidden.shape[-1]} "
            f"(shapes {tuple(weight.shape)} and {tuple(hidden.shape)}); pass the lm_head weight [V, H]"
        )
    if weight.shape[0] < 1:
        raise ValueError(f"{weight_name} has an empty vocabulary dim: shape {tuple(weight.shape)}")
    if (weight.dtype == torch.float64) != (hidden.dtype == torch.float64):
        raise TypeError(
            f"{weight_name} dtype {weight.dtype} and {hidden_name} dtype {hidden.dtype}: float64 only with float64 "
            "(bf16/fp16/fp32 may mix; they are computed in fp32)"
        )
    if weight.device != hidden.device:
        raise ValueError(f"{weight_name} is on {weight.device} but {hidden_name} is on {hidden.device}")
    if bias is not None:
        check_float(bias, bias_name)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{bias_name} must have shape ({weight.shape[0]},) (one per vocabulary row), got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"{bias_name} dtype {bias.dtype} must match {weight_name} dtype {weight.dtype}")
    return weight.shape[0]


def vocab_size_of(weight: torch.Tensor, group) -> int:
    """The full vocabulary: V, or the sum of the shard sizes over ``group``."""
    return Shard(weight, group).vocab


def fused_logprobs(hidden2d, weight, bias, ids2d, *, temperature, chunk_size, want_entropy, student_topk, group):
    """Validated-input entry point: ``[N, H]`` and ``[N, K]`` -> (s ``[N, K]``, E ``[N]``, top ids ``[N, k]``)."""
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden2d.shape[0], weight.shape[0], hidden2d.shape[1],
                                        upcast=needs_upcast(hidden2d, weight))
    return FusedLogprobs.apply(
        hidden2d, weight, bias, ids2d.long(), float(temperature), int(chunk_size), bool(want_entropy),
        int(student_topk), group,
    )


def fused_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    group=None,
):
    """log_softmax((hidden @ weight.T + bias) / tau) at ``ids``, without a ``[N, V]`` buffer.

    Equals ``token_logprobs(hidden @ weight.T + bias, ids, temperature=tau)`` (and, with ``return_entropy``, the
    entropy -sum_j pi_j log pi_j of the same distribution), in value and in the gradients of hidden, weight, bias.

    Args:
        hidden: ``[..., H]`` final hidden states (after the model's final norm). weight: lm_head ``[V, H]`` (or this
            rank's vocabulary shard with ``group``). ids: ``[...]`` sampled token ids.
        bias: ``[V]`` or None. temperature: tau. chunk_size: tokens per chunk (None: ``default_chunk_size``).
        group: process group over which ``weight`` is sharded on the vocabulary dim (None: not sharded).
    Returns ``[...]`` log-probs (fp32; fp64 for fp64), or ``(logprobs, entropy)`` with ``return_entropy``.
    """
    check_linear_inputs(hidden, weight, bias)
    check_int(ids, "ids")
    if tuple(ids.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"ids must have the leading shape of hidden {tuple(hidden.shape[:-1])}, got {tuple(ids.shape)}")
    check_temperature(temperature)
    check_chunk_size(chunk_size)
    if not isinstance(return_entropy, bool):
        raise TypeError(f"return_entropy must be a bool, got {return_entropy!r}")
    check_ids_in_range(ids, vocab_size_of(weight, group), "ids")
    lead = tuple(ids.shape)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    s, ent, _ = fused_logprobs(h2, weight, bias, ids.reshape(-1, 1), temperature=temperature, chunk_size=chunk_size,
                               want_entropy=return_entropy, student_topk=0, group=group)
    s = s.reshape(lead)
    return (s, ent.reshape(lead)) if return_entropy else s
