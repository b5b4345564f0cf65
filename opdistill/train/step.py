"""One optimizer step: token-budget micro-batches, one GlobalBatch, loss, backward, clip, step, exact metrics.

The step sees the whole batch of the step (rows of prompt + response in the padded layout, the teacher signal, the
sampler log-probs and the per-row advantages), cuts it into micro-batches whose padded size rows x longest-row stays
within ``micro_batch_tokens``, builds ONE ``GlobalBatch`` from the masks of all of them, and sums the micro-batch
gradients. Because every micro-batch loss is normalized by the global counts, the summed gradient is the full-batch
gradient whatever the budget (tested), and the metrics are reduced from exact sums, never averaged per micro-batch.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from opdistill import (DistillationLoss, GlobalBatch, MetricSums, TeacherSampled, TeacherTopK, policy_gradient_loss,
                       shift_for_next_token)
from opdistill.fused import causal_lm_hidden, no_cache_kwargs
from opdistill.loss import select_backend
from opdistill.train.teachers import PendingScores, TeacherMetrics, routed_split
from opdistill.train.placement import data_to

__all__ = ["StepData", "token_budget_split", "split_to_count", "group_advantages", "train_step", "rollout_mismatch",
           "tis_weights"]


@dataclass
class StepData:
    input_ids: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [B, S]
    response_mask: torch.Tensor  # [B, S]
    teacher_topk: TeacherTopK | None = None  # [B, S, K]
    teacher_sampled: torch.Tensor | None = None  # [B, S] teacher log-prob of token t+1
    sampler_logprobs: torch.Tensor | None = None  # [B, S] old log-probs (next-token layout)
    advantages: torch.Tensor | None = None  # [B] per-sequence advantage (broadcast over its tokens)
    # several teachers (train/teachers.py): each row's teacher index into teacher_names; pending: scores on their way
    row_teacher: torch.Tensor | None = None  # [B] int64
    teacher_names: tuple | None = None
    pending: PendingScores | None = None  # its fill(data) waits and sets teacher_topk / teacher_sampled


def tis_weights(train_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance-sampling weights ``min(exp(log pi_train - log pi_sampler), cap)``, detached (verl's and
    TRL's TIS): the per-token correction for tokens drawn by a sampler whose numerics differ from the trainer's."""
    return torch.exp(train_logprobs.detach() - sampler_logprobs.detach()).clamp(max=cap)


@torch.no_grad()
def rollout_mismatch(student, tgt: torch.Tensor, m: torch.Tensor, sampler_logprobs: torch.Tensor, *,
                     temperature: float, tis_cap: float | None, vocab: dict | None = None):
    """The trainer's own log-probs of the sampled tokens (at the rollout temperature, the distribution the sampler
    reports) against the sampler's: ``(old log-probs for the losses, TIS weights or None, metrics)``.

    Metrics: ``rollout/logprob_diff_mean`` and ``rollout/logprob_diff_max`` (``|log pi_train - log pi_sampler|``
    over response tokens); with ``tis_cap`` also ``rollout/tis_weight_mean`` and ``rollout/tis_clipfrac`` (the cap
    was active). With ``tis_cap`` the policy-gradient "old" log-probs become the trainer's own (detached), so the
    PPO ratio measures the update only and the sampler/trainer gap is corrected by the weight alone (verl's TIS);
    without it everything is left as it was."""
    train_lp = select_backend(student, **(vocab or {})).masked_token_logprobs(student, tgt, m, temperature=temperature)
    if train_lp.dtype not in (torch.float32, torch.float64):
        train_lp = train_lp.float()
    old = torch.where(m, sampler_logprobs.to(train_lp.dtype), 0.0)
    diff = (train_lp - old).abs()
    metrics = MetricSums()
    metrics.add_mean("rollout/logprob_diff_mean", diff.double(), m)
    metrics.add_extrema("rollout/logprob_diff", diff.double(), m)
    if tis_cap is None:
        return sampler_logprobs, None, metrics
    w = torch.where(m, tis_weights(train_lp, old, tis_cap), 0.0)
    metrics.add_mean("rollout/tis_weight_mean", w.double(), m)
    metrics.add_mean("rollout/tis_clipfrac", (torch.exp(train_lp - old) > tis_cap).double(), m)
    return train_lp, w, metrics


def token_budget_split(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive rows grouped so that len(group) * max(length in group) <= budget (one row always fits)."""
    groups, cur, cur_max = [], [], 0
    for i, n in enumerate(lengths):
        m = max(cur_max, n)
        if cur and (len(cur) + 1) * m > budget:
            groups.append(cur)
            cur, m = [], n
        cur.append(i)
        cur_max = m
    if cur:
        groups.append(cur)
    return groups


def split_to_count(groups: list[list[int]], count: int) -> list[list[int]]:
    """Split the largest groups in two (consecutive rows) until there are ``count`` groups (each split group stays
    within the budget). Under data parallelism every rank must run the same number of micro-batches (FSDP2 gathers
    the weights in every forward), so a rank with fewer splits further; the gradient does not depend on the split."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        i = max(range(len(groups)), key=lambda j: len(groups[j]))
        if len(groups[i]) < 2:
            raise ValueError(f"cannot split {sum(map(len, groups))} rows into {count} micro-batches")
        g = groups[i]
        groups[i:i + 1] = [g[: len(g) // 2], g[len(g) // 2:]]
    return groups


def _grad_norm(params, grad_clip: float | None) -> torch.Tensor:
    """The global gradient norm (clipping to ``grad_clip`` when set); DTensor (FSDP2) shards are reduced."""
    grads = [p.grad for p in params if p.grad is not None]
    meshes: dict = {}
    for g in grads:
        meshes.setdefault(getattr(g, "device_mesh", None), []).append(g)
    if len(meshes) > 1:  # FSDP2 (dp mesh) next to a vocab-parallel lm_head (dp x tp mesh): one norm per mesh
        parts = [torch.nn.utils.get_total_norm(gs) for gs in meshes.values()]
        norm = torch.linalg.vector_norm(torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n
                                                     for n in parts]))
        if grad_clip is not None:
            coef = float(torch.clamp(grad_clip / (norm + 1e-6), max=1.0))  # clip_grad_norm_'s rule
            for g in grads:
                g.mul_(coef)
        return norm
    if grad_clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def group_advantages(rewards: torch.Tensor, group_ids: list[int], eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: (r - mean of the prompt's group) / (std of the group + eps); 0 for a group of equal rewards."""
    rewards = rewards.float()
    adv = torch.zeros_like(rewards)
    gid = torch.tensor(group_ids)
    for g in gid.unique():
        sel = gid == g
        r = rewards[sel]
        std = r.std(unbiased=False) if r.numel() > 1 else torch.zeros(())
        adv[sel] = (r - r.mean()) / (std + eps)
    return adv


def _micro_loss(method, loss_fn: DistillationLoss | None, student, data: StepData, rows, L, targets, mask, batch,
                pg_kwargs, mismatch: dict | None = None, vocab: dict | None = None):
    """``student`` is the student's [b, L, V] logits, or a ``StudentHidden`` (fused lm_head: no [b, L, V] buffer);
    ``select_backend`` picks the ops for either, here and inside ``DistillationLoss``."""
    idx = torch.tensor(rows)
    tgt = targets[idx, :L]
    m = mask[idx, :L]
    old = data.sampler_logprobs[idx, :L] if data.sampler_logprobs is not None else None
    adv = data.advantages[idx][:, None].expand(-1, L) if data.advantages is not None else None  # [b, L]
    weights, mm_metrics = None, None
    if mismatch is not None and old is not None:
        old, weights, mm_metrics = rollout_mismatch(student, tgt, m, old, **mismatch, vocab=vocab)
    if method == "rl":
        lp = select_backend(student, **(vocab or {})).masked_token_logprobs(student, tgt, m, temperature=1.0)
        loss, metrics = policy_gradient_loss(lp, old, adv, m, batch, token_weights=weights, **pg_kwargs)
        return loss, metrics if mm_metrics is None else metrics.merge(mm_metrics)
    loss, metrics = _distill_loss(loss_fn, student, data, idx, L, tgt, m, batch, old, adv, weights,
                                  group=pg_kwargs.get("group"))
    return loss, metrics if mm_metrics is None else metrics.merge(mm_metrics)


def _distill_loss(loss_fn, student, data, idx, L, tgt, m, batch, old, adv, weights, *, group=None):
    cfg = loss_fn.config
    if cfg.loss_mode == "topk":
        v = data.teacher_topk.validated
        teacher = TeacherTopK(data.teacher_topk.ids[idx, :L], data.teacher_topk.logprobs[idx, :L], validated=v)
    elif cfg.loss_mode == "sampled":
        teacher = TeacherSampled(data.teacher_sampled[idx, :L])
        student = loss_fn.backend(student).masked_token_logprobs(student, tgt, m, temperature=cfg.temperature)
    else:
        raise ValueError("loss.loss_mode 'full' needs teacher logits, which the trainer does not keep (use topk)")
    return loss_fn(student, teacher, m, batch, sampled_ids=tgt, old_logprobs=old, task_advantages=adv,
                   group=group, token_weights=weights)


def _micro_step(model, method, loss_fn, data, rows, lengths, targets, mask, batch, pg_kwargs, *, bf16: bool,
                fused_lm_head: bool, sums: MetricSums, mismatch: dict | None = None,
                vocab: dict | None = None) -> torch.Tensor:
    """Forward, loss and backward of one micro-batch; its metrics merged into ``sums``; returns the detached loss."""
    L = max(lengths[r] for r in rows)
    idx = torch.tensor(rows)
    autocast = torch.autocast(data.input_ids.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    no_cache = no_cache_kwargs(model)  # a training forward: no KV cache (transformers builds one by default)
    with autocast:
        if fused_lm_head:
            student = causal_lm_hidden(model, input_ids=data.input_ids[idx, :L],
                                       attention_mask=data.attention_mask[idx, :L], **no_cache)
        else:
            student = model(input_ids=data.input_ids[idx, :L], attention_mask=data.attention_mask[idx, :L],
                            **no_cache).logits
    if not fused_lm_head and student.dtype not in (torch.float32, torch.float64):
        student = student.float()  # bf16 autocast: the losses upcast, do it once here
    if data.pending is not None:  # a remote teacher's request ran during this forward (train/teachers.py)
        data.pending.fill(data)
    loss, metrics = _micro_loss(method, loss_fn, student, data, rows, L, targets, mask, batch, pg_kwargs, mismatch,
                                vocab)
    loss.backward()
    sums.merge(metrics)
    return loss.detach().float()


def train_step(model, optimizer, data: StepData, *, method: str, loss_fn: DistillationLoss | None,
               micro_batch_tokens: int, grad_clip: float | None, bf16: bool = False,
               loss_scale_factor: float | None = None, pg_kwargs: dict | None = None,
               fused_lm_head: bool = False, group=None, mismatch: dict | None = None,
               vocab: dict | None = None) -> dict:
    """Run one optimizer step on ``data``; return the exact step metrics (dict of floats).

    ``fused_lm_head``: run the student's backbone only and hand its hidden states and lm_head to the fused losses
    (``opdistill.fused``): same loss, gradients and metrics, no [tokens, vocab] logits buffer.
    ``group``: the data-parallel group (``model`` wrapped by FSDP2 or DDP; ``data`` is this rank's rows): one
    ``GlobalBatch`` and the metrics are reduced over it, every rank runs the same number of micro-batches.
    ``mismatch``: ``dict(temperature=, tis_cap=)`` -- measure the sampler/trainer log-prob mismatch on the step's
    own forward (``rollout_mismatch``) and, with ``tis_cap``, weight the losses by truncated importance sampling
    (needs ``data.sampler_logprobs`` from the student's own rollouts; None: neither).
    ``vocab``: ``dict(vocab_group=, vocab_size=)`` when ``model``'s logits are this rank's vocabulary shard
    (``distributed.tp_size > 1``, train/tensor_parallel.py): every log-prob and loss then runs vocab-parallel."""
    model.train()
    data = data_to(data, next(model.parameters()).device)  # train.device cuda: the rows onto the student's device
    targets, mask = shift_for_next_token(data.input_ids, data.response_mask)
    lengths = data.attention_mask.sum(-1).tolist()
    micro = token_budget_split(lengths, micro_batch_tokens) if data.row_teacher is None else \
        routed_split(lengths, micro_batch_tokens, data.row_teacher, token_budget_split)  # one teacher per micro-batch
    if group is not None:
        count = torch.tensor([len(micro)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        micro = split_to_count(micro, int(count))
        pg_kwargs = {**(pg_kwargs or {}), "group": group}
    masks = [mask[torch.tensor(rows), : max(lengths[r] for r in rows)] for rows in micro]
    batch = GlobalBatch.from_masks(masks, group=group, loss_scale_factor=loss_scale_factor)
    optimizer.zero_grad(set_to_none=True)
    sums = MetricSums()
    per_teacher = None if data.row_teacher is None else TeacherMetrics(data.teacher_names, data.row_teacher, mask)
    loss_sum = torch.zeros(())
    for i, rows in enumerate(micro):
        # DDP: gradients are all-reduced once, in the last micro-batch's backward (forward and backward under no_sync)
        last = i == len(micro) - 1
        micro_sums = sums if per_teacher is None else MetricSums()
        with contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
            loss = _micro_step(model, method, loss_fn, data, rows, lengths, targets, mask, batch, pg_kwargs or {},
                               bf16=bf16, fused_lm_head=fused_lm_head, sums=micro_sums, mismatch=mismatch,
                               vocab=vocab)
        if per_teacher is not None:
            sums.merge(micro_sums)
            per_teacher.add(rows, micro_sums, sums)
        loss_sum = loss_sum + loss
    if per_teacher is not None:
        per_teacher.finish(sums)
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = _grad_norm(params, grad_clip)
    if group is not None:  # every rank applies the step or none does
        dist.all_reduce(loss_sum, group=group)
    # Non-finite policy (docs/reliability.md): a step whose loss or gradient norm is NaN/inf is not applied.
    applied = bool(torch.isfinite(loss_sum) and torch.isfinite(grad_norm))
    if applied:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    out = sums.reduce(group=group)
    out["train/nonfinite"] = float(not applied)
    out["train/grad_norm"] = float(grad_norm)
    out["train/micro_batches"] = float(len(micro))
    out["train/response_tokens"] = float(batch.num_tokens)
    return out
