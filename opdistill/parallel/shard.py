"""Where a vocabulary shard lives, and the few collectives the vocab-parallel ops issue.

A rank of a tensor-parallel group of size P holds the logit columns ``[start, start + width)`` of the vocabulary.
Two layouts are accepted:

* a plain tensor: Megatron's layout.  Every rank holds ``Vl`` columns, rank r starts at ``r * Vl``; the true
  vocabulary ``vocab_size`` may be smaller than ``P * Vl`` (Megatron pads the vocab to a multiple of P * 128), and
  the columns at or beyond ``vocab_size`` are padding: they get no probability mass and a zero gradient.
* a ``DTensor`` sharded on its last dim (``Shard(-1)``, e.g. the output of ``ColwiseParallel(use_local_output=False)``):
  its mesh dim gives the group and ``torch.chunk`` semantics give each rank's offset and (possibly uneven) width.

Every collective goes through the functions below, which skip the call when the group has one rank, so a
group of size 1 (or ``group=None`` on one process) runs no collective at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# Rows of logits converted to the compute dtype at a time (forward and backward), so no path holds a full
# fp32 copy of a [tokens, V/P] shard: 2**22 elements = 16 MiB in fp32.
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary: the one description every vocab-sharded stage reads.

    group       the tensor-parallel process group (None on a single process)
    size, rank  the group's size and this rank's index in it
    start       global id of local column 0
    width       local columns that are real vocabulary (<= local_width; the rest is padding)
    vocab_size  the true vocabulary size V
    local_width local columns in all (Vl), padding included
    equal_widths  plain-tensor layout: every rank must hold the same number of columns (checked for free in
                the first all-reduce, see ``all_reduce_max_checked``); False for a DTensor (torch.chunk widths) and
                for lm_head row shards (``for_rows``: the offsets were all-gathered)
    local       the local logits ``[..., Vl]`` given to ``resolve_shard`` (the DTensor's local shard); None from
                ``for_rows``
    """

    group: object
    size: int
    rank: int
    start: int
    width: int
    vocab_size: int
    local_width: int
    equal_widths: bool = False
    local: torch.Tensor | None = None

    @classmethod
    def for_rows(cls, rows: int, group, device) -> "VocabShard":
        """The shard of an lm_head whose ``rows`` vocabulary rows sit on this rank, ranks in order, widths possibly
        uneven.  One all_gather of the widths (none for a group of one rank): build it once per call."""
        size, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
        if size == 1:
            return cls(group, 1, 0, 0, rows, rows, rows)
        widths = torch.zeros(size, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(widths, torch.tensor([rows], dtype=torch.int64, device=device), group=group)
        start = int(widths[:rank].sum())
        return cls(group, size, rank, start, rows, int(widths.sum()), rows)


def _group_size_rank(group) -> tuple[int, int]:
    if group is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                "group=None in a multi-process run is ambiguous for a vocab-parallel op: pass the tensor-parallel "
                "process group that shards the vocabulary (e.g. mesh['tp'].get_group()), or a DTensor"
            )
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _dtensor_shard(x, name: str):
    """(local tensor, group, start, global V) for a DTensor sharded on its last dim."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    last = x.dim() - 1
    mesh_dims = [d for d, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim in (-1, last)]
    others = [p for d, p in enumerate(x.placements) if d not in mesh_dims and not isinstance(p, Replicate)]
    if len(mesh_dims) != 1 or others:
        raise ValueError(
            f"{name} as a DTensor must be sharded on its last (vocabulary) dim over exactly one mesh dim and "
            f"replicated on the others, got placements {tuple(x.placements)}"
        )
    mesh_dim = mesh_dims[0]
    group = x.device_mesh.get_group(mesh_dim)
    _, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
    return x.to_local(), group, int(offset[-1]), x.shape[-1]


def is_dtensor(x) -> bool:
    if not dist.is_available():  # builds without torch.distributed have no DTensor either
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def resolve_shard(logits, group, vocab_size: int | None, name: str = "local_logits") -> VocabShard:
    """Turn (logits shard or DTensor, group, vocab_size) into a ``VocabShard``; raises on an inconsistent layout."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or DTensor, got {type(logits).__name__}")
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
        raise ValueError(f"vocab_size must be an int >= 1 or None, got {vocab_size!r}")
    dtensor = is_dtensor(logits)
    if dtensor:
        if group is not None:
            raise ValueError(f"{name} is a DTensor: its mesh gives the group; pass group=None")
        local, group, start, global_v = _dtensor_shard(logits, name)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        V = global_v if vocab_size is None else vocab_size
        if V > global_v:
            raise ValueError(f"vocab_size={V} exceeds the DTensor's vocabulary dim {global_v}")
    else:
        local = logits
        size, rank = _group_size_rank(group)
        if local.dim() < 1:
            raise ValueError(f"{name} must have shape [..., V/tp], got {tuple(local.shape)}")
        vl = local.shape[-1]
        start = rank * vl
        V = size * vl if vocab_size is None else vocab_size
        if V > size * vl:
            raise ValueError(
                f"vocab_size={V} exceeds the {size} shards of {vl} columns ({size * vl} in all): every rank must hold "
                "an equal shard of the (padded) vocabulary, rank r owning columns [r * Vl, (r + 1) * Vl)"
            )
    width = max(0, min(local.shape[-1], V - start))
    return VocabShard(group=group, size=size, rank=rank, start=start, width=width, vocab_size=V,
                      local_width=local.shape[-1], equal_widths=not dtensor, local=local)


# -- collectives: each is skipped for a group of one rank ---------------------------------------------------------
def all_reduce_(x: torch.Tensor, op, shard: VocabShard) -> torch.Tensor:
    if shard.size > 1:
        dist.all_reduce(x, op=op, group=shard.group)
    return x


def all_reduce_max_checked(x: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """All-reduce MAX of ``x [N, ...]``, carrying (Vl, -Vl) in the same message to check that every rank holds
    the same number of columns (rank r's offset is r * Vl only then); raises on every rank alike otherwise."""
    if shard.size == 1:
        return x
    vl = shard.local_width
    both = torch.cat([x.reshape(-1), torch.tensor([vl, -vl], dtype=x.dtype, device=x.device)])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=shard.group)
    widest, narrowest = int(both[-2]), -int(both[-1])
    if shard.equal_widths and widest != narrowest:
        raise ValueError(
            f"the vocabulary shards have unequal widths ({narrowest} to {widest} columns): a plain-tensor shard must "
            "follow Megatron's layout (equal widths, rank r owning columns [r * Vl, (r + 1) * Vl); pad the vocabulary "
            "and pass vocab_size), or pass a DTensor sharded on the last dim (torch.chunk widths)"
        )
    return both[:-2].view_as(x)


def all_gather_cat(x: torch.Tensor, shard: VocabShard, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim``, rank order."""
    if shard.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(shard.size)]
    dist.all_gather(parts, x.contiguous(), group=shard.group)
    return torch.cat(parts, dim=dim)


def row_chunks(rows: int, width: int):
    """Slices over the rows so that one chunk holds about ``CHUNK_ELEMENTS`` logits."""
    step = max(1, CHUNK_ELEMENTS // max(width, 1))
    for lo in range(0, rows, step):
        yield slice(lo, min(rows, lo + step))


def zero_masked_rows(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``where(keep[..., None], x, 0)`` for logits ``[..., V]`` or a DTensor sharded on its last dim (applied to the
    local shard): what a masked position holds (padding garbage, NaN) then reaches no value and no gradient."""
    if is_dtensor(x):
        from torch.distributed.tensor import DTensor

        local = torch.where(keep.unsqueeze(-1), x.to_local(), 0.0)
        return DTensor.from_local(local, x.device_mesh, x.placements, shape=x.shape, stride=x.stride())
    return torch.where(keep.unsqueeze(-1), x, 0.0)
