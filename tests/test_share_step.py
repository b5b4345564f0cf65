"""opdistill/train/steps/share.py: one step's data packed by a tensor-parallel leader and unpacked by its peers
(issue 24).

Round trips are exact (every tensor equal, dtypes kept), the teacher's output head is never sent (the peer takes
its own teacher member's), and a head no member holds is refused. The broadcast itself runs in the world-2 launch
of tests/test_trainer_distributed.py (the tp runs: the peers generate nothing and never ask the teacher).
"""
import pytest
import torch

from opdistill.fused.hf import LMHead
from opdistill.loss.signals import GroupedScores, TeacherScores, TeacherTopK
from opdistill.train.steps.share import pack_step, share_step, unpack_step
from opdistill.train.run.distributed import DistContext
from opdistill.train.steps.step import StepData


class _Member:
    def __init__(self, H=4, V=7, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.head = LMHead(torch.randn(V, H, generator=g), None, 1.0, None, "stub")

    def named(self):  # a single teacher: itself
        return {"": self}


class _Routed:
    def __init__(self):
        self.members = {"a": _Member(seed=1), "b": _Member(seed=2)}

    def named(self):  # a composite: its members by name
        return dict(self.members)


def _rows(B=3, S=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 7, (B, S), generator=g)
    am = torch.ones(B, S, dtype=torch.long)
    am[0, :1] = 0
    resp = torch.zeros(B, S, dtype=torch.long)
    resp[:, 2:] = 1
    return ids, am, resp, g


def _equal(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a, b)


def _assert_scores_equal(a: TeacherScores, b: TeacherScores):
    assert (a.topk is None) == (b.topk is None)
    if a.topk is not None:
        assert _equal(a.topk.ids, b.topk.ids) and _equal(a.topk.logprobs, b.topk.logprobs)
        assert a.topk.validated == b.topk.validated
    for name in ("sampled_logprobs", "requested_logprobs", "hidden", "requested_ids"):
        assert _equal(getattr(a, name), getattr(b, name)), name


def test_rows_scores_and_metrics_round_trip_exactly():
    ids, am, resp, g = _rows()
    lp, top = torch.randn(3, 5, 7, generator=g).log_softmax(-1).topk(4, dim=-1)
    scores = TeacherScores(TeacherTopK(top, lp, validated=True), torch.randn(3, 5, generator=g),
                           torch.randn(3, 5, 2, generator=g, dtype=torch.float64), None, None,
                           torch.randint(0, 7, (3, 5, 2), generator=g))
    data = StepData(ids, am, resp, scores=scores, sampler_logprobs=torch.randn(3, 5, generator=g),
                    advantages=torch.tensor([0.5, -0.5, 0.0]), groups={"teacher/b/": torch.tensor([0, 2]),
                                                                      "teacher/a/": torch.tensor([1])},
                    requested_ids=torch.randint(0, 7, (3, 5, 2), generator=g))
    local = {"sums": [1.0, 3.0, 9.0], "time/rollout_s": 0.25, "time/teacher_s": 0.125}
    got, got_local = unpack_step(pack_step(data, local))
    for name in ("input_ids", "attention_mask", "response_mask", "sampler_logprobs", "advantages", "requested_ids"):
        assert _equal(getattr(got, name), getattr(data, name)), name
    assert list(got.groups) == list(data.groups)  # in their order: it cuts the micro-batches
    assert all(torch.equal(got.groups[k], data.groups[k]) for k in data.groups)
    _assert_scores_equal(got.scores, data.scores)
    assert got_local == local


def test_nothing_scored_and_no_optional_field():
    ids, am, resp, _ = _rows()
    got, local = unpack_step(pack_step(StepData(ids, am, resp), {"sums": [0.0, 3.0, 0.0]}))
    assert got.scores is None and got.groups is None and got.sampler_logprobs is None and got.advantages is None
    assert torch.equal(got.input_ids, ids) and local == {"sums": [0.0, 3.0, 0.0]}


def test_hidden_states_take_the_peers_own_head_of_the_member_that_scored_them():
    """Two routed teachers with different heads send hidden states (GroupedScores): each part arrives with the head
    of the same member on the receiving rank, which is not the sender's object (the head is never sent)."""
    ids, am, resp, g = _rows(B=4)
    sender, receiver = _Routed(), _Routed()
    parts = ((torch.tensor([0, 3]), TeacherScores(hidden=torch.randn(2, 5, 4, generator=g),
                                                  head=sender.members["b"].head)),
             (torch.tensor([1, 2]), TeacherScores(hidden=torch.randn(2, 5, 4, generator=g),
                                                  head=sender.members["a"].head)))
    data = StepData(ids, am, resp, scores=GroupedScores(parts))
    got, _ = unpack_step(pack_step(data, {"sums": [0.0, 4.0, 12.0]}, sender), receiver)
    assert isinstance(got.scores, GroupedScores) and len(got.scores.parts) == 2
    for (rows, part), (want_rows, want) in zip(got.scores.parts, parts):
        assert torch.equal(rows, want_rows)
        _assert_scores_equal(part, want)
    assert got.scores.parts[0][1].head is receiver.members["b"].head
    assert got.scores.parts[1][1].head is receiver.members["a"].head
    # one teacher (no members): its own head
    one_sender, one_receiver = _Member(seed=3), _Member(seed=3)
    data = StepData(ids, am, resp, scores=TeacherScores(hidden=torch.randn(4, 5, 4, generator=g),
                                                        head=one_sender.head))
    got, _ = unpack_step(pack_step(data, {"sums": [0.0, 4.0, 12.0]}, one_sender), one_receiver)
    assert got.scores.head is one_receiver.head and torch.equal(got.scores.hidden, data.scores.hidden)


def test_a_head_no_member_holds_is_refused():
    ids, am, resp, g = _rows()
    data = StepData(ids, am, resp, scores=TeacherScores(hidden=torch.zeros(3, 5, 4), head=_Member(seed=9).head))
    with pytest.raises(ValueError, match="^share_step: the teacher's scores carry an output head that no member of "
                                         "the teacher holds$"):
        pack_step(data, {"sums": [0.0, 3.0, 9.0]}, _Routed())


def test_without_tensor_parallelism_nothing_is_sent():
    ids, am, resp, _ = _rows()
    data, local = StepData(ids, am, resp), {"sums": [0.0, 3.0, 9.0]}
    got = share_step(DistContext(), data, local)
    assert got[0] is data and got[1] is local
