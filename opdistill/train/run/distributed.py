"""The trainer on torch.distributed: process group, data-parallel mesh, the student's wrapping, each rank's share.

``torchrun --nproc-per-node N -m opdistill train ...`` and plain ``opdistill train`` run the same loop; this module
holds everything that differs between them (docs/distributed.md):

- :func:`init_distributed` joins the process group torchrun describes (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the
  environment; backend ``auto`` = nccl on CUDA (``train.device: cuda``), gloo on CPU), or reuses
  one already initialized; a plain process
  gets a :class:`DistContext` of world size 1 with no group, and no collective ever runs. Before anything else every
  rank must hold rank 0's resolved config (:func:`agree_on_config`: a hash broadcast, the diff on a mismatch).
- Data parallelism: every rank owns a contiguous share of the step's prompts (``data.prompts_per_step`` must divide
  by the world size), so the ``rollout.n`` samples of a prompt (one GRPO group) stay on one rank. Sampling is keyed
  by (seed, step, global prompt index, sample index), so the same config draws the same samples at any world size.
- :func:`wrap_student`: FSDP2 ``fully_shard`` per decoder layer and at the root (default), or DDP. Rollouts and
  evaluation decode a different number of tokens on every rank, so they must not run collectives: under FSDP2 they
  run on a plain replica of the student refreshed from the sharded weights before each use
  (:meth:`DistContext.rollout_model`); under DDP the wrapped module itself has no collectives in its forward.
- ``distributed.tp_size > 1`` (opdistill/train/run/tensor_parallel.py): a (dp, tp) mesh, the student's lm_head
  sharded on the vocabulary over tp, every loss vocab-parallel; ``group``/``mesh`` are then the data-parallel ones (prompt
  shares, GlobalBatch, metrics) and ``world_group`` is every rank (rank 0's verdicts, checkpoints, the time limit).
- Rank 0 alone holds the run-directory lock and writes metrics, TensorBoard and checkpoint manifests; the others wait
  for its verdict (:meth:`DistContext.from_main`), so a refusal reaches every rank instead of a hang.
"""
from __future__ import annotations

import copy
import datetime
import hashlib
import json
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from opdistill.errors import ConfigError, UserError, quote
from opdistill.models import decoder_layers
from opdistill.runs.files import flatten_config
from opdistill.train.run.config import config_to_dict
from opdistill.train.run.placement import run_device
from opdistill.train.run.rules import check_backend, check_layout

__all__ = ["DistContext", "PeerError", "agree_on_config", "broadcast_bytes", "broadcast_text", "init_distributed",
           "launched_by_torchrun", "resolve_backend", "wrap_student"]


def broadcast_bytes(body: bytes | None, group, src_index: int = 0) -> bytes | None:
    """The ``body`` (or None) of the group's rank ``src_index`` (default its first) on every rank of ``group``, in
    two tensor broadcasts (a length, -1 for None, then the bytes): no pickle between ranks
    (``broadcast_object_list`` unpickles what it receives)."""
    src = dist.get_global_rank(group, src_index)
    data = None if body is None else torch.frombuffer(bytearray(body), dtype=torch.uint8)
    size = torch.tensor([-1 if data is None else data.numel()], dtype=torch.long)
    dist.broadcast(size, src=src, group=group)
    if int(size) < 0:
        return None
    if data is None:
        data = torch.empty(int(size), dtype=torch.uint8)
    if data.numel():
        dist.broadcast(data, src=src, group=group)
    return data.numpy().tobytes()


def broadcast_text(text: str | None, group, src_index: int = 0) -> str | None:
    """The ``text`` (or None) of the group's rank ``src_index`` on every rank of ``group`` (UTF-8,
    :func:`broadcast_bytes`)."""
    body = broadcast_bytes(None if text is None else text.encode(), group, src_index)
    return None if body is None else body.decode()


def agree_on_config(config: dict, group) -> None:
    """Refuse a job whose ranks resolved different configs (a rank started by hand with other overrides, another
    config file, another working copy): every rank would train on its own values while rank 0's config.yaml recorded
    one of them. Rank 0's SHA-256 of the canonical JSON is broadcast, each rank's verdict all-reduced (two small
    collectives when they agree); when one differs, the first differing rank's diff against rank 0 reaches every rank,
    which all raise the same :class:`ConfigError` (no rank is left waiting at a later collective)."""
    mine = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    digest = torch.tensor(list(hashlib.sha256(mine.encode()).digest()), dtype=torch.uint8)
    first = digest.clone()
    dist.broadcast(first, src=dist.get_global_rank(group, 0), group=group)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    differs = torch.zeros(world, dtype=torch.long)
    differs[me] = int(not torch.equal(first, digest))
    dist.all_reduce(differs, group=group)
    bad = [r for r in range(world) if differs[r]]
    if not bad:
        return
    reference = broadcast_text(mine, group)  # rank 0's config, to compute the diff
    diff = None
    if me == bad[0]:
        a, b = flatten_config(json.loads(reference)), flatten_config(json.loads(mine))
        diff = ", ".join(f"{k} {quote(a.get(k))} -> {quote(b.get(k))}" for k in sorted(set(a) | set(b))
                         if a.get(k) != b.get(k))
    diff = broadcast_text(diff, group, src_index=bad[0])
    raise ConfigError(f"distributed: rank {bad[0]} resolved another config than rank 0 ({diff}; ranks that differ "
                      f"from rank 0: {bad}); start every rank with the same config file and overrides")


def launched_by_torchrun() -> bool:
    """True when the environment describes a process group (torchrun, or any launcher setting the same variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def resolve_backend(name: str, device_type: str = "cpu") -> str:
    """``auto``: nccl for a run on CUDA devices (``train.device: cuda``), gloo on CPU (docs/distributed.md)."""
    if name == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    return name


class PeerError(UserError):
    """Another rank (rank 0 for the run directory) refused the run; this rank stops with its message."""

    kind = "error on another rank"


@dataclass
class DistContext:
    """Where this process sits in the job. ``group`` is the data-parallel group (None: one process, no collective)."""

    rank: int = 0
    world: int = 1
    group: object = None
    mesh: object = None
    strategy: str = "none"  # none | ddp | fsdp2
    decode: str = "replica"  # distributed.decode: what rollouts decode with under fsdp2 (replica | sharded)
    owns_group: bool = False  # init_distributed created the process group (and destroys it on close)
    # distributed.tp_size > 1 (train/run/tensor_parallel.py): ``group`` and ``mesh`` are then the data-parallel ones,
    # ``rank``/``world`` stay global; the tp ranks of a dp rank share its rows
    tp: object = None  # TensorParallel, or None at tp_size 1
    dp_rank: int | None = None  # None: rank (tp_size 1)
    dp_world: int | None = None  # None: world
    all_group: object = None  # every rank (rank 0's verdicts, checkpoints, the time limit); None: group
    _replica: object = field(default=None, repr=False)
    _replica_of: object = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        return self.group is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp(self) -> tuple[int, int]:
        """(data-parallel rank, data-parallel size): the rank and world at tp_size 1."""
        return (self.rank if self.dp_rank is None else self.dp_rank,
                self.world if self.dp_world is None else self.dp_world)

    @property
    def tp_leader(self) -> bool:
        """Whether this rank makes its data-parallel rank's rollouts and teacher requests: the first rank of its tp
        group (every rank at tp_size 1); its tp peers receive them (opdistill/train/steps/share.py)."""
        return self.tp is None or dist.get_rank(self.tp.group) == 0

    @property
    def world_group(self):
        """The group of every rank (the data-parallel group at tp_size 1)."""
        return self.group if self.all_group is None else self.all_group

    @property
    def vocab_kwargs(self) -> dict:
        """``vocab_group``/``vocab_size`` of the student's logits for the losses ({} at tp_size 1)."""
        return {} if self.tp is None else self.tp.loss_kwargs

    def share(self, total: int) -> tuple[int, int]:
        """(offset, count) of this rank's contiguous share of ``total`` items (``total`` divides by the dp size);
        the same on the tp ranks of one data-parallel rank."""
        rank, world = self.dp
        n = total // world
        return rank * n, n

    def split(self, total: int) -> tuple[int, int]:
        """(offset, count) of this rank's contiguous part of ``total`` items, any ``total`` (the first ranks get one
        more when it does not divide)."""
        rank, world = self.dp
        base, extra = divmod(total, world)
        start = rank * base + min(rank, extra)
        return start, base + (rank < extra)

    # -- collectives (no-ops at world size 1) -------------------------------------------------------------------
    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.world_group)

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over the ranks, in float64."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t.tolist()

    def max(self, value: float) -> float:
        """The maximum over every rank (tp ranks included: a time limit must stop them all at the same step)."""
        t = torch.tensor([value], dtype=torch.float64)
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.world_group)
        return float(t)

    def broadcast_text(self, text: str | None) -> str | None:
        """Rank 0's ``text`` on every rank (:func:`broadcast_text`)."""
        return broadcast_text(text, self.world_group) if self.enabled else text

    def from_main(self, fn, *args, **kwargs):
        """Run ``fn`` on rank 0 only and hand its outcome to every rank: rank 0 returns ``fn``'s result, the others
        ``None``; an exception of ``fn`` is raised on rank 0 and, as a :class:`PeerError` with its message, on the
        others (instead of leaving them waiting at the next collective)."""
        if not self.enabled:
            return fn(*args, **kwargs)
        result, error = None, None
        if self.is_main:
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 -- re-raised below, after the others have heard of it
                error = e
        why = broadcast_text(None if error is None else f"{type(error).__name__}: {error}", self.world_group)
        if error is not None:
            raise error
        if why is not None:
            raise PeerError(f"rank 0 stopped the run ({why})")
        return result

    # -- the student --------------------------------------------------------------------------------------------
    def rollout_model(self, model):
        """The module to decode with (rollouts, evaluation). Under FSDP2 the plain replica, refreshed from the
        sharded weights (every rank must call this at the same point; no collective in its forward); with
        ``distributed.decode: sharded`` the FSDP2 student itself (the sampler runs its forwards in step with the
        other ranks); otherwise ``model`` itself (the wrapped module under DDP)."""
        if self._replica is None:
            return getattr(model, "module", model)
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for name, p in model.named_parameters():
                full = p.full_tensor() if isinstance(p, DTensor) else p
                self._replica.get_parameter(name).copy_(full)
        return self._replica

    def full_weights(self, model) -> dict[str, torch.Tensor]:
        """The student's parameters and buffers, whole, as CPU copies keyed by the plain module's names (a
        collective under FSDP2: every rank calls this at the same point; a sharded tensor is gathered whole)."""
        from torch.distributed.tensor import DTensor

        model = getattr(model, "module", model)  # DDP
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().to("cpu", copy=True)
                for k, v in model.state_dict().items()}

    def decoding_copy(self, model):
        """A plain copy of the student to decode with in another thread (the pipelined step): no collective in its
        forward (a copy of the FSDP2 replica, of the module DDP wraps, or of ``model``); frozen."""
        base = self._replica if self._replica is not None else getattr(model, "module", model)
        return copy.deepcopy(base).requires_grad_(False)

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def init_distributed(cfg) -> DistContext:
    """The process layout of a run of trainer config ``cfg`` (its ``distributed``, ``data``, ``eval`` sections)."""
    dc = cfg.distributed
    if not (dist.is_available() and (dist.is_initialized() or launched_by_torchrun())):
        return DistContext()
    if dist.is_initialized() and dist.get_world_size() == 1 and not launched_by_torchrun():
        # a one-process group someone else made (an in-process vLLM engine initializes one): train as one process
        return DistContext()
    owns = False
    device = run_device(cfg)  # train.device: cpu, or cuda:LOCAL_RANK (opdistill/train/run/placement.py)
    if not dist.is_initialized():
        check_backend(cfg)  # before the group exists (opdistill/train/run/rules.py)
        backend = resolve_backend(dc.backend, device.type)
        if backend == "nccl":  # the loop also reduces small CPU tensors: those go through gloo
            torch.cuda.set_device(device)
            backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=dc.timeout_s))
        owns = True
    world, rank = dist.get_world_size(), dist.get_rank()
    ctx = DistContext(rank=rank, world=world, strategy=dc.strategy, decode=dc.decode, owns_group=owns)
    try:
        from opdistill.train.run.tensor_parallel import build_mesh

        agree_on_config(config_to_dict(cfg), dist.group.WORLD)  # before anything else reads the config
        check_layout(cfg, world)  # every rank the same verdict: the config agreed (opdistill/train/run/rules.py)
        if dc.tp_size > 1:
            build_mesh(ctx, dc.tp_size, device.type)  # (dp, tp): ctx.mesh and ctx.group become the data-parallel ones
        else:
            from torch.distributed.device_mesh import init_device_mesh

            ctx.mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
            ctx.group = ctx.mesh.get_group()
    except BaseException:
        ctx.close()
        raise
    return ctx


def wrap_student(ctx: DistContext, student):
    """The student as trained by ``ctx``: unchanged at world size 1 without a group, else FSDP2 (each decoder layer,
    then the root, sharded over the data-parallel mesh; a plain replica kept for decoding) or DDP."""
    if not ctx.enabled:
        return student
    if ctx.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(student, process_group=ctx.group)
    from torch.distributed.fsdp import fully_shard

    if ctx.decode == "replica":  # decode: sharded decodes from the FSDP2 student itself (engines/sampler.py)
        ctx._replica = copy.deepcopy(student).requires_grad_(False).eval()
    if ctx.tp is not None:  # the lm_head (and a tied embedding) sharded on the vocabulary over tp, before FSDP2
        from opdistill.train.run.tensor_parallel import shard_student

        shard_student(student, ctx.tp)
    for layer in decoder_layers(student):
        fully_shard(layer, mesh=ctx.mesh)
    if ctx.decode == "sharded":
        for module in reversed(_outside_layers(student)):  # inner modules first
            fully_shard(module, mesh=ctx.mesh)
    fully_shard(student, mesh=ctx.mesh)
    return student


def _outside_layers(student) -> list:
    """The modules outside the decoder layers that hold parameters, other than the input embedding and lm_head (the
    final norm): their own FSDP2 units under ``distributed.decode: sharded``, so that the root unit holds only the
    vocabulary-sized weights, which decoding uses by rows without gathering them (engines/sampler.py ``Lockstep``)."""
    vocab = [m for m in (student.get_input_embeddings(), student.get_output_embeddings()) if m is not None]
    skip = {id(p) for m in [*decoder_layers(student), *vocab] for p in m.parameters()}
    out = []
    for module in student.modules():
        own = list(module.parameters(recurse=False))
        if module is not student and own and not any(id(p) in skip for p in own):
            out.append(module)
    return out
