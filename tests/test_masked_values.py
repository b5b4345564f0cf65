"""Values at masked positions never reach a value or a gradient; non-finite values at valid positions are refused.

For every op and every back-end (plain ops, vocab-parallel, fused) a NaN / +inf / -inf written into the student's
logits (or hidden states) at masked positions must give exactly the loss and the gradients of the same inputs with
harmless values there (``torch.equal``, not a tolerance: the masked rows are replaced by zeros before any arithmetic,
so the valid rows run the same floating-point operations).  A NaN at a valid position raises a ``ValueError`` naming
the argument and the first bad position, unless ``validate=False``.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from opdistill import DistillationConfig, DistillationLoss, GlobalBatch, TeacherSampled, TeacherTopK
from opdistill.fused import (
    StudentHidden,
    TeacherHidden,
    fused_generalized_jsd,
    fused_token_logprobs,
    fused_topk_divergence,
    fused_topk_loss,
)
from opdistill.loss import TeacherLogits
from opdistill.ops import generalized_jsd, sampled_token_kl, token_logprobs, topk_divergence
from opdistill.parallel import (
    vocab_parallel_generalized_jsd,
    vocab_parallel_token_logprobs,
    vocab_parallel_topk_divergence,
)

B, S, H, V, K = 2, 5, 6, 13, 3
POISONS = [float("nan"), float("inf"), float("-inf")]
COMBOS = [("truncated", "forward", 0.5), ("tail", "reverse", 0.5), ("tail", "jsd", 0.3), ("renormalized", "jsd", 1.0)]


def message(name: str, pos: tuple) -> str:
    return re.escape(
        f"{name} is not finite at position {pos} (a NaN or +inf, or no finite value in the row) where the loss reads "
        "it; look for NaN weights or fp16 overflow, or mask that position (validate=False skips this check)"
    )


def case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, S, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
    bias = torch.randn(V, generator=g, dtype=torch.float64) * 0.2
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, 1] = mask[1, 3] = mask[1, 4] = False
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * S)]).reshape(B, S, K)
    lp = torch.log_softmax(torch.randn(B, S, V, generator=g, dtype=torch.float64) * 2, -1).gather(-1, ids)
    return h, w, bias, mask, ids, lp


def poisoned(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """x with ``value`` in one entry of every masked row (and the whole row of the first masked position)."""
    x = x.clone()
    rows = (~mask).nonzero()
    x[tuple(rows[0])] = value
    for r in rows[1:]:
        x[tuple(r)][1] = value
    return x


def grads(fn, *xs):
    xs = [x.clone().requires_grad_(True) for x in xs]
    out = fn(*xs)
    return out, torch.autograd.grad(out, xs)


# -- the ops, masked rows = all-empty teacher slots (how DistillationLoss sends them) -----------------------------
TOPK_BACKENDS = {
    "plain": lambda z, ids, lp, **kw: topk_divergence(z, ids, lp, **kw).loss,
    "parallel": lambda z, ids, lp, **kw: vocab_parallel_topk_divergence(z, ids, lp, **kw).loss,
    "fused": lambda h, w, b, ids, lp, **kw: fused_topk_divergence(h, w, ids, lp, bias=b, chunk_size=3, **kw).loss,
    "fused_weighted": lambda h, w, b, ids, lp, **kw: fused_topk_loss(
        h, w, ids, lp, torch.linspace(0.5, 1.5, B * S, dtype=h.dtype).reshape(B, S), bias=b, chunk_size=3, **kw)[0],
}


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "/".join(map(str, c)))
@pytest.mark.parametrize("backend", TOPK_BACKENDS)
def test_topk_ops_ignore_masked_rows(backend, combo, poison):
    support, div, beta = combo
    h, w, b, mask, ids, lp = case()
    lp = torch.where(mask.unsqueeze(-1), lp, float("-inf"))  # masked rows: every slot empty
    kw = dict(support=support, divergence=div, beta=beta, temperature=0.7)
    fn = TOPK_BACKENDS[backend]
    if backend.startswith("fused"):  # poison the hidden states
        bad = poisoned(h, mask, poison)
        run = lambda hh, ww, bb: fn(hh, ww, bb, ids, lp, **kw).sum()  # noqa: E731
        clean_out, clean_g = grads(run, h, w, b)
        out, g = grads(run, bad, w, b)
    else:  # poison the logits: differentiate with respect to them
        z = torch.nn.functional.linear(h, w, b)
        run = lambda zz: fn(zz, ids, lp, **kw).sum()  # noqa: E731
        clean_out, clean_g = grads(run, z)
        out, g = grads(run, poisoned(z, mask, poison))
    assert torch.isfinite(out) and torch.equal(out, clean_out)
    assert clean_g[0].abs().max() > 0, "vacuous: no gradient at all"
    for a, c in zip(g, clean_g):
        assert torch.isfinite(a).all() and torch.equal(a, c)
    assert not g[0][~mask].any()  # hidden states or logits: nothing at masked rows


# -- DistillationLoss: every loss mode x plain / vocab-parallel / fused -------------------------------------------
CASES = [
    dict(loss_mode="topk", support="tail", divergence="reverse"),
    dict(loss_mode="topk", support="truncated", log_prob_min_clamp=-4.0, loss_max_clamp=0.5, temperature=0.8),
    dict(loss_mode="topk", support="renormalized", divergence="jsd", use_policy_gradient=True),
    dict(loss_mode="topk", support="tail", use_task_rewards=True, distillation_coef=0.3),
    dict(loss_mode="sampled", estimator="k3"),
    dict(loss_mode="sampled", estimator="k1", use_policy_gradient=True),
    dict(loss_mode="full", beta=0.3, temperature=0.9),
]
PARALLEL = dict(vocab_size=V)  # selects the vocab-parallel back-end (one shard: the whole vocabulary)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("backend", ["plain", "parallel", "fused"])
@pytest.mark.parametrize("cfg", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_distillation_loss_ignores_masked_positions(cfg, backend, poison):
    cfg = DistillationConfig(**cfg)
    h, w, b, mask, ids, lp = case(1)
    g = torch.Generator().manual_seed(2)
    sampled = torch.randint(0, V, (B, S), generator=g)
    near = token_logprobs(torch.nn.functional.linear(h, w, b), sampled)  # a sampler close to the student: unclipped
    extra = dict(sampled_ids=sampled, old_logprobs=near + 0.05 * torch.randn(B, S, generator=g, dtype=torch.float64),
                 task_advantages=torch.randn(B, S, generator=g, dtype=torch.float64))
    ht, wt = torch.randn(B, S, 4, generator=g, dtype=torch.float64), torch.randn(V, 4, generator=g, dtype=torch.float64)
    teacher = {"topk": TeacherTopK(ids, lp), "sampled": TeacherSampled(-torch.rand(B, S, generator=g, dtype=torch.float64)),
               "full": TeacherHidden(ht, wt) if backend == "fused" else TeacherLogits(ht @ wt.T)}[cfg.loss_mode]
    loss_fn = DistillationLoss(cfg, **(PARALLEL if backend == "parallel" else {}))
    batch = GlobalBatch.from_masks(mask)

    if backend == "fused":
        def run(hh, ww, bb):
            return loss_fn(StudentHidden(hh, ww, bb), teacher, mask, batch, **extra)[0]
        args, bad_args = (h, w, b), (poisoned(h, mask, poison), w, b)
    else:  # logits (loss_mode sampled: the loss reads the log-probs of the sampled tokens from them)
        z = torch.nn.functional.linear(h, w, b)

        def run(zz):
            return loss_fn(zz, teacher, mask, batch, **extra)[0]
        args, bad_args = (z,), (poisoned(z, mask, poison),)
    clean_out, clean_g = grads(run, *args)
    out, got = grads(run, *bad_args)
    assert torch.isfinite(out) and torch.equal(out, clean_out)
    assert clean_g[0].abs().max() > 0, "vacuous: no gradient at all"
    for a, c in zip(got, clean_g):
        assert torch.isfinite(a).all() and torch.equal(a, c)
    assert not got[0][~mask].any()


# -- validation: NaN at a valid position --------------------------------------------------------------------------
def _valid_nan_calls():
    h, w, b, mask, ids, lp = case()
    z = torch.nn.functional.linear(h, w, b)
    zn = z.clone()
    zn[1, 2, 4] = float("nan")
    hn = h.clone()
    hn[1, 2, 0] = float("nan")
    wn = w.clone()
    wn[5, 1] = float("inf")
    y = ids[..., 0]
    zt = torch.randn(B, S, V, dtype=torch.float64)
    s = token_logprobs(z, y)
    sn = s.clone()
    sn[1, 2] = float("nan")
    t_lp = -torch.ones(B, S, dtype=torch.float64)
    one = torch.ones(B, S, dtype=torch.float64)
    return [
        ("topk_divergence", "student_logits", functools.partial(topk_divergence, zn, ids, lp, support="tail")),
        ("token_logprobs", "logits", functools.partial(token_logprobs, zn, y)),
        ("generalized_jsd", "student_logits", functools.partial(generalized_jsd, zn, zt)),
        ("generalized_jsd teacher", "teacher_logits", functools.partial(generalized_jsd, zt, zn)),
        ("sampled_token_kl", "student_logprobs", functools.partial(sampled_token_kl, sn, t_lp)),
        ("vocab_parallel_topk", "local_logits", functools.partial(vocab_parallel_topk_divergence, zn, ids, lp)),
        ("vocab_parallel_logprobs", "local_logits", functools.partial(vocab_parallel_token_logprobs, zn, y)),
        ("vocab_parallel_jsd", "local_student_logits", functools.partial(vocab_parallel_generalized_jsd, zn, zt)),
        ("vocab_parallel_jsd teacher", "local_teacher_logits",
         functools.partial(vocab_parallel_generalized_jsd, zt, zn)),
        ("fused_topk_divergence", "hidden", functools.partial(fused_topk_divergence, hn, w, ids, lp, chunk_size=4)),
        ("fused_topk_loss", "hidden", functools.partial(fused_topk_loss, hn, w, ids, lp, one, chunk_size=4)),
        ("fused_token_logprobs", "hidden", functools.partial(fused_token_logprobs, hn, w, y, chunk_size=4)),
        ("fused_generalized_jsd", "student_hidden",
         functools.partial(fused_generalized_jsd, hn, w, h, w.detach(), chunk_size=4)),
        ("fused_generalized_jsd teacher", "teacher_hidden",
         functools.partial(fused_generalized_jsd, h, w, hn, w.detach(), chunk_size=4)),
    ]


@pytest.mark.parametrize("what, name, call", _valid_nan_calls(), ids=lambda x: x if isinstance(x, str) else "")
def test_nan_at_a_valid_position_is_refused(what, name, call):
    with pytest.raises(ValueError, match=f"^{message(name, (1, 2))}$"):
        call()
    out = call(validate=False)  # the check is skipped: the NaN flows through
    values = out.loss if hasattr(out, "loss") else out[0] if isinstance(out, tuple) else out
    assert not torch.isfinite(values).all()


def test_a_bad_lm_head_is_named_not_the_hidden_states():
    h, w, b, mask, ids, lp = case()
    wn = w.clone()
    wn[5, 1] = float("nan")  # every row's logits
    with pytest.raises(ValueError, match="^" + message("the logits hidden @ weight.T + bias", (0, 0)) + "$"):
        fused_topk_divergence(h, wn, ids, lp, chunk_size=4)


def test_nan_at_a_valid_position_is_refused_through_distillation_loss():
    h, w, b, mask, ids, lp = case()
    z = torch.nn.functional.linear(h, w, b)
    z[1, 2, 4] = float("nan")
    with pytest.raises(ValueError, match=message("student_logits", (1, 2))):
        DistillationLoss(DistillationConfig(support="tail"))(z, TeacherTopK(ids, lp), mask, GlobalBatch.from_masks(mask))


def test_validate_false_skips_every_value_check_but_not_the_structural_ones():
    h, w, b, mask, ids, lp = case()
    z = torch.nn.functional.linear(h, w, b)
    bad_lp = lp.clone()
    bad_lp[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="^teacher_logprobs contains NaN$"):
        topk_divergence(z, ids, bad_lp, support="tail")
    assert topk_divergence(z, ids, bad_lp, support="tail", validate=False).loss.shape == (B, S)  # not checked
    with pytest.raises(ValueError, match=r"^teacher_logprobs must have the shape of teacher_ids"):
        topk_divergence(z, ids, lp[..., :2], support="tail", validate=False)
    with pytest.raises(ValueError, match=r"^ids must lie in \[0, 13\)"):
        token_logprobs(z, ids[..., 0] + V)
    with pytest.raises(ValueError, match="^teacher_logprobs contains NaN$"):
        sampled_token_kl(torch.zeros(3), torch.tensor([0.0, float("nan"), -1.0]))
    assert torch.isnan(sampled_token_kl(torch.zeros(3), torch.tensor([0.0, float("nan"), -1.0]), validate=False)[1])
