"""DistillationLoss end to end on one micro-batch: metric definitions, empty batches, low precision, task rewards."""

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
    aggregate,
    policy_gradient_loss,
    token_logprobs,
    topk_divergence,
)


def topk_batch(B=3, S=4, V=12, K=3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, S, V, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * S)]).reshape(B, S, K)
    lp = torch.log_softmax(torch.randn(B, S, V, generator=g), -1).gather(-1, ids)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)[:B, :S]
    return z, ids, lp, mask


def test_topk_metrics_follow_their_definitions():
    z, ids, lp, mask = topk_batch()
    K = ids.shape[-1]
    gb = GlobalBatch.from_masks([mask])
    loss, metrics = DistillationLoss(DistillationConfig(support="tail", divergence="reverse"))(z, TeacherTopK(ids, lp), mask, gb)
    r = metrics.reduce()
    res = topk_divergence(z, ids, lp, support="tail", divergence="reverse")
    n = int(mask.sum())
    assert r["distillation/loss"] == pytest.approx(res.loss[mask].sum().item() / n, rel=1e-6)
    assert r["distillation/loss_min"] == pytest.approx(res.loss[mask].min().item(), rel=1e-6)
    assert r["distillation/loss_max"] == pytest.approx(res.loss[mask].max().item(), rel=1e-6)
    assert r["distillation/student_mass"] == pytest.approx(res.student_mass[mask].mean().item(), rel=1e-6)
    assert r["distillation/teacher_mass_max"] == pytest.approx(res.teacher_mass[mask].max().item(), rel=1e-6)
    assert r["distillation/overlap_ratio"] == pytest.approx(res.overlap_count[mask].sum().item() / (K * n), rel=1e-12)
    sel = mask & (res.overlap_count > 0)
    expect_adv = res.overlap_token_advantage[sel].mean().item() if sel.any() else 0.0
    assert r["distillation/overlap_token_advantage"] == pytest.approx(expect_adv, rel=1e-6, abs=1e-12)
    assert r["distillation/clamp_fraction"] == 0.0


def test_loss_max_clamp_is_applied_after_min_max_are_logged():
    z, ids, lp, mask = topk_batch(seed=1)
    gb = GlobalBatch.from_masks([mask])
    res = topk_divergence(z, ids, lp, support="tail")
    c = float(res.loss[mask].median())
    loss, metrics = DistillationLoss(DistillationConfig(support="tail", loss_max_clamp=c))(z, TeacherTopK(ids, lp), mask, gb)
    r = metrics.reduce()
    assert r["distillation/loss_max"] == pytest.approx(res.loss[mask].max().item(), rel=1e-6)  # unclamped
    assert r["distillation/clamp_fraction"] == pytest.approx((res.loss[mask] > c).float().mean().item())
    assert loss.item() == pytest.approx(res.loss[mask].clamp(max=c).mean().item(), rel=1e-6)


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
        student, teacher = token_logprobs(z, kw["sampled_ids"]), TeacherSampled(torch.full((3, 4), float("nan")))
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
    z, ids, lp, mask = topk_batch(dtype=dtype)
    gb = GlobalBatch.from_masks([mask])
    loss_lo, _ = DistillationLoss(DistillationConfig())(z, TeacherTopK(ids, lp.to(dtype)), mask, gb)
    loss_32, _ = DistillationLoss(DistillationConfig())(z.float(), TeacherTopK(ids, lp.to(dtype).float()), mask, gb)
    assert loss_lo.dtype == torch.float32
    assert loss_lo.item() == loss_32.item()


def test_task_rewards_total_is_task_plus_coef_times_distillation():
    z, ids, lp, mask = topk_batch(seed=2)
    gb = GlobalBatch.from_masks([mask])
    sampled = torch.randint(0, 12, (3, 4))
    old = token_logprobs(z, sampled).detach() - 0.1
    adv = torch.randn(3, 1).expand(3, 4)
    cfg = DistillationConfig(use_task_rewards=True, distillation_coef=0.25)
    total, metrics = DistillationLoss(cfg)(z, TeacherTopK(ids, lp), mask, gb, sampled_ids=sampled, old_logprobs=old,
                                           task_advantages=adv)
    distill = aggregate(topk_divergence(z, ids, lp, support="tail").loss, mask, "token-mean", gb)
    task, _ = policy_gradient_loss(token_logprobs(z, sampled), old, adv, mask, gb)
    assert total.item() == pytest.approx(task.item() + 0.25 * distill.item(), rel=1e-6)
    r = metrics.reduce()
    assert r["loss/total"] == pytest.approx(total.item(), rel=1e-6)
    assert r["task/loss"] == pytest.approx(task.item(), rel=1e-6)


def test_policy_gradient_distillation_on_policy_ratio_one():
    """At ratio 1 the PG surrogate's value is -A = L per token, so the loss equals the supervised value."""
    z, ids, lp, mask = topk_batch(seed=3, dtype=torch.float64)
    gb = GlobalBatch.from_masks([mask])
    sampled = torch.randint(0, 12, (3, 4))
    old = token_logprobs(z, sampled).detach()
    cfg = DistillationConfig(support="tail", divergence="reverse", use_policy_gradient=True)
    loss, metrics = DistillationLoss(cfg)(z, TeacherTopK(ids, lp), mask, gb, sampled_ids=sampled, old_logprobs=old)
    sup, _ = DistillationLoss(DistillationConfig(support="tail", divergence="reverse"))(z, TeacherTopK(ids, lp), mask, gb)
    assert loss.item() == pytest.approx(sup.item(), rel=1e-12)
    assert metrics.reduce()["distillation/pg_clipfrac"] == 0.0
