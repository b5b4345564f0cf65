"""Loud on bad input (SPEC 1, promise 3): the exact exception type and a message naming the argument."""

import math

import pytest
import torch

from opdistill import (
    DistillationConfig,
    DistillationLoss,
    GlobalBatch,
    TeacherSampled,
    TeacherTopK,
    aggregate,
    generalized_jsd,
    sampled_token_kl,
    shift_for_next_token,
    token_logprobs,
    topk_divergence,
)


def good(V=10, K=3, lead=(2, 3)):
    z = torch.randn(*lead, V)
    ids = torch.stack([torch.randperm(V)[:K] for _ in range(math.prod(lead))]).reshape(*lead, K)
    lp = torch.log_softmax(torch.randn(*lead, V), -1).gather(-1, ids)
    return z, ids, lp


TOPK_CASES = [
    # (description, mutate(z, ids, lp) -> (z, ids, lp, kwargs), exception, message regex)
    ("K = 0", lambda z, i, l: (z, i[..., :0], l[..., :0], {}), ValueError, r"teacher_ids.*K >= 1"),
    ("K > V", lambda z, i, l: (z[..., :2], i.clamp_max(1), l, {}), ValueError, r"K=3.*V=2"),
    ("id >= V", lambda z, i, l: (z, i.index_fill(-1, torch.tensor([0]), 10), l, {}), ValueError, r"teacher_ids must lie in \[0, 10\)"),
    ("id < 0", lambda z, i, l: (z, i - 20, l, {}), ValueError, r"teacher_ids must lie in"),
    ("float ids", lambda z, i, l: (z, i.float(), l, {}), TypeError, r"teacher_ids must be an integer tensor"),
    ("int logits", lambda z, i, l: (z.long(), i, l, {}), TypeError, r"student_logits must be a floating-point"),
    ("NaN teacher", lambda z, i, l: (z, i, l.index_fill(-1, torch.tensor([1]), float("nan")), {}), ValueError, r"teacher_logprobs contains NaN"),
    ("+inf teacher", lambda z, i, l: (z, i, l.index_fill(-1, torch.tensor([1]), float("inf")), {}), ValueError, r"teacher_logprobs contains \+inf"),
    ("positive teacher", lambda z, i, l: (z, i, l + 3.0, {}), ValueError, r"teacher_logprobs must be log-probabilities"),
    ("mass > 1", lambda z, i, l: (z, i, torch.full_like(l, math.log(0.5)), {}), ValueError, r"teacher mass .* <= 1"),
    ("shape mismatch ids", lambda z, i, l: (z, i[:1], l[:1], {}), ValueError, r"teacher_ids must have shape"),
    ("shape mismatch logprobs", lambda z, i, l: (z, i, l[..., :2], {}), ValueError, r"teacher_logprobs must have the shape of teacher_ids"),
    ("duplicates tail", lambda z, i, l: (z, i[..., :1].expand_as(i).contiguous(), l - 2, {"support": "tail"}), ValueError, r"duplicate ids"),
    ("duplicates renorm", lambda z, i, l: (z, i[..., :1].expand_as(i).contiguous(), l - 2, {"support": "renormalized"}), ValueError, r"duplicate ids"),
    ("unknown support", lambda z, i, l: (z, i, l, {"support": "full"}), ValueError, r"support must be one of"),
    ("unknown divergence", lambda z, i, l: (z, i, l, {"divergence": "kl"}), ValueError, r"divergence must be one of"),
    ("truncated reverse", lambda z, i, l: (z, i, l, {"divergence": "reverse"}), ValueError, r"support='truncated' only supports"),
    ("beta > 1", lambda z, i, l: (z, i, l, {"support": "tail", "divergence": "jsd", "beta": 1.5}), ValueError, r"beta must be"),
    ("temperature 0", lambda z, i, l: (z, i, l, {"temperature": 0.0}), ValueError, r"temperature must be"),
    ("clamp on tail", lambda z, i, l: (z, i, l, {"support": "tail", "log_prob_min_clamp": -5.0}), ValueError, r"log_prob_min_clamp is only defined"),
    ("clamp nan", lambda z, i, l: (z, i, l, {"log_prob_min_clamp": float("nan")}), ValueError, r"log_prob_min_clamp must be"),
    ("0-d logits", lambda z, i, l: (z[0, 0], i, l, {}), ValueError, r"student_logits must have shape"),
    ("list logits", lambda z, i, l: (z.tolist(), i, l, {}), TypeError, r"student_logits must be a torch.Tensor"),
]


@pytest.mark.parametrize("desc,mutate,exc,msg", TOPK_CASES, ids=[c[0] for c in TOPK_CASES])
def test_topk_bad_input(desc, mutate, exc, msg):
    z, ids, lp, kw = mutate(*good())
    with pytest.raises(exc, match=msg):
        topk_divergence(z, ids, lp, **kw)


def test_topk_allowed_edge_inputs():
    z, ids, lp = good()
    # -inf is an empty slot; duplicates are allowed on the truncated support (verl) and among empty slots
    lp2 = lp.clone()
    lp2[..., 1:] = float("-inf")
    dup = ids.clone()
    dup[..., 2] = dup[..., 1]
    for support in ("tail", "renormalized", "truncated"):
        assert torch.isfinite(topk_divergence(z, dup, lp2, support=support).loss).all()
    assert torch.isfinite(topk_divergence(z, dup, lp - 1).loss).all()
    # teacher mass a hair above 1 (fp16 rounding) is tolerated
    tiny = torch.zeros(1, 10)
    one = torch.tensor([[0, 1]])
    assert torch.isfinite(topk_divergence(tiny, one, torch.log(torch.tensor([[0.5002, 0.5]])), support="tail").loss).all()


def test_sampled_and_logprob_bad_inputs():
    s = -torch.rand(4)
    with pytest.raises(ValueError, match="estimator must be one of"):
        sampled_token_kl(s, s, "k4")
    with pytest.raises(ValueError, match="student_logprobs and teacher_logprobs must have the same shape"):
        sampled_token_kl(s, s[:3], "k3")
    with pytest.raises(ValueError, match="teacher_logprobs contains -inf"):
        sampled_token_kl(s, torch.tensor([0.0, -1.0, float("-inf"), -2.0]), "k3")
    with pytest.raises(ValueError, match="teacher_logprobs must be log-probabilities"):
        sampled_token_kl(s, s + 5, "k3")
    with pytest.raises(TypeError, match="student_logprobs must be a floating-point"):
        sampled_token_kl(torch.zeros(4, dtype=torch.long), s, "k3")
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 5\)"):
        token_logprobs(torch.randn(3, 5), torch.tensor([0, 5, 1]))
    with pytest.raises(ValueError, match="ids must have the leading shape"):
        token_logprobs(torch.randn(3, 5), torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        token_logprobs(torch.randn(3, 5), torch.tensor([0.0, 1.0, 2.0]))


def test_jsd_bad_inputs():
    with pytest.raises(ValueError, match="student_logits and teacher_logits must have the same shape"):
        generalized_jsd(torch.randn(2, 5), torch.randn(2, 6))
    with pytest.raises(ValueError, match="beta must be"):
        generalized_jsd(torch.randn(2, 5), torch.randn(2, 5), beta=-0.1)


def test_aggregate_bad_inputs():
    loss, mask = torch.randn(2, 3), torch.ones(2, 3)
    gb = GlobalBatch.from_masks([mask])
    with pytest.raises(TypeError, match="batch must be a GlobalBatch"):
        aggregate(loss, mask, "token-mean", None)
    with pytest.raises(ValueError, match="loss_agg_mode must be one of"):
        aggregate(loss, mask, "mean", gb)
    with pytest.raises(ValueError, match="mask must contain only 0 and 1"):
        aggregate(loss, mask * 0.5, "token-mean", gb)
    with pytest.raises(ValueError, match="mask must have the shape of loss"):
        aggregate(loss, mask[:1], "token-mean", gb)
    with pytest.raises(ValueError, match="needs a fixed loss_scale_factor"):
        aggregate(loss, mask, "seq-mean-token-sum-norm", gb)
    with pytest.raises(ValueError, match="batch.num_tokens=2"):
        aggregate(loss, mask, "token-mean", GlobalBatch(2, 1))
    with pytest.raises(ValueError, match="cu_seqlens"):
        aggregate(loss.flatten(), mask.flatten(), "seq-mean-token-mean", GlobalBatch.from_masks([mask]))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        aggregate(loss.flatten(), mask.flatten(), "seq-mean-token-mean", gb, cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="cu_seqlens must have one entry per mask"):
        GlobalBatch.from_masks([mask], cu_seqlens=[])
    with pytest.raises(ValueError, match="response_mask must have the shape of token_ids"):
        shift_for_next_token(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 2))


def test_global_batch_dp_size_must_match_the_group(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    gb = GlobalBatch(10, 2, dp_size=2)
    with pytest.raises(ValueError, match="batch.dp_size=2 disagrees with the group's size 4"):
        aggregate(torch.randn(2, 3), torch.ones(2, 3), "token-mean", gb, group=object())


CONFIG_CASES = [
    (dict(loss_mode="logits"), ValueError, "loss_mode must be one of"),
    (dict(support="tail", divergence="reverse", beta=2.0), ValueError, "beta must be"),
    (dict(support="truncated", divergence="jsd"), ValueError, "unstable"),
    (dict(loss_mode="sampled", estimator="k1"), ValueError, "zero expected gradient"),
    (dict(loss_mode="sampled", estimator="kl"), ValueError, "zero expected gradient"),
    (dict(estimator="k9"), ValueError, "estimator must be one of"),
    (dict(loss_agg_mode="seq-mean-token-sum-norm"), ValueError, "needs a fixed loss_scale_factor"),
    (dict(loss_scale_factor=8.0), ValueError, "loss_scale_factor is only used"),
    (dict(loss_max_clamp=0.0), ValueError, "loss_max_clamp must be"),
    (dict(support="tail", log_prob_min_clamp=-3.0), ValueError, "log_prob_min_clamp is only defined"),
    (dict(topk=0), ValueError, "topk must be"),
    (dict(clip_ratio_low=1.5), ValueError, "clip_ratio_low must be < 1"),
    (dict(clip_ratio_c=0.5), ValueError, "clip_ratio_c must be"),
    (dict(temperature=-1.0), ValueError, "temperature must be"),
    (dict(distillation_coef=float("inf")), ValueError, "distillation_coef must be"),
    (dict(use_policy_gradient="yes"), TypeError, "use_policy_gradient must be a bool"),
]


@pytest.mark.parametrize("kw,exc,msg", CONFIG_CASES, ids=[str(c[0]) for c in CONFIG_CASES])
def test_config_refuses(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        DistillationConfig(**kw)


def test_config_from_dict_refuses_unknown_keys_and_round_trips():
    with pytest.raises(ValueError, match=r"unknown DistillationConfig keys \['topK'\]"):
        DistillationConfig.from_dict({"topK": 8})
    cfg = DistillationConfig(support="renormalized", divergence="jsd", beta=0.2)
    assert DistillationConfig.from_dict(cfg.to_dict()) == cfg


def test_config_warns_on_truncated_policy_gradient(caplog):
    with caplog.at_level("WARNING"):
        DistillationConfig(support="truncated", use_policy_gradient=True)
    assert "wastes the distribution" in caplog.text


def test_distillation_loss_bad_calls():
    z, ids, lp = good()
    mask = torch.ones(2, 3)
    gb = GlobalBatch.from_masks([mask])
    fn = DistillationLoss(DistillationConfig(topk=3))
    with pytest.raises(TypeError, match="batch must be a GlobalBatch"):
        fn(z, TeacherTopK(ids, lp), mask, {"num_tokens": 6})
    with pytest.raises(TypeError, match="needs teacher=TeacherTopK"):
        fn(z, TeacherSampled(lp[..., 0]), mask, gb)
    with pytest.raises(ValueError, match="mask must have shape"):
        fn(z, TeacherTopK(ids, lp), mask[:, :2], gb)
    with pytest.raises(ValueError, match="config.topk=4"):
        DistillationLoss(DistillationConfig(topk=4))(z, TeacherTopK(ids, lp), mask, gb)
    with pytest.raises(ValueError, match="old_logprobs is required"):
        DistillationLoss(DistillationConfig(use_policy_gradient=True))(z, TeacherTopK(ids, lp), mask, gb)
    with pytest.raises(ValueError, match="sampled_ids is required"):
        DistillationLoss(DistillationConfig(use_policy_gradient=True))(z, TeacherTopK(ids, lp), mask, gb,
                                                                       old_logprobs=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="task_advantages is required"):
        DistillationLoss(DistillationConfig(use_task_rewards=True))(z, TeacherTopK(ids, lp), mask, gb,
                                                                    old_logprobs=torch.zeros(2, 3))
    with pytest.raises(TypeError, match="TeacherTopK.ids must be an integer tensor"):
        TeacherTopK(lp, lp)
    with pytest.raises(TypeError, match="config must be a DistillationConfig"):
        DistillationLoss({"loss_mode": "topk"})


def test_full_vocabulary_says_which_keys_it_ignores(caplog):
    # issue 35 item 7: loss_mode full silently ignored loss.topk / support / divergence
    with caplog.at_level("WARNING"):
        DistillationConfig(loss_mode="full", beta=1.0)
    assert caplog.text == ""
    with caplog.at_level("WARNING"):
        DistillationConfig(loss_mode="full", topk=8, divergence="reverse")
    assert ("loss_mode='full' ignores topk=8, divergence='reverse': it takes every token of the vocabulary and beta "
            "chooses the divergence (beta 0.5: 0 = forward KL, 1 = reverse KL, between = generalized JSD)") in caplog.text
