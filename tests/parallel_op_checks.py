"""Per-rank checks of the vocab-parallel ops against the single-device ops (run inside gloo workers).

Every rank builds the same full tensors from a seed, computes the single-device result, and compares it with the
vocab-parallel op on its own shard: values within 1e-5 (fp32) / 1e-10 (fp64), overlap_count exactly, and its
gradient shard equal to the matching slice of the single-device gradient (zero on padding columns).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from opdistill.batch import GlobalBatch
from opdistill.loss import DistillationConfig, DistillationLoss, TeacherLogits, TeacherTopK
from opdistill.ops import generalized_jsd, token_logprobs, topk_divergence
from opdistill.parallel import (
    vocab_parallel_generalized_jsd,
    vocab_parallel_token_logprobs,
    vocab_parallel_topk_divergence,
)

from .parallel_launch import CollectiveCounter

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


def check_vocab_rows(rank: int, world: int) -> None:
    """VocabRows (decoding from an FSDP2 student's vocabulary rows): each rank gets, for inputs of its own size
    (none at all on rank 0 once), the whole weight's lookup bit for bit and its logits within fp64 rounding, for
    torch.chunk widths that are uneven (V = 19) or leave a rank without rows (V = 3 at 4 ranks: 1, 1, 1, 0), on an
    FSDP2-sharded embedding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from opdistill.parallel import VocabRows

    mesh = init_device_mesh("cpu", (world,))
    for V in (19, 3, 32):
        torch.manual_seed(V)
        emb = torch.nn.Embedding(V, 6, dtype=torch.float64)
        whole = emb.weight.detach().clone()
        fully_shard(emb, mesh=mesh)
        local = emb.weight.to_local()
        assert local.shape[0] == max(0, min(-(-V // world), V - rank * -(-V // world)))  # torch.chunk widths
        rows = VocabRows(local, mesh.get_group())
        assert rows.vocab_size == V
        for n in (rank + 2, 0 if rank == 0 else 3):  # each rank its own number of rows
            g = torch.Generator().manual_seed(10 * rank + n)
            ids = torch.randint(0, V, (n, 2), generator=g)
            assert torch.equal(rows.lookup(ids), torch.nn.functional.embedding(ids, whole)), (V, n)
            h = torch.randn(n, 2, 6, dtype=torch.float64, generator=g)
            got, want = rows.logits(h), torch.nn.functional.linear(h, whole)
            assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-14, atol=1e-14), (V, n)


def check_distillation_loss(rank: int, world: int, group) -> None:
    """DistillationLoss(vocab_group=, vocab_size=) (the vocab-parallel back-end) equals the plain one on ragged
    padded/packed batches: top-k supervised, top-k policy gradient (token log-probs), full-vocabulary JSD."""
    V = world * 6 - 3
    Vl = -(-V // world)
    x, ids, lp = topk_case(11, (4, 7), V, Vl, world, torch.float64, duplicates=False)
    g = torch.Generator().manual_seed(12)
    xt = torch.randn(x.shape, generator=g, dtype=torch.float64)
    sampled = torch.randint(0, V, (4, 7), generator=g)
    old = (token_logprobs(x, sampled) + 0.1 * torch.randn((4, 7), generator=g, dtype=torch.float64)).detach()
    lengths = torch.tensor([7, 2, 5, 0])  # uneven, one empty sequence
    mask = torch.arange(7)[None, :] < lengths[:, None]
    dp = [dist.new_group([r]) for r in range(world)][rank]  # pure tensor parallelism: data-parallel size 1
    configs = [
        DistillationConfig(support="tail", divergence="reverse", loss_agg_mode="seq-mean-token-mean"),
        DistillationConfig(support="renormalized", divergence="jsd", beta=0.3, use_policy_gradient=True),
        DistillationConfig(loss_mode="full", beta=0.3, temperature=0.7, loss_agg_mode="seq-mean-token-sum"),
    ]
    for cfg, packed in ((c, p) for c in configs for p in (False, True)):
        sel = (lambda t: t[mask]) if packed else (lambda t: t)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]) if packed else None
        m = sel(mask)
        batch = GlobalBatch.from_masks(m, cu_seqlens=cu, group=dp)
        xr = sel(x).clone().requires_grad_(True)
        xl = shard_of(sel(x), rank, world, Vl).requires_grad_(True)
        if cfg.loss_mode == "full":
            t_ref, t_par = TeacherLogits(sel(xt)), TeacherLogits(shard_of(sel(xt), rank, world, Vl, pad_value=-30.0))
        else:
            t_ref = t_par = TeacherTopK(sel(ids), sel(lp))
        kw = dict(cu_seqlens=cu, sampled_ids=sel(sampled), old_logprobs=sel(old)) if cfg.use_policy_gradient else dict(cu_seqlens=cu)
        lr, mr = DistillationLoss(cfg)(xr, t_ref, m, batch, **kw)
        lg, mg = DistillationLoss(cfg, vocab_group=group, vocab_size=V)(xl, t_par, m, batch, **kw)
        lr.backward()
        lg.backward()
        what = f"DistillationLoss {cfg.loss_mode} pg={cfg.use_policy_gradient} packed={packed}"
        _close(lg, lr, 1e-10, what)
        start, width = rank * Vl, max(0, min(Vl, V - rank * Vl))
        _close(xl.grad[..., :width], xr.grad[..., start : start + width], 1e-10, what + " grad")
        assert xr.grad.abs().max() > 0, what + ": vacuous (no gradient)"
        a, b = mr.reduce(dp), mg.reduce(dp)
        assert a.keys() == b.keys()
        for k in a:
            assert abs(a[k] - b[k]) <= 1e-10, (what, k, a[k], b[k])


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


# -- the student's rest mass where the student is confident (docs/losses.md, "Precision of the tail rest mass") ----
CONFIDENT_RTOL = 2e-5  # fp32 vs the float64 SPEC reference: per-token loss, and gradient relative to its row max


def confident_tail_case(seed: int = 0, n: int = 9, V: int = 301, K: int = 4):
    """fp32 logits of realistic magnitude (~20-30) whose K teacher ids hold all but 1 - Q of the student's mass,
    1 - Q spread log-uniformly over [1e-7, 1e-3] (computed in float64 from these fp32 logits); teacher mass P ~ 0.9.
    One slot of the last row is empty.  Returns (logits fp32 [n, V], ids [n, K], teacher log-probs fp32 [n, K])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(n)])
    z = torch.randn(n, V, generator=g, dtype=torch.float64)  # background: log-mass ~ log(V) + c
    top = 25.0 + 0.7 * torch.randn(n, K, generator=g, dtype=torch.float64)
    target = torch.logspace(-7, -3, n, dtype=torch.float64)  # 1 - Q
    for r in range(n):
        lse_top = torch.logsumexp(top[r], 0)
        lse_bg = torch.logsumexp(z[r], 0)
        z[r] += lse_top + torch.log(target[r] / (1 - target[r])) - lse_bg  # background mass / top mass = target/(1-t)
    z.scatter_(1, ids, top)
    mass = 0.85 + 0.1 * torch.rand(n, 1, generator=g, dtype=torch.float64)  # teacher P in [0.85, 0.95]
    nu = torch.softmax(torch.randn(n, K, generator=g, dtype=torch.float64), -1) * mass
    lp = nu.log()
    lp[-1, 0] = float("-inf")
    return z.float(), ids, lp.float()


def check_confident_tail(rank: int, world: int, group) -> int:
    """Tail forward/reverse/jsd on confident rows: the vocab-parallel fp32 loss and gradient equal the float64 SPEC
    reference to ``CONFIDENT_RTOL`` relative (this rank's gradient columns, padded layout)."""
    from .reference import topk_reference

    x, ids, lp = confident_tail_case()
    n, V = x.shape
    Vl = -(-V // world)
    start, width = rank * Vl, max(0, min(Vl, V - rank * Vl))
    checks = 0
    for div, beta in (("forward", 0.5), ("reverse", 0.5), ("jsd", 0.5)):
        zr = x.double().requires_grad_(True)
        ref = topk_reference(zr, ids, lp.double(), "tail", div, beta)
        ref.sum().backward()
        xl = shard_of(x, rank, world, Vl).requires_grad_(True)
        got = vocab_parallel_topk_divergence(xl, ids, lp, group=group, vocab_size=V, support="tail", divergence=div,
                                             beta=beta)
        got.loss.sum().backward()
        assert_rel_close(got.loss, ref, f"tp={world} tail/{div} loss")
        assert_rel_close(xl.grad[:, :width], zr.grad[:, start : start + width], f"tp={world} tail/{div} grad",
                         scale=zr.grad.abs().amax(-1, keepdim=True))
        checks += 1
    return checks


def assert_rel_close(got, ref, what, scale=None, rtol=CONFIDENT_RTOL):
    """|got - ref| <= rtol * scale elementwise (scale: |ref|, or a per-row scale such as the row's largest |grad|)."""
    ref = ref.detach().double()
    scale = ref.abs() if scale is None else scale.double()
    err = ((got.detach().double() - ref).abs() / scale.clamp_min(1e-30)).max().item()
    assert err <= rtol, f"{what}: max relative error {err:.3g} > {rtol:.1g}"
