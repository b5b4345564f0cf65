"""The full-vocabulary loss from the teacher's hidden states (loss_mode full with a ``TeacherHidden``; SPEC 6.4).

It must equal the K = V top-k path (the teacher's whole distribution as K = V (id, log-prob) pairs, tail support: the
rest bucket is empty) in value, metrics and gradients: fp64 to 1e-10, fp32 to 1e-5, on the plain back-end (logits +
the teacher's hidden states and head), the fused one (hidden states on both sides, one-pass and recompute paths)
and the vocab-parallel one and the fused one over a vocabulary group (2 and 4 gloo ranks, one launch each). The
expectations come from the K = V top-k loss on the teacher's own log-softmax, computed in float64 by
``tests/reference.py``; masked positions hold NaN on both sides and must reach no value and no gradient.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from opdistill import DistillationConfig, DistillationLoss, GlobalBatch, TeacherTopK
from opdistill.fused import StudentHidden, TeacherHidden, fused_generalized_jsd, fused_jsd_loss

from . import reference as R
from .parallel_launch import launch

B, S, H, HT, V = 2, 5, 6, 7, 13
CASES = {  # name -> (full-mode config, the K = V top-k config with the same per-token loss)
    "reverse": (dict(loss_mode="full", beta=1.0), dict(divergence="reverse")),
    "forward": (dict(loss_mode="full", beta=0.0, temperature=0.7), dict(divergence="forward", temperature=0.7)),
    "jsd": (dict(loss_mode="full", beta=0.3, loss_agg_mode="seq-mean-token-mean", loss_max_clamp=0.4),
            dict(divergence="jsd", beta=0.3, loss_agg_mode="seq-mean-token-mean", loss_max_clamp=0.4)),
    "reverse-pg": (dict(loss_mode="full", beta=1.0, use_policy_gradient=True),
                   dict(divergence="reverse", use_policy_gradient=True)),
    "reverse-task": (dict(loss_mode="full", beta=1.0, use_task_rewards=True, distillation_coef=0.5),
                     dict(divergence="reverse", use_task_rewards=True, distillation_coef=0.5)),
}
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}
MASK = [[0, 1, 1, 1, 0], [1, 1, 0, 1, 1]]


def data(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, s=1.0: (torch.randn(*shape, generator=g, dtype=torch.float64) * s)  # noqa: E731
    d = dict(h=r(B, S, H), w=r(V, H, s=0.8), b=r(V, s=0.3), th=r(B, S, HT), tw=r(V, HT, s=0.9), tb=r(V, s=0.2),
             mask=torch.tensor(MASK, dtype=torch.bool), sampled=torch.randint(0, V, (B, S), generator=g),
             old=r(B, S, s=0.2) - 2.5, adv=r(B, S))
    d["tscale"] = 1.5  # the teacher's logit multiplier (Granite/Cohere-style), the student has its own: 2
    return {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in d.items()}


def teacher_logits64(d):
    return (d["th"].double() @ d["tw"].double().T + d["tb"].double()) * d["tscale"]


def reference(case: str, d: dict):
    """(objective, metrics, d objective / d z) in float64: the K = V top-k loss on the clean logits, the teacher's
    K = V log-probs at the loss's temperature (the full-vocabulary JSD divides both sides' logits by it)."""
    _, topk_cfg = CASES[case]
    z = (torch.nn.functional.linear(d["h"].double(), d["w"].double(), d["b"].double()) * 2.0).requires_grad_(True)
    tlp = torch.log_softmax(teacher_logits64(d) / topk_cfg.get("temperature", 1.0), -1)
    ids = torch.arange(V).expand(B, S, V)
    loss, metrics = R.distillation_reference(z, d["mask"], (ids, tlp.gather(-1, ids)), support="tail", topk=V,
                                             **topk_cfg, sampled_ids=d["sampled"], old_logprobs=d["old"].double(),
                                             advantages=d["adv"].double())
    (gz,) = torch.autograd.grad(loss, z)
    return loss.detach(), metrics, gz


def poisoned(x, mask):
    """``x`` [B, S, F] with NaN at every masked position."""
    return torch.where(mask[..., None], x, float("nan"))


def run_full(case, d, student, teacher, *, vocab_group=None, vocab_size=None, dp_group=None):
    cfg = DistillationConfig(**CASES[case][0])
    loss_fn = DistillationLoss(cfg, vocab_group=vocab_group, vocab_size=vocab_size)
    m = d["mask"]
    return loss_fn(student, teacher, m, GlobalBatch.from_masks([m], group=dp_group), sampled_ids=d["sampled"],
                   old_logprobs=torch.where(m, d["old"], float("nan")), task_advantages=torch.where(m, d["adv"], 0.0),
                   group=dp_group)


def check(case, dtype, loss, metrics, grad_z, dp_group=None):
    d = data(dtype)
    ref, ref_metrics, gz = reference(case, d)
    tol = TOL[dtype]
    torch.testing.assert_close(loss.detach().double(), ref, **tol)
    reduced = metrics.reduce(group=dp_group)
    for k, v in ref_metrics.items():
        if k.startswith("distillation/") and k.split("/")[1] in ("student_mass", "teacher_mass", "overlap_ratio",
                                                                 "overlap_token_advantage", "student_mass_min",
                                                                 "student_mass_max", "teacher_mass_min",
                                                                 "teacher_mass_max"):
            continue  # top-k diagnostics: the full mode has no K
        assert k in reduced, f"metric {k} missing"
        torch.testing.assert_close(torch.tensor(reduced[k], dtype=torch.float64), torch.tensor(v, dtype=torch.float64),
                                   **tol, msg=k)
    torch.testing.assert_close(grad_z.double(), gz, **tol)
    assert not grad_z[~d["mask"]].any(), "a masked position reached a gradient"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_plain_logits_with_the_teachers_hidden_states(case, dtype):
    d = data(dtype)
    z = (torch.nn.functional.linear(d["h"], d["w"], d["b"]) * 2.0).detach()
    z = poisoned(z, d["mask"]).requires_grad_(True)
    teacher = TeacherHidden(poisoned(d["th"], d["mask"]), d["tw"], d["tscale"], d["tb"])
    loss, metrics = run_full(case, d, z, teacher)
    (gz,) = torch.autograd.grad(loss, z)
    check(case, dtype, loss, metrics, torch.nan_to_num(gz, nan=123.0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_hidden_states_on_both_sides(case, dtype):
    """One-pass (supervised: the gradient computed in forward) and recompute (policy gradient) paths alike: the
    student's hidden-state gradient is checked through d z / d h = 2 W."""
    d = data(dtype)
    h = poisoned(d["h"], d["mask"]).requires_grad_(True)
    student = StudentHidden(h, d["w"] / 2 * 2, d["b"], logit_scale=2.0)
    teacher = TeacherHidden(poisoned(d["th"], d["mask"]), d["tw"], d["tscale"], d["tb"])
    loss, metrics = run_full(case, d, student, teacher)
    (gh,) = torch.autograd.grad(loss, h)
    ref_loss, _, gz = reference(case, d)
    # d loss / d h = (d loss / d z) @ (2 W): compare through the reference's z-gradient
    want = gz @ (2.0 * d["w"].double())
    tol = TOL[dtype]
    torch.testing.assert_close(loss.detach().double(), ref_loss, **tol)
    torch.testing.assert_close(torch.nan_to_num(gh, nan=123.0).double(), want, **tol)
    assert not gh[~d["mask"]].any()
    check(case, dtype, loss, metrics, gz.to(dtype))  # metrics (the gradient itself checked above)


def test_one_pass_and_recompute_give_the_same_gradients():
    """fused_jsd_loss (gradient in forward) == autograd through fused_generalized_jsd (recompute), any weights."""
    d = data()
    w = torch.rand(B, S, dtype=torch.float64) * d["mask"]
    for beta in (0.0, 0.4, 1.0):
        hs = d["h"].clone().requires_grad_(True)
        ws = d["w"].clone().requires_grad_(True)
        bs = d["b"].clone().requires_grad_(True)
        obj, J = fused_jsd_loss(hs, ws, d["th"], d["tw"], w, beta=beta, temperature=0.8, student_bias=bs,
                                teacher_bias=d["tb"], chunk_size=3)
        g1 = torch.autograd.grad(3.0 * obj, [hs, ws, bs])
        J2 = fused_generalized_jsd(hs, ws, d["th"], d["tw"], beta=beta, temperature=0.8, student_bias=bs,
                                   teacher_bias=d["tb"], chunk_size=4)
        g2 = torch.autograd.grad(3.0 * (J2 * w).sum(), [hs, ws, bs])
        torch.testing.assert_close(J, J2.detach(), rtol=1e-12, atol=1e-12)
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0], ids=["forward", "jsd", "reverse"])
@pytest.mark.parametrize("spread", [1.0, 60.0], ids=["plain", "underflow"])
def test_the_one_pass_step_equals_trls_jsd_and_its_autograd(beta, spread):
    """``divergence_step`` on one chunk (padding columns after the real ones, tau != 1): J equals TRL's generalized
    JSD computed in float64 by ``tests/reference.py``, the logit gradient equals autograd through it, the lse are the
    two log-sum-exps, and padding columns get 0. ``spread`` 60 puts most probabilities below fp32's range (exp
    underflows to 0 on both sides, the JSD's mixture too): still finite and equal to the float64 reference."""
    from opdistill.ops.divergence import canonical
    from opdistill.parallel.shard import VocabShard
    from opdistill.parallel.stages import divergence_step

    g = torch.Generator().manual_seed(5)
    c, w, pad, tau = 4, 23, 3, 0.7
    zs64 = torch.randn(c, w, generator=g, dtype=torch.float64) * spread
    zt64 = torch.randn(c, w, generator=g, dtype=torch.float64) * spread
    weights = torch.tensor([0.5, 0.0, 2.0, 1.0], dtype=torch.float64)
    z = zs64.clone().requires_grad_(True)
    J_ref = R.trl_generalized_jsd(z, zt64, beta=beta, temperature=tau)
    (gz_ref,) = torch.autograd.grad((J_ref * weights).sum(), z)
    lse_ref = torch.stack([torch.logsumexp(zs64 / tau, -1), torch.logsumexp(zt64 / tau, -1)], -1)
    shard = VocabShard(None, 1, 0, 0, w, w, w + pad)
    for dtype, tol in ((torch.float64, dict(rtol=1e-10, atol=1e-10)), (torch.float32, dict(rtol=1e-5, atol=1e-5))):
        zs = torch.cat([zs64, torch.full((c, pad), 7.0, dtype=torch.float64)], -1).to(dtype)
        zt = torch.cat([zt64, torch.full((c, pad), -3.0, dtype=torch.float64)], -1).to(dtype)
        seen = []
        J, lse = divergence_step(shard, zs, zt, tau, canonical("jsd", beta), beta,
                                 lambda j: seen.append(j.clone()) or weights.to(dtype))
        torch.testing.assert_close(J.double(), J_ref.detach(), **tol)
        torch.testing.assert_close(seen[0].double(), J_ref.detach(), **tol)  # the gradient function sees J
        torch.testing.assert_close(lse.double(), lse_ref, **tol)
        torch.testing.assert_close(zs[:, :w].double(), gz_ref, **tol)
        assert not zs[:, w:].any() and torch.isfinite(zs).all()
        J2, _ = divergence_step(shard, zs64.to(dtype, copy=True), zt64.to(dtype, copy=True), tau, canonical("jsd", beta), beta)
        torch.testing.assert_close(J2, J)  # no gradient asked: the same values


def test_gradcheck_of_both_fused_ops():
    g = torch.Generator().manual_seed(3)
    hs = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    ws = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    bs = torch.randn(9, generator=g, dtype=torch.float64, requires_grad=True)
    ht, wt, bt = (torch.randn(2, 3, 5, generator=g, dtype=torch.float64), torch.randn(9, 5, generator=g,
                  dtype=torch.float64), torch.randn(9, generator=g, dtype=torch.float64))
    wts = torch.rand(2, 3, generator=g, dtype=torch.float64)
    for beta in (0.0, 0.6, 1.0):
        assert torch.autograd.gradcheck(lambda a, b, c: fused_generalized_jsd(a, b, ht, wt, beta=beta, student_bias=c,
                                                                              teacher_bias=bt, chunk_size=4),
                                        (hs, ws, bs))
        # the first backward scales the gradient computed in forward (g * c), a repeat recomputes it with the
        # gradient folded in (g c): equal but for rounding, hence the reentrancy tolerance
        assert torch.autograd.gradcheck(lambda a, b, c: fused_jsd_loss(a, b, ht, wt, wts, beta=beta, student_bias=c,
                                                                       teacher_bias=bt, chunk_size=2)[0],
                                        (hs, ws, bs), nondet_tol=1e-12)


def test_a_teacher_head_that_requires_grad_is_held_detached_and_gets_no_gradient():
    """A teacher model's own lm_head Parameter may be passed as it is: every back-end gives the loss of the detached
    head (the same value) and no gradient reaches the teacher."""
    d = data()
    tw = torch.nn.Parameter(d["tw"].clone())
    tb = torch.nn.Parameter(d["tb"].clone())
    teacher = TeacherHidden(d["th"], tw, d["tscale"], tb)
    assert not teacher.weight.requires_grad and not teacher.bias.requires_grad
    ref_loss = reference("reverse", d)[0]
    z = (torch.nn.functional.linear(d["h"], d["w"], d["b"]) * 2.0).requires_grad_(True)
    loss, _ = run_full("reverse", d, z, teacher)
    student = StudentHidden(d["h"].clone().requires_grad_(True), d["w"], d["b"], logit_scale=2.0)
    loss_fused, _ = run_full("reverse", d, student, teacher)
    for x in (loss, loss_fused):
        torch.testing.assert_close(x.detach(), ref_loss, rtol=1e-10, atol=1e-10)
    (loss + loss_fused).backward()
    assert tw.grad is None and tb.grad is None


def test_bad_inputs_name_what_is_wrong():
    d = data()
    m = d["mask"]
    gb = GlobalBatch.from_masks([m])
    fn = DistillationLoss(DistillationConfig(loss_mode="full", beta=1.0))
    z = torch.nn.functional.linear(d["h"], d["w"], d["b"])
    with pytest.raises(ValueError, match=r"^TeacherHidden.weight has 12 rows but student has 13 logit columns"):
        fn(z, TeacherHidden(d["th"], d["tw"][:12], 1.0), m, gb)
    with pytest.raises(ValueError, match=r"^TeacherHidden.weight has H=7 columns but TeacherHidden.hidden has H=6"):
        TeacherHidden(d["th"][..., :6], d["tw"], 1.0)
    with pytest.raises(ValueError, match=r"^TeacherHidden.hidden must have shape \(2, 5, 'H'\)"):
        fn(z, TeacherHidden(d["th"][:, :4], d["tw"], 1.0), m, gb)
    bad = d["th"].clone()
    bad[1, 1, 0] = float("nan")  # a valid position
    with pytest.raises(ValueError, match=r"teacher_hidden is not finite at position \(1, 1\)"):
        fn(StudentHidden(d["h"], d["w"], d["b"]), TeacherHidden(bad, d["tw"], 1.0), m, gb)
    with pytest.raises(TypeError, match=r"^loss_mode='full' needs teacher=TeacherLogits\(\.\.\.\) or "
                                        r"TeacherHidden\(\.\.\.\), got TeacherTopK$"):
        fn(z, TeacherTopK(torch.zeros(B, S, 1, dtype=torch.long), torch.zeros(B, S, 1)), m, gb)


# -- a vocabulary shard per rank: the vocab-parallel logits and the fused heads over the group --------------------
def _vp_worker(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist

    dp = [dist.new_group([r]) for r in range(world)][rank]  # pure tensor parallelism: data-parallel size 1
    verdicts = {}
    for case in CASES:
        for dtype in (torch.float64, torch.float32):
            key = f"{case}-{dtype}"
            try:
                d = data(dtype)
                vl = -(-V // world)  # padded logit shards (torch.chunk / Megatron layout)
                z = torch.nn.functional.linear(d["h"], d["w"], d["b"]) * 2.0
                pad = torch.full(z.shape[:-1] + (vl * world - V,), 30.0, dtype=dtype)
                x = poisoned(torch.cat([z, pad], -1)[..., rank * vl:(rank + 1) * vl], d["mask"])
                x = x.detach().requires_grad_(True)
                teacher = TeacherHidden(poisoned(d["th"], d["mask"]), d["tw"], d["tscale"], d["tb"])  # the whole head
                loss, metrics = run_full(case, d, x, teacher, vocab_group=dist.group.WORLD, vocab_size=V, dp_group=dp)
                (gx,) = torch.autograd.grad(loss, x)
                start, width = rank * vl, max(0, min(vl, V - rank * vl))
                assert not gx[..., width:].any(), "gradient on the padding columns"
                full = torch.zeros(B, S, V, dtype=dtype)
                full[..., start:start + width] = torch.nan_to_num(gx[..., :width], nan=123.0)
                dist.all_reduce(full)
                check(case, dtype, loss, metrics, full, dp_group=dp)
                # the fused heads over the group: this rank's contiguous rows of both heads (uneven widths)
                rows = [V // world + (r < V % world) for r in range(world)]
                a = sum(rows[:rank])
                h = poisoned(d["h"], d["mask"]).requires_grad_(True)
                student = StudentHidden(h, d["w"][a:a + rows[rank]], d["b"][a:a + rows[rank]], logit_scale=2.0)
                loss2, _ = run_full(case, d, student, teacher, vocab_group=dist.group.WORLD, dp_group=dp)
                (gh,) = torch.autograd.grad(loss2, h)
                ref, _, gz = reference(case, d)
                torch.testing.assert_close(loss2.detach().double(), ref, **TOL[dtype])
                torch.testing.assert_close(torch.nan_to_num(gh, nan=123.0).double(), gz @ (2.0 * d["w"].double()),
                                           **TOL[dtype])
                verdicts[key] = "ok"
            except Exception as e:  # noqa: BLE001 -- every rank runs every collective of a case before comparing
                verdicts[key] = f"rank {rank}: {type(e).__name__}: {e}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(verdicts, f)


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_shards_over_a_group(world, tmp_path):
    launch("tests.test_hidden_full_vocab:_vp_worker", world, str(tmp_path))
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    bad = [v for verdicts in per_rank for v in verdicts.values() if v != "ok"]
    assert not bad, "\n".join(bad)
    assert len(per_rank[0]) == 2 * len(CASES)
