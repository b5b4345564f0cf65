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
from dataclasses import dataclass

import torch

from ..batch import GlobalBatch, aggregate
from ..metrics import MetricSums
from ..ops.checks import check_float, check_mask
from ..ops.policy import check_clip_ratios, ppo_clip_loss
from ..ops.sampled import sampled_token_kl
from ..ops.topk import union_support
from ..fused import TeacherHidden
from .backend import Backend, select_backend
from .config import DistillationConfig
from .signals import SIGNAL_FOR_MODE, TeacherLogits, TeacherSampled, TeacherScores, TeacherTopK


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


@dataclass(frozen=True)
class _Inputs:
    """One micro-batch's inputs as ``DistillationLoss`` reads them, checked once at the entry (``_check``)."""

    backend: Backend
    student: object  # logits [..., V] (or this rank's shard) or a StudentHidden
    teacher: object  # the loss mode's teacher signal
    mask: torch.Tensor  # [...] bool
    batch: GlobalBatch
    sampled_ids: torch.Tensor | None
    old_logprobs: torch.Tensor | None
    task_advantages: torch.Tensor | None
    weights: torch.Tensor | None  # [...] float64, 0 where masked (token_weights)
    agg: dict  # the aggregation's keyword arguments (mode, clip ratios, cu_seqlens, group)


class DistillationLoss:
    """Callable computing one micro-batch's distillation loss and its exact metrics (see module docstring)."""

    def __init__(self, config: DistillationConfig, *, vocab_group=None, vocab_size: int | None = None):
        """``vocab_group``: the tensor-parallel process group when the student's logits (or its lm_head weight, for
        a ``StudentHidden``) are this rank's contiguous vocabulary shard; ``vocab_size``: the true vocabulary when
        logit shards are padded.  Neither: one device (DTensor logits carry their own mesh)."""
        if not isinstance(config, DistillationConfig):
            raise TypeError(f"config must be a DistillationConfig, got {type(config).__name__}")
        _check_vocab_size(vocab_size)
        self.config = config
        self.vocab_group = vocab_group
        self.vocab_size = vocab_size

    @property
    def loss_scale_factor(self) -> float | None:
        """The fixed divisor of ``seq-mean-token-sum-norm`` (what ``GlobalBatch`` records), else None."""
        return self.config.loss_scale_factor

    def backend(self, student) -> Backend:
        """The back-end this loss runs ``student`` on (``select_backend``)."""
        return select_backend(student, vocab_group=self.vocab_group, vocab_size=self.vocab_size)

    def signal(self, scores: TeacherScores | None):
        """What this loss reads of a teacher's ``scores`` (``opdistill.teachers``): the top-k for loss_mode topk,
        the sampled tokens' log-probs for sampled, the final hidden states with the teacher's head for full."""
        mode = self.config.loss_mode
        got = None if scores is None else {"topk": scores.topk, "sampled": scores.sampled_logprobs,
                                           "full": scores.hidden}[mode]
        if got is None or (mode == "full" and scores.head is None):
            what = {"topk": "top-k", "sampled": "sampled-token log-probs"}.get(mode, "hidden states and lm_head")
            raise ValueError(f"loss_mode={mode!r} reads the teacher's {what}, which these teacher scores do not hold")
        if mode == "topk" and self.config.support == "union":
            if scores.requested_logprobs is None or scores.requested_ids is None:
                raise ValueError("support='union' joins the teacher's top-k with its log-probs at the ids the student "
                                 "chose (requested_ids), which these teacher scores do not hold")
            ids, lp = union_support(got.ids, got.logprobs, scores.requested_ids, scores.requested_logprobs)
            return TeacherTopK(ids, lp)
        if mode == "topk":
            return got
        if mode == "sampled":
            return TeacherSampled(got)
        head = scores.head
        if head.softcap is not None:
            raise ValueError(f"loss_mode='full': the teacher ({head.model}) soft-caps its logits (c * tanh(z / c)), "
                             f"which the hidden-state path does not implement; use loss_mode topk with this teacher")
        return TeacherHidden(got, head.weight, head.logit_scale, head.bias)

    def token_logprobs(self, student, ids: torch.Tensor, mask: torch.Tensor, *, temperature: float | None = None):
        """The student's log-probs of ``ids`` where ``mask`` (0 elsewhere) at ``temperature`` (default the loss's),
        on this loss's back-end: what a trainer compares with its sampler's log-probs."""
        tau = self.config.temperature if temperature is None else temperature
        return self.backend(student).masked_token_logprobs(student, ids, check_mask(mask, "mask"), temperature=tau)

    def __call__(self, student, teacher: TeacherTopK | TeacherSampled | TeacherLogits, mask: torch.Tensor,
                 batch: GlobalBatch, *, sampled_ids: torch.Tensor | None = None,
                 old_logprobs: torch.Tensor | None = None, task_advantages: torch.Tensor | None = None,
                 cu_seqlens: torch.Tensor | None = None, group=None,
                 token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, MetricSums]:
        """Return ``(loss, metrics)`` for one micro-batch.

        student: logits ``[..., V]`` (or this rank's vocabulary shard, see ``__init__``), or a ``StudentHidden``
            (final hidden states plus lm_head, e.g. from ``opdistill.fused.causal_lm_hidden``: the fused back-end,
            same numbers, no ``[..., V]`` logits).
        teacher: ``TeacherTopK`` / ``TeacherSampled`` / ``TeacherLogits`` for loss_mode topk / sampled / full
            (full with a ``StudentHidden``: a ``TeacherHidden``).
        mask ``[...]``: 1 where row t predicts a response token.  group: the data-parallel group of ``batch``.
        sampled_ids ``[...]``: the sampled tokens (loss_mode sampled, policy gradient, task rewards).
        old_logprobs ``[...]``: the sampler's log-probs (policy gradient / task rewards).
        task_advantages ``[...]``: per-token task advantages (use_task_rewards).
        token_weights ``[...]``: per-token weights (detached; truncated importance sampling, docs/engines.md): each
            token's distillation loss (or policy-gradient surrogate) and task surrogate is multiplied by its weight
            before the aggregation; the metrics stay unweighted.
        """
        x = self._check(student, teacher, mask, batch, sampled_ids, old_logprobs, task_advantages, cu_seqlens, group,
                        token_weights)
        metrics = MetricSums()
        per_token, logprob, precomputed = self._terms(x, metrics)
        return self._objective(x, per_token, logprob, precomputed, metrics)

    # -- the entry: every input checked once ----------------------------------------------------------------------
    def _check(self, student, teacher, mask, batch, sampled_ids, old_logprobs, task_advantages, cu_seqlens, group,
               token_weights) -> _Inputs:
        cfg = self.config
        if not isinstance(batch, GlobalBatch):
            raise TypeError(
                f"batch must be a GlobalBatch counted over the whole step, got {type(batch).__name__}; build it "
                "with GlobalBatch.from_masks(all micro-batch masks, group=...)"
            )
        backend = self.backend(student)
        expected = backend.full_teachers if cfg.loss_mode == "full" else (SIGNAL_FOR_MODE[cfg.loss_mode],)
        if not isinstance(teacher, expected):
            names = " or ".join(f"{t.__name__}(...)" for t in expected)
            raise TypeError(f"loss_mode={cfg.loss_mode!r} needs teacher={names}, got {type(teacher).__name__}")
        lead = backend.tokens(student)
        m = check_mask(mask, "mask")
        if m.shape != lead:
            raise ValueError(f"mask must have shape {tuple(lead)} (the token dims of student), got {tuple(m.shape)}")
        needs_logprob = cfg.use_policy_gradient or cfg.use_task_rewards
        if needs_logprob and old_logprobs is None:
            raise ValueError("old_logprobs is required when use_policy_gradient or use_task_rewards is on")
        if cfg.use_task_rewards and task_advantages is None:
            raise ValueError("task_advantages is required when use_task_rewards=True")
        if needs_logprob or cfg.loss_mode == "sampled":
            if sampled_ids is None:
                why = "with loss_mode='sampled'" if cfg.loss_mode == "sampled" else \
                    f"for policy gradient / task rewards with loss_mode={cfg.loss_mode!r}"
                raise ValueError(f"sampled_ids is required {why}")
            if not isinstance(sampled_ids, torch.Tensor) or sampled_ids.shape != m.shape:
                got = tuple(sampled_ids.shape) if isinstance(sampled_ids, torch.Tensor) else type(sampled_ids).__name__
                raise ValueError(f"sampled_ids must have the shape of mask {tuple(m.shape)}, got {got}")
        _check_signal(cfg, backend, teacher, m)
        w = None if token_weights is None else _weights(token_weights, m, torch.float64)
        agg = dict(loss_agg_mode=cfg.loss_agg_mode, clip_ratio_low=cfg.clip_ratio_low,
                   clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c, cu_seqlens=cu_seqlens,
                   group=group)
        return _Inputs(backend, student, teacher, m, batch, sampled_ids, old_logprobs, task_advantages, w, agg)

    # -- the per-token terms ----------------------------------------------------------------------------------------
    def _terms(self, x: _Inputs, metrics: MetricSums):
        """(the per-token divergence L_t, the student's log-probs of the sampled tokens when the mode or the update
        rule reads them (else None), the aggregated clamped loss when the back-end computed it in its forward pass
        (else None)). Masked positions are sanitised first: they may hold padding garbage."""
        cfg, m = self.config, x.mask
        logprob = None
        if cfg.loss_mode == "sampled" or cfg.use_policy_gradient or cfg.use_task_rewards:
            logprob = x.backend.masked_token_logprobs(x.student, x.sampled_ids, m, temperature=cfg.temperature)
        if cfg.loss_mode == "sampled":
            per_token = sampled_token_kl(torch.where(m, logprob, 0.0), torch.where(m, x.teacher.logprobs, 0.0),
                                         cfg.estimator)
            metrics.add_mean("distillation/abs_loss", per_token.abs(), m)
            return per_token, logprob, None
        if cfg.loss_mode == "full":
            per_token, precomputed = self._full(x)
            return per_token, logprob, precomputed
        res, precomputed = self._topk(x)
        k = x.teacher.ids.shape[-1]
        metrics.add_mean("distillation/student_mass", res.student_mass, m)
        metrics.add_extrema("distillation/student_mass", res.student_mass, m)
        metrics.add_mean("distillation/teacher_mass", res.teacher_mass, m)
        metrics.add_extrema("distillation/teacher_mass", res.teacher_mass, m)
        metrics.add_ratio("distillation/overlap_ratio", res.overlap_count[m].sum(), k * int(m.sum()))
        metrics.add_mean("distillation/overlap_token_advantage", res.overlap_token_advantage,
                         m & (res.overlap_count > 0))
        return res.loss, logprob, precomputed

    def _full(self, x: _Inputs):
        """(the per-token full-vocabulary JSD, the aggregated loss when the back-end computed it in one pass)."""
        cfg, keep = self.config, x.mask.unsqueeze(-1)
        kw = dict(beta=cfg.beta, temperature=cfg.temperature)
        if x.backend.weighted_jsd is not None and not cfg.use_policy_gradient:
            weights = self._weights_of(x, x.student.hidden)
            precomputed, per_token = x.backend.weighted_jsd(x.student, x.teacher, keep, weights,
                                                            loss_max_clamp=cfg.loss_max_clamp, **kw)
            return per_token, precomputed
        # policy gradient reads the per-token loss detached: no graph
        with torch.no_grad() if cfg.use_policy_gradient else contextlib.nullcontext():
            return x.backend.jsd(x.student, x.teacher, keep, **kw), None

    def _weights_of(self, x: _Inputs, like: torch.Tensor) -> torch.Tensor:
        """Each token's weight in the aggregated objective (times its token weight): what a one-pass op needs."""
        weights = _aggregation_weights(x.mask, self.config.loss_agg_mode, x.batch, x.agg["cu_seqlens"],
                                       x.agg["group"], like)
        return weights if x.weights is None else weights * x.weights.to(weights.dtype)

    def _topk(self, x: _Inputs):
        """(TopKResult, the aggregated loss when the back-end computed it in one pass, else None)."""
        cfg, m = self.config, x.mask
        keep = m.unsqueeze(-1)
        # Masked rows become all-empty slots: zero loss, zero mass, nothing to validate.
        ids = torch.where(keep, x.teacher.ids, torch.zeros_like(x.teacher.ids))
        lp = torch.where(keep, x.teacher.logprobs, float("-inf"))
        kw = dict(support="tail" if cfg.support == "union" else cfg.support, divergence=cfg.divergence, beta=cfg.beta,
                  log_prob_min_clamp=cfg.log_prob_min_clamp, temperature=cfg.temperature,
                  validate="student" if x.teacher.validated else True)
        if x.backend.weighted_topk is not None and not cfg.use_policy_gradient:
            # supervised: the aggregation is a known linear map, so the back-end can compute the gradient while
            # each chunk's logits are alive (no recompute in backward)
            weights = self._weights_of(x, x.student.hidden)
            precomputed, res = x.backend.weighted_topk(x.student, ids, lp, weights, loss_max_clamp=cfg.loss_max_clamp,
                                                       **kw)
            return res, precomputed
        # policy gradient reads the per-token loss detached: no graph (the fused op then skips its gradients)
        with torch.no_grad() if cfg.use_policy_gradient else contextlib.nullcontext():
            return x.backend.topk(x.student, ids, lp, **kw), None

    # -- clamp, update rule, aggregation -----------------------------------------------------------------------------
    def _objective(self, x: _Inputs, per_token, logprob, precomputed, metrics: MetricSums):
        cfg, m, w = self.config, x.mask, x.weights
        metrics.add_extrema("distillation/loss", per_token, m)  # -> loss_min / loss_max, before the clamp
        if cfg.loss_max_clamp is not None:
            c = cfg.loss_max_clamp
            metrics.add_mean("distillation/clamp_fraction", (per_token.detach().abs() > c).double(), m)
            per_token = per_token.clamp(-c, c)
        else:
            metrics.add_mean("distillation/clamp_fraction", torch.zeros_like(per_token, dtype=torch.float64), m)
        metrics.add_mean("distillation/divergence", per_token, m)
        if cfg.use_policy_gradient:
            distill, pg_metrics = policy_gradient_loss(logprob, x.old_logprobs, -per_token.detach(), m, x.batch,
                                                       prefix="distillation/pg_", token_weights=w, **x.agg)
            metrics.merge(pg_metrics)
        elif precomputed is not None:
            distill = precomputed
        else:
            distill = aggregate(per_token if w is None else per_token * w.to(per_token.dtype), m, cfg.loss_agg_mode,
                                x.batch, cu_seqlens=x.agg["cu_seqlens"], group=x.agg["group"])
        metrics.add_sum("distillation/loss", distill.detach() / x.batch.dp_size)
        if not cfg.use_task_rewards:
            return distill, metrics
        task, task_metrics = policy_gradient_loss(logprob, x.old_logprobs, x.task_advantages, m, x.batch,
                                                  prefix="task/", token_weights=w, **x.agg)
        metrics.merge(task_metrics)
        total = task + cfg.distillation_coef * distill
        metrics.add_sum("loss/total", total.detach() / x.batch.dp_size)
        return total, metrics


class PolicyGradientLoss:
    """The policy-gradient objective of RL from task rewards (GRPO-style advantages), on the same student forms and
    back-ends as :class:`DistillationLoss`: ``loss(student, None, mask, batch, sampled_ids=, old_logprobs=,
    task_advantages=, token_weights=)`` computes the student's log-probs of the sampled tokens at ``temperature``
    (1 by default: the behaviour policy's own distribution) and returns :func:`policy_gradient_loss`'s
    ``(loss, metrics)`` (``policy/loss``, ``policy/clipfrac``, ``policy/clipfrac_lower``)."""

    def __init__(self, *, loss_agg_mode: str = "token-mean", clip_ratio_low: float = 0.2,
                 clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0, loss_scale_factor: float | None = None,
                 temperature: float = 1.0, vocab_group=None, vocab_size: int | None = None):
        check_clip_ratios(clip_ratio_low, clip_ratio_high, clip_ratio_c)
        _check_vocab_size(vocab_size)
        self.agg = dict(loss_agg_mode=loss_agg_mode, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                        clip_ratio_c=clip_ratio_c)
        self.loss_scale_factor, self.temperature = loss_scale_factor, temperature
        self.vocab_group, self.vocab_size = vocab_group, vocab_size

    @classmethod
    def from_config(cls, config: DistillationConfig, **kw) -> "PolicyGradientLoss":
        """The clip range, aggregation and scale factor of a ``DistillationConfig`` (the trainer's ``loss``)."""
        return cls(loss_agg_mode=config.loss_agg_mode, clip_ratio_low=config.clip_ratio_low,
                   clip_ratio_high=config.clip_ratio_high, clip_ratio_c=config.clip_ratio_c,
                   loss_scale_factor=config.loss_scale_factor, **kw)

    def backend(self, student) -> Backend:
        return select_backend(student, vocab_group=self.vocab_group, vocab_size=self.vocab_size)

    def signal(self, scores) -> None:
        """Rewards alone: nothing of a teacher's scores is read."""
        return None

    def token_logprobs(self, student, ids: torch.Tensor, mask: torch.Tensor, *, temperature: float | None = None):
        """As :meth:`DistillationLoss.token_logprobs`."""
        tau = self.temperature if temperature is None else temperature
        return self.backend(student).masked_token_logprobs(student, ids, check_mask(mask, "mask"), temperature=tau)

    def __call__(self, student, teacher, mask: torch.Tensor, batch: GlobalBatch, *, sampled_ids: torch.Tensor,
                 old_logprobs: torch.Tensor, task_advantages: torch.Tensor, cu_seqlens=None, group=None,
                 token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, MetricSums]:
        if teacher is not None:
            raise TypeError(f"PolicyGradientLoss learns from rewards alone: teacher must be None, got "
                            f"{type(teacher).__name__}")
        lp = self.token_logprobs(student, sampled_ids, mask)
        return policy_gradient_loss(lp, old_logprobs, task_advantages, mask, batch, token_weights=token_weights,
                                    cu_seqlens=cu_seqlens, group=group, **self.agg)


def _check_vocab_size(vocab_size) -> None:
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
        raise ValueError(f"vocab_size must be an int >= 1 or None, got {vocab_size!r}")


def _check_signal(cfg: DistillationConfig, backend: Backend, teacher, m: torch.Tensor) -> None:
    """The teacher signal's shape against the mask (and K against ``config.topk``; the fused JSD's group)."""
    if cfg.loss_mode == "sampled":
        if teacher.logprobs.shape != m.shape:
            raise ValueError(f"TeacherSampled.logprobs must have shape {tuple(m.shape)}, got "
                             f"{tuple(teacher.logprobs.shape)}")
    elif cfg.loss_mode == "topk":
        ids, lp = teacher.ids, teacher.logprobs
        if ids.shape != lp.shape or ids.shape[:-1] != m.shape:
            raise ValueError(f"teacher ids/logprobs must have shape {tuple(m.shape) + ('K',)}, got "
                             f"{tuple(ids.shape)} and {tuple(lp.shape)}")
        if cfg.support == "union":  # the teacher's top-K joined with the ids the student chose (signal)
            if cfg.topk is not None and ids.shape[-1] < cfg.topk:
                raise ValueError(f"support='union': the signal has {ids.shape[-1]} slots per token, fewer than the "
                                 f"teacher's top-k (config.topk={cfg.topk}); build it with DistillationLoss.signal "
                                 "or ops.union_support")
        elif cfg.topk is not None and ids.shape[-1] != cfg.topk:
            raise ValueError(f"the teacher sent K={ids.shape[-1]} ids per token but config.topk={cfg.topk}")


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

