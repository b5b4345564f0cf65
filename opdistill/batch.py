"""One optimizer step, any split: ``GlobalBatch``, ``aggregate``, the two layouts and the next-token alignment.

The bug class this module exists to prevent (verl issue 7200): a micro-batch loss normalised by *its own* token
count makes the accumulated gradient depend on how the step was cut -- 8x too large at micro-batch 1 vs 8 in that
report.  Here the normaliser is a ``GlobalBatch``, counted over every micro-batch of the step on every
data-parallel rank (one all-reduce) *before* any loss is computed, and ``aggregate`` cannot run without one.

Layouts:  padded  ``loss/mask [B, S]``, one row per sequence.
          packed  ``loss/mask [N]`` plus ``cu_seqlens [num_seqs + 1]`` (0, end_1, end_2, ..., N).
A sequence always lives in exactly one micro-batch (the per-sequence modes need its whole length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from .ops.checks import check_choice, check_float, check_int, check_mask

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def group_size(group) -> int:
    """World size of ``group``; 1 for ``group=None`` on a single process.

    ``group=None`` inside a multi-process run is refused: it would silently mean either "no reduction" or "the
    whole world", and both are wrong in some parallel layout.  Pass the data-parallel group explicitly.
    """
    if group is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                "group=None in a multi-process run is ambiguous: pass the data-parallel process group explicitly "
                "(dist.group.WORLD for pure data parallelism, the mesh's 'dp' group otherwise)"
            )
        return 1
    return dist.get_world_size(group)


@dataclass(frozen=True)
class GlobalBatch:
    """What one optimizer step looks like before it is split (SPEC 4).

    num_tokens         N: valid (mask = 1) tokens over every micro-batch of the step and every data-parallel rank
    num_seqs           B: sequences with at least one valid token, counted the same way
    dp_size            D: data-parallel world size (DDP/FSDP average gradients over D, so losses carry a factor D)
    loss_scale_factor  fixed divisor for ``seq-mean-token-sum-norm`` (never a padded width); None otherwise
    """

    num_tokens: int
    num_seqs: int
    dp_size: int = 1
    loss_scale_factor: float | None = None

    def __post_init__(self):
        for name in ("num_tokens", "num_seqs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"GlobalBatch.{name} must be an int >= 0, got {v!r}")
        if isinstance(self.dp_size, bool) or not isinstance(self.dp_size, int) or self.dp_size < 1:
            raise ValueError(f"GlobalBatch.dp_size must be an int >= 1, got {self.dp_size!r}")
        if self.num_seqs > self.num_tokens:
            raise ValueError(
                f"GlobalBatch.num_seqs ({self.num_seqs}) cannot exceed num_tokens ({self.num_tokens}): a counted "
                "sequence has at least one valid token"
            )
        lsf = self.loss_scale_factor
        if lsf is not None and (isinstance(lsf, bool) or not isinstance(lsf, (int, float)) or not math.isfinite(lsf) or lsf <= 0):
            raise ValueError(f"GlobalBatch.loss_scale_factor must be a finite number > 0 or None, got {lsf!r}")

    @classmethod
    def from_masks(
        cls,
        masks: torch.Tensor | Sequence[torch.Tensor],
        *,
        group=None,
        loss_scale_factor: float | None = None,
        cu_seqlens: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> "GlobalBatch":
        """Count N and B over this rank's micro-batch masks, then sum over ``group`` with one all-reduce.

        ``masks``: the response masks of *all* micro-batches of the step on this rank (padded ``[B, S]`` each, or
        packed ``[N]`` each with the matching ``cu_seqlens``).  Every rank of ``group`` must call this.
        """
        if isinstance(masks, torch.Tensor):
            masks = [masks]
            if cu_seqlens is not None:
                cu_seqlens = [cu_seqlens]
        masks = list(masks)
        if cu_seqlens is not None:
            cu_seqlens = list(cu_seqlens)
            if len(cu_seqlens) != len(masks):
                raise ValueError(f"cu_seqlens must have one entry per mask: got {len(cu_seqlens)} for {len(masks)} masks")
        dp_size = group_size(group)
        device = masks[0].device if masks else torch.device("cpu")
        n_tokens = torch.zeros((), dtype=torch.int64, device=device)
        n_seqs = torch.zeros((), dtype=torch.int64, device=device)
        for i, mask in enumerate(masks):
            m = check_mask(mask, f"masks[{i}]")
            per_seq = sequence_sums(m.to(torch.int64), None if cu_seqlens is None else cu_seqlens[i], f"masks[{i}]")
            n_tokens += per_seq.sum()
            n_seqs += (per_seq > 0).sum()
        counts = torch.stack([n_tokens, n_seqs])
        if dp_size > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)  # the one collective
        n, b = (int(v) for v in counts.tolist())
        return cls(num_tokens=n, num_seqs=b, dp_size=dp_size, loss_scale_factor=loss_scale_factor)

    def check_group(self, group) -> None:
        """Refuse a batch built for a different data-parallel size than ``group`` has."""
        size = group_size(group)
        if size != self.dp_size:
            raise ValueError(
                f"batch.dp_size={self.dp_size} disagrees with the group's size {size}: build the GlobalBatch with "
                "GlobalBatch.from_masks(..., group=<the data-parallel group>)"
            )


def check_cu_seqlens(cu_seqlens: torch.Tensor, n: int, name: str = "cu_seqlens") -> None:
    check_int(cu_seqlens, name)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must be 1-D [num_seqs + 1], got shape {tuple(cu_seqlens.shape)}")
    c = cu_seqlens.tolist()
    if c[0] != 0 or c[-1] != n or any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(f"{name} must start at 0, be non-decreasing and end at N={n}, got {c[:6]}{'...' if len(c) > 6 else ''}")


def sequence_sums(x: torch.Tensor, cu_seqlens: torch.Tensor | None, name: str = "mask") -> torch.Tensor:
    """Per-sequence sums: padded ``[B, S]`` -> ``[B]``; packed ``[N]`` + cu_seqlens -> ``[num_seqs]``."""
    if cu_seqlens is None:
        if x.dim() != 2:
            raise ValueError(
                f"{name} must be padded [B, S] (or packed [N] with cu_seqlens), got shape {tuple(x.shape)}"
            )
        return x.sum(-1)
    if x.dim() != 1:
        raise ValueError(f"{name} must be packed [N] when cu_seqlens is given, got shape {tuple(x.shape)}")
    check_cu_seqlens(cu_seqlens, x.shape[0])
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_index = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device), lengths.to(x.device))
    return torch.zeros(lengths.numel(), dtype=x.dtype, device=x.device).index_add(0, seq_index, x)


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    batch: GlobalBatch,
    *,
    cu_seqlens: torch.Tensor | None = None,
    group=None,
) -> torch.Tensor:
    """This micro-batch's share of the step's objective (SPEC 4); summing the micro-batch losses and averaging
    the gradients over the D data-parallel ranks gives exactly the full-batch objective.

    ============================  =============================================================
    token-mean                    sum(mask * l) * D / N
    token-sum                     sum(mask * l) * D
    seq-mean-token-sum            sum_s (sum_t mask * l) * D / B
    seq-mean-token-mean           sum_s (sum_t mask * l / n_s) * D / B   (empty sequences excluded)
    seq-mean-token-sum-norm       sum_s (sum_t mask * l) * D / (B * loss_scale_factor)
    ============================  =============================================================

    Masked entries are zeroed with ``where`` before any sum, so a NaN/inf there never leaks; N = 0 gives 0.
    ``group``, when given, is checked against ``batch.dp_size``.
    """
    if not isinstance(batch, GlobalBatch):
        raise TypeError(
            f"batch must be a GlobalBatch (counted over the whole step), got {type(batch).__name__}; there is no "
            "local-mean fallback: build one with GlobalBatch.from_masks(all micro-batch masks, group=...)"
        )
    check_choice(mode, "loss_agg_mode", AGG_MODES)
    check_float(loss, "loss")
    m = check_mask(mask, "mask")
    if m.shape != loss.shape:
        raise ValueError(f"mask must have the shape of loss {tuple(loss.shape)}, got {tuple(m.shape)}")
    if group is not None:
        batch.check_group(group)
    if mode == "seq-mean-token-sum-norm" and batch.loss_scale_factor is None:
        raise ValueError(
            "loss_agg_mode='seq-mean-token-sum-norm' needs a fixed loss_scale_factor (e.g. the max response length); "
            "GlobalBatch.loss_scale_factor is None"
        )
    local_tokens = int(m.sum())
    if local_tokens > batch.num_tokens:
        raise ValueError(
            f"mask has {local_tokens} valid tokens but batch.num_tokens={batch.num_tokens}: the GlobalBatch must be "
            "counted from the masks of every micro-batch of this step"
        )
    x = torch.where(m, loss, 0.0)
    D = batch.dp_size
    if mode == "token-mean":
        return x.sum() * (D / max(batch.num_tokens, 1))
    if mode == "token-sum":
        return x.sum() * D
    if cu_seqlens is None and loss.dim() == 1:
        raise ValueError(f"loss_agg_mode={mode!r} needs sequence boundaries: pass cu_seqlens for a packed [N] loss")
    seq_loss = sequence_sums(x, cu_seqlens, "loss")
    if mode == "seq-mean-token-mean":
        n_s = sequence_sums(m.to(x.dtype), cu_seqlens, "mask")
        seq_loss = seq_loss / n_s.clamp_min(1.0)
    total = seq_loss.sum() * (D / max(batch.num_seqs, 1))
    if mode == "seq-mean-token-sum-norm":
        total = total / batch.loss_scale_factor
    return total


def shift_for_next_token(
    token_ids: torch.Tensor, response_mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Align a causal LM's outputs with the tokens they predict, without slicing.

    The logits at position t (and the teacher's top-k row t, which a server returns for the token *after* t)
    predict token t+1.  Given ``token_ids`` and ``response_mask`` in token coordinates (mask = 1 on response
    tokens), returns ``targets[t] = token_ids[t+1]`` and ``target_mask[t] = response_mask[t+1]``, both the shape of
    ``token_ids``, so ``logits[t]``, ``teacher[t]``, ``targets[t]`` and ``target_mask[t]`` line up.  The last
    position of every sequence (and, packed, the position before the next sequence starts) predicts nothing.
    """
    check_int(token_ids, "token_ids")
    m = check_mask(response_mask, "response_mask")
    if m.shape != token_ids.shape:
        raise ValueError(f"response_mask must have the shape of token_ids {tuple(token_ids.shape)}, got {tuple(m.shape)}")
    targets = torch.zeros_like(token_ids)
    target_mask = torch.zeros_like(m)
    targets[..., :-1] = token_ids[..., 1:]
    target_mask[..., :-1] = m[..., 1:]
    if cu_seqlens is not None:
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be packed [N] when cu_seqlens is given, got {tuple(token_ids.shape)}")
        check_cu_seqlens(cu_seqlens, token_ids.shape[0])
        ends = cu_seqlens[1:].long() - 1  # last position of each sequence predicts nothing
        ends = ends[ends >= 0]
        target_mask[ends] = False
        targets[ends] = 0
    return targets, target_mask


def response_logits_slice(prompt_len: int, response_len: int) -> slice:
    """Rows of ``logits[:, rows]`` that predict the response tokens ``input_ids[:, prompt_len : prompt_len + response_len]``.

    The classic off-by-one: the first response token is predicted by the *last prompt* position.
    """
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1 (a response token is predicted by the position before it), got {prompt_len}")
    if response_len < 0:
        raise ValueError(f"response_len must be >= 0, got {response_len}")
    return slice(prompt_len - 1, prompt_len - 1 + response_len)


def pack(padded: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``[B, S, ...]`` with per-row ``lengths [B]`` -> packed ``[N, ...]`` and ``cu_seqlens [B + 1]``."""
    check_int(lengths, "lengths")
    if lengths.dim() != 1 or lengths.shape[0] != padded.shape[0]:
        raise ValueError(f"lengths must be [B] with B={padded.shape[0]}, got {tuple(lengths.shape)}")
    if bool((lengths < 0).any()) or bool((lengths > padded.shape[1]).any()):
        raise ValueError(f"lengths must lie in [0, {padded.shape[1]}], got {lengths.tolist()}")
    keep = torch.arange(padded.shape[1], device=padded.device).unsqueeze(0) < lengths.to(padded.device).unsqueeze(1)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    cu[1:] = lengths.long().cumsum(0)
    return padded[keep], cu


def unpack(packed: torch.Tensor, cu_seqlens: torch.Tensor, width: int, fill=0) -> torch.Tensor:
    """Inverse of ``pack``: packed ``[N, ...]`` -> right-padded ``[B, width, ...]`` filled with ``fill``."""
    check_cu_seqlens(cu_seqlens, packed.shape[0])
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    if lengths.numel() and int(lengths.max()) > width:
        raise ValueError(f"width={width} is shorter than the longest sequence ({int(lengths.max())})")
    out = packed.new_full((lengths.numel(), width) + tuple(packed.shape[1:]), fill)
    keep = torch.arange(width, device=packed.device).unsqueeze(0) < lengths.to(packed.device).unsqueeze(1)
    out[keep] = packed
    return out
