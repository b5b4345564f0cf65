"""GlobalBatch, aggregate (five modes, both layouts), the alignment helpers, MetricSums."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from opdistill import AGG_MODES, GlobalBatch, MetricSums, aggregate, pack, response_logits_slice, shift_for_next_token, unpack
from tests import reference as ref


def ragged_mask(lengths, width, start=None):
    start = start or [0] * len(lengths)
    m = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, (a, n) in enumerate(zip(start, lengths)):
        m[i, a : a + n] = True
    return m


def test_global_batch_counts_tokens_and_nonempty_sequences():
    m1 = ragged_mask([3, 0, 2], 5)
    m2 = ragged_mask([4], 6)
    gb = GlobalBatch.from_masks([m1, m2])
    assert (gb.num_tokens, gb.num_seqs, gb.dp_size) == (9, 3, 1)
    packed, cu = pack(m1.long(), torch.tensor([5, 5, 5]))
    gb2 = GlobalBatch.from_masks([packed], cu_seqlens=[cu])
    assert (gb2.num_tokens, gb2.num_seqs) == (5, 2)


def test_global_batch_is_frozen_and_validated():
    gb = GlobalBatch(10, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        gb.num_tokens = 3
    with pytest.raises(ValueError, match="num_seqs"):
        GlobalBatch(1, 2)
    with pytest.raises(ValueError, match="dp_size"):
        GlobalBatch(1, 1, dp_size=0)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        GlobalBatch(1, 1, loss_scale_factor=-1.0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_padded_and_packed_match_reference(mode):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 0, 3, 7, 1]
    mask = ragged_mask(lengths, 8, start=[1, 0, 2, 0, 4])
    loss = torch.randn(5, 8, generator=g, dtype=torch.float64)
    loss[~mask] = float("nan")  # garbage in masked slots must never leak
    lsf = 8.0 if mode == "seq-mean-token-sum-norm" else None
    gb = GlobalBatch.from_masks([mask], loss_scale_factor=lsf)
    expect = ref.aggregate_reference(torch.nan_to_num(loss), mask, mode, loss_scale_factor=lsf)
    got = aggregate(loss, mask, mode, gb)
    torch.testing.assert_close(got, expect, rtol=1e-12, atol=1e-14)
    pl, cu = pack(loss, torch.tensor([8] * 5))
    pm, _ = pack(mask, torch.tensor([8] * 5))
    torch.testing.assert_close(aggregate(pl, pm, mode, gb, cu_seqlens=cu), expect, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_empty_global_batch_gives_zero_not_nan(mode):
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss = torch.full((2, 3), float("nan"), requires_grad=True)
    gb = GlobalBatch.from_masks([mask], loss_scale_factor=4.0)
    out = aggregate(loss, mask, mode, gb)
    out.backward()
    assert out.item() == 0.0 and torch.equal(loss.grad, torch.zeros(2, 3))


def test_micro_batch_size_does_not_change_the_loss():
    """verl issue 7200 in one test: mb=1 vs mb=8 of the same step give the same summed loss."""
    g = torch.Generator().manual_seed(1)
    mask = ragged_mask([3, 6, 1, 4, 2, 5, 7, 8], 8)
    loss = torch.rand(8, 8, generator=g, dtype=torch.float64)
    for mode in AGG_MODES:
        lsf = 8.0 if mode.endswith("norm") else None
        gb = GlobalBatch.from_masks([mask[i : i + 1] for i in range(8)], loss_scale_factor=lsf)
        one_by_one = sum(aggregate(loss[i : i + 1], mask[i : i + 1], mode, gb) for i in range(8))
        all_at_once = aggregate(loss, mask, mode, gb)
        torch.testing.assert_close(one_by_one, all_at_once, rtol=1e-12, atol=1e-14)


def test_shift_for_next_token_padded():
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    resp = torch.tensor([[0, 0, 1, 1, 1]])  # prompt = 2 tokens, response = 3 tokens
    targets, tmask = shift_for_next_token(ids, resp)
    assert targets.tolist() == [[11, 12, 13, 14, 0]]
    assert tmask.tolist() == [[False, True, True, True, False]]
    # the rows selected by the mask are exactly the rows response_logits_slice names
    rows = response_logits_slice(prompt_len=2, response_len=3)
    assert torch.arange(5)[rows].tolist() == tmask[0].nonzero()[:, 0].tolist()
    # and those rows of a causal LM's logits score the response tokens: logits[t] predicts ids[t+1]
    V = 20
    logits = torch.full((1, 5, V), -9.0)
    for t in range(4):
        logits[0, t, ids[0, t + 1]] = 9.0
    lp = F.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    assert bool((lp[tmask] > -1e-3).all())


def test_shift_for_next_token_packed_does_not_cross_sequences():
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    resp = torch.tensor([0, 1, 1, 0, 1, 1, 1])
    cu = torch.tensor([0, 3, 7])
    targets, tmask = shift_for_next_token(ids, resp, cu)
    # position 2 is the end of sequence 0: it must not predict token 4 of sequence 1
    assert tmask.tolist() == [True, True, False, True, True, True, False]
    assert targets.tolist() == [2, 3, 0, 5, 6, 7, 0]


def test_response_logits_slice_bad_input():
    with pytest.raises(ValueError, match="prompt_len"):
        response_logits_slice(0, 3)


def test_pack_unpack_roundtrip():
    x = torch.arange(24.0).reshape(3, 4, 2)
    lengths = torch.tensor([2, 0, 4])
    packed, cu = pack(x, lengths)
    assert cu.tolist() == [0, 2, 2, 6] and packed.shape == (6, 2)
    back = unpack(packed, cu, 4)
    keep = torch.arange(4)[None] < lengths[:, None]
    assert torch.equal(back[keep], x[keep]) and torch.equal(back[~keep], torch.zeros_like(back[~keep]))


def test_metric_sums_exact_global_means():
    a, b = MetricSums(), MetricSums()
    a.add_mean("m", torch.tensor([1.0, 2.0, 3.0]))  # mean of micro-batch means would be (2 + 10) / 2 = 6
    b.add_mean("m", torch.tensor([10.0]))
    a.add_extrema("m", torch.tensor([1.0, 2.0, 3.0]))
    b.add_extrema("m", torch.tensor([10.0]))
    a.add_ratio("r", 3, 8)
    b.add_ratio("r", 1, 2)
    a.add_sum("s", 0.25)
    b.add_sum("s", 0.5)
    a.add_mean("empty", torch.tensor([5.0]), torch.tensor([0]))
    out = a.merge(b).reduce()
    assert out == {"m": 4.0, "m_min": 1.0, "m_max": 10.0, "r": 0.4, "s": 0.75, "empty": 0.0}


def test_metric_sums_mask_must_match():
    m = MetricSums()
    with pytest.raises(ValueError, match="mask"):
        m.add_mean("x", torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError, match="only 0 and 1"):
        m.add_mean("x", torch.ones(3), torch.tensor([0.5, 1, 1]))
    with pytest.raises(TypeError, match="MetricSums"):
        m.merge({"x": 1})
