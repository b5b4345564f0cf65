"""One optimizer step: token-budget micro-batches, one GlobalBatch, loss, backward, clip, step, exact metrics.

The step sees the whole batch of the step (rows of prompt + response in the padded layout, the teacher's scores, the
sampler log-probs and the per-row advantages), cuts it into micro-batches whose padded size rows x longest-row stays
within ``micro_batch_tokens``, builds ONE ``GlobalBatch`` from the masks of all of them, and sums the micro-batch
gradients. Because every micro-batch loss is normalized by the global counts, the summed gradient is the full-batch
gradient whatever the budget (tested), and the metrics are reduced from exact sums, never averaged per micro-batch.

The step knows nothing of where the scores came from. ``StepData.scores`` may still be on its way (a Future: a remote
teacher's request overlapped with the first micro-batch's forward; it is waited for where the loss first reads it),
and ``StepData.groups`` names metric groups of rows (several routed teachers: ``teacher/<name>/``): every
micro-batch is cut within one group, and each group's share of the metrics is reported under its prefix
(:class:`StepPlan`). The loss object decides what it reads (``loss_fn.signal(scores)``): a
:class:`~opdistill.DistillationLoss` or a :class:`~opdistill.PolicyGradientLoss` (RL from rewards alone).
"""
from __future__ import annotations

import contextlib
import dataclasses
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from opdistill import (DistillationConfig, DistillationLoss, GlobalBatch, MetricSums, TeacherScores,
                       shift_for_next_token)
from opdistill.fused import causal_lm_hidden, no_cache_kwargs
from opdistill.ops.correction import icepop_weights, sequence_log_ratio, tis_weights
from opdistill.train.run.placement import data_to

__all__ = ["StepData", "StepPlan", "token_budget_split", "split_to_count", "group_split", "group_advantages",
           "train_step", "rollout_mismatch", "tis_weights", "icepop_weights",
           "sequence_log_ratio"]


@dataclass
class StepData:
    """One step's rows and what scored them."""

    input_ids: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [B, S]
    response_mask: torch.Tensor  # [B, S]
    scores: TeacherScores | Future | None = None  # the teacher's; a Future while a request is on its way
    sampler_logprobs: torch.Tensor | None = None  # [B, S] old log-probs (next-token layout)
    advantages: torch.Tensor | None = None  # [B] per-sequence advantage (broadcast over its tokens)
    groups: dict[str, torch.Tensor] | None = None  # metric groups: prefix ("teacher/<name>/") -> row indices
    requested_ids: torch.Tensor | None = None  # [B, S, J] the ids the teacher was asked to score (support union)

    def teacher_scores(self) -> TeacherScores | None:
        """The scores, waited for if still on their way, on the rows' device (``train.device: cuda`` moved the rows
        before the scores arrived), with the ids the request named attached to their log-probs."""
        if isinstance(self.scores, Future):
            self.scores = self.scores.result()
        if self.scores is not None:
            if self.requested_ids is not None and self.scores.requested_ids is None:
                self.scores = dataclasses.replace(self.scores, requested_ids=self.requested_ids)
            self.scores = self.scores.to(self.input_ids.device)
        return self.scores


@torch.no_grad()
def rollout_mismatch(student, tgt: torch.Tensor, m: torch.Tensor, sampler_logprobs: torch.Tensor, *,
                     temperature: float, tis_cap: float | None, band: tuple[float, float] | None = None,
                     level: str = "token", loss=None):
    """The trainer's own log-probs of the sampled tokens (at the rollout temperature, the distribution the sampler
    reports) against the sampler's: ``(old log-probs for the losses, TIS weights or None, metrics)``. ``loss``: the
    step's loss object, whose back-end computes the log-probs (default: plain logits on one device).

    Metrics: ``rollout/logprob_diff_mean`` and ``rollout/logprob_diff_max`` (``|log pi_train - log pi_sampler|``
    over response tokens); with ``tis_cap`` also ``rollout/tis_weight_mean`` and ``rollout/tis_clipfrac`` (the cap
    was active); with ``band`` (ICE-POP, :func:`icepop_weights`) instead ``rollout/icepop_maskfrac`` (tokens
    masked); with either, ``rollout/ratio_mean`` and ``rollout/ratio_min`` / ``_max`` (``pi_train / pi_sampler``).
    With a correction the policy-gradient "old" log-probs become the trainer's own (detached), so the PPO ratio
    measures the update only and the sampler/trainer gap (or the staleness of a pipelined step, SPEC 6.5) is
    corrected by the weight alone (verl's TIS); without one everything is left as it was. ``level``
    (``rollout.correction_level``): the ratio of the weights and metrics per token, or per sequence
    (:func:`sequence_log_ratio`: every token of a row gets its row's weight)."""
    loss = loss if loss is not None else DistillationLoss(DistillationConfig())
    train_lp = loss.token_logprobs(student, tgt, m, temperature=temperature)
    if train_lp.dtype not in (torch.float32, torch.float64):
        train_lp = train_lp.float()
    old = torch.where(m, sampler_logprobs.to(train_lp.dtype), 0.0)
    diff = (train_lp - old).abs()
    metrics = MetricSums()
    metrics.add_mean("rollout/logprob_diff_mean", diff.double(), m)
    metrics.add_extrema("rollout/logprob_diff", diff.double(), m)
    if tis_cap is None and band is None:
        return sampler_logprobs, None, metrics
    log_ratio = sequence_log_ratio(train_lp, old, m, level)  # token: train_lp - old; else one per row
    ratio = torch.exp(sequence_log_ratio(train_lp.double(), old.double(), m, level))
    metrics.add_mean("rollout/ratio_mean", ratio, m)
    metrics.add_extrema("rollout/ratio", ratio, m)
    zero = torch.zeros_like(log_ratio)
    if band is not None:
        w = torch.where(m, icepop_weights(log_ratio, zero, band), 0.0)
        metrics.add_mean("rollout/icepop_maskfrac", 1.0 - w.double(), m)
        return train_lp, w, metrics
    w = torch.where(m, tis_weights(log_ratio, zero, tis_cap), 0.0)
    metrics.add_mean("rollout/tis_weight_mean", w.double(), m)
    metrics.add_mean("rollout/tis_clipfrac", (ratio > tis_cap).double(), m)
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


def group_split(lengths: list[int], budget: int, groups: list[torch.Tensor], split=token_budget_split
                ) -> list[list[int]]:
    """Micro-batches (``split(lengths, budget)``) cut within each group of rows (``groups``: row indices, in order;
    empty groups skipped): every micro-batch holds one group's rows, groups in order, rows ascending within one."""
    out = []
    for rows in groups:
        rows = sorted(rows.tolist())
        out += [[rows[i] for i in g] for g in split([lengths[r] for r in rows], budget)]
    return out


class StepPlan:
    """How one step's rows are cut and counted, decided once before the first forward: the micro-batches (within a
    metric group each, the same count on every data-parallel rank), the next-token targets and mask, the step's
    ``GlobalBatch``, and the metric groups whose shares of the metrics are kept (module docstring).

    Per metric group ``p`` (e.g. ``teacher/<name>/``): ``{p}token_frac``, the group's share of the step's response
    tokens (the shares sum to 1; all 0 when the step has no response token), and every ``distillation/*`` metric
    restricted to its rows under ``p``: ``{p}loss`` is its share of ``distillation/loss`` (the shares add up to it).
    A group without tokens in a step still reports every name (the same names on every rank and step): 0."""

    def __init__(self, data: StepData, micro_batch_tokens: int, *, group=None, loss_scale_factor=None):
        self.targets, self.mask = shift_for_next_token(data.input_ids, data.response_mask)
        self.lengths = data.attention_mask.sum(-1).tolist()
        self.groups = data.groups
        if self.groups is None:
            micro = token_budget_split(self.lengths, micro_batch_tokens)
        else:  # one metric group per micro-batch
            micro = group_split(self.lengths, micro_batch_tokens, list(self.groups.values()))
        if group is not None:  # FSDP2 gathers weights in every forward: every rank runs as many micro-batches
            count = torch.tensor([len(micro)])
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
            micro = split_to_count(micro, int(count))
        self.micro = micro
        masks = [self.mask[torch.tensor(rows), : self.length(rows)] for rows in micro]
        self.batch = GlobalBatch.from_masks(masks, group=group, loss_scale_factor=loss_scale_factor)
        self._tokens = self.mask.sum(-1)  # [B] response tokens per row
        self._group_of = {}
        for j, rows in enumerate((self.groups or {}).values()):
            for r in rows.tolist():
                self._group_of[r] = j

    def length(self, rows: list[int]) -> int:
        """The padded length of a micro-batch: its longest row."""
        return max(self.lengths[r] for r in rows)

    def record(self, rows: list[int], micro: MetricSums, sums: MetricSums) -> None:
        """A micro-batch's metrics into the step's ``sums``, and its group's share into the group's names."""
        sums.merge(micro)
        if self.groups is None:
            return
        prefixes = list(self.groups)
        j = self._group_of[rows[0]]
        n = self._tokens[torch.tensor(rows)].sum()
        for i, p in enumerate(prefixes):
            sums.add_ratio(f"{p}token_frac", n if i == j else torch.zeros(()), n)
        sums.merge(micro.renamed("distillation/", prefixes[j]))

    def finish(self, sums: MetricSums) -> None:
        """Every group reports every name (0 where it had no tokens): the same names on every rank and step."""
        if self.groups is None:
            return
        template = sums.renamed("distillation/", "", empty=True)
        for p in self.groups:
            sums.merge(template.renamed("", p, empty=True))


@dataclass(frozen=True)
class _Settings:
    """What every micro-batch of a step shares (``train_step``'s keyword arguments)."""

    loss_fn: object
    bf16: bool
    fused_lm_head: bool
    group: object
    mismatch: dict | None


def _forward(model, data: StepData, idx: torch.Tensor, L: int, s: _Settings):
    """The student on a micro-batch: its [b, L, V] logits (fp32 under bf16 autocast: the losses upcast, once here),
    or a ``StudentHidden`` (fused lm_head: no [b, L, V] buffer)."""
    autocast = torch.autocast(data.input_ids.device.type, dtype=torch.bfloat16) if s.bf16 else contextlib.nullcontext()
    no_cache = no_cache_kwargs(model)  # a training forward: no KV cache (transformers builds one by default)
    with autocast:
        if s.fused_lm_head:
            return causal_lm_hidden(model, input_ids=data.input_ids[idx, :L], attention_mask=data.attention_mask[idx, :L],
                                    **no_cache)
        student = model(input_ids=data.input_ids[idx, :L], attention_mask=data.attention_mask[idx, :L],
                        **no_cache).logits
    return student.float() if student.dtype not in (torch.float32, torch.float64) else student


def _micro_step(model, data: StepData, plan: StepPlan, rows: list[int], s: _Settings):
    """Forward, loss and backward of one micro-batch: (the detached loss, its metrics)."""
    idx, L = torch.tensor(rows), plan.length(rows)
    student = _forward(model, data, idx, L, s)
    scores = data.teacher_scores()  # a remote teacher's request ran during this forward
    teacher = s.loss_fn.signal(None if scores is None else scores.micro(idx, L))
    tgt, m = plan.targets[idx, :L], plan.mask[idx, :L]
    old = data.sampler_logprobs[idx, :L] if data.sampler_logprobs is not None else None
    adv = data.advantages[idx][:, None].expand(-1, L) if data.advantages is not None else None  # [b, L]
    weights, mm_metrics = None, None
    if s.mismatch is not None and old is not None:
        old, weights, mm_metrics = rollout_mismatch(student, tgt, m, old, **s.mismatch, loss=s.loss_fn)
    loss, metrics = s.loss_fn(student, teacher, m, plan.batch, sampled_ids=tgt, old_logprobs=old,
                              task_advantages=adv, group=s.group, token_weights=weights)
    loss.backward()
    return loss.detach().float(), metrics if mm_metrics is None else metrics.merge(mm_metrics)


def train_step(model, optimizer, data: StepData, *, loss_fn, micro_batch_tokens: int, grad_clip: float | None,
               bf16: bool = False, fused_lm_head: bool = False, group=None, mismatch: dict | None = None) -> dict:
    """Run one optimizer step on ``data``; return the exact step metrics (dict of floats).

    ``loss_fn``: a :class:`~opdistill.DistillationLoss` or :class:`~opdistill.PolicyGradientLoss` (it knows its
    vocabulary group: ``distributed.tp_size > 1`` runs every log-prob and loss vocab-parallel).
    ``fused_lm_head``: run the student's backbone only and hand its hidden states and lm_head to the fused losses
    (``opdistill.fused``): same loss, gradients and metrics, no [tokens, vocab] logits buffer.
    ``group``: the data-parallel group (``model`` wrapped by FSDP2 or DDP; ``data`` is this rank's rows): one
    ``GlobalBatch`` and the metrics are reduced over it, every rank runs the same number of micro-batches.
    ``mismatch``: ``dict(temperature=, tis_cap=)`` -- measure the sampler/trainer log-prob mismatch on the step's
    own forward (``rollout_mismatch``) and, with ``tis_cap``, weight the losses by truncated importance sampling
    (needs ``data.sampler_logprobs`` from the student's own rollouts; None: neither)."""
    model.train()
    data = data_to(data, next(model.parameters()).device)  # train.device cuda: the rows onto the student's device
    plan = StepPlan(data, micro_batch_tokens, group=group, loss_scale_factor=loss_fn.loss_scale_factor)
    settings = _Settings(loss_fn, bf16, fused_lm_head, group, mismatch)
    optimizer.zero_grad(set_to_none=True)
    sums = MetricSums()
    loss_sum = torch.zeros(())
    for i, rows in enumerate(plan.micro):
        # DDP: gradients are all-reduced once, in the last micro-batch's backward (forward and backward under no_sync)
        last = i == len(plan.micro) - 1
        with contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
            loss, micro = _micro_step(model, data, plan, rows, settings)
        plan.record(rows, micro, sums)
        loss_sum = loss_sum + loss
    plan.finish(sums)
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
    out["train/micro_batches"] = float(len(plan.micro))
    out["train/response_tokens"] = float(plan.batch.num_tokens)
    return out
