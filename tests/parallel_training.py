"""End-to-end data-parallel exactness (tiny Llama, 3 AdamW steps) and the launch targets of test_parallel_dist.

``ranks2``: ops at tp=2 (+ size-1 groups, unequal shards, DTensor, DistillationLoss back-end, saved bytes), DDP and
FSDP2.  ``ranks4``: ops at tp=4 and the 2x2 (dp x tp) mesh with a vocab-sharded lm_head.  The training runs save
final parameters and reduced metrics to ``out_dir`` for the test to compare with the one-process run.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from opdistill.batch import GlobalBatch
from opdistill.loss import DistillationConfig, DistillationLoss, TeacherTopK
from opdistill.metrics import MetricSums

from .parallel_op_checks import (
    K,
    check_confident_tail,
    check_distillation_loss,
    check_dtensor,
    check_ops,
    check_random_sweep,
    check_saved_bytes,
    check_size_one_groups,
    check_unequal_widths,
    check_vocab_rows,
)

# -- end-to-end data-parallel exactness ----------------------------------------------------------------------------
TRAIN_V, TRAIN_STEPS, PROMPT = 45, 3, 2
LENGTHS = [5, 9, 3, 12, 7, 4, 10, 6]  # 8 ragged sequences: 4 micro-batches of 2
TRAIN_CFG = dict(support="tail", divergence="forward", loss_agg_mode="seq-mean-token-mean")


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=TRAIN_V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).to(torch.float64)


def global_batch_data():
    """The fixed step: per sequence its tokens, target mask (next-token, response only) and teacher top-k rows."""
    g = torch.Generator().manual_seed(1234)
    seqs = []
    for n in LENGTHS:
        tokens = torch.randint(0, TRAIN_V, (n,), generator=g)
        response = torch.arange(n) >= PROMPT
        mask = torch.zeros(n, dtype=torch.bool)
        mask[:-1] = response[1:]  # row t predicts token t + 1
        teacher = torch.log_softmax(torch.randn(n, TRAIN_V, generator=g, dtype=torch.float64) * 2, -1)
        ids = torch.topk(teacher, K, -1).indices
        seqs.append((tokens, mask, ids, teacher.gather(1, ids)))
    return seqs


def micro_batch(seqs, packed: bool):
    """Padded [b, S] (right padding, garbage teacher rows on the padding) or packed [N] with cu_seqlens."""
    if packed:
        tokens = torch.cat([s[0] for s in seqs])
        pos = torch.cat([torch.arange(len(s[0])) for s in seqs])
        cu = torch.tensor([0] + [len(s[0]) for s in seqs]).cumsum(0)
        return dict(tokens=tokens[None], pos=pos[None], mask=torch.cat([s[1] for s in seqs]),
                    ids=torch.cat([s[2] for s in seqs]), lp=torch.cat([s[3] for s in seqs]), cu=cu)
    S = max(len(s[0]) for s in seqs)

    def pad(x, fill):
        return torch.stack([torch.cat([t, t.new_full((S - len(t),) + t.shape[1:], fill)]) for t in x])

    return dict(tokens=pad([s[0] for s in seqs], 0), pos=None, mask=pad([s[1] for s in seqs], False),
                ids=pad([s[2] for s in seqs], 0), lp=pad([s[3] for s in seqs], 0.0), cu=None)


def train(model, seqs_per_mb, *, packed: bool, group=None, loss_fn=None, sync_grads=None):
    """3 AdamW steps on the fixed step: GlobalBatch over the dp group, sum of micro-batch losses, reduced metrics."""
    loss_fn = loss_fn or DistillationLoss(DistillationConfig(**TRAIN_CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    mbs = [micro_batch(s, packed) for s in seqs_per_mb]
    history = []
    for _ in range(TRAIN_STEPS):
        batch = GlobalBatch.from_masks([mb["mask"] for mb in mbs], group=group,
                                       cu_seqlens=[mb["cu"] for mb in mbs] if packed else None)
        metrics = MetricSums()
        opt.zero_grad()
        for mb in mbs:
            out = model(input_ids=mb["tokens"], position_ids=mb["pos"], use_cache=False).logits
            logits = out[0] if packed else out
            loss, m = loss_fn(logits, TeacherTopK(mb["ids"], mb["lp"]), mb["mask"], batch, cu_seqlens=mb["cu"],
                              group=group)
            loss.backward()
            metrics.merge(m)
        if sync_grads is not None:
            sync_grads()
        opt.step()
        history.append(metrics.reduce(group))
    return history


def full_params(model) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        p = p.detach()
        out[name.removeprefix("module.")] = (p.full_tensor() if isinstance(p, DTensor) else p).clone()
    return out


def save_run(out_dir: str, tag: str, params: dict, history: list) -> None:
    torch.save(params, os.path.join(out_dir, f"{tag}.pt"))
    with open(os.path.join(out_dir, f"{tag}.json"), "w") as f:
        json.dump(history, f)


def reference_run(packed: bool):
    """(a) one process, 4 micro-batches of 2 sequences."""
    seqs = global_batch_data()
    model = tiny_model()
    history = train(model, [seqs[i : i + 2] for i in range(0, 8, 2)], packed=packed)
    return full_params(model), history


def _my_micro_batches(dp_rank: int, dp: int):
    seqs = global_batch_data()
    per_rank = len(seqs) // dp
    mine = seqs[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return [mine[i : i + 2] for i in range(0, len(mine), 2)]

# -- launch targets ------------------------------------------------------------------------------------------------
def ranks2(rank: int, world: int, out_dir: str) -> None:
    """Every 2-rank check: ops at tp=2, size-1 groups, DTensor, DistillationLoss back-end, DDP, FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    group = dist.group.WORLD
    n = check_ops(rank, world, group, "tp=2") + check_random_sweep(rank, world, group)
    check_size_one_groups(rank, world)
    check_unequal_widths(rank, world)
    check_confident_tail(rank, world, group)  # the rest mass where the student is confident, vs float64
    check_dtensor(rank, world)
    check_vocab_rows(rank, world)
    check_distillation_loss(rank, world, group)
    check_saved_bytes(rank, world, group, "tp=2")
    mbs = _my_micro_batches(rank, world)
    # (b) DDP, 2 ranks x 2 micro-batches
    ddp = DistributedDataParallel(tiny_model())
    history = train(ddp, mbs, packed=False, group=group)
    params = full_params(ddp)
    if rank == 0:
        save_run(out_dir, "ddp", params, history)
    # (c) FSDP2, 2 ranks x 2 micro-batches, packed layout
    model = tiny_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    history = train(model, mbs, packed=True, group=group)
    params = full_params(model)
    if rank == 0:
        save_run(out_dir, "fsdp", params, history)
        with open(os.path.join(out_dir, "ops_checks.txt"), "w") as f:
            f.write(str(n))


def ranks4(rank: int, world: int, out_dir: str) -> None:
    """Every 4-rank check: ops at tp=4, and the 2x2 (dp x tp) mesh with a vocab-sharded lm_head."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    group = dist.group.WORLD
    n = check_ops(rank, world, group, "tp=4") + check_random_sweep(rank, world, group)
    check_saved_bytes(rank, world, group, "tp=4")
    check_vocab_rows(rank, world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_group = mesh["dp"].get_group()
    model = tiny_model()
    parallelize_module(model, mesh["tp"], {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    assert isinstance(model.lm_head.weight, DTensor)

    def sync_grads():  # data-parallel average over the dp group (what DDP does), local shards for DTensors
        for p in model.parameters():
            g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=dp_group)
            g.div_(2)

    # The logits are a DTensor sharded on the vocab: DistillationLoss picks the vocab-parallel back-end, whose ops
    # take the tp group from the mesh.
    loss_fn = DistillationLoss(DistillationConfig(**TRAIN_CFG))
    history = train(model, _my_micro_batches(mesh["dp"].get_local_rank(), 2), packed=False, group=dp_group,
                    loss_fn=loss_fn, sync_grads=sync_grads)
    params = full_params(model)
    if rank == 0:
        save_run(out_dir, "tp2x2", params, history)
        with open(os.path.join(out_dir, "ops_checks.txt"), "w") as f:
            f.write(str(n))
