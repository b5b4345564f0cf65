"""The union-support top-k loss (``support: union``, issue 22 item 6): the teacher's top-k joined with its log-probs
at the ids the student chose (its own top-k and the sampled token), each id once, plus one rest bucket.

Expectations come from ``tests/reference.py``'s per-position tail loss in float64, on a union built here with Python
sets (not with ``ops.union_support``): value and gradient on the plain back-end, the fused one (``StudentHidden``)
equal to the plain one, and the trainer's sampler top-k equal to a fresh forward's.
"""
from __future__ import annotations

import math

import pytest
import torch

from opdistill import DistillationConfig, DistillationLoss, GlobalBatch, TeacherScores, TeacherTopK
from opdistill.fused import StudentHidden
from opdistill.ops import union_support

from . import reference as R

B, S, V, K, J, H = 2, 4, 11, 3, 4, 5


def _row_union(ids, lp, extra_ids, extra_lp):
    """One position: the union as (ids, log-probs) lists, the first live occurrence of each id (Python sets)."""
    seen, out_ids, out_lp = set(), [], []
    for i, v in list(zip(ids.tolist(), lp.tolist())) + list(zip(extra_ids.tolist(), extra_lp.tolist())):
        if v == float("-inf") or i in seen:
            continue
        seen.add(i)
        out_ids.append(i)
        out_lp.append(v)
    return out_ids, out_lp


def _signal(seed=0, dtype=torch.float64):
    """A teacher's top-K (one empty slot at row 0 position 1) and its log-probs at J requested ids that repeat some
    of the top-K ids and each other; a real distribution over V ids."""
    g = torch.Generator().manual_seed(seed)
    t = torch.log_softmax(torch.randn(B, S, V, generator=g, dtype=torch.float64) * 1.5, -1)
    top_lp, top_ids = t.topk(K, -1)
    top_lp = top_lp.clone()
    top_lp[0, 1, 2] = float("-inf")  # an empty top-k slot: its id must not hide a requested one
    req = torch.randint(0, V, (B, S, J), generator=g)
    req[..., 0] = top_ids[..., 0]  # the student agrees with the teacher's best id
    req[..., 1] = req[..., 2]  # a repeat among the requested ids
    req[0, 1, 3] = top_ids[0, 1, 2]  # the empty slot's id, requested: must be a bucket
    req_lp = t.gather(-1, req)
    return (top_ids, top_lp.to(dtype)), (req, req_lp.to(dtype)), t


def test_union_support_keeps_each_id_once_and_empties_repeats():
    (ti, tl), (ri, rl), _ = _signal()
    ids, lp = union_support(ti, tl, ri, rl)
    assert ids.shape == (B, S, K + J) and lp.shape == (B, S, K + J)
    for b in range(B):
        for s in range(S):
            want_ids, want_lp = _row_union(ti[b, s], tl[b, s], ri[b, s], rl[b, s])
            live = lp[b, s] > float("-inf")
            assert ids[b, s][live].tolist() == want_ids  # in order: the first occurrence kept
            assert lp[b, s][live].tolist() == want_lp
    assert lp[0, 1, K + 3] > float("-inf")  # the id of an empty top-k slot, requested, is a bucket
    with pytest.raises(ValueError, match=r"^union_support: ids \(2, 4, 3\) / logprobs \(2, 4, 3\) and extra_ids "
                                         r"\(2, 4, 4\) / extra_logprobs \(2, 4, 3\) must pair up"):
        union_support(ti, tl, ri, rl[..., :3])


def _loss_inputs(dtype):
    (ti, tl), (ri, rl), _ = _signal(dtype=dtype)
    g = torch.Generator().manual_seed(7)
    h = torch.randn(B, S, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    scores = TeacherScores(TeacherTopK(ti, tl), requested_logprobs=rl, requested_ids=ri)
    return h.to(dtype), w.to(dtype), mask, scores, (ti, tl, ri, rl)


def _reference(h, w, mask, parts, div):
    """Token-mean of the float64 per-position tail loss over the union built with Python sets, and d/dh."""
    ti, tl, ri, rl = parts
    h = h.double().detach().requires_grad_(True)
    z = h @ w.double().T
    terms = []
    for b in range(B):
        for s in range(S):
            if mask[b, s]:
                ids, lp = _row_union(ti[b, s], tl[b, s].double(), ri[b, s], rl[b, s].double())
                terms.append(R.topk_row(z[b, s], torch.tensor(ids), torch.tensor(lp, dtype=torch.float64), "tail",
                                        div))
    loss = torch.stack(terms).sum() / len(terms)
    (gh,) = torch.autograd.grad(loss, h)
    return loss.detach(), gh


@pytest.mark.parametrize("div", ["forward", "reverse", "jsd"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_the_union_loss_is_the_tail_loss_over_the_union(div, dtype):
    h, w, mask, scores, parts = _loss_inputs(dtype)
    ref, ref_gh = _reference(h, w, mask, parts, div)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    fn = DistillationLoss(DistillationConfig(loss_mode="topk", support="union", divergence=div, topk=K))
    teacher = fn.signal(scores)
    batch = GlobalBatch.from_masks([mask])
    hp = h.clone().requires_grad_(True)
    loss, _ = fn(hp @ w.T, teacher, mask, batch)
    (gh,) = torch.autograd.grad(loss, hp)
    torch.testing.assert_close(loss.detach().double(), ref, **tol)
    torch.testing.assert_close(gh.double(), ref_gh, **tol)
    hf = h.clone().requires_grad_(True)  # the fused back-end: hidden states and lm_head, no [N, V] logits
    loss_f, _ = fn(StudentHidden(hf, w), teacher, mask, batch)
    (gf,) = torch.autograd.grad(loss_f, hf)
    torch.testing.assert_close(loss_f.detach().double(), ref, **tol)
    torch.testing.assert_close(gf.double(), ref_gh, **tol)


def test_union_without_requested_ids_is_refused():
    _, _, mask, scores, _ = _loss_inputs(torch.float64)
    fn = DistillationLoss(DistillationConfig(loss_mode="topk", support="union", topk=K))
    with pytest.raises(ValueError, match=r"^support='union' joins the teacher's top-k with its log-probs at the ids "
                                         r"the student chose \(requested_ids\), which these teacher scores do not hold"):
        fn.signal(TeacherScores(scores.topk))
    with pytest.raises(ValueError, match=r"^support='union': the signal has 2 slots per token, fewer than the "
                                         r"teacher's top-k \(config.topk=3\)"):
        fn(torch.zeros(B, S, V), TeacherTopK(scores.topk.ids[..., :2], scores.topk.logprobs[..., :2]), mask,
           GlobalBatch.from_masks([mask]))


def test_the_samplers_top_k_is_the_students_top_k_and_the_request_adds_the_sampled_token():
    from opdistill.engines.rollout import generate_rollouts
    from opdistill.models import build_tiny_llama, char_tokenizer
    from opdistill.train.steps.collect import student_choices

    tok = char_tokenizer("0123456789+=,>")
    model = build_tiny_llama(tok, hidden_size=32)
    prompts = [tok.encode("12+34="), tok.encode("5+6=")]
    ro = generate_rollouts(model, tok, prompts, n=2, max_new_tokens=6, seed=3, want_topk=4)
    with torch.no_grad():
        logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits
    nxt = torch.zeros_like(ro.response_mask, dtype=torch.bool)
    nxt[:, :-1] = ro.response_mask[:, 1:].bool()  # row t predicts a response token
    top = logits.topk(4, -1)
    got = ro.sampler_topk[nxt]
    ref_ids = top.indices[nxt]
    # ids agree where the fresh forward ranks them apart (near-ties may swap between the two forwards)
    gaps = (top.values[nxt][:, :-1] - top.values[nxt][:, 1:]).abs()
    for r in range(got.shape[0]):
        if bool((gaps[r] > 1e-4).all()):
            assert got[r].tolist() == ref_ids[r].tolist()
    assert not ro.sampler_topk[~nxt].any()
    req = student_choices(ro.input_ids, ro.sampler_topk)
    assert req.shape == (*ro.input_ids.shape, 5)
    assert torch.equal(req[:, :-1, 4], ro.input_ids[:, 1:])  # the sampled token itself, last
    assert math.isclose(float((gaps > 1e-4).all(-1).double().mean()), 1.0, abs_tol=0.5)  # the check ran on most rows


_UNION = "loss.support: expected tail, truncated or renormalized with {} (support union asks the teacher for its " \
         "log-probs at the student's top-k ids, {}), got 'union'"


@pytest.mark.parametrize("overrides, message", [
    (["train.method=off_policy"], _UNION.format("train.method off_policy", "which only on-policy rollouts carry")),
    (["rollout.engine=vllm"], _UNION.format("rollout.engine vllm", "which the vLLM rollout engine does not return")),
    (["teacher.engine=vllm"], _UNION.format("teacher.engine vllm", "which vLLM's prompt log-probs cannot answer")),
    (["teacher.url=http://h:1", "teacher.api=vllm"],
     _UNION.format("teacher.api vllm", "which a stock vllm serve endpoint cannot answer")),
])
def test_config_refusals(overrides, message):
    from opdistill.errors import ConfigError
    from opdistill.train.run.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config(base={"model": {"student": "s", "teacher": "t"},
                          "loss": {"loss_mode": "topk", "topk": 8, "support": "union"}}, overrides=overrides)
    assert str(e.value) == message
