"""An evaluation's per-problem values (``EvalValues``), their JSON file format (``RUN_DIR/eval/step_NNNNNN.json``,
``opdistill eval --values``) and their summary: every metric is a ratio of two per-problem sums with a 95% bootstrap
interval (:mod:`opdistill.runs.stats`).

    eval/greedy_acc        greedy correct / problems
    eval/sampled_acc       correct samples / samples
    eval/response_len      response tokens / samples
    eval/teacher_kl        k1: sum over response tokens of log pi(y_t) - log nu(y_t) / tokens
    eval/teacher_kl_k3     k3: sum of (r - 1) - log r, r = nu(y_t) / pi(y_t), / tokens
    eval/teacher_kl_seq    the k1 sum per response: sum / samples
    eval/topk_reverse_kl   the top-k tail reverse KL (K+1 buckets) / tokens
    eval/student_mass      sum_k pi(i_k) on the teacher's top-k / tokens;  eval/teacher_mass likewise
    eval/overlap_ratio     |teacher top-k cap student top-k| / (K tokens)

The trainer measures them (``opdistill.train.steps.evaluate``); ``opdistill compare`` reads them back and pairs two
evaluations of the same problems.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from opdistill.runs.stats import DEFAULT_LEVEL, DEFAULT_RESAMPLES, ratio_intervals

__all__ = ["EvalValues", "METRICS", "summarize", "nest_intervals", "values_to_json", "values_from_json"]

# metric -> (numerator field, denominator field) of EvalValues; "overlap_ratio"'s denominator is K x tokens
METRICS = {
    "eval/greedy_acc": ("greedy_correct", "problems"),
    "eval/sampled_acc": ("sampled_correct", "samples"),
    "eval/response_len": ("tokens", "samples"),
    "eval/teacher_kl": ("k1_sum", "tokens"),
    "eval/teacher_kl_k3": ("k3_sum", "tokens"),
    "eval/teacher_kl_seq": ("k1_sum", "samples"),
    "eval/topk_reverse_kl": ("tail_kl_sum", "tokens"),
    "eval/student_mass": ("student_mass_sum", "tokens"),
    "eval/teacher_mass": ("teacher_mass_sum", "tokens"),
    "eval/overlap_ratio": ("overlap_count", "overlap_slots"),
    "eval/greedy_used_tool": ("greedy_used_tool", "problems"),  # episodes (SPEC 6.8): a tool answered a call
    "eval/sampled_used_tool": ("sampled_used_tool", "samples"),
}


# sums of a divergence, which may be +inf: a teacher that gives a token the student wrote probability 0 (the files of
# cross-tokenizer evaluations before such tokens were left out hold it); every other field is finite
DIVERGENCE_SUMS = ("k1_sum", "k3_sum", "tail_kl_sum")


@dataclass
class EvalValues:
    """Per-problem sums (float64 tensors of shape [P]); a field is None when it was not measured (no greedy pass,
    no sampling, no teacher). ``cat`` joins the values of disjoint problem slices (e.g. one per rank) in order."""

    problems: torch.Tensor  # 1 per problem (the denominator of greedy accuracy)
    greedy_correct: torch.Tensor | None = None
    samples: torch.Tensor | None = None  # samples drawn for the problem (eval.num_samples)
    sampled_correct: torch.Tensor | None = None  # how many of them the verifier accepts
    tokens: torch.Tensor | None = None  # response tokens over the problem's samples (EOS included)
    k1_sum: torch.Tensor | None = None
    k3_sum: torch.Tensor | None = None
    tail_kl_sum: torch.Tensor | None = None
    student_mass_sum: torch.Tensor | None = None
    teacher_mass_sum: torch.Tensor | None = None
    overlap_count: torch.Tensor | None = None
    overlap_slots: torch.Tensor | None = None  # K x tokens
    greedy_used_tool: torch.Tensor | None = None  # episodes: 1 where the greedy episode got a tool's answer
    sampled_used_tool: torch.Tensor | None = None  # how many of the samples' episodes did

    @property
    def num_problems(self) -> int:
        return self.problems.numel()

    @classmethod
    def cat(cls, parts: list["EvalValues"]) -> "EvalValues":
        out = {}
        for f in fields(cls):
            vals = [getattr(p, f.name) for p in parts]
            present = [v is not None for v in vals]
            if any(present) and not all(present):
                raise ValueError(f"EvalValues.cat: {f.name} is measured in some parts only")
            out[f.name] = torch.cat(vals) if all(present) else None
        return cls(**out)


def values_to_json(values: EvalValues) -> dict[str, list[float]]:
    """{field: [one float per problem]} for every measured field (plain JSON)."""
    return {f.name: getattr(values, f.name).tolist() for f in fields(EvalValues) if getattr(values, f.name) is not None}


def values_from_json(data, source: str = "values") -> EvalValues:
    """The inverse of :func:`values_to_json`, checked: known fields only, ``problems`` present, one finite number per
    problem in every field, +inf allowed in :data:`DIVERGENCE_SUMS` (ValueError naming ``source`` and the field
    otherwise)."""
    known = {f.name for f in fields(EvalValues)}
    if not isinstance(data, dict) or "problems" not in data:
        raise ValueError(f"{source}: expected an object of per-problem lists with a 'problems' list")
    out = {}
    for name, vals in data.items():
        if name not in known:
            raise ValueError(f"{source}: unknown field {name!r} (expected some of {sorted(known)})")
        ok = (lambda v: math.isfinite(v) or v == math.inf) if name in DIVERGENCE_SUMS else math.isfinite
        if not isinstance(vals, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and ok(v)
                                                 for v in vals):
            kind = "finite numbers or +inf" if name in DIVERGENCE_SUMS else "finite numbers"
            raise ValueError(f"{source}: field {name!r} must be a list of {kind}")
        out[name] = torch.tensor(vals, dtype=torch.float64)
    lengths = {len(v) for v in out.values()}
    if len(lengths) != 1:
        raise ValueError(f"{source}: every field needs one value per problem, got lengths {sorted(lengths)}")
    return EvalValues(**out)




def summarize(values: EvalValues, *, resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
              level: float = DEFAULT_LEVEL) -> dict[str, float]:
    """{metric: point estimate, metric_lo, metric_hi} for every metric ``values`` measured (bootstrap over problems;
    ``resamples=0``: point estimates only)."""
    if values.num_problems == 0:
        return {}
    ratios = {}
    for name, (num, den) in METRICS.items():
        a, b = getattr(values, num), getattr(values, den)
        if a is not None and b is not None:
            ratios[name] = (a.numpy(), b.numpy())
    out: dict[str, float] = {}
    if resamples == 0:
        for name, (a, b) in ratios.items():
            out[name] = float(a.sum() / b.sum()) if b.sum() != 0 else float("nan")
        return out
    for name, iv in ratio_intervals(ratios, resamples=resamples, seed=seed, level=level).items():
        out[name], out[f"{name}_lo"], out[f"{name}_hi"] = iv.value, iv.lo, iv.hi
    return out


def nest_intervals(metrics: dict) -> dict[str, dict]:
    """{metric: value, metric_lo, metric_hi} -> {metric: {"value", "lo", "hi"}} (non-finite numbers -> None, so the
    result is plain JSON; lo/hi None when the metric has no interval)."""
    def num(x):
        return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x

    out = {}
    for name, v in metrics.items():
        if name.endswith(("_lo", "_hi")) and name[:-3] in metrics:
            continue
        out[name] = {"value": num(v), "lo": num(metrics.get(f"{name}_lo")), "hi": num(metrics.get(f"{name}_hi"))}
    return out
