"""Confidence intervals for evaluation metrics: a seeded percentile bootstrap over problems.

Every evaluation metric is a ratio of two per-problem sums, ``sum_i num_i / sum_i den_i`` (accuracy: correct / 1;
sampled accuracy: correct samples / samples; teacher-KL: summed per-token KL / response tokens, so token-weighted
metrics stay token-weighted). The bootstrap resamples PROBLEMS with replacement and recomputes each ratio as
sum/sum over the resampled problems; all metrics of one evaluation share the same resamples, so their intervals
are computed from the same pseudo-datasets.

The draw is fixed: ``numpy.random.default_rng(seed).integers(0, n, size=(resamples, n))`` (row b: the problems of
resample b), and the interval is the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the resampled ratios
(numpy's default linear interpolation). Resamples whose denominator sums to 0 are left out of the quantiles.
:func:`paired_change` compares evaluations of the SAME problems (a run before and after training, over one or more
seeds): the relative change of the ratio, ``mean over seeds s of R_after_s / R_before_s - 1``, where every R is a
ratio of sums; each resample draws one set of problems and recomputes every R on it, so the interval is paired (the
problem-to-problem variation common to before and after cancels). :func:`paired_difference` compares two groups
of runs evaluated on the same problems (e.g. on- and off-policy at one step): ``mean_s R_a_s - mean_t R_b_t``, paired
the same way.

The point estimate is the ratio on the problems as they are; a percentile interval is not centred on it and, for a
very skewed statistic on very few problems, need not contain it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Interval", "bootstrap_indices", "bootstrap_counts", "ratio_interval", "ratio_intervals", "paired_change",
           "paired_difference", "paired_lift_ratio"]

DEFAULT_RESAMPLES = 1000
DEFAULT_LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    value: float  # the point estimate: sum(num) / sum(den) over all problems
    lo: float
    hi: float


def bootstrap_indices(n: int, resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> np.ndarray:
    """[resamples, n] int64: the problems drawn (with replacement) for each resample."""
    if n < 1:
        raise ValueError(f"n: expected at least 1 problem to resample, got {n}")
    if resamples < 1:
        raise ValueError(f"resamples: expected an integer >= 1, got {resamples}")
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def bootstrap_counts(n: int, resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> np.ndarray:
    """[resamples, n] float64: how many times each problem is drawn in each resample (the same draw as
    :func:`bootstrap_indices`), so that a resampled sum is ``counts @ values``."""
    idx = bootstrap_indices(n, resamples, seed)
    flat = (idx + n * np.arange(resamples)[:, None]).ravel()
    return np.bincount(flat, minlength=resamples * n).reshape(resamples, n).astype(np.float64)


def _ratio(num: float, den: float) -> float:
    return float(num / den) if den != 0 else float("nan")


def _interval(num: np.ndarray, den: np.ndarray, counts: np.ndarray, level: float) -> Interval:
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    point = _ratio(num.sum(), den.sum())
    rn, rd = counts @ num, counts @ den
    ok = rd != 0
    if not ok.any():
        return Interval(point, float("nan"), float("nan"))
    ratios = rn[ok] / rd[ok]
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return Interval(point, float(lo), float(hi))


def _check(num, den, level) -> None:
    if np.shape(num) != np.shape(den) or np.ndim(num) != 1:
        raise ValueError(f"num and den: expected two 1-D arrays of one value per problem, got shapes "
                         f"{np.shape(num)} and {np.shape(den)}")
    if not 0 < level < 1:
        raise ValueError(f"level: expected a number in (0, 1), got {level}")


def ratio_interval(num, den, *, resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                   level: float = DEFAULT_LEVEL) -> Interval:
    """sum(num) / sum(den) with its percentile-bootstrap interval over problems (``num``, ``den``: one per problem)."""
    _check(num, den, level)
    return _interval(num, den, bootstrap_counts(len(num), resamples, seed), level)


def ratio_intervals(ratios: dict[str, tuple], *, resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                    level: float = DEFAULT_LEVEL) -> dict[str, Interval]:
    """{name: (num, den)} -> {name: Interval}, every metric on the same resamples of the same problems."""
    if not ratios:
        return {}
    n = {len(num) for num, _ in ratios.values()}
    if len(n) != 1:
        raise ValueError(f"ratios: every metric needs one value per problem of the same problems, got lengths {n}")
    for num, den in ratios.values():
        _check(num, den, level)
    counts = bootstrap_counts(n.pop(), resamples, seed)
    return {name: _interval(num, den, counts, level) for name, (num, den) in ratios.items()}


def _paired(evals: list[tuple], statistic, level: float, resamples: int, seed: int, what: str) -> Interval:
    """``statistic`` (a function of one ratio per evaluation, each a scalar or a [resamples] array) on the problems as
    they are, with its percentile interval over resamples that draw one set of problems for every evaluation."""
    pairs = [(np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)) for num, den in evals]
    for num, den in pairs:
        _check(num, den, level)
    n = {len(num) for num, _ in pairs}
    if len(n) != 1:
        raise ValueError(f"{what}: every evaluation needs one value per problem of the same problems, got "
                         f"lengths {sorted(n)}")
    with np.errstate(divide="ignore", invalid="ignore"):
        point = float(statistic([num.sum() / den.sum() for num, den in pairs]))
        counts = bootstrap_counts(n.pop(), resamples, seed)
        vals = np.asarray(statistic([(counts @ num) / (counts @ den) for num, den in pairs]))
    vals = vals[np.isfinite(vals)]
    if vals.size == 0:
        return Interval(point, float("nan"), float("nan"))
    lo, hi = np.quantile(vals, [(1 - level) / 2, (1 + level) / 2])
    return Interval(point, float(lo), float(hi))


def paired_change(before: list[tuple], after: list[tuple], *, resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                  level: float = DEFAULT_LEVEL) -> Interval:
    """Relative change of a ratio metric on the same problems, paired over problems (module docstring).

    ``before`` and ``after``: one ``(num, den)`` per seed (same order), each two 1-D arrays with one value per problem
    of the same problems. Returns ``mean_s(R_after_s / R_before_s) - 1`` with its percentile-bootstrap interval
    (e.g. -0.30 = 30% lower); resamples where any ratio is undefined (a zero denominator, or a zero ratio before)
    are left out of the quantiles."""
    if not before or len(before) != len(after):
        raise ValueError(f"before and after: expected one (num, den) per seed for each, the same number of seeds, got "
                         f"{len(before)} and {len(after)}")
    k = len(before)
    return _paired([*before, *after], lambda r: np.mean([r[k + s] / r[s] for s in range(k)], axis=0) - 1.0,
                   level, resamples, seed, "before and after")


def paired_difference(a: list[tuple], b: list[tuple], *, resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                      level: float = DEFAULT_LEVEL) -> Interval:
    """Difference of a ratio metric between two groups of evaluations of the same problems, paired over problems.

    ``a`` and ``b``: one ``(num, den)`` per seed of each group (the counts may differ; seeds are not paired). Returns
    ``mean_s R_a_s - mean_t R_b_t`` (e.g. accuracy 0.05 higher in ``a``) with its percentile-bootstrap interval: each
    resample draws one set of problems and recomputes every R on it, so the difficulty of the problems drawn, common
    to both groups, cancels; resamples where a ratio is undefined are left out of the quantiles."""
    if not a or not b:
        raise ValueError(f"a and b: expected at least one (num, den) in each, got {len(a)} and {len(b)}")
    k = len(a)
    return _paired([*a, *b], lambda r: np.mean(r[:k], axis=0) - np.mean(r[k:], axis=0), level, resamples, seed,
                   "a and b")


def paired_lift_ratio(base: tuple, a: list[tuple], b: list[tuple], *, resamples: int = DEFAULT_RESAMPLES,
                      seed: int = 0, level: float = DEFAULT_LEVEL) -> Interval:
    """How much of ``b``'s lift over a shared start ``a`` reaches: ``(mean_s R_a_s - R_base) / (mean_t R_b_t -
    R_base)`` (1: the same lift; 0.8: 80% of it), paired over problems as :func:`paired_difference` (each resample
    draws one set of problems for the start and every run); resamples where ``b`` does not lift are left out."""
    if not a or not b:
        raise ValueError(f"a and b: expected at least one (num, den) in each, got {len(a)} and {len(b)}")
    k = len(a)

    def ratio(r):
        gain_b = np.mean(r[1 + k:], axis=0) - r[0]
        return np.where(gain_b > 0, (np.mean(r[1:1 + k], axis=0) - r[0]) / np.where(gain_b > 0, gain_b, 1.0),
                        np.nan)

    return _paired([base, *a, *b], ratio, level, resamples, seed, "base, a and b")
