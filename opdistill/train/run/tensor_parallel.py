"""The student's vocabulary-parallel lm_head under torchrun (``distributed.tp_size > 1``; docs/distributed.md).

The world of W ranks is a (dp, tp) DeviceMesh of shape (W / tp, tp), ranks laid out row-major: the tp ranks of one
data-parallel rank are consecutive (one node's GPUs). On that mesh:

- the student's lm_head is sharded on the vocabulary over ``tp`` with DTensor ``ColwiseParallel`` (weight rows
  ``Shard(0)``, input ``Replicate``, output ``Shard(-1)`` handed on as this rank's local logits). Its output is
  padded to ``ceil(V / tp)`` columns when V does not divide by tp (DTensor shards follow ``torch.chunk``: rank r
  owns ids ``[r c, r c + c)``, c = ceil(V / tp), the last ranks fewer), which is Megatron's layout with the true
  vocabulary ``V``: the padding columns get no mass and no gradient in the vocab-parallel losses;
- a tied input embedding (``tie_word_embeddings``: the demo models, SmolLM2, Qwen3 <= 4B) is sharded alike on its
  rows (``RowwiseParallel``: each rank looks up the ids it owns, one all-reduce) and tied again to the lm_head: one
  DTensor parameter, whose gradient sums the lookup's and the lm_head's;
- every other parameter is replicated over tp and sharded (FSDP2) or replicated (DDP) over dp, as at tp = 1.

Every rank of a tp group holds the same rows (prompt shares come from the dp rank), so the per-token losses,
computed by ``opdistill.parallel`` over the tp group (``DistillationLoss(vocab_group=tp, vocab_size=V)``), are
identical on them, and the gradient each rank computes for its logit columns is exact. The hidden state's gradient
from one shard is partial; ``ColwiseParallel``'s input (``DTensor.from_local(..., Replicate())``) turns it back into
the sum over the tp ranks in backward (one all-reduce), so the replicated parameters get the full gradient on every
tp rank (tested against tp = 1, and seen to fail without that all-reduce).

Decoding (rollouts, evaluation) runs on a plain replica of the student with the full lm_head, refreshed from the
sharded weights before each use (``DistContext.rollout_model``): a decode step must run no collective (dp ranks
decode different numbers of tokens), and decoding needs the full next-token distribution anyway.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from opdistill.errors import ConfigError

__all__ = ["TensorParallel", "shard_student"]


@dataclass
class TensorParallel:
    """The tp side of a run: the tp mesh and group, and what the losses need (``loss_kwargs``)."""

    size: int
    mesh: object  # the 1-D tp submesh
    group: object
    vocab_size: int = 0

    @property
    def loss_kwargs(self) -> dict:
        """``vocab_group`` / ``vocab_size`` for ``DistillationLoss`` and ``select_backend``."""
        return {"vocab_group": self.group, "vocab_size": self.vocab_size}


def _module_path(root, module) -> str:
    for name, m in root.named_modules():
        if m is module:
            return name
    raise ValueError("module not found in the student")


def shard_student(student, tp: TensorParallel) -> None:
    """Shard ``student``'s lm_head (and a tied input embedding) on the vocabulary over ``tp.mesh``, in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    head = student.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ConfigError(f"distributed.tp_size={tp.size}: the student's output embedding is "
                          f"{type(head).__name__}, not an nn.Linear lm_head; set distributed.tp_size=1")
    embed = student.get_input_embeddings()
    tied = embed is not None and embed.weight is head.weight
    V = head.out_features
    if V < tp.size:
        raise ConfigError(f"distributed.tp_size={tp.size}: larger than the student's vocabulary ({V}); set "
                          f"distributed.tp_size to a divisor of the world size of at most {V}")
    plan = {_module_path(student, head): ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)}
    if tied:
        plan[_module_path(student, embed)] = RowwiseParallel(input_layouts=Replicate())
    parallelize_module(student, tp.mesh, plan)
    if tied:  # two DTensor parameters now, of the same Shard(0) layout: one again
        head.weight = embed.weight
    width = -(-V // tp.size)  # torch.chunk's shard width
    if V % tp.size:
        def pad(_module, _inputs, out):  # rank r owns ids [r * width, ...): Megatron's layout, padded to width
            return F.pad(out, (0, width - out.shape[-1])) if out.shape[-1] < width else out

        head.register_forward_hook(pad)
    tp.vocab_size = V


def build_mesh(ctx, tp_size: int, device_type: str = "cpu") -> None:
    """The (dp, tp) mesh of ``ctx``'s world: ``ctx.mesh``/``ctx.group`` become the dp ones, ``ctx.tp`` the tp side,
    ``ctx.dp_rank``/``ctx.dp_world`` this rank's data-parallel coordinates, ``ctx.all_group`` every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (ctx.world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    ctx.mesh, ctx.group = mesh["dp"], mesh.get_group("dp")
    ctx.tp = TensorParallel(size=tp_size, mesh=mesh["tp"], group=mesh.get_group("tp"))
    ctx.dp_rank, ctx.dp_world = mesh.get_local_rank("dp"), ctx.world // tp_size
    ctx.all_group = dist.group.WORLD
