"""bf16/fp16: the fused gradient error against a float64 reference is no larger than the naive low-precision path's
(logits are never rounded before the fp32 softmax).  Bad inputs: exact exception type and a message naming the
argument."""

import pytest
import torch

from opdistill.fused import fused_generalized_jsd, fused_token_logprobs, fused_topk_divergence
from opdistill.ops.topk import topk_divergence
from tests.conftest import random_teacher_topk, seeded


def make(n=48, H=32, V=500, K=8, seed=0):
    g = seeded(seed)
    h = torch.randn(n, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7  # logits of size ~4: bf16 rounds them by ~0.015
    ids, lp = random_teacher_topk(g, n, V, K, scale=3, dtype=torch.float64)
    return h, w, ids, lp


def rel_err(x, ref):
    return float((x.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("support,divergence", [("tail", "forward"), ("renormalized", "jsd")])
def test_low_precision_gradient_error_not_worse_than_naive(dtype, support, divergence):
    h64, w64, ids, lp = make()
    kw = dict(support=support, divergence=divergence)
    h_ref, w_ref = h64.clone().requires_grad_(True), w64.clone().requires_grad_(True)
    ref = torch.autograd.grad(topk_divergence(h_ref @ w_ref.T, ids, lp, **kw).loss.sum(), (h_ref, w_ref))

    def run(fused):
        h = h64.to(dtype).requires_grad_(True)
        w = w64.to(dtype).requires_grad_(True)
        if fused:
            loss = fused_topk_divergence(h, w, ids, lp.float(), chunk_size=7, **kw).loss
        else:  # what a model does: lm_head in bf16, then the fp32 op
            loss = topk_divergence(h @ w.T, ids, lp.float(), **kw).loss
        gh, gw = torch.autograd.grad(loss.sum(), (h, w))
        assert gh.dtype == dtype and gw.dtype == dtype
        return rel_err(gh, ref[0]), rel_err(gw, ref[1])

    naive, fused = run(False), run(True)
    assert fused[0] <= naive[0] and fused[1] <= naive[1], (fused, naive)


def test_bf16_logits_are_fp32_accumulated():
    h64, w64, ids, _ = make(n=16)
    s = fused_token_logprobs(h64.bfloat16(), w64.bfloat16(), ids[:, 0])
    exact = torch.log_softmax(h64.bfloat16().double() @ w64.bfloat16().double().T, -1).gather(-1, ids[:, :1])[:, 0]
    assert s.dtype == torch.float32
    assert float((s.double() - exact).abs().max()) < 1e-4  # bf16-rounded logits would be off by ~1e-2


# -- bad inputs ----------------------------------------------------------------------------------------------------
def small():
    h = torch.randn(4, 3)
    w = torch.randn(10, 3)
    ids = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]])
    lp = torch.full((4, 2), -1.5)
    return h, w, ids, lp


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: a.update(hidden=a["hidden"].long()), TypeError, "hidden must be a floating-point tensor"),
        (lambda a: a.update(hidden=torch.randn(3)), ValueError, "hidden must have shape"),
        (lambda a: a.update(weight=torch.randn(10, 5)), ValueError, "weight has H=5 columns but hidden has H=3"),
        (lambda a: a.update(weight=torch.randn(10, 3, 1)), ValueError, "weight must be the lm_head weight"),
        (lambda a: a.update(weight=torch.randn(10, 3, dtype=torch.float64)), TypeError, "weight dtype"),
        (lambda a: a.update(bias=torch.randn(9)), ValueError, r"bias must have shape \(10,\)"),
        (lambda a: a.update(bias=torch.randn(10).double()), TypeError, "bias dtype"),
        (lambda a: a.update(teacher_ids=a["teacher_ids"][:3], teacher_logprobs=a["teacher_logprobs"][:3]), ValueError,
         "teacher_ids must have shape"),
        (lambda a: a.update(teacher_ids=a["teacher_ids"] + 5), ValueError, r"teacher_ids must lie in \[0, 10\)"),
        (lambda a: a.update(teacher_ids=a["teacher_ids"].float()), TypeError, "teacher_ids must be an integer tensor"),
        (lambda a: a.update(teacher_logprobs=a["teacher_logprobs"] + 2), ValueError, "teacher_logprobs"),
        (lambda a: a.update(chunk_size=0), ValueError, "chunk_size must be an int >= 1"),
        (lambda a: a.update(chunk_size=2.5), ValueError, "chunk_size must be an int >= 1"),
        (lambda a: a.update(temperature=0.0), ValueError, "temperature must be a finite number > 0"),
        (lambda a: a.update(support="tail", divergence="nope"), ValueError, "divergence must be one of"),
        (lambda a: a.update(divergence="reverse"), ValueError, "support='truncated' only supports"),
    ],
)
def test_topk_bad_inputs(mutate, exc, match):
    h, w, ids, lp = small()
    args = dict(hidden=h, weight=w, teacher_ids=ids, teacher_logprobs=lp, bias=None, chunk_size=None,
                support="truncated", divergence="forward", temperature=1.0)
    mutate(args)
    with pytest.raises(exc, match=match):
        fused_topk_divergence(args.pop("hidden"), args.pop("weight"), args.pop("teacher_ids"),
                              args.pop("teacher_logprobs"), **args)


def test_token_logprobs_bad_inputs():
    h, w, _, _ = small()
    with pytest.raises(ValueError, match="ids must have the leading shape of hidden"):
        fused_token_logprobs(h, w, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 10\)"):
        fused_token_logprobs(h, w, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        fused_token_logprobs(h, w, torch.zeros(4))
    with pytest.raises(TypeError, match="return_entropy must be a bool"):
        fused_token_logprobs(h, w, torch.zeros(4, dtype=torch.long), return_entropy=1)


def test_jsd_bad_inputs():
    h, w, _, _ = small()
    with pytest.raises(ValueError, match="student_weight has V=10 rows but teacher_weight has V=9"):
        fused_generalized_jsd(h, w, h, torch.randn(9, 3), beta=0.5)
    with pytest.raises(ValueError, match="student_hidden and teacher_hidden must have the same leading dims"):
        fused_generalized_jsd(h, w, h[:3], w, beta=0.5)
    with pytest.raises(ValueError, match="teacher_weight requires grad"):
        fused_generalized_jsd(h, w, h, w.clone().requires_grad_(True), beta=0.5)
    with pytest.raises(ValueError, match=r"beta must be a number in \[0, 1\]"):
        fused_generalized_jsd(h, w, h, w, beta=1.5)
    with pytest.raises(ValueError, match="teacher_weight has H=3 columns but teacher_hidden has H=2"):
        fused_generalized_jsd(h, w, torch.randn(4, 2), w, beta=0.5)


def test_mixed_dtypes_autocast_style():
    # bf16 activations with fp32 master weights (torch.autocast): computed in fp32, each gradient in its own dtype
    h64, w64, ids, lp = make(n=10, H=8, V=60, K=4)
    hb = h64.bfloat16().requires_grad_(True)
    w = w64.float().requires_grad_(True)
    b = torch.zeros(60, requires_grad=True)
    res = fused_topk_divergence(hb, w, ids, lp.float(), bias=b, chunk_size=3, support="tail", divergence="forward")
    gh, gw, gb = torch.autograd.grad(res.loss.sum(), (hb, w, b))
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.float32 and gb.dtype == torch.float32
    h32 = hb.detach().float().requires_grad_(True)
    w2 = w.detach().clone().requires_grad_(True)
    ref = topk_divergence(h32 @ w2.T, ids, lp.float(), support="tail", divergence="forward")
    rh, rw = torch.autograd.grad(ref.loss.sum(), (h32, w2))
    torch.testing.assert_close(res.loss, ref.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, rh.bfloat16())


def test_autocast_does_not_round_the_logits():
    h64, w64, ids, lp = make(n=12, H=8, V=60, K=4)
    h, w = h64.float().requires_grad_(True), w64.float().requires_grad_(True)
    kw = dict(support="tail", divergence="reverse", chunk_size=5)
    plain = fused_topk_divergence(h, w, ids, lp.float(), **kw)
    g_plain = torch.autograd.grad(plain.loss.sum(), (h, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = fused_topk_divergence(h, w, ids, lp.float(), **kw)
        g_auto = torch.autograd.grad(auto.loss.sum(), (h, w))
    torch.testing.assert_close(auto.loss, plain.loss, rtol=0, atol=0)
    for a, b in zip(g_plain, g_auto):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
