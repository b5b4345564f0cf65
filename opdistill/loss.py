"""``DistillationConfig`` + ``DistillationLoss``: pick the op, clamp, apply the update rule, aggregate, record metrics.

One micro-batch in, its share of the step's objective out (SPEC 3.4 and 4):

    per-token divergence L_t  (top-k | sampled-token estimator | full-vocabulary JSD)
      -> log loss_min / loss_max, then clamp to [-loss_max_clamp, loss_max_clamp]
      -> supervised:       aggregate(L)
         policy gradient:  aggregate(PPO-clip(log pi, log pi_old, A = -stopgrad(L)))
      -> with task rewards: aggregate(PPO-clip(..., A = task advantages)) + distillation_coef * the above

The config refuses, at construction, the combinations that cannot work (see ``DistillationConfig``), and the
call refuses to run without a ``GlobalBatch``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from .batch import AGG_MODES, GlobalBatch, aggregate
from .metrics import MetricSums
from .ops.checks import DIVERGENCES, SUPPORTS, check_choice, check_float, check_int, check_mask, check_unit_interval
from .ops.jsd import generalized_jsd
from .ops.policy import check_clip_ratios, ppo_clip_loss
from .ops.sampled import ESTIMATORS, canonical_estimator, sampled_token_kl, token_logprobs
from .ops.topk import topk_divergence
from .parallel.shard import zero_masked_rows
from .fused import (
    StudentHidden,
    TeacherHidden,
    fused_generalized_jsd,
    fused_token_logprobs,
    fused_topk_divergence,
    fused_topk_loss,
)

logger = logging.getLogger(__name__)

LOSS_MODES = ("topk", "sampled", "full")


# -- teacher signals ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TeacherTopK:
    """The teacher's top-k next-token distribution per position: ids ``[..., K]`` (int), log-probs ``[..., K]``."""

    ids: torch.Tensor
    logprobs: torch.Tensor

    def __post_init__(self):
        check_int(self.ids, "TeacherTopK.ids")
        check_float(self.logprobs, "TeacherTopK.logprobs")


@dataclass(frozen=True)
class TeacherSampled:
    """The teacher's log-prob of the token the student sampled, per position ``[...]``."""

    logprobs: torch.Tensor

    def __post_init__(self):
        check_float(self.logprobs, "TeacherSampled.logprobs")


@dataclass(frozen=True)
class TeacherLogits:
    """The teacher's full logits per position ``[..., V]`` (in-process teacher; full-vocabulary JSD)."""

    logits: torch.Tensor

    def __post_init__(self):
        check_float(self.logits, "TeacherLogits.logits")


_SIGNAL_FOR_MODE = {"topk": TeacherTopK, "sampled": TeacherSampled, "full": TeacherLogits}
_FUSED_SIGNAL_FOR_MODE = {"topk": TeacherTopK, "sampled": TeacherSampled, "full": TeacherHidden}


# -- config ------------------------------------------------------------------------------------------------------
def _is_number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


@dataclass(frozen=True)
class DistillationConfig:
    """What the distillation loss computes.  Validated at construction; unknown keys refused by ``from_dict``.

    loss_mode            "topk" (teacher top-k ids + log-probs), "sampled" (teacher log-prob of the sampled token,
                         estimator), "full" (teacher logits, generalized JSD)
    support, divergence  top-k family (SPEC 3.1); beta: JSD mixture weight (also used by loss_mode="full")
    topk                 expected K of the teacher signal (None: whatever the teacher sends)
    estimator            sampled-token estimator: k1 k2 k3 abs (aliases kl mse low_var_kl)
    use_policy_gradient  False: back-propagate L_t; True: PPO-clip with advantage -stopgrad(L_t)
    clip_ratio_low/high/c  PPO clip range and dual-clip bound
    loss_max_clamp       clamp each per-token loss to [-c, c] before aggregation (None: off)
    log_prob_min_clamp   truncated top-k only: floor on both log-probs (verl)
    loss_agg_mode        one of the five aggregation modes (SPEC 4)
    loss_scale_factor    fixed divisor for seq-mean-token-sum-norm (required by it, refused otherwise)
    temperature          student temperature tau (logits / tau before log-softmax)
    use_task_rewards     add a PPO-clip task policy loss from verifier advantages
    distillation_coef    total = task_policy_loss + coef * distillation_loss (task rewards on; 1 otherwise)
    """

    loss_mode: str = "topk"
    support: str = "tail"
    divergence: str = "forward"
    beta: float = 0.5
    topk: int | None = None
    estimator: str = "k3"
    use_policy_gradient: bool = False
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_max_clamp: float | None = None
    log_prob_min_clamp: float | None = None
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    temperature: float = 1.0
    use_task_rewards: bool = False
    distillation_coef: float = 1.0

    def __post_init__(self):
        check_choice(self.loss_mode, "loss_mode", LOSS_MODES)
        check_choice(self.support, "support", SUPPORTS)
        check_choice(self.divergence, "divergence", DIVERGENCES)
        check_unit_interval(self.beta, "beta")
        check_choice(self.estimator, "estimator", ESTIMATORS)
        check_choice(self.loss_agg_mode, "loss_agg_mode", AGG_MODES)
        for name in ("use_policy_gradient", "use_task_rewards"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.topk is not None and (isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1):
            raise ValueError(f"topk must be an int >= 1 or None, got {self.topk!r}")
        check_clip_ratios(self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c)
        if self.loss_max_clamp is not None and not (_is_number(self.loss_max_clamp) and self.loss_max_clamp > 0):
            raise ValueError(f"loss_max_clamp must be a finite number > 0 or None, got {self.loss_max_clamp!r}")
        if not (_is_number(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if not (_is_number(self.distillation_coef) and self.distillation_coef >= 0):
            raise ValueError(f"distillation_coef must be a finite number >= 0, got {self.distillation_coef!r}")
        if self.loss_agg_mode == "seq-mean-token-sum-norm":
            if not (_is_number(self.loss_scale_factor) and self.loss_scale_factor > 0):
                raise ValueError(
                    "loss_agg_mode='seq-mean-token-sum-norm' needs a fixed loss_scale_factor > 0 (e.g. the maximum "
                    f"response length), got {self.loss_scale_factor!r}"
                )
        elif self.loss_scale_factor is not None:
            raise ValueError(
                f"loss_scale_factor is only used by loss_agg_mode='seq-mean-token-sum-norm', got it with "
                f"{self.loss_agg_mode!r}; remove it"
            )
        if self.log_prob_min_clamp is not None:
            if not (self.loss_mode == "topk" and self.support == "truncated"):
                raise ValueError(
                    "log_prob_min_clamp is only defined for loss_mode='topk' with support='truncated' (verl's "
                    f"forward_kl_topk), got loss_mode={self.loss_mode!r}, support={self.support!r}"
                )
            if not _is_number(self.log_prob_min_clamp):
                raise ValueError(f"log_prob_min_clamp must be a finite number or None, got {self.log_prob_min_clamp!r}")
        if self.loss_mode == "topk" and self.support == "truncated" and self.divergence != "forward":
            raise ValueError(
                f"support='truncated' with divergence={self.divergence!r} is refused: on the truncated support the "
                "student can lower the loss by shrinking its own mass on the teacher's ids (unstable). Use "
                "support='tail' or 'renormalized'."
            )
        if self.loss_mode == "sampled" and not self.use_policy_gradient and canonical_estimator(self.estimator) == "k1":
            raise ValueError(
                f"estimator={self.estimator!r} as a supervised loss has zero expected gradient "
                "(E_pi[grad log pi] = 0): use k3 or k2 supervised, or k1 with use_policy_gradient=True"
            )
        if self.use_policy_gradient and self.loss_mode in ("topk", "full"):
            # SPEC 3.4 allows it (verl offers it) but it is almost never what the user wants: see docs/losses.md.
            logger.warning(
                "use_policy_gradient=True with loss_mode=%r reduces the teacher's distribution to one scalar reward "
                "per token (it wastes the distribution), and that reward depends only on the prefix, not on the "
                "sampled token, so its expected per-token policy gradient is zero; the supervised rule follows the "
                "divergence's gradient exactly", self.loss_mode,
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DistillationConfig":
        """Build from a mapping (e.g. parsed YAML); unknown keys are an error that lists the known ones."""
        if not isinstance(d, dict):
            raise TypeError(f"DistillationConfig.from_dict expects a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown DistillationConfig keys {unknown}; known keys: {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- the loss ----------------------------------------------------------------------------------------------------
def policy_gradient_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    batch: GlobalBatch,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    cu_seqlens: torch.Tensor | None = None,
    group=None,
    prefix: str = "policy/",
) -> tuple[torch.Tensor, MetricSums]:
    """Aggregated PPO-clip loss for task rewards (e.g. GRPO advantages), with exact metrics.

    Masked positions are zeroed before the surrogate so garbage there cannot reach a gradient.
    Metrics: ``{prefix}loss`` (this micro-batch's share of the step objective), ``{prefix}clipfrac`` (the clip
    branch was active), ``{prefix}clipfrac_lower`` (the dual clip was active).
    """
    m = check_mask(mask, "mask")
    for name, x in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages)):
        check_float(x, name)
        if x.shape != m.shape:
            raise ValueError(f"{name} must have the shape of mask {tuple(m.shape)}, got {tuple(x.shape)}")
    res = ppo_clip_loss(
        torch.where(m, logprobs, 0.0),
        torch.where(m, old_logprobs, 0.0),
        torch.where(m, advantages, 0.0),
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
    )
    loss = aggregate(res.loss, m, loss_agg_mode, batch, cu_seqlens=cu_seqlens, group=group)
    metrics = MetricSums()
    metrics.add_sum(f"{prefix}loss", loss.detach() / batch.dp_size)
    metrics.add_mean(f"{prefix}clipfrac", res.clipped.double(), m)
    metrics.add_mean(f"{prefix}clipfrac_lower", res.dual_clipped.double(), m)
    return loss, metrics


class DistillationLoss:
    """Callable computing one micro-batch's distillation loss and its exact metrics (see module docstring)."""

    def __init__(self, config: DistillationConfig, *, topk_fn=None, token_logprobs_fn=None, jsd_fn=None):
        """``topk_fn``/``token_logprobs_fn``/``jsd_fn`` swap in another back-end with the signature of
        ``topk_divergence``/``token_logprobs``/``generalized_jsd`` (e.g. the vocab-parallel ops with the group bound
        by ``functools.partial``); default: the single-device ops."""
        if not isinstance(config, DistillationConfig):
            raise TypeError(f"config must be a DistillationConfig, got {type(config).__name__}")
        for name, fn in (("topk_fn", topk_fn), ("token_logprobs_fn", token_logprobs_fn), ("jsd_fn", jsd_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")
        self.config = config
        self.topk_fn = topk_fn or topk_divergence
        self.token_logprobs_fn = token_logprobs_fn or token_logprobs
        self.jsd_fn = jsd_fn or generalized_jsd

    def __call__(
        self,
        student: torch.Tensor,
        teacher: TeacherTopK | TeacherSampled | TeacherLogits,
        mask: torch.Tensor,
        batch: GlobalBatch,
        *,
        sampled_ids: torch.Tensor | None = None,
        old_logprobs: torch.Tensor | None = None,
        task_advantages: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        group=None,
    ) -> tuple[torch.Tensor, MetricSums]:
        """Return ``(loss, metrics)`` for one micro-batch.

        student: logits ``[..., V]`` for loss_mode topk/full, the student's log-probs of the sampled tokens
            ``[...]`` for loss_mode sampled -- or, for every loss_mode, a ``StudentHidden`` (final hidden states plus
            lm_head, e.g. from ``opdistill.fused.causal_lm_hidden``): the fused path, same numbers, no ``[..., V]``
            logits (loss_mode sampled then needs ``sampled_ids``; loss_mode full needs a ``TeacherHidden``).  ``mask [...]``: 1 where row t predicts a response token.
        sampled_ids ``[...]``: the sampled tokens (policy gradient / task rewards with logits).
        old_logprobs ``[...]``: the sampler's log-probs (policy gradient / task rewards).
        task_advantages ``[...]``: per-token task advantages (use_task_rewards).
        """
        cfg = self.config
        if not isinstance(batch, GlobalBatch):
            raise TypeError(
                f"batch must be a GlobalBatch counted over the whole step, got {type(batch).__name__}; build it "
                "with GlobalBatch.from_masks(all micro-batch masks, group=...)"
            )
        fused = isinstance(student, StudentHidden)
        expected = (_FUSED_SIGNAL_FOR_MODE if fused else _SIGNAL_FOR_MODE)[cfg.loss_mode]
        if not isinstance(teacher, expected):
            raise TypeError(f"loss_mode={cfg.loss_mode!r} needs teacher={expected.__name__}(...), got {type(teacher).__name__}")
        if fused:
            lead = student.hidden.shape[:-1]
        else:
            check_float(student, "student")
            lead = student.shape if cfg.loss_mode == "sampled" else student.shape[:-1]
        m = check_mask(mask, "mask")
        if m.shape != lead:
            raise ValueError(f"mask must have shape {tuple(lead)} (the token dims of student), got {tuple(m.shape)}")
        needs_logprob = cfg.use_policy_gradient or cfg.use_task_rewards
        if fused:  # masked positions may hold anything (padding, NaN): zeroed, nothing there reaches a gradient
            student = dataclasses.replace(student, hidden=torch.where(m.unsqueeze(-1), student.hidden, 0.0))
        if needs_logprob and old_logprobs is None:
            raise ValueError("old_logprobs is required when use_policy_gradient or use_task_rewards is on")
        if cfg.use_task_rewards and task_advantages is None:
            raise ValueError("task_advantages is required when use_task_rewards=True")

        if fused and cfg.loss_mode == "sampled":
            # the student's log-prob of its sampled tokens, from hidden states (no [..., V] logits)
            if sampled_ids is None:
                raise ValueError("sampled_ids is required with loss_mode='sampled' and a StudentHidden student")
            student = self._fused_logprobs(student, sampled_ids, m)

        metrics = MetricSums()
        weights = None
        if fused and cfg.loss_mode == "topk" and not cfg.use_policy_gradient:
            # supervised fused top-k: the aggregation is a known linear map, so the fused op can compute the
            # gradient while each chunk's logits are alive (no recompute in backward)
            weights = _aggregation_weights(m, cfg.loss_agg_mode, batch, cu_seqlens, group, student.hidden)
        per_token, precomputed = self._per_token(student, teacher, m, metrics, weights)  # [...] divergence L_t
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
            if cfg.loss_mode == "sampled":
                logprob = student
            else:
                if sampled_ids is None:
                    raise ValueError(f"sampled_ids is required for policy gradient / task rewards with loss_mode={cfg.loss_mode!r}")
                if fused:
                    logprob = self._fused_logprobs(student, sampled_ids, m)
                else:
                    safe_ids = torch.where(m, sampled_ids, torch.zeros_like(sampled_ids)) if sampled_ids.shape == m.shape else sampled_ids
                    logprob = self.token_logprobs_fn(zero_masked_rows(student, m), safe_ids,
                                                     temperature=cfg.temperature)
        agg = dict(loss_agg_mode=cfg.loss_agg_mode, clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                   clip_ratio_c=cfg.clip_ratio_c, cu_seqlens=cu_seqlens, group=group)
        if cfg.use_policy_gradient:
            distill, pg_metrics = policy_gradient_loss(logprob, old_logprobs, -per_token.detach(), m, batch,
                                                       prefix="distillation/pg_", **agg)
            metrics.merge(pg_metrics)
        else:
            distill = precomputed if precomputed is not None else aggregate(
                per_token, m, cfg.loss_agg_mode, batch, cu_seqlens=cu_seqlens, group=group)
        metrics.add_sum("distillation/loss", distill.detach() / batch.dp_size)
        if not cfg.use_task_rewards:
            return distill, metrics
        task, task_metrics = policy_gradient_loss(logprob, old_logprobs, task_advantages, m, batch, prefix="task/", **agg)
        metrics.merge(task_metrics)
        total = task + cfg.distillation_coef * distill
        metrics.add_sum("loss/total", total.detach() / batch.dp_size)
        return total, metrics

    def _fused_logprobs(self, student: StudentHidden, sampled_ids: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        if not isinstance(sampled_ids, torch.Tensor) or sampled_ids.shape != m.shape:
            got = tuple(sampled_ids.shape) if isinstance(sampled_ids, torch.Tensor) else type(sampled_ids).__name__
            raise ValueError(f"sampled_ids must have the shape of mask {tuple(m.shape)}, got {got}")
        safe_ids = torch.where(m, sampled_ids, torch.zeros_like(sampled_ids))
        return fused_token_logprobs(student.hidden, student.weight, safe_ids, bias=student.bias,
                                    temperature=student.temperature(self.config.temperature), group=student.vocab_group)

    def _per_token(self, student, teacher, m: torch.Tensor, metrics: MetricSums, weights=None):
        """(the per-token divergence, with masked positions sanitised (they may hold padding garbage), and the
        aggregated clamped loss when the fused path computed it from ``weights``, else None)."""
        cfg = self.config
        if cfg.loss_mode == "topk":
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
                      log_prob_min_clamp=cfg.log_prob_min_clamp)
            precomputed = None
            if isinstance(student, StudentHidden) and weights is not None:
                precomputed, res = fused_topk_loss(
                    student.hidden, student.weight, ids, lp, weights, bias=student.bias, group=student.vocab_group,
                    temperature=student.temperature(cfg.temperature), loss_max_clamp=cfg.loss_max_clamp, **kw)
            elif isinstance(student, StudentHidden):
                res = fused_topk_divergence(student.hidden, student.weight, ids, lp, bias=student.bias,
                                            group=student.vocab_group, temperature=student.temperature(cfg.temperature),
                                            **kw)
            else:
                res = self.topk_fn(student, ids, lp, temperature=cfg.temperature, **kw)
            k = ids.shape[-1]
            metrics.add_mean("distillation/student_mass", res.student_mass, m)
            metrics.add_extrema("distillation/student_mass", res.student_mass, m)
            metrics.add_mean("distillation/teacher_mass", res.teacher_mass, m)
            metrics.add_extrema("distillation/teacher_mass", res.teacher_mass, m)
            metrics.add_ratio("distillation/overlap_ratio", res.overlap_count[m].sum(), k * int(m.sum()))
            metrics.add_mean("distillation/overlap_token_advantage", res.overlap_token_advantage, m & (res.overlap_count > 0))
            return res.loss, precomputed
        if cfg.loss_mode == "sampled":
            lp = teacher.logprobs
            if lp.shape != m.shape:
                raise ValueError(f"TeacherSampled.logprobs must have shape {tuple(m.shape)}, got {tuple(lp.shape)}")
            per_token = sampled_token_kl(torch.where(m, student, 0.0), torch.where(m, lp, 0.0), cfg.estimator)
            metrics.add_mean("distillation/abs_loss", per_token.abs(), m)
            return per_token, None
        if isinstance(student, StudentHidden):
            keep = m.unsqueeze(-1)
            t = teacher
            if t.hidden.shape[:-1] != m.shape:
                raise ValueError(f"TeacherHidden.hidden must have shape {tuple(m.shape) + ('H',)}, got {tuple(t.hidden.shape)}")
            if student.vocab_group is not None:
                raise ValueError(
                    "loss_mode='full' with a vocabulary-sharded StudentHidden (vocab_group set) is not supported by the "
                    "fused JSD; use the vocab-parallel back-end (jsd_fn) on sharded logits instead"
                )
            if student.logit_scale != t.logit_scale:
                raise ValueError(
                    f"StudentHidden.logit_scale={student.logit_scale} and TeacherHidden.logit_scale={t.logit_scale} "
                    "differ; the fused JSD applies one temperature to both sides"
                )
            return fused_generalized_jsd(
                torch.where(keep, student.hidden, 0.0), student.weight, torch.where(keep, t.hidden, 0.0), t.weight,
                beta=cfg.beta, temperature=student.temperature(cfg.temperature), student_bias=student.bias,
            ), None
        t = teacher.logits
        if t.shape != student.shape:
            raise ValueError(f"TeacherLogits.logits must have the shape of student {tuple(student.shape)}, got {tuple(t.shape)}")
        keep = m.unsqueeze(-1)
        return self.jsd_fn(torch.where(keep, student, 0.0), torch.where(keep, t, 0.0),
                           beta=cfg.beta, temperature=cfg.temperature), None


def _aggregation_weights(m, mode, batch, cu_seqlens, group, like: torch.Tensor) -> torch.Tensor:
    """d aggregate / d per_token: every aggregation mode is linear in the per-token losses, so these weights turn
    the micro-batch loss into sum_t w_t L_t exactly (same arithmetic as ``aggregate``, through autograd)."""
    x = torch.zeros(m.shape, dtype=torch.float64 if like.dtype == torch.float64 else torch.float32,
                    device=like.device, requires_grad=True)
    with torch.enable_grad():
        (w,) = torch.autograd.grad(aggregate(x, m, mode, batch, cu_seqlens=cu_seqlens, group=group), x,
                                   allow_unused=True)
    return torch.zeros_like(x) if w is None else w

