"""The split-invariance harness (SPEC 1, promise 1).

A random global batch (ragged lengths, empty rows, garbage in masked slots) is cut at random into D simulated
data-parallel ranks x M micro-batches, padded or packed.  Summed micro-batch gradients averaged over D must equal
the full-batch gradient (float64, 1e-10 relative) and the merged metrics must equal the full-batch metrics, for
every loss family and every aggregation mode.
"""

import dataclasses
import random

import pytest
import torch

from opdistill import (
    AGG_MODES,
    DistillationConfig,
    DistillationLoss,
    GlobalBatch,
    MetricSums,
    TeacherLogits,
    TeacherSampled,
    TeacherTopK,
    pack,
)

B, S, V, K = 9, 7, 13, 4

FAMILIES = {
    "truncated": dict(loss_mode="topk", support="truncated"),
    "truncated-clamp": dict(loss_mode="topk", support="truncated", log_prob_min_clamp=-3.0),
    "tail-forward": dict(loss_mode="topk", support="tail", divergence="forward"),
    "tail-reverse": dict(loss_mode="topk", support="tail", divergence="reverse"),
    "tail-jsd": dict(loss_mode="topk", support="tail", divergence="jsd", beta=0.3),
    "renorm-forward": dict(loss_mode="topk", support="renormalized", divergence="forward"),
    "renorm-reverse": dict(loss_mode="topk", support="renormalized", divergence="reverse"),
    "renorm-jsd": dict(loss_mode="topk", support="renormalized", divergence="jsd"),
    "tail-reverse-pg": dict(loss_mode="topk", support="tail", divergence="reverse", use_policy_gradient=True),
    "tail-maxclamp": dict(loss_mode="topk", support="tail", loss_max_clamp=0.3),
    "k2": dict(loss_mode="sampled", estimator="k2"),
    "k3": dict(loss_mode="sampled", estimator="k3"),
    "abs": dict(loss_mode="sampled", estimator="abs"),
    "k1-pg": dict(loss_mode="sampled", estimator="k1", use_policy_gradient=True),
    "k3-pg-maxclamp": dict(loss_mode="sampled", estimator="k3", use_policy_gradient=True, loss_max_clamp=0.5),
    "full-jsd": dict(loss_mode="full", beta=0.5),
    "full-forward": dict(loss_mode="full", beta=0.0),
    "tail-task-rewards": dict(loss_mode="topk", support="tail", use_task_rewards=True, distillation_coef=0.5),
}


def make_global_batch(seed):
    g = torch.Generator().manual_seed(seed)
    total = torch.randint(1, S + 1, (B,), generator=g)  # real length of each sequence (prompt + response)
    total[0] = S
    mask = torch.zeros(B, S, dtype=torch.bool)
    for i in range(B):
        prompt = int(torch.randint(0, int(total[i]), (1,), generator=g))
        mask[i, prompt : int(total[i]) - 1] = True  # the last real position predicts nothing
    mask[2] = False  # an empty row
    logits = torch.randn(B, S, V, generator=g, dtype=torch.float64) * 2
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * S)]).reshape(B, S, K)
    t_logits = torch.randn(B, S, V, generator=g, dtype=torch.float64) * 2
    t_lp = torch.log_softmax(t_logits, -1).gather(-1, ids)
    # garbage where the mask is 0: it must be sanitised, never validated or propagated
    ids = torch.where(mask[..., None], ids, 0)
    t_lp = torch.where(mask[..., None], t_lp, 7.0)
    sampled = torch.randint(0, V, (B, S), generator=g)
    t_sampled = torch.log_softmax(t_logits, -1).gather(-1, sampled[..., None])[..., 0]
    t_sampled = torch.where(mask, t_sampled, float("nan"))
    old = torch.log_softmax(logits, -1).gather(-1, sampled[..., None])[..., 0] + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, S).clone()
    return dict(total=total, mask=mask, logits=logits, ids=ids, t_lp=t_lp, t_logits=t_logits, sampled=sampled,
                t_sampled=t_sampled, old=old, adv=adv)


def micro_batch(data, leaf, rows, packed):
    """The tensors of one micro-batch holding sequences ``rows`` (a view of the shared leaf, so grads accumulate)."""
    idx = torch.tensor(rows, dtype=torch.long)
    mb = {k: v[idx] for k, v in data.items() if k != "logits"}
    mb["logits"] = leaf[idx]
    if not packed:
        return mb, None
    lengths = data["total"][idx]
    out = {}
    for k, v in mb.items():
        if k == "total":
            continue
        out[k], cu = pack(v, lengths)
    return out, cu


def run(cfg, data, leaf, micro_batches, dp_size, packed):
    """Sum of micro-batch losses (backward called on each) and merged metrics."""
    loss_fn = DistillationLoss(cfg)
    masks, cus = [], []
    built = []
    for rows in micro_batches:
        mb, cu = micro_batch(data, leaf, rows, packed)
        built.append((mb, cu))
        masks.append(mb["mask"])
        cus.append(cu)
    gb = GlobalBatch.from_masks(masks, cu_seqlens=cus if packed else None, loss_scale_factor=cfg.loss_scale_factor)
    gb = dataclasses.replace(gb, dp_size=dp_size)  # what the all-reduce over D ranks would give
    metrics = MetricSums()
    total = 0.0
    for mb, cu in built:
        if cfg.loss_mode == "topk":
            student, teacher = mb["logits"], TeacherTopK(mb["ids"], mb["t_lp"])
        elif cfg.loss_mode == "sampled":
            student, teacher = mb["logits"], TeacherSampled(mb["t_sampled"])
        else:
            student, teacher = mb["logits"], TeacherLogits(mb["t_logits"])
        loss, m = loss_fn(student, teacher, mb["mask"], gb, sampled_ids=mb["sampled"], old_logprobs=mb["old"],
                          task_advantages=mb["adv"], cu_seqlens=cu)
        assert torch.isfinite(loss)
        loss.backward()
        total += loss.item()
        metrics.merge(m)
    return total, metrics.reduce()


def random_split(rng):
    """Random D ranks x M micro-batches over the B sequences (uneven, order shuffled)."""
    order = list(range(B))
    rng.shuffle(order)
    D = rng.choice([1, 2, 3])
    cuts = sorted(rng.sample(range(1, B), D - 1))
    ranks = [order[a:b] for a, b in zip([0] + cuts, cuts + [B])]
    micro = []
    for rank_rows in ranks:
        M = rng.randint(1, len(rank_rows))
        mcuts = sorted(rng.sample(range(1, len(rank_rows)), M - 1)) if M > 1 else []
        micro += [rank_rows[a:b] for a, b in zip([0] + mcuts, mcuts + [len(rank_rows)])]
    return D, micro


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_split_invariance(family, mode):
    kw = dict(FAMILIES[family], loss_agg_mode=mode)
    if mode == "seq-mean-token-sum-norm":
        kw["loss_scale_factor"] = float(S)
    cfg = DistillationConfig(**kw)
    rng = random.Random(f"{family}-{mode}")
    data = make_global_batch(seed=rng.randint(0, 10**6))

    leaf = data["logits"].clone().requires_grad_(True)
    full_loss, full_metrics = run(cfg, data, leaf, [list(range(B))], 1, packed=False)
    full_grad = leaf.grad.clone()
    assert full_grad.abs().sum() > 0

    for packed in (False, True):
        for _ in range(2):
            D, micro = random_split(rng)
            leaf.grad = None
            split_loss, split_metrics = run(cfg, data, leaf, micro, D, packed)
            torch.testing.assert_close(leaf.grad / D, full_grad, rtol=1e-10, atol=1e-13)
            assert split_loss / D == pytest.approx(full_loss, rel=1e-10, abs=1e-13)
            assert split_metrics.keys() == full_metrics.keys()
            for name, value in full_metrics.items():
                assert split_metrics[name] == pytest.approx(value, rel=1e-10, abs=1e-13), name
