"""Confidence intervals of the evaluation: the bootstrap over problems (opdistill/runs/stats.py) and the per-problem
values the evaluation turns into metrics (evaluate_values, summarize) (opdistill/train/steps/evaluate.py).

Expectations come from an independent numpy implementation (explicit index draws, per-resample sums, a hand-written
linear-interpolation quantile), from exact small cases, and from a coverage check on a known population."""
import math

import numpy as np
import pytest
import torch

from opdistill.runs.values import METRICS, EvalValues, nest_intervals, summarize, values_from_json, values_to_json
from opdistill.runs.stats import paired_change, paired_difference, paired_lift_ratio, ratio_interval, ratio_intervals


def _quantile(sorted_vals, q):
    pos = q * (len(sorted_vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (pos - lo) * (sorted_vals[hi] - sorted_vals[lo])


def _reference(num, den, resamples, seed, level=0.95):
    """The documented procedure, written independently: draw, index, sum, ratio, quantiles."""
    n = len(num)
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    ratios = []
    for b in range(resamples):
        d = sum(den[i] for i in idx[b])
        if d != 0:
            ratios.append(sum(num[i] for i in idx[b]) / d)
    ratios.sort()
    return sum(num) / sum(den), _quantile(ratios, (1 - level) / 2), _quantile(ratios, (1 + level) / 2)


@pytest.mark.parametrize("seed,level", [(0, 0.95), (7, 0.9)])
def test_bootstrap_matches_an_independent_numpy_implementation(seed, level):
    rng = np.random.default_rng(100 + seed)
    num = rng.exponential(size=37).tolist()
    den = rng.integers(1, 30, size=37).astype(float).tolist()
    iv = ratio_interval(np.array(num), np.array(den), resamples=400, seed=seed, level=level)
    point, lo, hi = _reference(num, den, 400, seed, level)
    assert iv.value == pytest.approx(point, rel=1e-12)
    assert iv.lo == pytest.approx(lo, rel=1e-12)
    assert iv.hi == pytest.approx(hi, rel=1e-12)
    assert iv.lo < iv.value < iv.hi


def test_every_metric_uses_the_same_resamples():
    rng = np.random.default_rng(3)
    a, b = rng.random(25), rng.random(25) + 0.5
    both = ratio_intervals({"x": (a, np.ones(25)), "y": (b, np.ones(25))}, resamples=300, seed=5)
    assert both["x"] == ratio_interval(a, np.ones(25), resamples=300, seed=5)
    assert both["y"] == ratio_interval(b, np.ones(25), resamples=300, seed=5)


def test_coverage_of_a_bernoulli_population():
    """400 problems, each correct with probability 0.3: the 95% interval holds 0.3 for ~95% of 200 datasets."""
    hits = 0
    for seed in range(200):
        x = (np.random.default_rng(10_000 + seed).random(400) < 0.3).astype(float)
        iv = ratio_interval(x, np.ones(400), resamples=1000, seed=seed)
        hits += iv.lo <= 0.3 <= iv.hi
    assert 0.90 <= hits / 200 <= 0.99, hits


def test_token_weighted_metrics_resample_sums_not_means():
    """Problem A: 1 token of KL 10; problem B: 99 tokens of KL 0. The token-weighted KL is 10 / 100 = 0.1 (a mean of
    per-problem means would say 5). Resamples are {A,A} -> 10, {A,B} -> 0.1, {B,B} -> 0 with probability 1/4, 1/2,
    1/4, so the 2.5% and 97.5% quantiles are exactly 0 and 10."""
    iv = ratio_interval(np.array([10.0, 0.0]), np.array([1.0, 99.0]), resamples=1000, seed=0)
    assert iv.value == pytest.approx(0.1)
    assert (iv.lo, iv.hi) == (0.0, 10.0)
    # through the evaluation's per-problem values: the same numbers for eval/teacher_kl
    vals = EvalValues(problems=torch.ones(2, dtype=torch.float64), samples=torch.ones(2, dtype=torch.float64),
                      tokens=torch.tensor([1.0, 99.0], dtype=torch.float64),
                      k1_sum=torch.tensor([10.0, 0.0], dtype=torch.float64))
    out = summarize(vals, resamples=1000, seed=0)
    assert (out["eval/teacher_kl"], out["eval/teacher_kl_lo"], out["eval/teacher_kl_hi"]) == pytest.approx(
        (0.1, 0.0, 10.0))
    assert out["eval/teacher_kl_seq"] == pytest.approx(5.0)  # per response: 10 / 2 samples
    assert "eval/greedy_acc" not in out  # not measured -> not reported


def test_summarize_every_metric_and_cat_across_ranks():
    rng = np.random.default_rng(1)
    P = 30

    def t(x):
        return torch.as_tensor(x, dtype=torch.float64)

    tokens = t(rng.integers(4, 40, P) * 2.0)
    vals = EvalValues(problems=t(np.ones(P)), greedy_correct=t(rng.random(P) < 0.5), samples=t(np.full(P, 2.0)),
                      sampled_correct=t(rng.integers(0, 3, P)), tokens=tokens, k1_sum=t(rng.normal(size=P)),
                      k3_sum=t(rng.random(P)), tail_kl_sum=t(rng.random(P)), student_mass_sum=tokens * 0.4,
                      teacher_mass_sum=tokens * t(rng.random(P)), overlap_count=t(rng.integers(0, 8, P)),
                      overlap_slots=tokens * 8, greedy_used_tool=t(rng.random(P) < 0.7),
                      sampled_used_tool=t(rng.integers(0, 3, P)))
    out = summarize(vals, resamples=200, seed=3)
    for name, (num, den) in METRICS.items():
        a, b = getattr(vals, num).numpy(), getattr(vals, den).numpy()
        point, lo, hi = _reference(a.tolist(), b.tolist(), 200, 3)
        assert out[name] == pytest.approx(point, rel=1e-12), name
        assert (out[f"{name}_lo"], out[f"{name}_hi"]) == pytest.approx((lo, hi), rel=1e-12), name
    # two ranks' slices, concatenated in order, are the whole evaluation
    halves = [EvalValues(**{k: (None if v is None else v[s]) for k, v in vars(vals).items()})
              for s in (slice(0, 11), slice(11, P))]
    assert summarize(EvalValues.cat(halves), resamples=200, seed=3) == out
    nested = nest_intervals(out)
    assert set(nested) == set(METRICS)
    assert nested["eval/teacher_kl"] == {"value": out["eval/teacher_kl"], "lo": out["eval/teacher_kl_lo"],
                                         "hi": out["eval/teacher_kl_hi"]}
    assert set(summarize(vals, resamples=0)) == set(METRICS)  # point estimates only


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"^resamples: expected an integer >= 1, got 0$"):
        ratio_interval(np.ones(3), np.ones(3), resamples=0)
    with pytest.raises(ValueError, match=r"^level: expected a number in \(0, 1\), got 1.5$"):
        ratio_interval(np.ones(3), np.ones(3), level=1.5)
    with pytest.raises(ValueError, match=r"^n: expected at least 1 problem to resample, got 0$"):
        ratio_interval(np.ones(0), np.ones(0))
    parts = [EvalValues(problems=torch.ones(1, dtype=torch.float64), greedy_correct=torch.ones(1, dtype=torch.float64)),
             EvalValues(problems=torch.ones(1, dtype=torch.float64))]
    with pytest.raises(ValueError, match=r"^EvalValues.cat: greedy_correct is measured in some parts only$"):
        EvalValues.cat(parts)


def _paired_reference(before, after, resamples, seed, level=0.95):
    """paired_change's documented procedure, written independently with explicit index draws and loops."""
    n = len(before[0][0])
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))

    def change(rows):
        per_seed = []
        for (n0, d0), (n1, d1) in zip(before, after):
            r0 = sum(n0[i] for i in rows) / sum(d0[i] for i in rows)
            r1 = sum(n1[i] for i in rows) / sum(d1[i] for i in rows)
            per_seed.append(r1 / r0)
        return sum(per_seed) / len(per_seed) - 1

    vals = sorted(change(idx[b]) for b in range(resamples))
    return change(range(n)), _quantile(vals, (1 - level) / 2), _quantile(vals, (1 + level) / 2)


@pytest.mark.parametrize("seeds", [1, 2])
def test_paired_change_matches_an_independent_reference(seeds):
    rng = np.random.default_rng(5)
    n = 23
    before, after = [], []
    for _ in range(seeds):
        tokens = rng.integers(20, 90, size=n).astype(float)
        kl = rng.exponential(size=n) * tokens
        before.append((kl.tolist(), tokens.tolist()))
        tokens2 = rng.integers(20, 90, size=n).astype(float)
        after.append(((kl * rng.uniform(0.4, 1.1, size=n)).tolist(), tokens2.tolist()))
    iv = paired_change(before, after, resamples=300, seed=3)
    ref = _paired_reference(before, after, 300, 3)
    assert (iv.value, iv.lo, iv.hi) == pytest.approx(ref, rel=1e-12)


def test_paired_change_exact_cases_and_pairing():
    rng = np.random.default_rng(0)
    n = 40
    tokens = rng.integers(10, 100, size=n).astype(float)
    difficulty = rng.lognormal(sigma=1.5, size=n) * tokens  # problems differ a lot
    same = paired_change([(difficulty, tokens)], [(difficulty, tokens)])
    assert (same.value, same.lo, same.hi) == (0.0, 0.0, 0.0)
    cut = paired_change([(difficulty, tokens)], [(0.7 * difficulty, tokens)])  # 30% lower on every problem
    assert (cut.value, cut.lo, cut.hi) == pytest.approx((-0.3, -0.3, -0.3), abs=1e-12)
    # with noise on top, the paired interval is far narrower than the two unpaired intervals would suggest
    noisy = 0.7 * difficulty * rng.uniform(0.9, 1.1, size=n)
    iv = paired_change([(difficulty, tokens)], [(noisy, tokens)])
    a, b = ratio_interval(difficulty, tokens), ratio_interval(noisy, tokens)
    assert iv.lo < iv.value < iv.hi < 0
    assert iv.hi - iv.lo < 0.25 * ((a.hi - a.lo) / a.value + (b.hi - b.lo) / b.value)


def test_paired_change_bad_inputs():
    one = (np.ones(3), np.ones(3))
    with pytest.raises(ValueError, match=r"^before and after: expected one \(num, den\) per seed for each, the same "
                                         r"number of seeds, got 1 and 2$"):
        paired_change([one], [one, one])
    with pytest.raises(ValueError, match=r"^before and after: every evaluation needs one value per problem of the "
                                         r"same problems, got lengths \[3, 4\]$"):
        paired_change([one], [(np.ones(4), np.ones(4))])


def _difference_reference(a, b, resamples, seed, level=0.95):
    """paired_difference's documented procedure, written independently with explicit index draws and loops."""
    n = len(a[0][0])
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))

    def diff(rows):
        ra = [sum(num[i] for i in rows) / sum(den[i] for i in rows) for num, den in a]
        rb = [sum(num[i] for i in rows) / sum(den[i] for i in rows) for num, den in b]
        return sum(ra) / len(ra) - sum(rb) / len(rb)

    vals = sorted(diff(idx[r]) for r in range(resamples))
    return diff(range(n)), _quantile(vals, (1 - level) / 2), _quantile(vals, (1 + level) / 2)


@pytest.mark.parametrize("seeds", [(1, 1), (2, 1), (2, 3)])
def test_paired_difference_matches_an_independent_reference(seeds):
    rng = np.random.default_rng(7)
    n = 19
    groups = []
    for k in seeds:
        group = []
        for _ in range(k):
            samples = rng.integers(1, 5, size=n).astype(float)
            group.append((rng.binomial(samples.astype(int), 0.6).astype(float).tolist(), samples.tolist()))
        groups.append(group)
    iv = paired_difference(*groups, resamples=300, seed=4)
    assert (iv.value, iv.lo, iv.hi) == pytest.approx(_difference_reference(*groups, 300, 4), rel=1e-12, abs=1e-15)


def test_paired_difference_exact_cases_and_pairing():
    rng = np.random.default_rng(1)
    n = 60
    ones = np.ones(n)
    easy = rng.uniform(0.0, 0.9, size=n)  # per-problem accuracy, very different from problem to problem
    same = paired_difference([(easy, ones)], [(easy, ones)])
    assert (same.value, same.lo, same.hi) == (0.0, 0.0, 0.0)
    up = paired_difference([(easy + 0.1, ones), (easy + 0.3, ones)], [(easy, ones)])  # mean of 2 seeds: +0.2 each
    assert (up.value, up.lo, up.hi) == pytest.approx((0.2, 0.2, 0.2), abs=1e-12)
    # a small noisy gain: paired, the interval is far narrower than the two groups' own intervals side by side
    noisy = np.clip(easy + 0.05 + rng.normal(0, 0.02, size=n), 0, 1)
    iv = paired_difference([(noisy, ones)], [(easy, ones)])
    x, y = ratio_interval(noisy, ones), ratio_interval(easy, ones)
    assert 0 < iv.lo < iv.value < iv.hi
    assert iv.hi - iv.lo < 0.25 * ((x.hi - x.lo) + (y.hi - y.lo))


def test_paired_difference_bad_inputs():
    one = (np.ones(3), np.ones(3))
    with pytest.raises(ValueError, match=r"^a and b: expected at least one \(num, den\) in each, got 1 and 0$"):
        paired_difference([one], [])
    with pytest.raises(ValueError, match=r"^a and b: every evaluation needs one value per problem of the same "
                                         r"problems, got lengths \[3, 4\]$"):
        paired_difference([one], [(np.ones(4), np.ones(4))])


def test_values_json_round_trip_and_refusals():
    vals = EvalValues(problems=torch.ones(3, dtype=torch.float64), tokens=torch.tensor([4.0, 5.0, 6.0], dtype=torch.float64),
                      k1_sum=torch.tensor([0.5, -0.25, 1.0], dtype=torch.float64))
    data = values_to_json(vals)
    assert data == {"problems": [1.0, 1.0, 1.0], "tokens": [4.0, 5.0, 6.0], "k1_sum": [0.5, -0.25, 1.0]}
    back = values_from_json(data)
    assert back.k1_sum.tolist() == [0.5, -0.25, 1.0] and back.greedy_correct is None
    with pytest.raises(ValueError, match=r"^f.json: expected an object of per-problem lists with a 'problems' list$"):
        values_from_json({"tokens": [1.0]}, "f.json")
    with pytest.raises(ValueError, match=r"^f.json: unknown field 'kl' \(expected some of \["):
        values_from_json({"problems": [1.0], "kl": [1.0]}, "f.json")
    with pytest.raises(ValueError, match=r"^f.json: field 'tokens' must be a list of finite numbers$"):
        values_from_json({"problems": [1.0], "tokens": [float("nan")]}, "f.json")
    with pytest.raises(ValueError, match=r"^f.json: every field needs one value per problem, got lengths \[1, 2\]$"):
        values_from_json({"problems": [1.0], "tokens": [1.0, 2.0]}, "f.json")
    # a divergence sum may be +inf (a teacher that gave a written token probability 0); never -inf, NaN, or elsewhere
    assert values_from_json({"problems": [1.0, 1.0], "k1_sum": [float("inf"), 0.5]}).k1_sum[0] == float("inf")
    for field, bad in (("k1_sum", float("-inf")), ("k3_sum", float("nan")), ("tokens", float("inf"))):
        kind = "finite numbers or \\+inf" if field.endswith("_sum") else "finite numbers"
        with pytest.raises(ValueError, match=rf"^f.json: field '{field}' must be a list of {kind}$"):
            values_from_json({"problems": [1.0], field: [bad]}, "f.json")


def test_paired_lift_ratio_matches_an_independent_reference_and_exact_cases():
    """(mean_s R_a_s - R_base) / (mean_t R_b_t - R_base) on one draw of problems per resample, written with explicit
    index draws; a run that lifts as much as the reference gives exactly 1, half as much exactly 0.5."""
    rng = np.random.default_rng(3)
    n = 40
    ones = [1.0] * n
    base = (rng.binomial(1, 0.2, n).astype(float).tolist(), ones)
    a = [(rng.binomial(1, 0.6, n).astype(float).tolist(), ones) for _ in range(2)]
    b = [(rng.binomial(1, 0.7, n).astype(float).tolist(), ones) for _ in range(2)]
    iv = paired_lift_ratio(base, a, b, resamples=200, seed=5)
    idx = np.random.default_rng(5).integers(0, n, size=(200, n))

    def lift(rows):
        r = lambda num: sum(num[i] for i in rows) / len(rows)  # noqa: E731
        gain_b = sum(r(x[0]) for x in b) / len(b) - r(base[0])
        return (sum(r(x[0]) for x in a) / len(a) - r(base[0])) / gain_b if gain_b > 0 else None

    vals = sorted(v for v in (lift(idx[k]) for k in range(200)) if v is not None)
    assert (iv.value, iv.lo, iv.hi) == pytest.approx((lift(range(n)), _quantile(vals, 0.025), _quantile(vals, 0.975)),
                                                     rel=1e-12)
    easy = rng.uniform(0.0, 0.5, size=n)
    one = np.ones(n)
    same = paired_lift_ratio((easy, one), [(easy + 0.2, one)], [(easy + 0.2, one)])
    half = paired_lift_ratio((easy, one), [(easy + 0.1, one)], [(easy + 0.2, one)])
    assert (same.value, same.lo, same.hi) == pytest.approx((1.0, 1.0, 1.0)) and half.value == pytest.approx(0.5)
    assert (half.lo, half.hi) == pytest.approx((0.5, 0.5))
