"""Chunk kernels shared by every fused op: fp32 logits of one token chunk, its statistics, its logit gradient.

Design: the fused ops loop over chunks of tokens; each chunk holds the full vocabulary row of its tokens (so a
row's log-sum-exp, gathered values and top-K are complete inside the chunk), never more than one chunk of logits
at a time.  Every GEMM that produces logits accumulates *and stores* in fp32 (fp64 for fp64 inputs): bf16/fp16
logits are never rounded to bf16/fp16 before the softmax.  Where the backend has no bf16 x bf16 -> fp32 GEMM
(PyTorch on CPU), the weight is upcast one vocabulary block at a time, so no fp32 copy of the whole weight exists.

With a process ``group`` the weight is a vocabulary shard ``[V_local, H]`` (rank r owns the contiguous id range
``[start_r, start_r + V_local)``); per chunk the max, the sum of exponentials, the gathered teacher-id values and
the entropy sum are all-reduced, and the student top-K is a local top-K, all-gathered, then a global top-K.  A group
of size 1 (or ``None``) runs no collective.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from ..ops.checks import compute_dtype

# Bytes of one fp32 chunk of logits [chunk, V]; the working set of a chunk is about three of these.
DEFAULT_CHUNK_BYTES = 128 * 2**20
# Bytes of one upcast weight block [rows, H] when the backend cannot multiply bf16 into fp32 directly.
UPCAST_BLOCK_BYTES = 32 * 2**20
# A GEMM with fewer rows than this runs far below peak; the chunk never goes below it (unless N does).
MIN_CHUNK_ROWS = 32


def default_chunk_size(n_tokens: int, vocab: int, hidden: int, *, upcast: bool = False) -> int:
    """Rows per chunk: as many as fit ``DEFAULT_CHUNK_BYTES`` of fp32 logits (twice that when ``upcast``: the
    low-precision weight is then converted block by block once per chunk, a cost amortised over the chunk's rows),
    at least ``MIN_CHUNK_ROWS`` (GEMM efficiency) and, when the vocabulary is small next to the hidden size, at least
    ``hidden // 4`` rows (the chunk's GEMM then costs more than its logits buffer is worth saving); at most N."""
    budget = DEFAULT_CHUNK_BYTES * (2 if upcast else 1)
    rows = max(budget // (4 * max(vocab, 1)), MIN_CHUNK_ROWS)
    if vocab < hidden:
        rows = max(rows, hidden // 4)
    return max(1, min(n_tokens, rows))


def check_chunk_size(chunk_size) -> None:
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be an int >= 1 or None (automatic), got {chunk_size!r}")


@functools.lru_cache(maxsize=None)
def _native_fp32_out(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` works for this device and low-precision dtype."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def needs_upcast(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``mm_fp32`` will upcast the weight block by block (low precision, no native fp32-output GEMM)."""
    low = weight.dtype in (torch.bfloat16, torch.float16)
    return low and not (hidden.dtype == weight.dtype and _native_fp32_out(weight.device.type, weight.dtype))


@contextlib.contextmanager
def _bf16_compute_fp32_out(enabled: bool):
    """On CPU, let oneDNN run fp32 GEMMs with bf16 multiplies, fp32 accumulation and fp32 output.

    Only entered for operands that are bf16 values upcast to fp32 (exactly representable in bf16), so the
    internal downcast is exact and the result is the bf16 x bf16 -> fp32 GEMM the backend lacks an op for.
    """
    setting = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    if not enabled or setting is None or not hasattr(setting, "fp32_precision") or not torch.backends.mkldnn.is_available():
        yield
        return
    before = setting.fp32_precision
    setting.fp32_precision = "bf16"
    try:
        yield
    finally:
        setting.fp32_precision = before


def _no_autocast(fn):
    """Run a GEMM helper with autocast off: under ``torch.autocast`` the GEMMs would otherwise run (and round the
    logits) in bf16/fp16, silently breaking the fp32 guarantee."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.autocast(device_type=args[0].device.type, enabled=False):
            return fn(*args, **kwargs)

    return wrapper


@_no_autocast
def mm_fp32(a: torch.Tensor, b_t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b_t.T`` accumulated and returned in the compute dtype, for a (``[M, H]``) and b_t (``[V, H]``) of float
    dtypes (fp64 only with fp64).  Low-precision operands are multiplied natively into fp32 where the backend can
    (CUDA), else the low-precision ``b_t`` is upcast one block of rows at a time (``a`` is small: one chunk), never
    as a whole."""
    cd = compute_dtype(a.dtype)
    M, V = a.shape[0], b_t.shape[0]
    if out is None:
        out = torch.empty(M, V, dtype=cd, device=a.device)
    if a.dtype == cd and b_t.dtype == cd:
        return torch.mm(a, b_t.t(), out=out)
    if a.dtype == b_t.dtype and _native_fp32_out(a.device.type, a.dtype):
        out.copy_(torch.mm(a, b_t.t(), out_dtype=cd))
        return out
    a32 = a.to(cd)
    if b_t.dtype == cd:  # low-precision hidden, fp32 weight (autocast with fp32 master weights)
        return torch.mm(a32, b_t.t(), out=out)
    rows = max(1, UPCAST_BLOCK_BYTES // (4 * max(b_t.shape[1], 1)))
    # the bf16-compute trick is exact only when both operands hold bf16 values
    buf = torch.empty(min(rows, V), b_t.shape[1], dtype=cd, device=a.device)  # one block, reused (no page faults)
    with _bf16_compute_fp32_out(a.dtype == b_t.dtype == torch.bfloat16 and a.device.type == "cpu"):
        for v0 in range(0, V, rows):
            blk = b_t[v0 : v0 + rows]
            blk32 = buf[: blk.shape[0]].copy_(blk)
            torch.mm(a32, blk32.t(), out=out[:, v0 : v0 + blk.shape[0]])
    return out


@_no_autocast
def grad_hidden_mm(dz: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dL/dh = dL/dz @ W ``[c, H]``, returned in the compute dtype.

    For bf16/fp16 weights the logit gradient is rounded to the weight dtype first and the GEMM runs natively (as
    autograd does for a bf16 lm_head); each row of dL/dh is complete within its chunk, so it is rounded once.
    """
    if weight.dtype == dz.dtype:
        return dz @ weight
    return (dz.to(weight.dtype) @ weight).to(dz.dtype)


@_no_autocast
def grad_weight_addmm_(acc: torch.Tensor, dz: torch.Tensor, h: torch.Tensor, weight_dtype: torch.dtype) -> None:
    """acc += dL/dz^T @ h in the compute dtype; ``acc`` (fp32 for bf16/fp16 weights) sums the chunks unrounded.

    For a low-precision weight the logit gradient is rounded to the hidden dtype first (as autograd does for a
    bf16 lm_head); for an fp32 weight nothing is rounded."""
    if h.dtype == acc.dtype or weight_dtype == acc.dtype:
        acc.addmm_(dz.t(), h.to(acc.dtype))
        return
    if _native_fp32_out(h.device.type, h.dtype):
        acc += torch.mm(dz.t().to(h.dtype), h, out_dtype=acc.dtype)
        return
    if h.dtype == torch.bfloat16 and h.device.type == "cpu":
        with _bf16_compute_fp32_out(True):  # oneDNN rounds dz to bf16 itself: no explicit round trip
            acc.addmm_(dz.t(), h.to(acc.dtype))
        return
    acc.addmm_(dz.t().to(h.dtype).to(acc.dtype), h.to(acc.dtype))


class Shard:
    """Where this rank's weight rows sit in the full vocabulary, and the collectives over ``group``."""

    def __init__(self, weight: torch.Tensor, group) -> None:
        self.group = group
        self.local_vocab = weight.shape[0]
        self.world = 1 if group is None else dist.get_world_size(group)
        if self.world == 1:
            self.start, self.vocab = 0, self.local_vocab
            return
        sizes = torch.zeros(self.world, dtype=torch.int64, device=weight.device)
        mine = torch.tensor([self.local_vocab], dtype=torch.int64, device=weight.device)
        dist.all_gather_into_tensor(sizes, mine, group=group)
        rank = dist.get_rank(group)
        self.start = int(sizes[:rank].sum())
        self.vocab = int(sizes.sum())

    @property
    def parallel(self) -> bool:
        return self.world > 1

    def all_reduce(self, x: torch.Tensor, op=None) -> torch.Tensor:
        if self.parallel:
            dist.all_reduce(x, op=dist.ReduceOp.SUM if op is None else op, group=self.group)
        return x

    def local_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids shifted into this shard and clamped to it, mask of the ids this rank owns)."""
        if not self.parallel:
            return ids, torch.ones_like(ids, dtype=torch.bool)
        local = ids - self.start
        owned = (local >= 0) & (local < self.local_vocab)
        return local.clamp(0, self.local_vocab - 1), owned


def chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """z / tau for one chunk, ``[c, V_local]`` in the compute dtype (fp32 for bf16/fp16, never rounded)."""
    z = mm_fp32(h, weight)
    if bias is not None:
        z += bias.to(z.dtype)
    if temperature != 1.0:
        z /= temperature
    return z


def chunk_logsumexp(z: torch.Tensor, shard: Shard) -> torch.Tensor:
    """logsumexp over the (possibly sharded) vocabulary, ``[c]``."""
    if not shard.parallel:
        return torch.logsumexp(z, dim=-1)
    m = z.amax(dim=-1)
    shard.all_reduce(m, dist.ReduceOp.MAX)
    m = torch.where(torch.isfinite(m), m, 0.0)
    se = torch.exp(z - m.unsqueeze(-1)).sum(-1)
    shard.all_reduce(se)
    return torch.log(se) + m


def chunk_gather(z: torch.Tensor, ids: torch.Tensor, shard: Shard) -> torch.Tensor:
    """z at the (global) ids ``[c, K]``; each id's value comes from the rank that owns it."""
    local, owned = shard.local_ids(ids)
    vals = z.gather(1, local)
    if shard.parallel:
        vals = shard.all_reduce(torch.where(owned, vals, 0.0))
    return vals


def chunk_topk(z: torch.Tensor, k: int, shard: Shard) -> torch.Tensor:
    """Global ids of the k largest logits per row ``[c, k]`` (local top-k, all-gathered, then a global top-k)."""
    vals, idx = torch.topk(z, k=min(k, z.shape[-1]), dim=-1)
    if not shard.parallel:
        return idx
    idx = idx + shard.start
    if vals.shape[-1] < k:  # a shard smaller than k: pad with -inf candidates that never win
        pad = k - vals.shape[-1]
        vals = torch.cat([vals, vals.new_full((vals.shape[0], pad), float("-inf"))], -1)
        idx = torch.cat([idx, idx.new_zeros((idx.shape[0], pad))], -1)
    all_vals = [torch.empty_like(vals) for _ in range(shard.world)]
    all_idx = [torch.empty_like(idx) for _ in range(shard.world)]
    dist.all_gather(all_vals, vals.contiguous(), group=shard.group)
    dist.all_gather(all_idx, idx.contiguous(), group=shard.group)
    vals, idx = torch.cat(all_vals, -1), torch.cat(all_idx, -1)
    top = torch.topk(vals, k=k, dim=-1).indices
    return idx.gather(1, top)


def chunk_logit_grad(
    z: torch.Tensor,
    lse: torch.Tensor,
    ids: torch.Tensor,
    grad_s: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    entropy: torch.Tensor | None,
    temperature: float,
    shard: Shard,
) -> torch.Tensor:
    """dLoss/dz for one chunk, in place in ``z`` (which holds z / tau on entry).

    With y = z / tau, log pi = y - lse, s_k = log pi(i_k) and entropy E = -sum_j pi_j log pi_j:
        dL/dy_j = sum_k g_k [i_k = j] - (sum_k g_k) pi_j  -  gE * pi_j (log pi_j + E)
        dL/dz_j = dL/dy_j / tau
    """
    logp = z.sub_(lse.unsqueeze(-1))  # [c, V] log pi
    if grad_entropy is not None:
        p = logp.exp()
        # -gE * pi (log pi + E) - (sum g) pi  ==  pi * (-(gE (log pi + E)) - sum g)
        coef = grad_s.sum(-1, keepdim=True) if grad_s is not None else 0.0
        dy = logp.add_(entropy.unsqueeze(-1)).mul_(-grad_entropy.unsqueeze(-1)).sub_(coef).mul_(p)
        del p
    else:
        dy = logp.exp_().mul_(-grad_s.sum(-1, keepdim=True))
    if grad_s is not None:
        local, owned = shard.local_ids(ids)
        dy.scatter_add_(1, local, torch.where(owned, grad_s, 0.0).to(dy.dtype))
    if temperature != 1.0:
        dy /= temperature
    return dy
