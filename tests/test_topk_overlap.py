"""The overlap diagnostic of ``finish_topk`` (T cap S, its count and advantage) against a brute-force O(K^2)
all-pairs reference, on random rows with ties, repeated ids, empty slots and clamps; and the cheap input checks of a
``TeacherTopK`` our own scorer marks ``validated``."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opdistill import DistillationConfig, DistillationLoss, GlobalBatch, TeacherTopK
from opdistill.ops.topk import finish_topk, is_member


def brute_force_overlap(teacher_ids, student_top, t, s, clamp):
    """(count, advantage) from the definitions: slot k is in the overlap when it is non-empty and its id equals one
    of the row's student top ids (every pair compared), advantage = -sum nu (l - log pi) / count, 0 when empty."""
    valid = t > float("-inf")
    if clamp is not None:
        s = s.clamp_min(clamp)
        t = torch.where(valid, t.clamp_min(clamp), t)
    overlap = valid & (teacher_ids.unsqueeze(-1) == student_top.unsqueeze(-2)).any(-1)
    count = overlap.sum(-1)
    t_safe, s_safe = torch.where(overlap, t, 0.0), torch.where(overlap, s, 0.0)
    contribution = torch.where(overlap, t_safe.exp() * (t_safe - s_safe), 0.0).sum(-1)
    return count, torch.where(count > 0, -contribution / count.clamp_min(1), 0.0)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 6), k=st.integers(1, 9), r=st.integers(1, 9), vocab=st.integers(1, 12),
       empty=st.floats(0.0, 1.0), clamp=st.sampled_from([None, -3.0, -0.5]), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_overlap_matches_all_pairs(n, k, r, vocab, empty, clamp, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    # a small vocabulary makes repeated ids (in T and in S) and ties of many slots the common case
    teacher_ids = torch.randint(-1, vocab + 2, (n, k), generator=g)  # ids outside the vocabulary: members of nothing
    student_top = torch.randint(0, vocab, (n, r), generator=g)
    t = (-3 * torch.rand(n, k, generator=g, dtype=torch.float64)).to(dtype)
    t = t.masked_fill(torch.rand(n, k, generator=g) < empty, float("-inf"))
    s = (-3 * torch.rand(n, k, generator=g, dtype=torch.float64)).to(dtype)
    # membership, slot by slot, against Python sets
    want = [[int(i) in set(student_top[row].tolist()) for i in teacher_ids[row]] for row in range(n)]
    assert is_member(teacher_ids, student_top).tolist() == want  # sort + binary search
    assert is_member(teacher_ids, student_top, vocab).tolist() == want  # vocabulary mask
    count, adv = brute_force_overlap(teacher_ids, student_top, t, s, clamp)
    for vocab_size in (None, vocab):
        res = finish_topk(torch.zeros(n, dtype=dtype), s, t, teacher_ids, student_top, clamp, (n,), vocab_size)
        assert torch.equal(res.overlap_count, count)
        assert torch.equal(res.overlap_token_advantage, adv)  # the same arithmetic: equal to the bit


def test_overlap_leading_dims_and_int32():
    teacher_ids = torch.tensor([[[3, 1, 4], [1, 5, 9]], [[2, 6, 5], [3, 5, 8]]], dtype=torch.int32)
    student_top = torch.tensor([[[4, 3, 0], [9, 9, 1]], [[7, 7, 7], [8, 5, 3]]])
    for vocab_size in (None, 10):
        assert is_member(teacher_ids, student_top, vocab_size).tolist() == [
            [[True, False, True], [True, False, True]], [[False, False, False], [True, True, True]]]


@pytest.mark.parametrize("k", [5, 6])
def test_topk_divergence_overlap_against_all_pairs(k):
    """topk_divergence's overlap (K < V: the student's top-K; K = V: every id, no top-k computed) equals the
    all-pairs reference against the student's own top-K ids, with empty slots and masked rows."""
    from opdistill.ops.topk import topk_divergence

    g = torch.Generator().manual_seed(k)
    z = torch.randn(4, 7, 6, generator=g, dtype=torch.float64)
    t_full = torch.log_softmax(torch.randn(4, 7, 6, generator=g, dtype=torch.float64), -1)
    lp, ids = t_full.topk(k, -1)
    lp[0, :3, -2:] = float("-inf")  # empty slots
    lp[1, 4] = float("-inf")  # a masked row
    res = topk_divergence(z, ids, lp, support="tail", divergence="reverse")
    s = torch.log_softmax(z, -1).gather(-1, ids)
    count, adv = brute_force_overlap(ids, torch.topk(z, k, -1).indices, lp, s, None)
    assert torch.equal(res.overlap_count, count)
    torch.testing.assert_close(res.overlap_token_advantage, adv, rtol=1e-12, atol=1e-12)
    assert int(count.sum()) > 0 and (k < 6 or torch.equal(count, (lp > float("-inf")).sum(-1)))


def _loss_and_teacher(validated: bool):
    ids = torch.tensor([[[1, 1], [0, 2]]])  # a repeated id in the first row
    lp = torch.log(torch.tensor([[[0.3, 0.3], [0.5, 0.2]]]))
    return (DistillationLoss(DistillationConfig(loss_mode="topk", support="tail", topk=2)),
            TeacherTopK(ids, lp, validated=validated))


def test_unvalidated_teacher_duplicates_are_refused():
    loss, teacher = _loss_and_teacher(validated=False)
    mask = torch.ones(1, 2)
    msg = r"^teacher_ids has duplicate ids within a row \(first at position \[0, 0\]\); support='tail' would count"
    with pytest.raises(ValueError, match=msg):
        loss(torch.zeros(1, 2, 4), teacher, mask, GlobalBatch.from_masks([mask]))


def test_validated_teacher_skips_the_teacher_value_checks_but_not_the_student_check():
    loss, teacher = _loss_and_teacher(validated=True)
    mask = torch.ones(1, 2)
    value, _ = loss(torch.zeros(1, 2, 4), teacher, mask, GlobalBatch.from_masks([mask]))  # no duplicate sort: runs
    assert torch.isfinite(value)
    z = torch.zeros(1, 2, 4)
    z[0, 1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"^student_logits is not finite at position \(0, 1\)"):
        loss(z, teacher, mask, GlobalBatch.from_masks([mask]))


def test_validated_must_be_a_bool():
    with pytest.raises(TypeError, match=r"^TeacherTopK.validated must be a bool, got 1$"):
        TeacherTopK(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1), validated=1)
