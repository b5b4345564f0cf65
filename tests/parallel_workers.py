"""Per-rank bodies of the parallel tests, run in real gloo processes (``launch``), plus the shared fixtures.

Not a test module: ``tests/test_parallel_*.py`` launch these.  Each launch costs a few seconds, so one launch of
P ranks runs every P-rank check: ``ranks2`` (vocab-parallel ops at tp=2, size-1 groups, DDP, FSDP2) and ``ranks4``
(ops at tp=4, the 2x2 dp x tp mesh).  Op checks assert inside the workers against the single-device op computed
on the same (seeded, identical on every rank) full tensors; training runs save final parameters and reduced
metrics to ``out_dir`` for the test to compare with the one-process run.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from opdistill.batch import GlobalBatch
from opdistill.loss import DistillationConfig, DistillationLoss, TeacherTopK
from opdistill.metrics import MetricSums
from opdistill.ops import generalized_jsd, token_logprobs, topk_divergence
from opdistill.parallel import (
    vocab_parallel_generalized_jsd,
    vocab_parallel_token_logprobs,
    vocab_parallel_topk_divergence,
)

K = 4
COMBOS = [  # (support, divergence, beta, log_prob_min_clamp): every combination topk_divergence accepts
    ("truncated", "forward", 0.5, None),
    ("truncated", "forward", 0.5, -3.0),
    ("tail", "forward", 0.5, None),
    ("tail", "reverse", 0.5, None),
    ("tail", "jsd", 0.0, None),
    ("tail", "jsd", 0.3, None),
    ("tail", "jsd", 1.0, None),
    ("renormalized", "forward", 0.5, None),
    ("renormalized", "reverse", 0.5, None),
    ("renormalized", "jsd", 0.0, None),
    ("renormalized", "jsd", 0.3, None),
    ("renormalized", "jsd", 1.0, None),
]
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "barrier")


# -- launching ---------------------------------------------------------------------------------------------------
def launch(target: str, world: int, out_dir: str) -> None:
    """Run ``target(rank, world, out_dir)`` on ``world`` gloo processes; a failure in any rank raises here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(world, port, target, out_dir), nprocs=world, join=True)


def _entry(rank: int, world: int, port: int, target: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        globals()[target](rank, world, out_dir)
    finally:
        dist.destroy_process_group()


class CollectiveCounter:
    """Replace every torch.distributed collective by a counter (context manager) -- for the no-collective tests."""

    def __init__(self):
        self.calls: list[str] = []

    def __enter__(self):
        self._saved = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
        for n in self._saved:
            setattr(dist, n, functools.partial(self._record, n))
        return self

    def _record(self, name, *args, **kwargs):
        self.calls.append(name)
        raise AssertionError(f"unexpected collective dist.{name}")

    def __exit__(self, *exc):
        for n, f in self._saved.items():
            setattr(dist, n, f)
        return False


# -- inputs ------------------------------------------------------------------------------------------------------
def topk_case(seed: int, lead: tuple, V: int, Vl: int, world: int, dtype, *, duplicates: bool):
    """Full student logits [*lead, V] and a teacher top-k [*lead, K] that hits verl's edge cases.

    Row 0 holds the first id of every shard (local index 0 on each rank: the collision with the masked dummy)
    plus id 0; row 1 the last real id V-1 (next to the padding); row 2 duplicates (truncated only); row 3 an empty
    slot; the last row is a masked position (all slots empty, ids 0, as DistillationLoss sends it); row 4 has
    student and teacher log-probs far below the clamp -3.
    """
    g = torch.Generator().manual_seed(seed)
    n = math.prod(lead)
    x = (torch.randn(n, V, generator=g, dtype=torch.float64) * 2.0)
    teacher = torch.log_softmax(torch.randn(n, V, generator=g, dtype=torch.float64) * 2.0, -1)
    ids = torch.topk(teacher, K, dim=-1).indices
    starts = [r * Vl for r in range(1, world) if r * Vl < V][: K - 1]
    ids[0, : len(starts) + 1] = torch.tensor(starts + [0])
    ids[1, 0] = V - 1
    if duplicates:
        ids[2, 1] = ids[2, 0]
    for r in range(n):  # keep rows 0/1 distinct if the overrides collided
        if not (duplicates and r == 2):
            seen, row = set(), ids[r].tolist()
            for k, v in enumerate(row):
                while v in seen:
                    v = (v + 1) % V
                row[k] = v
                seen.add(v)
            ids[r] = torch.tensor(row)
    lp = teacher.gather(1, ids)
    x[4, ids[4, 1:]] -= 25.0  # student log-probs below the clamp
    lp[4, -1] = -6.0  # teacher log-prob below the clamp
    lp = lp - torch.logsumexp(lp, -1, keepdim=True).clamp_min(0.0)  # duplicates: keep the mass <= 1
    lp[3, -1] = float("-inf")
    lp[-1] = float("-inf")
    ids[-1] = 0
    return x.to(dtype).reshape(*lead, V), ids.reshape(*lead, K), lp.to(dtype).reshape(*lead, K)


def shard_of(full: torch.Tensor, rank: int, world: int, Vl: int, pad_value: float = 30.0) -> torch.Tensor:
    """Megatron's layout: pad the vocab to world * Vl with (large, to be ignored) garbage, take rank's columns."""
    V = full.shape[-1]
    padded = torch.cat([full, full.new_full((*full.shape[:-1], world * Vl - V), pad_value)], -1)
    return padded[..., rank * Vl : (rank + 1) * Vl].clone()


def _close(a, b, tol, what):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.1g}"


# -- op checks ---------------------------------------------------------------------------------------------------
def check_ops(rank: int, world: int, group, tag: str) -> int:
    """Every vocab-parallel op against its single-device op on `group` (this process is rank `rank` of `world`)."""
    checks = 0
    for dtype, tol in TOL.items():
        for V in (world * 6, world * 6 - 3):  # divisible, and Megatron-padded
            Vl = -(-V // world)
            for lead in ((3, 5), (13,)):  # padded [B, S], packed [N]
                for ci, (support, div, beta, clamp) in enumerate(COMBOS):
                    x, ids, lp = topk_case(100 * ci + V, lead, V, Vl, world, dtype, duplicates=support == "truncated")
                    kw = dict(support=support, divergence=div, beta=beta, log_prob_min_clamp=clamp, temperature=0.7)
                    xr = x.clone().requires_grad_(True)
                    ref = topk_divergence(xr, ids, lp, **kw)
                    xl = shard_of(x, rank, world, Vl).requires_grad_(True)
                    got = vocab_parallel_topk_divergence(xl, ids, lp, group=group, vocab_size=V, **kw)
                    what = f"{tag} {dtype} V={V} {lead} {support}/{div}/beta={beta}/clamp={clamp}"
                    _close(got.loss, ref.loss, tol, what + " loss")
                    _close(got.student_mass, ref.student_mass, tol, what + " student_mass")
                    _close(got.teacher_mass, ref.teacher_mass, tol, what + " teacher_mass")
                    _close(got.overlap_token_advantage, ref.overlap_token_advantage, tol, what + " advantage")
                    assert torch.equal(got.overlap_count, ref.overlap_count), what + " overlap_count"
                    w = torch.randn(lead, generator=torch.Generator().manual_seed(ci), dtype=torch.float64)
                    (ref.loss * w.to(ref.loss.dtype)).sum().backward()
                    (got.loss * w.to(got.loss.dtype)).sum().backward()
                    start, width = rank * Vl, max(0, min(Vl, V - rank * Vl))
                    _close(xl.grad[..., :width], xr.grad[..., start : start + width], tol, what + " grad")
                    assert not xl.grad[..., width:].any(), what + " padding got a gradient"
                    checks += 1
                # token log-probs and the full-vocabulary JSD (both logits sharded)
                g = torch.Generator().manual_seed(V)
                n = math.prod(lead)
                xs = torch.randn(n, V, generator=g, dtype=torch.float64).to(dtype).reshape(*lead, V)
                xt = torch.randn(n, V, generator=g, dtype=torch.float64).to(dtype).reshape(*lead, V)
                y = torch.randint(0, V, lead, generator=g)
                y.view(-1)[: world - 1] = torch.arange(1, world) * Vl  # local index 0 of the other shards
                w = torch.randn(lead, generator=g, dtype=torch.float64)
                start, width = rank * Vl, max(0, min(Vl, V - rank * Vl))
                xr = xs.clone().requires_grad_(True)
                xl = shard_of(xs, rank, world, Vl).requires_grad_(True)
                ref = token_logprobs(xr, y, temperature=0.7)
                got = vocab_parallel_token_logprobs(xl, y, group=group, vocab_size=V, temperature=0.7)
                _close(got, ref, tol, f"{tag} token_logprobs {dtype} V={V} {lead}")
                (ref * w.to(ref.dtype)).sum().backward()
                (got * w.to(got.dtype)).sum().backward()
                _close(xl.grad[..., :width], xr.grad[..., start : start + width], tol, f"{tag} token_logprobs grad")
                assert not xl.grad[..., width:].any()
                for beta in (0.0, 0.3, 1.0):
                    xr = xs.clone().requires_grad_(True)
                    xl = shard_of(xs, rank, world, Vl).requires_grad_(True)
                    ref = generalized_jsd(xr, xt, beta=beta, temperature=0.7)
                    got = vocab_parallel_generalized_jsd(
                        xl, shard_of(xt, rank, world, Vl, pad_value=-30.0), group=group, vocab_size=V, beta=beta,
                        temperature=0.7,
                    )
                    _close(got, ref, tol, f"{tag} jsd beta={beta} {dtype} V={V} {lead}")
                    (ref * w.to(ref.dtype)).sum().backward()
                    (got * w.to(got.dtype)).sum().backward()
                    _close(xl.grad[..., :width], xr.grad[..., start : start + width], tol, f"{tag} jsd grad beta={beta}")
                    assert not xl.grad[..., width:].any()
                checks += 4
    return checks


def check_dtensor(rank: int, world: int) -> None:
    """A DTensor sharded on the vocab dim (uneven: torch.chunk widths) gives the single-device result."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    V = world * 6 - 3
    x, ids, lp = topk_case(7, (3, 5), V, -(-V // world), world, torch.float64, duplicates=False)
    xr = x.clone().requires_grad_(True)
    ref = topk_divergence(xr, ids, lp, support="tail", divergence="reverse")
    xd = distribute_tensor(x, mesh, [Shard(-1)]).requires_grad_(True)
    got = vocab_parallel_topk_divergence(xd, ids, lp, support="tail", divergence="reverse")
    _close(got.loss, ref.loss, 1e-10, "dtensor loss")
    assert torch.equal(got.overlap_count, ref.overlap_count)
    got.loss.sum().backward()
    ref.loss.sum().backward()
    _close(xd.grad.full_tensor(), xr.grad, 1e-10, "dtensor grad")
    y = ids[..., 0]
    _close(vocab_parallel_token_logprobs(xd.detach(), y), token_logprobs(x, y), 1e-10, "dtensor token_logprobs")
    xt = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = vocab_parallel_generalized_jsd(xd.detach(), distribute_tensor(xt, mesh, [Shard(-1)]), beta=0.3)
    _close(got, generalized_jsd(x, xt, beta=0.3), 1e-10, "dtensor jsd")


def check_size_one_groups(rank: int, world: int) -> None:
    """A group of one rank runs no collective and equals the single-device op; group=None is refused here."""
    solo = [dist.new_group([r]) for r in range(world)][rank]
    V = 11
    x, ids, lp = topk_case(5, (2, 6), V, V, 1, torch.float64, duplicates=False)
    xt = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xr, xl = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    with CollectiveCounter() as counter:
        got = vocab_parallel_topk_divergence(xl, ids, lp, group=solo, support="tail", divergence="jsd")
        got.loss.sum().backward()
        lp_tok = vocab_parallel_token_logprobs(x, ids[..., 0], group=solo)
        jsd = vocab_parallel_generalized_jsd(x, xt, group=solo, beta=0.3)
    assert counter.calls == [], counter.calls
    ref = topk_divergence(xr, ids, lp, support="tail", divergence="jsd")
    ref.loss.sum().backward()
    _close(got.loss, ref.loss, 1e-12, "solo loss")
    _close(xl.grad, xr.grad, 1e-12, "solo grad")
    _close(lp_tok, token_logprobs(x, ids[..., 0]), 1e-12, "solo token_logprobs")
    _close(jsd, generalized_jsd(x, xt, beta=0.3), 1e-12, "solo jsd")
    try:
        vocab_parallel_topk_divergence(x, ids, lp, group=None)
    except ValueError as e:
        assert "group=None" in str(e)
    else:
        raise AssertionError("group=None in a multi-process run must be refused")


def check_unequal_widths(rank: int, world: int) -> None:
    """torch.chunk-style plain shards (6 and 5 columns) are refused on every rank, in the first all-reduce."""
    x, ids, lp = topk_case(2, (3, 5), 11, 6, world, torch.float64, duplicates=False)
    ids = ids.clamp_max(9)  # in range for both ranks' idea of the vocabulary
    lp[:] = float("-inf")
    local = x.tensor_split(world, -1)[rank]
    xt = torch.zeros_like(local)
    for call in (
        lambda: vocab_parallel_topk_divergence(local, ids, lp, group=dist.group.WORLD),
        lambda: vocab_parallel_token_logprobs(local, ids[..., 0], group=dist.group.WORLD),
        lambda: vocab_parallel_generalized_jsd(local, xt, group=dist.group.WORLD),
    ):
        try:
            call()
        except ValueError as e:
            assert "unequal widths" in str(e), str(e)
        else:
            raise AssertionError("unequal plain shards must be refused")


def check_distillation_loss(rank: int, world: int, group) -> None:
    """DistillationLoss with the vocab-parallel back-end equals the default one on ragged padded/packed batches."""
    V = world * 6 - 3
    Vl = -(-V // world)
    x, ids, lp = topk_case(11, (4, 7), V, Vl, world, torch.float64, duplicates=False)
    lengths = torch.tensor([7, 2, 5, 0])  # uneven, one empty sequence
    mask = torch.arange(7)[None, :] < lengths[:, None]
    dp = [dist.new_group([r]) for r in range(world)][rank]  # pure tensor parallelism: data-parallel size 1
    cfg = DistillationConfig(support="tail", divergence="reverse", loss_agg_mode="seq-mean-token-mean")
    ref_fn = DistillationLoss(cfg)
    par_fn = DistillationLoss(cfg, topk_fn=functools.partial(vocab_parallel_topk_divergence, group=group, vocab_size=V))
    for packed in (False, True):
        if packed:
            keep = mask
            xs, ids_, lp_, m = x[keep], ids[keep], lp[keep], mask[keep]
            cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        else:
            xs, ids_, lp_, m, cu = x, ids, lp, mask, None
        batch = GlobalBatch.from_masks(m, cu_seqlens=cu, group=dp)
        xr = xs.clone().requires_grad_(True)
        xl = shard_of(xs, rank, world, Vl).requires_grad_(True)
        lr, mr = ref_fn(xr, TeacherTopK(ids_, lp_), m, batch, cu_seqlens=cu)
        lg, mg = par_fn(xl, TeacherTopK(ids_, lp_), m, batch, cu_seqlens=cu)
        lr.backward()
        lg.backward()
        _close(lg, lr, 1e-10, f"DistillationLoss packed={packed}")
        start, width = rank * Vl, max(0, min(Vl, V - rank * Vl))
        _close(xl.grad[..., :width], xr.grad[..., start : start + width], 1e-10, "DistillationLoss grad")
        a, b = mr.reduce(dp), mg.reduce(dp)
        assert a.keys() == b.keys()
        for k in a:
            assert abs(a[k] - b[k]) <= 1e-10, (k, a[k], b[k])


# -- saved tensors -----------------------------------------------------------------------------------------------
def saved_tensors(fn):
    """Run fn() under saved_tensors_hooks; returns [(shape, dtype, nbytes, data_ptr)] of every tensor saved."""
    seen = []

    def pack(t):
        seen.append((tuple(t.shape), t.dtype, t.numel() * t.element_size(), t.untyped_storage().data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, seen


def check_saved_bytes(rank: int, world: int, group, tag: str) -> None:
    """Besides the input logits (their own storage and dtype), only O(N x K) bytes are saved for backward."""
    V, N = world * 40, 24
    Vl = V // world
    for dtype in (torch.bfloat16, torch.float32):
        x, ids, lp = topk_case(1, (N,), V, Vl, world, torch.float32, duplicates=False)
        xl = shard_of(x, rank, world, Vl).to(dtype).requires_grad_(True)
        inputs = {xl.untyped_storage().data_ptr()}
        res, seen = saved_tensors(
            lambda: vocab_parallel_topk_divergence(xl, ids, lp, group=group, vocab_size=V, support="tail").loss
        )
        _check_seen(seen, inputs, dtype, N, Vl, f"{tag} topk {dtype}")
        res.sum().backward()
        _, seen = saved_tensors(lambda: vocab_parallel_token_logprobs(xl, ids[:, 0], group=group, vocab_size=V))
        _check_seen(seen, inputs, dtype, N, Vl, f"{tag} token_logprobs {dtype}")
        xt = shard_of(torch.randn(N, V), rank, world, Vl).to(dtype)
        _, seen = saved_tensors(
            lambda: vocab_parallel_generalized_jsd(xl, xt, group=group, vocab_size=V, beta=0.3)
        )
        _check_seen(seen, inputs | {xt.untyped_storage().data_ptr()}, dtype, N, Vl, f"{tag} jsd {dtype}")


def _check_seen(seen, inputs, dtype, N, Vl, what):
    assert seen, what + ": nothing saved?"
    other = 0
    for shape, dt, nbytes, ptr in seen:
        if ptr in inputs:
            assert dt == dtype, f"{what}: input saved as {dt}, not its own dtype {dtype}"
            continue
        assert math.prod(shape) <= N * (K + 1), f"{what}: saved a {shape} {dt} tensor ({nbytes} bytes)"
        other += nbytes
    assert other <= 8 * N * (4 * K + 4), f"{what}: {other} bytes saved beyond the inputs"


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
    check_dtensor(rank, world)
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

    # The logits are a DTensor sharded on the vocab: the vocab-parallel op takes the tp group from its mesh.
    loss_fn = DistillationLoss(DistillationConfig(**TRAIN_CFG), topk_fn=vocab_parallel_topk_divergence)
    history = train(model, _my_micro_batches(mesh["dp"].get_local_rank(), 2), packed=False, group=dp_group,
                    loss_fn=loss_fn, sync_grads=sync_grads)
    params = full_params(model)
    if rank == 0:
        save_run(out_dir, "tp2x2", params, history)
        with open(os.path.join(out_dir, "ops_checks.txt"), "w") as f:
            f.write(str(n))


def check_random_sweep(rank: int, world: int, group, cases: int = 40) -> int:
    """Seeded random cases (V, K, N, tau, support x divergence, empty slots, duplicates) in fp64 and fp32."""
    g = torch.Generator().manual_seed(2024)
    done = 0
    for case in range(cases):
        support, div, beta, clamp = COMBOS[int(torch.randint(len(COMBOS), (), generator=g))]
        k = int(torch.randint(1, 7, (), generator=g))
        V = int(torch.randint(max(k, world), 41, (), generator=g))
        Vl = -(-V // world)
        n = int(torch.randint(1, 12, (), generator=g))
        tau = [0.5, 1.0, 2.0][case % 3]
        dtype = torch.float64 if case % 2 else torch.float32
        x = torch.randn(n, V, generator=g, dtype=torch.float64) * 3
        teacher = torch.log_softmax(torch.randn(n, V, generator=g, dtype=torch.float64) * 2, -1)
        if support == "truncated":
            ids = torch.randint(0, V, (n, k), generator=g)  # duplicates allowed
        else:
            ids = torch.argsort(torch.rand(n, V, generator=g), -1)[:, :k]
        lp = teacher.gather(1, ids)
        lp = lp - torch.logsumexp(lp, -1, keepdim=True).clamp_min(0.0)
        lp[torch.rand(n, k, generator=g) < 0.15] = float("-inf")
        x, lp = x.to(dtype), lp.to(dtype)
        kw = dict(support=support, divergence=div, beta=beta, log_prob_min_clamp=clamp, temperature=tau)
        xr = x.clone().requires_grad_(True)
        ref = topk_divergence(xr, ids, lp, **kw)
        xl = shard_of(x, rank, world, Vl).requires_grad_(True)
        got = vocab_parallel_topk_divergence(xl, ids, lp, group=group, vocab_size=V, **kw)
        tol, what = TOL[dtype], f"sweep case {case}: {dtype} V={V} K={k} N={n} tau={tau} {support}/{div}/{beta}/{clamp}"
        for f in ("loss", "student_mass", "teacher_mass", "overlap_token_advantage"):
            _close(getattr(got, f), getattr(ref, f), tol, f"{what} {f}")
        assert torch.equal(got.overlap_count, ref.overlap_count), what + " overlap_count"
        ref.loss.sum().backward()
        got.loss.sum().backward()
        start, width = rank * Vl, max(0, min(Vl, V - rank * Vl))
        _close(xl.grad[..., :width], xr.grad[..., start : start + width], tol, what + " grad")
        assert not xl.grad[..., width:].any(), what + " padding grad"
        done += 1
    return done
