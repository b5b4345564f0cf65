"""GEMM helpers shared by every fused op: fp32 logits of one token chunk, and the GEMMs of its gradient.

Design: the fused ops loop over chunks of tokens; each chunk holds the full vocabulary row of its tokens (so a
row's log-sum-exp, gathered values and top-K are complete inside the chunk), never more than one chunk of logits
at a time.  Every GEMM that produces logits accumulates *and stores* in fp32 (fp64 for fp64 inputs): bf16/fp16
logits are never rounded to bf16/fp16 before the softmax.  Where the backend has no bf16 x bf16 -> fp32 GEMM
(PyTorch on CPU), the weight is upcast one vocabulary block at a time, so no fp32 copy of the whole weight exists.

The softmax math on a chunk (log-sum-exp, gather, logit gradient, top-K, over a vocabulary that may be sharded over
a process group) is not here: it is the vocab-sharded stages of ``opdistill.parallel.stages``, which every path
shares.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from ..ops.checks import compute_dtype
from ..parallel.shard import all_reduce_

# Bytes of one fp32 chunk of logits [chunk, V]; the working set of a chunk is about three of these.
DEFAULT_CHUNK_BYTES = 128 * 2**20
# Bytes of one upcast weight block [rows, H] when the backend cannot multiply bf16 into fp32 directly.
UPCAST_BLOCK_BYTES = 32 * 2**20
# A GEMM with fewer rows than this runs far below peak; the chunk never goes below it (unless N does).
MIN_CHUNK_ROWS = 32
# Rows at which the chunk's GEMMs run at about their large-matrix rate on CPU (fp32, H = 512, V = 151,936, 2 threads,
# GFLOP per CPU-second: 128 rows 40, 256 ~52, 512 ~60, 1024 ~61). The two-head loss runs four GEMMs per chunk and
# nothing else of their size, so it takes chunks this tall (``min_rows``) where the top-k ops keep the byte budget.
# A bf16 weight upcast block by block (``mm_fp32`` on CPU) runs at one rate from 256 rows up (~78 GFLOP per CPU-second
# at 256, 512 and 1024): half the rows, half the chunk's memory.
GEMM_ROWS = 512
GEMM_ROWS_UPCAST = 256


def default_chunk_size(n_tokens: int, vocab: int, hidden: int, *, upcast: bool = False, buffers: int = 1,
                       min_rows: int = MIN_CHUNK_ROWS) -> int:
    """Rows per chunk: as many as fit ``DEFAULT_CHUNK_BYTES`` of fp32 logits (twice that when ``upcast``: the
    low-precision weight is then converted block by block once per chunk, a cost amortised over the chunk's rows),
    at least ``min_rows`` (GEMM efficiency) and, when the vocabulary is small next to the hidden size, at least
    ``hidden // 4`` rows (the chunk's GEMM then costs more than its logits buffer is worth saving); at most N.
    ``buffers``: chunk-sized logit buffers alive at once (the JSD holds student and teacher: 2), dividing the rows."""
    budget = DEFAULT_CHUNK_BYTES * (2 if upcast else 1)
    rows = max(budget // (4 * max(vocab, 1)), MIN_CHUNK_ROWS)
    if vocab < hidden:
        rows = max(rows, hidden // 4)
    return max(1, min(n_tokens, max(rows // buffers, min_rows)))


def chunk_rows(chunk_size, hidden: torch.Tensor, weight: torch.Tensor, width: int | None = None,
               buffers: int = 1, min_rows: int = MIN_CHUNK_ROWS) -> int:
    """``chunk_size`` checked (an int >= 1, or None: ``default_chunk_size`` for hidden ``[..., H]`` and weight
    ``[V, H]``; ``width``: the hidden size to plan for, default H)."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be an int >= 1 or None (automatic), got {chunk_size!r}")
    if chunk_size is not None:
        return chunk_size
    H = hidden.shape[-1]
    return default_chunk_size(hidden.numel() // max(H, 1), weight.shape[0], width or H,
                              upcast=needs_upcast(hidden, weight), buffers=buffers, min_rows=min_rows)


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


def chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """z / tau for one chunk, ``[c, V_local]`` in the compute dtype (fp32 for bf16/fp16, never rounded)."""
    z = mm_fp32(h, weight)
    if bias is not None:
        z += bias.to(z.dtype)
    if temperature != 1.0:
        z /= temperature
    return z


class LinearGrads:
    """The gradients of (hidden, weight, bias) of z = h W^T + b, summed from each chunk's dL/dz in fp32 (fp64 for
    fp64) buffers, so a bf16 weight's gradient is rounded once, not once per chunk:

        grad_hidden[chunk] = dL/dz @ W,    grad_W += dL/dz^T @ hidden[chunk],    grad_b += sum_rows dL/dz
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, needs, dtype):
        self.inputs = (hidden, weight, bias)
        self.grads = [torch.zeros(x.shape, dtype=dtype, device=x.device) if need else None
                      for x, need in zip(self.inputs, needs)]

    def add(self, rows: slice, dz: torch.Tensor) -> None:
        hidden, weight, _ = self.inputs
        gh, gw, gb = self.grads
        if gh is not None:
            gh[rows] = grad_hidden_mm(dz, weight)
        if gw is not None:
            grad_weight_addmm_(gw, dz, hidden[rows], weight.dtype)
        if gb is not None:
            gb += dz.sum(0)

    def result(self, shard=None) -> tuple:
        """(grad_hidden, grad_weight, grad_bias) in the inputs' dtypes, None where not needed.  With a vocabulary
        shard of a group, the hidden gradient is all-reduced: hidden is replicated, each rank's rows give a part."""
        if self.grads[0] is not None and shard is not None:
            all_reduce_(self.grads[0], dist.ReduceOp.SUM, shard)
        return tuple(None if g is None else g.to(x.dtype) for g, x in zip(self.grads, self.inputs))
