"""DistillationLoss with a StudentHidden student (the fused path) == DistillationLoss with the logits: the loss, its
gradients and every metric, for each loss_mode, with policy gradient and task rewards, under masking."""

import pytest
import torch

from opdistill import DistillationConfig, DistillationLoss, GlobalBatch, TeacherSampled, TeacherTopK
from opdistill.fused import StudentHidden, TeacherHidden
from opdistill.loss import TeacherLogits
from tests.conftest import random_teacher_topk, seeded

B, S, H, V, K = 3, 5, 8, 67, 4


def inputs(seed=0):
    g = seeded(seed)
    h = (torch.randn(B, S, H, generator=g) * 0.7).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) * 0.7).requires_grad_(True)
    b = (torch.randn(V, generator=g) * 0.2).requires_grad_(True)
    mask = torch.rand(B, S, generator=g) > 0.3
    mask[1] = False  # an empty sequence
    ids, lp = random_teacher_topk(g, B * S, V, K, scale=2)
    ids, lp = ids.reshape(B, S, K), lp.reshape(B, S, K)
    sampled = torch.randint(0, V, (B, S), generator=g)
    t_lp = -torch.rand(B, S, generator=g) * 3
    old = -torch.rand(B, S, generator=g) * 3
    adv = torch.randn(B, S, generator=g)
    return h, w, b, mask, ids, lp, sampled, t_lp, old, adv


CASES = [
    dict(loss_mode="topk", support="tail", divergence="reverse"),
    dict(loss_mode="topk", support="truncated", log_prob_min_clamp=-4.0, loss_max_clamp=0.5, temperature=0.8),
    dict(loss_mode="topk", support="renormalized", divergence="jsd", use_policy_gradient=True),
    dict(loss_mode="topk", support="tail", use_task_rewards=True, distillation_coef=0.3,
         loss_agg_mode="seq-mean-token-mean"),
    dict(loss_mode="sampled", estimator="k3"),
    dict(loss_mode="sampled", estimator="k1", use_policy_gradient=True, temperature=1.2),
    dict(loss_mode="full", beta=0.3, temperature=0.9),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_fused_student_matches_logits(case):
    h, w, b, mask, ids, lp, sampled, t_lp, old, adv = inputs()
    cfg = DistillationConfig(**case)
    loss_fn = DistillationLoss(cfg)
    batch = GlobalBatch.from_masks(mask)
    extra = dict(sampled_ids=sampled, old_logprobs=old if (cfg.use_policy_gradient or cfg.use_task_rewards) else None,
                 task_advantages=adv if cfg.use_task_rewards else None)
    g = torch.Generator().manual_seed(5)
    ht, wt = torch.randn(B, S, 6, generator=g), torch.randn(V, 6, generator=g)
    logits = torch.nn.functional.linear(h, w, b)
    if cfg.loss_mode == "topk":
        t_plain = t_fused = TeacherTopK(ids, lp)
    elif cfg.loss_mode == "sampled":
        t_plain = t_fused = TeacherSampled(t_lp)
    else:
        t_plain, t_fused = TeacherLogits(ht @ wt.T), TeacherHidden(ht, wt)
    l1, m1 = loss_fn(logits, t_plain, mask, batch, **extra)
    g1 = torch.autograd.grad(l1, (h, w, b), allow_unused=True)
    l2, m2 = loss_fn(StudentHidden(h, w, b), t_fused, mask, batch, **extra)
    g2 = torch.autograd.grad(l2, (h, w, b), allow_unused=True)
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-6)
    for a, c in zip(g1, g2):
        if a is None:
            assert c is None or torch.count_nonzero(c) == 0
        else:
            torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)
    r1, r2 = m1.reduce(), m2.reduce()
    assert r1.keys() == r2.keys()
    for k in r1:
        assert r2[k] == pytest.approx(r1[k], rel=1e-5, abs=1e-6), k


def test_wrong_teacher_type_with_student_hidden():
    h, w, b, mask, *_ = inputs()
    loss_fn = DistillationLoss(DistillationConfig(loss_mode="full"))
    with pytest.raises(TypeError, match="loss_mode='full' needs teacher=TeacherHidden"):
        loss_fn(StudentHidden(h, w, b), TeacherLogits(torch.randn(B, S, V)), mask, GlobalBatch.from_masks(mask))
    loss_fn = DistillationLoss(DistillationConfig(loss_mode="sampled"))
    with pytest.raises(ValueError, match="sampled_ids is required"):
        loss_fn(StudentHidden(h, w, b), TeacherSampled(-torch.ones(B, S)), mask, GlobalBatch.from_masks(mask))
