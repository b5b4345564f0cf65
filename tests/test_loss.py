"""DistillationLoss end to end on one micro-batch: metric definitions, empty batches, low precision, task rewards.

Every expectation is built from the float64 definitions in tests/reference.py (through tests/conftest.py), never from
the code under test.
"""

import math

import pytest
import torch

from opdistill import (
    DistillationConfig,
    DistillationLoss,
    GlobalBatch,
    TeacherLogits,
    TeacherSampled,
    TeacherTopK,
    token_logprobs,
)
from tests import reference as ref
from tests.conftest import ref_token_logprobs, ref_topk_objective, random_teacher_topk, seeded

EXACT = dict(rel=1e-10, abs=1e-12)  # float64 code against the float64 reference


def topk_batch(B=3, S=4, V=12, K=3, seed=0, dtype=torch.float64):
    """Student logits [B, S, V] (drawn in fp32, then cast), teacher top-k [B, S, K], a mask with an empty row."""
    g = seeded(seed)
    z = torch.randn(B, S, V, generator=g).to(dtype)
    ids, lp = random_teacher_topk(g, B * S, V, K)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)[:B, :S]
    return z, ids.reshape(B, S, K), lp.reshape(B, S, K).to(dtype), mask


def test_topk_metrics_follow_their_definitions():
    z, ids, lp, mask = topk_batch()
    K = ids.shape[-1]
    gb = GlobalBatch.from_masks([mask])
    loss, metrics = DistillationLoss(DistillationConfig(support="tail", divergence="reverse"))(z, TeacherTopK(ids, lp), mask, gb)
    r = metrics.reduce()
    objective, per_token = ref_topk_objective(z, ids, lp, mask, "tail", "reverse")
    q, p, count, adv = ref.diagnostics_reference(z, ids, lp)
    n = int(mask.sum())
    assert loss.item() == pytest.approx(objective.item(), **EXACT)
    assert r["distillation/loss"] == pytest.approx(objective.item(), **EXACT)
    assert r["distillation/loss_min"] == pytest.approx(per_token[mask].min().item(), **EXACT)
    assert r["distillation/loss_max"] == pytest.approx(per_token[mask].max().item(), **EXACT)
    assert r["distillation/student_mass"] == pytest.approx(q[mask].mean().item(), **EXACT)
    assert r["distillation/teacher_mass_max"] == pytest.approx(p[mask].max().item(), **EXACT)
    assert r["distillation/overlap_ratio"] == pytest.approx(count[mask].sum().item() / (K * n), **EXACT)
    sel = mask & (count > 0)
    assert sel.any() and not sel.all()  # the mean is over overlapping tokens only: both kinds are present
    assert r["distillation/overlap_token_advantage"] == pytest.approx(adv[sel].mean().item(), **EXACT)
    assert r["distillation/clamp_fraction"] == 0.0


def test_loss_max_clamp_is_applied_after_min_max_are_logged():
    z, ids, lp, mask = topk_batch(seed=1)
    gb = GlobalBatch.from_masks([mask])
    _, per_token = ref_topk_objective(z, ids, lp, mask, "tail", "forward")
    vals = per_token[mask].sort().values
    c = float(vals[2] + vals[3]) / 2  # between two losses, so rounding cannot move one across it
    loss, metrics = DistillationLoss(DistillationConfig(support="tail", loss_max_clamp=c))(z, TeacherTopK(ids, lp), mask, gb)
    r = metrics.reduce()
    clamped, _ = ref_topk_objective(z, ids, lp, mask, "tail", "forward", loss_max_clamp=c)
    assert r["distillation/loss_max"] == pytest.approx(per_token[mask].max().item(), **EXACT)  # unclamped
    assert r["distillation/clamp_fraction"] == pytest.approx((per_token[mask] > c).double().mean().item(), **EXACT)
    assert 0 < r["distillation/clamp_fraction"] < 1
    assert loss.item() == pytest.approx(clamped.item(), **EXACT)


@pytest.mark.parametrize(
    "cfg",
    [
        DistillationConfig(),
        DistillationConfig(support="truncated"),
        DistillationConfig(loss_mode="sampled", estimator="k3", use_policy_gradient=True),
        DistillationConfig(loss_mode="full", loss_agg_mode="seq-mean-token-mean"),
        DistillationConfig(use_task_rewards=True),
    ],
)
def test_empty_global_batch_gives_zero_loss_no_nan(cfg):
    z, ids, lp, _ = topk_batch()
    mask = torch.zeros(3, 4, dtype=torch.bool)
    gb = GlobalBatch.from_masks([mask])
    z = z.requires_grad_(True)
    kw = dict(sampled_ids=torch.zeros(3, 4, dtype=torch.long), old_logprobs=torch.zeros(3, 4), task_advantages=torch.ones(3, 4))
    if cfg.loss_mode == "sampled":
        student, teacher = z, TeacherSampled(torch.full((3, 4), float("nan")))
    elif cfg.loss_mode == "full":
        student, teacher = z, TeacherLogits(torch.randn(3, 4, 12))
    else:
        student, teacher = z, TeacherTopK(ids, lp)
    loss, metrics = DistillationLoss(cfg)(student, teacher, mask, gb, **kw)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(z.grad, torch.zeros_like(z))
    assert all(math.isfinite(v) for v in metrics.reduce().values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_computed_in_fp32(dtype):
    """Low-precision inputs are upcast before any arithmetic: the loss equals the float64 reference on the same
    (rounded) input values to fp32 accuracy (rtol 1e-5, ~100 fp32 ulps over a few dozen terms). Arithmetic in the
    input dtype would be off by about its own epsilon (bf16 2^-8, fp16 2^-11), far outside that tolerance."""
    z, ids, lp, mask = topk_batch(dtype=dtype)
    gb = GlobalBatch.from_masks([mask])
    lp = lp.to(dtype)
    loss, metrics = DistillationLoss(DistillationConfig())(z, TeacherTopK(ids, lp), mask, gb)
    assert loss.dtype == torch.float32
    objective, _ = ref_topk_objective(z, ids, lp, mask, "tail", "forward")
    assert loss.item() == pytest.approx(objective.item(), rel=1e-5)
    assert metrics.reduce()["distillation/loss"] == pytest.approx(objective.item(), rel=1e-5)


def test_task_rewards_total_is_task_plus_coef_times_distillation():
    z, ids, lp, mask = topk_batch(seed=2)
    gb = GlobalBatch.from_masks([mask])
    g = seeded(12)
    sampled = torch.randint(0, 12, (3, 4), generator=g)
    old = ref_token_logprobs(z, sampled) + 0.3 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 4)
    cfg = DistillationConfig(use_task_rewards=True, distillation_coef=0.25)
    total, metrics = DistillationLoss(cfg)(z, TeacherTopK(ids, lp), mask, gb, sampled_ids=sampled, old_logprobs=old,
                                           task_advantages=adv)
    distill, _ = ref_topk_objective(z, ids, lp, mask, "tail", "forward")
    task = ref.aggregate_reference(ref.ppo_reference(ref_token_logprobs(z, sampled), old, adv), mask, "token-mean")
    assert total.item() == pytest.approx(task.item() + 0.25 * distill.item(), **EXACT)
    r = metrics.reduce()
    assert r["loss/total"] == pytest.approx(total.item(), **EXACT)
    assert r["task/loss"] == pytest.approx(task.item(), **EXACT)
    assert r["distillation/loss"] == pytest.approx(distill.item(), **EXACT)
    assert 0 < r["task/clipfrac"] < 1  # the ratios are spread enough for both branches of the clip


def test_policy_gradient_distillation_on_policy_ratio_one():
    """At ratio 1 the PG surrogate's value is -A = L per token, so the loss equals the supervised objective."""
    z, ids, lp, mask = topk_batch(seed=3)
    gb = GlobalBatch.from_masks([mask])
    sampled = torch.randint(0, 12, (3, 4), generator=seeded(13))
    old = token_logprobs(z, sampled).detach()
    cfg = DistillationConfig(support="tail", divergence="reverse", use_policy_gradient=True)
    loss, metrics = DistillationLoss(cfg)(z, TeacherTopK(ids, lp), mask, gb, sampled_ids=sampled, old_logprobs=old)
    objective, _ = ref_topk_objective(z, ids, lp, mask, "tail", "reverse")
    assert loss.item() == pytest.approx(objective.item(), **EXACT)
    assert metrics.reduce()["distillation/pg_clipfrac"] == 0.0
