"""An embedding or lm_head weight ``[V, H]`` held by vocabulary rows over a group, used without gathering it (a
scaled embedding's multiplier applied to the rows it looks up, as Gemma's forward does).

FSDP2 shards a parameter on dim 0 (``Shard(0)``, ``torch.chunk`` widths: rank r holds rows ``[r c, r c + c)``,
c = ceil(V / P), the last ranks fewer, possibly none). For an input embedding or an lm_head those rows are
vocabulary ids. The ranks of a data-parallel group decode different rows, so each call first pads every rank's
inputs to the longest (one all-gather of the counts) and all-gathers them; then:

- the lookup: each rank looks up every rank's ids it owns (zeros for the others'), and a reduce-scatter (sum)
  hands each rank the rows of its own ids. Every id is owned by exactly one rank, so the sum adds zeros to one
  row: the whole weight's lookup, bit for bit;
- the logits: each rank computes every rank's hidden states against its rows, padded to c columns, and an
  all-to-all hands each rank its own rows' columns from every rank; the padding is cut. Each logit is the whole
  weight's dot product (up to the rounding of another GEMM shape).

Per call: 2 all-gathers (counts, inputs) and 1 reduce-scatter or all-to-all, over ``P x (longest input)``
elements; no rank ever holds the whole ``[V, H]`` weight. Decoding from an FSDP2 student (``distributed.decode:
sharded``, engines/sampler.py) uses this for its vocabulary-sized root weights. Forward only (decoding runs under
no_grad).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .shard import VocabShard
from .stages import owned_local_ids

__all__ = ["VocabRows"]


class VocabRows:
    """``local`` [w_r, H]: this rank's rows of a [V, H] weight split over ``group`` in rank order (widths may differ;
    one all-gather of them here, so build it at the same point on every rank). Every rank of the group must make
    the same calls in the same order, each with its own inputs (module notes)."""

    def __init__(self, local: torch.Tensor, group, *, scale: torch.Tensor | None = None):
        if local.dim() != 2:
            raise ValueError(f"VocabRows: expected this rank's rows of a [V, H] weight, got shape {tuple(local.shape)}")
        self.group, self.scale = group, scale  # scale: what a scaled embedding multiplies its rows by (Gemma's)
        self.widths = self._gather_counts(local.shape[0])
        size, rank = len(self.widths), dist.get_rank(group)
        self.local = local
        self.shard = VocabShard(group, size, rank, sum(self.widths[:rank]), local.shape[0], sum(self.widths),
                                max(self.widths))

    @property
    def vocab_size(self) -> int:
        return self.shard.vocab_size

    def _gather_counts(self, n: int) -> list[int]:
        counts = torch.zeros(dist.get_world_size(self.group), dtype=torch.int64)
        dist.all_gather_into_tensor(counts, torch.tensor([n], dtype=torch.int64), group=self.group)
        return counts.tolist()

    def _gather_padded(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``x`` [n, ...] of this rank -> every rank's, padded to the longest m: ``[P, m, ...]``; and m."""
        m = max(self._gather_counts(x.shape[0]))
        padded = x.new_zeros(m, *x.shape[1:])
        padded[: x.shape[0]] = x
        out = x.new_empty(len(self.widths) * m, *x.shape[1:])
        dist.all_gather_into_tensor(out, padded.contiguous(), group=self.group)
        return out.view(len(self.widths), m, *x.shape[1:]), m

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """``[...]`` ids -> ``[..., H]``: the whole weight's rows at ``ids`` (module notes)."""
        flat = ids.reshape(-1)
        if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < self.vocab_size:
            raise IndexError(f"VocabRows.lookup: ids must be in [0, {self.vocab_size}), got "
                             f"{int(flat.min())}..{int(flat.max())}")
        every, m = self._gather_padded(flat)  # [P, m]: padding id 0 is looked up and dropped
        owned, at = owned_local_ids(self.shard, every)
        H = self.local.shape[1]
        if self.local.shape[0] == 0:  # no rows here: only zeros to add
            mine = self.local.new_zeros(*every.shape, H)
        else:
            mine = torch.where(owned[..., None], F.embedding(at, self.local), 0.0)
        out = self.local.new_empty(m, H)
        dist.reduce_scatter_tensor(out, mine.reshape(-1, H), op=dist.ReduceOp.SUM, group=self.group)
        out = out[: flat.shape[0]].view(*ids.shape, H)
        # a scaled embedding (Gemma: sqrt(H)) multiplies the looked-up rows, in the weight's dtype as its forward does
        return out if self.scale is None else out * self.scale.to(self.local.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., V]``: ``hidden @ W^T`` of the whole weight (module notes)."""
        lead, H = hidden.shape[:-1], hidden.shape[-1]
        flat = hidden.reshape(-1, H)
        every, m = self._gather_padded(flat)  # [P, m, H]
        z = F.linear(every, self.local)  # [P, m, w_r]: every rank's rows against this rank's columns
        c = self.shard.local_width
        if z.shape[-1] < c:
            z = F.pad(z, (0, c - z.shape[-1]))
        got = torch.empty_like(z)
        dist.all_to_all_single(got, z.contiguous(), group=self.group)  # got[r]: rank r's columns of this rank's rows
        full = torch.cat([got[r, :, :w] for r, w in enumerate(self.widths)], dim=-1)
        return full[: flat.shape[0]].view(*lead, self.vocab_size)
