"""``DistillationLoss``: one micro-batch in, its share of the step's objective and exact metrics out (SPEC 3.4, 4).

    per-token divergence L_t  (top-k | sampled-token estimator | full-vocabulary JSD), from the back-end
    ``select_backend`` picks for the student (plain logits | vocab-parallel shards | fused hidden states x lm_head)
      -> log loss_min / loss_max, then clamp to [-loss_max_clamp, loss_max_clamp]
      -> supervised:       aggregate(L)
         policy gradient:  aggregate(PPO-clip(log pi, log pi_old, A = -stopgrad(L)))
      -> with task rewards: aggregate(PPO-clip(..., A = task advantages)) + distillation_coef * the above

The config refuses, at construction, the combinations that cannot work (``DistillationConfig``), and the call
refuses to run without a ``GlobalBatch``.
"""

from __future__ import annotations

import contextlib

import torch

from ..batch import GlobalBatch, aggregate
from ..metrics import MetricSums
from ..ops.checks import check_float, check_mask
from ..ops.policy import ppo_clip_loss
from ..ops.sampled import sampled_token_kl
from .backend import Backend, select_backend
from .config import DistillationConfig
from .signals import SIGNAL_FOR_MODE, TeacherLogits, TeacherSampled, TeacherTopK


def policy_gradient_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                         mask: torch.Tensor, batch: GlobalBatch, *, loss_agg_mode: str = "token-mean",
                         clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
                         cu_seqlens: torch.Tensor | None = None, group=None,
                         prefix: str = "policy/", token_weights: torch.Tensor | None = None,
                         ) -> tuple[torch.Tensor, MetricSums]:
    """Aggregated PPO-clip loss for task rewards (e.g. GRPO advantages), with exact metrics.

    Masked positions are zeroed before the surrogate so garbage there cannot reach a gradient; a NaN/inf at a valid
    position of any of the three inputs raises a ``ValueError`` naming the input and the first bad position.
    ``token_weights`` ``[...]`` (detached; e.g. truncated importance-sampling weights): each token's surrogate is
    multiplied by its weight before the aggregation.
    Metrics: ``{prefix}loss`` (this micro-batch's share of the step objective), ``{prefix}clipfrac`` (the clip
    branch was active), ``{prefix}clipfrac_lower`` (the dual clip was active).
    """
    m = check_mask(mask, "mask")
    for name, x in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages)):
        check_float(x, name)
        if x.shape != m.shape:
            raise ValueError(f"{name} must have the shape of mask {tuple(m.shape)}, got {tuple(x.shape)}")
        bad = m & ~torch.isfinite(x)  # a NaN/inf log-prob or advantage gives a NaN loss and gradient
        if bool(bad.any()):
            pos = tuple(int(i) for i in bad.nonzero()[0].tolist())
            raise ValueError(f"{name} is not finite at position {pos} (NaN or inf) where the policy-gradient loss "
                             f"reads it; mask that position or fix the {name} that produced it")
    res = ppo_clip_loss(
        torch.where(m, logprobs, 0.0),
        torch.where(m, old_logprobs, 0.0),
        torch.where(m, advantages, 0.0),
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
    )
    per_token = res.loss if token_weights is None else res.loss * _weights(token_weights, m, res.loss.dtype)
    loss = aggregate(per_token, m, loss_agg_mode, batch, cu_seqlens=cu_seqlens, group=group)
    metrics = MetricSums()
    metrics.add_sum(f"{prefix}loss", loss.detach() / batch.dp_size)
    metrics.add_mean(f"{prefix}clipfrac", res.clipped.double(), m)
    metrics.add_mean(f"{prefix}clipfrac_lower", res.dual_clipped.double(), m)
    return loss, metrics


class DistillationLoss:
    """Callable computing one micro-batch's distillation loss and its exact metrics (see module docstring)."""

    def __init__(self, config: DistillationConfig, *, vocab_group=None, vocab_size: int | None = None):
        """``vocab_group``: the tensor-parallel process group when the student's logits (or its lm_head weight, for
        a ``StudentHidden``) are this rank's contiguous vocabulary shard; ``vocab_size``: the true vocabulary when
        logit shards are padded.  Neither: one device (DTensor logits carry their own mesh)."""
        if not isinstance(config, DistillationConfig):
            raise TypeError(f"config must be a DistillationConfig, got {type(config).__name__}")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
            raise ValueError(f"vocab_size must be an int >= 1 or None, got {vocab_size!r}")
        self.config = config
        self.vocab_group = vocab_group
        self.vocab_size = vocab_size

    def backend(self, student) -> Backend:
        """The back-end this loss runs ``student`` on (``select_backend``)."""
        return select_backend(student, vocab_group=self.vocab_group, vocab_size=self.vocab_size)

    def __call__(self, student, teacher: TeacherTopK | TeacherSampled | TeacherLogits, mask: torch.Tensor,
                 batch: GlobalBatch, *, sampled_ids: torch.Tensor | None = None,
                 old_logprobs: torch.Tensor | None = None, task_advantages: torch.Tensor | None = None,
                 cu_seqlens: torch.Tensor | None = None, group=None,
                 token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, MetricSums]:
        """Return ``(loss, metrics)`` for one micro-batch.

        student: logits ``[..., V]`` (or this rank's vocabulary shard, see ``__init__``), or a ``StudentHidden``
            (final hidden states plus lm_head, e.g. from ``opdistill.fused.causal_lm_hidden``: the fused back-end,
            same numbers, no ``[..., V]`` logits).  loss_mode sampled also takes the student's log-probs of the
            sampled tokens ``[...]`` as a tensor (a ``StudentHidden`` then needs ``sampled_ids``).
        teacher: ``TeacherTopK`` / ``TeacherSampled`` / ``TeacherLogits`` for loss_mode topk / sampled / full
            (full with a ``StudentHidden``: a ``TeacherHidden``).
        mask ``[...]``: 1 where row t predicts a response token.  group: the data-parallel group of ``batch``.
        sampled_ids ``[...]``: the sampled tokens (policy gradient / task rewards, sampled mode from hidden states).
        old_logprobs ``[...]``: the sampler's log-probs (policy gradient / task rewards).
        task_advantages ``[...]``: per-token task advantages (use_task_rewards).
        token_weights ``[...]``: per-token weights (detached; truncated importance sampling, docs/engines.md): each
            token's distillation loss (or policy-gradient surrogate) and task surrogate is multiplied by its weight
            before the aggregation; the metrics stay unweighted.
        """
        cfg = self.config
        if not isinstance(batch, GlobalBatch):
            raise TypeError(
                f"batch must be a GlobalBatch counted over the whole step, got {type(batch).__name__}; build it "
                "with GlobalBatch.from_masks(all micro-batch masks, group=...)"
            )
        backend = self.backend(student)
        given_logprobs = cfg.loss_mode == "sampled" and isinstance(student, torch.Tensor)
        expected = backend.full_teacher if cfg.loss_mode == "full" else SIGNAL_FOR_MODE[cfg.loss_mode]
        if not isinstance(teacher, expected):
            raise TypeError(f"loss_mode={cfg.loss_mode!r} needs teacher={expected.__name__}(...), got {type(teacher).__name__}")
        if given_logprobs:
            check_float(student, "student")
        lead = student.shape if given_logprobs else backend.tokens(student)
        m = check_mask(mask, "mask")
        if m.shape != lead:
            raise ValueError(f"mask must have shape {tuple(lead)} (the token dims of student), got {tuple(m.shape)}")
        needs_logprob = cfg.use_policy_gradient or cfg.use_task_rewards
        if needs_logprob and old_logprobs is None:
            raise ValueError("old_logprobs is required when use_policy_gradient or use_task_rewards is on")
        if cfg.use_task_rewards and task_advantages is None:
            raise ValueError("task_advantages is required when use_task_rewards=True")
        if cfg.loss_mode == "sampled" and not given_logprobs:
            student = self._logprobs(backend, student, sampled_ids, m, "with loss_mode='sampled' and a StudentHidden student")

        metrics = MetricSums()
        w = None if token_weights is None else _weights(token_weights, m, torch.float64)
        per_token, precomputed = self._per_token(backend, student, teacher, m, metrics, batch, cu_seqlens, group, w)
        metrics.add_extrema("distillation/loss", per_token, m)  # -> loss_min / loss_max, before the clamp
        if cfg.loss_max_clamp is not None:
            c = cfg.loss_max_clamp
            metrics.add_mean("distillation/clamp_fraction", (per_token.detach().abs() > c).double(), m)
            per_token = per_token.clamp(-c, c)
        else:
            metrics.add_mean("distillation/clamp_fraction", torch.zeros_like(per_token, dtype=torch.float64), m)
        metrics.add_mean("distillation/divergence", per_token, m)

        logprob = None
        if needs_logprob:
            logprob = student if cfg.loss_mode == "sampled" else self._logprobs(
                backend, student, sampled_ids, m, f"for policy gradient / task rewards with loss_mode={cfg.loss_mode!r}")
        agg = dict(loss_agg_mode=cfg.loss_agg_mode, clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                   clip_ratio_c=cfg.clip_ratio_c, cu_seqlens=cu_seqlens, group=group)
        if cfg.use_policy_gradient:
            distill, pg_metrics = policy_gradient_loss(logprob, old_logprobs, -per_token.detach(), m, batch,
                                                       prefix="distillation/pg_", token_weights=w, **agg)
            metrics.merge(pg_metrics)
        else:
            distill = precomputed if precomputed is not None else aggregate(
                per_token if w is None else per_token * w.to(per_token.dtype), m, cfg.loss_agg_mode, batch,
                cu_seqlens=cu_seqlens, group=group)
        metrics.add_sum("distillation/loss", distill.detach() / batch.dp_size)
        if not cfg.use_task_rewards:
            return distill, metrics
        task, task_metrics = policy_gradient_loss(logprob, old_logprobs, task_advantages, m, batch, prefix="task/",
                                                  token_weights=w, **agg)
        metrics.merge(task_metrics)
        total = task + cfg.distillation_coef * distill
        metrics.add_sum("loss/total", total.detach() / batch.dp_size)
        return total, metrics

    def _logprobs(self, backend: Backend, student, sampled_ids, m: torch.Tensor, why: str) -> torch.Tensor:
        """The student's log-probs of ``sampled_ids`` at temperature tau, masked positions read at id 0."""
        if sampled_ids is None:
            raise ValueError(f"sampled_ids is required {why}")
        if not isinstance(sampled_ids, torch.Tensor) or sampled_ids.shape != m.shape:
            got = tuple(sampled_ids.shape) if isinstance(sampled_ids, torch.Tensor) else type(sampled_ids).__name__
            raise ValueError(f"sampled_ids must have the shape of mask {tuple(m.shape)}, got {got}")
        return backend.masked_token_logprobs(student, sampled_ids, m, temperature=self.config.temperature)

    def _per_token(self, backend: Backend, student, teacher, m, metrics: MetricSums, batch, cu_seqlens, group, w=None):
        """(the per-token divergence, with masked positions sanitised (they may hold padding garbage), and the
        aggregated clamped loss when the back-end computed it in its forward pass, else None)."""
        cfg = self.config
        if cfg.loss_mode == "sampled":
            lp = teacher.logprobs
            if lp.shape != m.shape:
                raise ValueError(f"TeacherSampled.logprobs must have shape {tuple(m.shape)}, got {tuple(lp.shape)}")
            per_token = sampled_token_kl(torch.where(m, student, 0.0), torch.where(m, lp, 0.0), cfg.estimator)
            metrics.add_mean("distillation/abs_loss", per_token.abs(), m)
            return per_token, None
        if cfg.loss_mode == "full":
            return backend.jsd(student, teacher, m.unsqueeze(-1), beta=cfg.beta, temperature=cfg.temperature), None
        ids, lp = teacher.ids, teacher.logprobs
        if ids.shape != lp.shape or ids.shape[:-1] != m.shape:
            raise ValueError(
                f"teacher ids/logprobs must have shape {tuple(m.shape) + ('K',)}, got {tuple(ids.shape)} and {tuple(lp.shape)}"
            )
        if cfg.topk is not None and ids.shape[-1] != cfg.topk:
            raise ValueError(f"the teacher sent K={ids.shape[-1]} ids per token but config.topk={cfg.topk}")
        keep = m.unsqueeze(-1)
        # Masked rows become all-empty slots: zero loss, zero mass, nothing to validate.
        ids = torch.where(keep, ids, torch.zeros_like(ids))
        lp = torch.where(keep, lp, float("-inf"))
        kw = dict(support=cfg.support, divergence=cfg.divergence, beta=cfg.beta,
                  log_prob_min_clamp=cfg.log_prob_min_clamp, temperature=cfg.temperature,
                  validate="student" if teacher.validated else True)
        precomputed = None
        if backend.weighted_topk is not None and not cfg.use_policy_gradient:
            # supervised: the aggregation is a known linear map, so the back-end can compute the gradient while
            # each chunk's logits are alive (no recompute in backward)
            weights = _aggregation_weights(m, cfg.loss_agg_mode, batch, cu_seqlens, group, student.hidden)
            if w is not None:
                weights = weights * w.to(weights.dtype)
            precomputed, res = backend.weighted_topk(student, ids, lp, weights, loss_max_clamp=cfg.loss_max_clamp, **kw)
        else:  # policy gradient reads the per-token loss detached: no graph (the fused op then skips its gradients)
            with torch.no_grad() if cfg.use_policy_gradient else contextlib.nullcontext():
                res = backend.topk(student, ids, lp, **kw)
        k = ids.shape[-1]
        metrics.add_mean("distillation/student_mass", res.student_mass, m)
        metrics.add_extrema("distillation/student_mass", res.student_mass, m)
        metrics.add_mean("distillation/teacher_mass", res.teacher_mass, m)
        metrics.add_extrema("distillation/teacher_mass", res.teacher_mass, m)
        metrics.add_ratio("distillation/overlap_ratio", res.overlap_count[m].sum(), k * int(m.sum()))
        metrics.add_mean("distillation/overlap_token_advantage", res.overlap_token_advantage, m & (res.overlap_count > 0))
        return res.loss, precomputed


def _weights(token_weights: torch.Tensor, m: torch.Tensor, dtype) -> torch.Tensor:
    """Checked, detached per-token weights (0 where masked) in ``dtype``."""
    check_float(token_weights, "token_weights")
    if token_weights.shape != m.shape:
        raise ValueError(f"token_weights must have the shape of mask {tuple(m.shape)}, got {tuple(token_weights.shape)}")
    w = torch.where(m, token_weights.detach(), 0.0)
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("token_weights must be finite and >= 0 where mask is 1")
    return w.to(dtype)


def _aggregation_weights(m, mode, batch, cu_seqlens, group, like: torch.Tensor) -> torch.Tensor:
    """d aggregate / d per_token: every aggregation mode is linear in the per-token losses, so these weights turn
    the micro-batch loss into sum_t w_t L_t exactly (same arithmetic as ``aggregate``, through autograd)."""
    x = torch.zeros(m.shape, dtype=torch.float64 if like.dtype == torch.float64 else torch.float32,
                    device=like.device, requires_grad=True)
    with torch.enable_grad():
        (w,) = torch.autograd.grad(aggregate(x, m, mode, batch, cu_seqlens=cu_seqlens, group=group), x,
                                   allow_unused=True)
    return torch.zeros_like(x) if w is None else w

