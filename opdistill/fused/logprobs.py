"""Fused ``log pi(ids)`` from hidden states and the lm_head weight, chunked over tokens (SPEC 5, "Fused linear").

The one autograd Function every fused top-k / sampled-token path goes through.  Per chunk of tokens it computes
z = h W^T + b (fp32 accumulation and storage, ``_chunks.chunk_logits``) and hands it to the vocab-sharded stages of
``opdistill.parallel.stages`` -- the same code the vocab-parallel ops run on their logit shards:

    lse, s_k = z_{i_k}/tau - lse, E          ``lse_and_gather``     (2 collectives per chunk with a group, else 0)
    S = the student's own top-K ids          ``global_topk``        (1 collective per chunk with a group; optional)

so s ``[N, K]`` is exactly what ``student_logprobs_at`` computes, E = -sum_j pi_j log pi_j (optional, ``[N]``).
Everything downstream (``topk_loss_from_logprobs``, estimators, PPO-clip) is plain autograd on ``[N, K]`` tensors,
so one Function serves every support x divergence: the loss reaches the logits only through s (and E).

Forward keeps per token only lse and E (``[N]``); backward recomputes each chunk's logits (one extra GEMM per chunk,
against the naive path's ``[N, V]`` buffers) and applies, per chunk, ``logit_grad`` (in place in the chunk buffer):

    dL/dz_j = (1/tau) * (sum_k g_k [i_k = j] - (sum_k g_k) pi_j - gE pi_j (log pi_j + E)),   g = dL/ds, gE = dL/dE
    grad_hidden[chunk] = dL/dz @ W,   grad_W += dL/dz^T @ hidden[chunk],   grad_b += sum_rows dL/dz

and, with a group, one all-reduce of grad_hidden (hidden is replicated; each rank's rows give a partial gradient).
Exact for any downstream use of s (per-token weights, clamps, policy gradients) because nothing is precomputed
under an assumption about the incoming gradient.
"""

from __future__ import annotations

import torch

from ..ops.checks import check_finite_rows, check_float, check_ids_in_range, check_int, check_temperature, compute_dtype
from ..parallel.shard import VocabShard
from ..parallel.stages import global_topk, logit_grad, lse_and_gather
from ._chunks import LinearGrads, chunk_logits, chunk_rows


def chunk_stages(shard, h, weight, bias, ids, temperature, dtype, student_topk=0, entropy=False, keep_exp=None,
                 rest_slots=None, rest_out=None):
    """One chunk through the stages: z = h W^T + b in fp32 (before the temperature), the student's top-K ids (None
    unless asked), ``lse_and_gather`` -> (z [c, V_local], top, lse [c], s [c, K], E [c] | None).  ``keep_exp``: z
    is returned as exp(z / tau - m), ``keep_exp`` [c] = 1 / S (``lse_and_gather``).  ``rest_slots``/``rest_out``:
    the student's rest log-mass log(1 - Q) summed directly outside T (``lse_and_gather``)."""
    z = chunk_logits(h, weight, bias, 1.0)
    top = global_topk(shard, z, student_topk) if student_topk else None  # top-k of z == top-k of z / tau
    lse, z_at, ent = lse_and_gather(shard, (z,), ids, temperature, dtype, entropy=entropy, keep_exp=keep_exp,
                                    rest_slots=rest_slots, rest_out=rest_out)
    return z, top, lse[:, 0], z_at - lse, ent


class FusedLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V_local, H], bias [V_local] | None, ids [N, K]) -> (s [N, K], E [N], lse [N])."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, shard, temperature, chunk_size, want_entropy):
        N, cd = hidden.shape[0], compute_dtype(hidden.dtype)
        s = torch.empty(ids.shape, dtype=cd, device=hidden.device)
        lse = torch.empty(N, dtype=cd, device=hidden.device)
        ent = torch.empty(N if want_entropy else 0, dtype=cd, device=hidden.device)
        with torch.no_grad():
            for a in range(0, N, chunk_size):
                b = min(a + chunk_size, N)
                _, _, lse[a:b], s[a:b], e = chunk_stages(shard, hidden[a:b], weight, bias, ids[a:b], temperature, cd,
                                                         entropy=want_entropy)
                if want_entropy:
                    ent[a:b] = e
        ctx.save_for_backward(hidden, weight, bias, ids, lse, ent)
        ctx.cfg = (temperature, chunk_size, want_entropy, shard)
        ctx.mark_non_differentiable(lse)
        return s, ent, lse

    @staticmethod
    def backward(ctx, grad_s, grad_ent, _grad_lse):
        hidden, weight, bias, ids, lse, ent = ctx.saved_tensors
        temperature, chunk_size, want_entropy, shard = ctx.cfg
        if not want_entropy or grad_ent is None or not bool(grad_ent.any()):
            grad_ent = None
        if grad_s is None:
            grad_s = torch.zeros(ids.shape, dtype=lse.dtype, device=hidden.device)
        grads = LinearGrads(hidden, weight, bias, ctx.needs_input_grad[:3], lse.dtype)
        recompute_grads(grads, shard, ids, lse, grad_s.to(lse.dtype), temperature, chunk_size, grad_ent, ent)
        return grads.result(shard) + (None,) * 5


def recompute_grads(grads: LinearGrads, shard, ids, lse, g, temperature, chunk_size, g_entropy=None,
                    entropy=None, g_rest=None, log_rest=None, rest_slots=None) -> None:
    """Sum into ``grads`` the gradients of every chunk from g = dL/ds [N, K] (and dL/dE, and g_rest = dL/d log(1-Q)
    with log_rest, rest_slots): each chunk's logits are recomputed (one GEMM) and overwritten in place by dL/dz
    (``logit_grad``)."""
    hidden, weight, bias = grads.inputs
    with torch.no_grad():
        for a in range(0, hidden.shape[0], chunk_size):
            b = min(a + chunk_size, hidden.shape[0])
            z = chunk_logits(hidden[a:b], weight, bias, 1.0)  # [c, V_local]
            dz = logit_grad(shard, z, ids[a:b], lse[a:b], g[a:b], temperature,
                            g_entropy=None if g_entropy is None else g_entropy[a:b],
                            entropy=None if g_entropy is None else entropy[a:b], out=z,
                            g_rest=None if g_rest is None else g_rest[a:b],
                            log_rest=None if g_rest is None else log_rest[a:b],
                            rest_slots=None if g_rest is None else rest_slots[a:b])
            grads.add(slice(a, b), dz)
            del z, dz


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


def weight_shard(weight: torch.Tensor, group) -> VocabShard:
    """This rank's vocabulary rows of the lm_head (``VocabShard.for_rows``): one all_gather with a group, none
    without.  Build it once per call and pass it on."""
    return VocabShard.for_rows(weight.shape[0], group, weight.device)


def check_fused_rows(lse: torch.Tensor, live: torch.Tensor | None, hidden2d: torch.Tensor, lead: tuple) -> None:
    """``validate``: a live row whose log-sum-exp is not finite is refused, naming ``hidden`` when that row of the
    hidden states is not finite, else the logits (the weight or bias then holds a NaN/inf, or the GEMM overflowed)."""
    bad = ~torch.isfinite(lse) if live is None else ~torch.isfinite(lse) & live
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        name = "hidden" if not bool(torch.isfinite(hidden2d[row]).all()) else "the logits hidden @ weight.T + bias"
        check_finite_rows(bad.reshape(lead), name)


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
    validate: bool = True,
):
    """log_softmax((hidden @ weight.T + bias) / tau) at ``ids``, without a ``[N, V]`` buffer.

    Equals ``token_logprobs(hidden @ weight.T + bias, ids, temperature=tau)`` (and, with ``return_entropy``, the
    entropy -sum_j pi_j log pi_j of the same distribution), in value and in the gradients of hidden, weight, bias.

    Args:
        hidden: ``[..., H]`` final hidden states (after the model's final norm). weight: lm_head ``[V, H]`` (or this
            rank's vocabulary shard with ``group``). ids: ``[...]`` sampled token ids.
        bias: ``[V]`` or None. temperature: tau. chunk_size: tokens per chunk (None: ``default_chunk_size``).
        group: process group over which ``weight`` is sharded on the vocabulary dim (None: not sharded).
        validate: refuse a row whose logits are not finite (``ValueError`` naming ``hidden`` and the first such
            position); False skips this value check for hot loops.  The op has no mask: zero masked rows of hidden
            first.
    Returns ``[...]`` log-probs (fp32; fp64 for fp64), or ``(logprobs, entropy)`` with ``return_entropy``.
    """
    check_linear_inputs(hidden, weight, bias)
    check_int(ids, "ids")
    if tuple(ids.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"ids must have the leading shape of hidden {tuple(hidden.shape[:-1])}, got {tuple(ids.shape)}")
    check_temperature(temperature)
    chunk_size = chunk_rows(chunk_size, hidden, weight)
    if not isinstance(return_entropy, bool):
        raise TypeError(f"return_entropy must be a bool, got {return_entropy!r}")
    shard = weight_shard(weight, group)
    if validate:
        check_ids_in_range(ids, shard.vocab_size, "ids")
    lead = tuple(ids.shape)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    s, ent, lse = FusedLogprobs.apply(h2, weight, bias, ids.reshape(-1, 1).long(), shard, float(temperature),
                                      int(chunk_size), return_entropy)
    if validate:
        check_fused_rows(lse, None, h2, lead)
    s = s.reshape(lead)
    return (s, ent.reshape(lead)) if return_entropy else s
