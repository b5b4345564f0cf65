"""Vocab-parallel ops on one process (no launch): no collective, saved bytes, chunking, padding, validation.

The multi-rank equalities are in test_parallel_dist.py; here ``group=None`` runs the same code with P = 1.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import opdistill.parallel.shard as shard_mod
from opdistill.ops import generalized_jsd, token_logprobs, topk_divergence
from opdistill.ops.jsd import jsd_from_logprobs
from opdistill.parallel import (
    vocab_parallel_generalized_jsd,
    vocab_parallel_token_logprobs,
    vocab_parallel_topk_divergence,
)
from opdistill.ops.divergence import divergence_grad

from . import parallel_op_checks as W
from .conftest import random_teacher_topk, seeded
from .parallel_launch import CollectiveCounter


def _case(V=13, lead=(3, 5), dtype=torch.float64, seed=0, duplicates=False):
    return W.topk_case(seed, lead, V, V, 1, dtype, duplicates=duplicates)


@pytest.mark.parametrize("combo", W.COMBOS, ids=lambda c: "/".join(map(str, c)))
def test_group_none_runs_no_collective_and_equals_single_device(combo):
    support, div, beta, clamp = combo
    x, ids, lp = _case(duplicates=support == "truncated")
    kw = dict(support=support, divergence=div, beta=beta, log_prob_min_clamp=clamp, temperature=0.7)
    xr, xl = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    with CollectiveCounter() as counter:
        got = vocab_parallel_topk_divergence(xl, ids, lp, **kw)
        got.loss.sum().backward()
    assert counter.calls == []
    ref = topk_divergence(xr, ids, lp, **kw)
    ref.loss.sum().backward()
    for f in ("loss", "student_mass", "teacher_mass", "overlap_token_advantage"):
        torch.testing.assert_close(getattr(got, f), getattr(ref, f), rtol=0, atol=1e-12)
    assert torch.equal(got.overlap_count, ref.overlap_count)
    torch.testing.assert_close(xl.grad, xr.grad, rtol=0, atol=1e-12)


def test_token_logprobs_and_jsd_run_no_collective():
    x, ids, _ = _case()
    xt = torch.randn(x.shape, dtype=torch.float64)
    with CollectiveCounter() as counter:
        a = vocab_parallel_token_logprobs(x, ids[..., 0])
        b = vocab_parallel_generalized_jsd(x, xt, beta=0.3)
    assert counter.calls == []
    torch.testing.assert_close(a, token_logprobs(x, ids[..., 0]), rtol=0, atol=1e-12)
    torch.testing.assert_close(b, generalized_jsd(x, xt, beta=0.3), rtol=0, atol=1e-12)


def test_truncated_forward_gradient_is_P_pi_minus_nu_on_T():
    """SPEC 5: dL/dz_j = P pi_j - nu_j [j in T] for truncated forward (no clamp, loss > 0), from the definition."""
    g = seeded(3)
    x = torch.randn(6, 17, generator=g, dtype=torch.float64)
    ids, lp = random_teacher_topk(g, 6, 17, 4, dtype=torch.float64)
    xl = x.clone().requires_grad_(True)
    res = vocab_parallel_topk_divergence(xl, ids, lp)
    assert bool((res.loss > 0).all())
    res.loss.sum().backward()
    nu = torch.zeros_like(x).scatter_(1, ids, lp.exp())
    expected = lp.exp().sum(-1, keepdim=True) * torch.softmax(x, -1) - nu
    torch.testing.assert_close(xl.grad, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 1e-3, 0.3, 0.5, 1 - 1e-3, 1.0])
def test_jsd_logprob_grad_matches_autograd_of_the_single_device_stage(beta):
    g = torch.Generator().manual_seed(4)
    s = torch.log_softmax(torch.randn(5, 9, generator=g, dtype=torch.float64), -1).requires_grad_(True)
    t = torch.log_softmax(torch.randn(5, 9, generator=g, dtype=torch.float64), -1)
    (expected,) = torch.autograd.grad(jsd_from_logprobs(s, t, beta).sum(), s)
    torch.testing.assert_close(divergence_grad(t, s.detach(), "jsd", beta), expected, rtol=0, atol=1e-14)


def test_chunked_forward_and_backward_equal_single_device(monkeypatch):
    """Row chunks of a few logits each (the forward and the backward both loop) change nothing."""
    monkeypatch.setattr(shard_mod, "CHUNK_ELEMENTS", 20)
    x, ids, lp = _case(V=13, lead=(4, 5))
    xt = torch.randn(x.shape, dtype=torch.float64)
    for fn, ref_fn in (
        (functools.partial(vocab_parallel_topk_divergence, support="tail", divergence="jsd", temperature=0.7),
         functools.partial(topk_divergence, support="tail", divergence="jsd", temperature=0.7)),
    ):
        xr, xl = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        fn(xl, ids, lp).loss.sum().backward()
        ref_fn(xr, ids, lp).loss.sum().backward()
        torch.testing.assert_close(xl.grad, xr.grad, rtol=0, atol=1e-12)
    xr, xl = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    vocab_parallel_generalized_jsd(xl, xt, beta=0.3, temperature=0.7).sum().backward()
    generalized_jsd(xr, xt, beta=0.3, temperature=0.7).sum().backward()
    torch.testing.assert_close(xl.grad, xr.grad, rtol=0, atol=1e-12)


def test_padded_columns_get_no_mass_and_no_gradient():
    """One process holding a Megatron-padded shard: columns >= vocab_size are ignored, whatever they hold."""
    V = 13
    x, ids, lp = _case(V=V)
    padded = torch.cat([x, torch.full((*x.shape[:-1], 3), 40.0, dtype=x.dtype)], -1).requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    got = vocab_parallel_topk_divergence(padded, ids, lp, vocab_size=V, support="tail", divergence="reverse")
    ref = topk_divergence(xr, ids, lp, support="tail", divergence="reverse")
    torch.testing.assert_close(got.loss, ref.loss, rtol=0, atol=1e-12)
    assert torch.equal(got.overlap_count, ref.overlap_count)  # the large padding logits are not "top-k"
    got.loss.sum().backward()
    ref.loss.sum().backward()
    torch.testing.assert_close(padded.grad[..., :V], xr.grad, rtol=0, atol=1e-12)
    assert not padded.grad[..., V:].any()
    y = ids[..., 0]
    torch.testing.assert_close(vocab_parallel_token_logprobs(padded, y, vocab_size=V), token_logprobs(x, y))


def test_saved_tensors_are_the_input_plus_o_tokens_times_k():
    W.check_saved_bytes(0, 1, None, "one process")


def test_saved_bytes_do_not_grow_with_the_vocabulary():
    """The bytes saved beyond the input are the same at V = 64 and V = 4096."""
    sizes = []
    for V in (64, 4096):
        x, ids, lp = _case(V=V, lead=(8,), dtype=torch.float32)
        xl = x.requires_grad_(True)
        _, seen = W.saved_tensors(lambda: vocab_parallel_topk_divergence(xl, ids, lp, support="tail").loss)
        sizes.append(sum(n for _, _, n, ptr in seen if ptr != xl.untyped_storage().data_ptr()))
    assert sizes[0] == sizes[1] > 0


def test_bad_layouts_are_refused():
    x, ids, lp = _case(V=13)
    with pytest.raises(ValueError, match="vocab_size=20 exceeds"):
        vocab_parallel_topk_divergence(x, ids, lp, vocab_size=20)
    with pytest.raises(ValueError, match="vocab_size must be an int"):
        vocab_parallel_topk_divergence(x, ids, lp, vocab_size=0)
    with pytest.raises(ValueError, match=r"teacher_ids must lie in \[0, 12\)"):
        vocab_parallel_topk_divergence(x, ids.clamp_min(12), lp, vocab_size=12)  # an id in the padding
    with pytest.raises(ValueError, match="ids must have the leading shape"):
        vocab_parallel_token_logprobs(x, ids)
    with pytest.raises(ValueError, match="same shape"):
        vocab_parallel_generalized_jsd(x, x[..., :5])
    with pytest.raises(TypeError, match="local_logits must be a torch.Tensor"):
        vocab_parallel_topk_divergence(x.tolist(), ids, lp)
    with pytest.raises(ValueError, match="teacher_logprobs contains NaN"):
        vocab_parallel_topk_divergence(x, ids, torch.full_like(lp, math.nan))


def test_zero_tokens_give_empty_results_and_gradients():
    x = torch.randn(0, 10, requires_grad=True)
    ids, lp = torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3)
    res = vocab_parallel_topk_divergence(x, ids, lp, support="tail")
    res.loss.sum().backward()
    assert res.loss.shape == res.overlap_count.shape == (0,) and x.grad.shape == (0, 10)
    assert vocab_parallel_token_logprobs(x, ids[:, 0]).shape == (0,)
    assert vocab_parallel_generalized_jsd(x, x.detach()).shape == (0,)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_compute_in_fp32_like_the_single_device_op(dtype):
    x, ids, lp = _case(V=50, lead=(6,), dtype=torch.float32)
    x = x.to(dtype)
    xr, xl = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ref = topk_divergence(xr, ids, lp, support="tail", divergence="reverse", temperature=0.7)
    got = vocab_parallel_topk_divergence(xl, ids, lp, support="tail", divergence="reverse", temperature=0.7)
    assert got.loss.dtype == torch.float32
    torch.testing.assert_close(got.loss, ref.loss, rtol=0, atol=1e-6)
    assert torch.equal(got.overlap_count, ref.overlap_count)
    got.loss.sum().backward()
    ref.loss.sum().backward()
    assert xl.grad.dtype == dtype
    torch.testing.assert_close(xl.grad.float(), xr.grad.float(), rtol=0, atol=1e-3)
