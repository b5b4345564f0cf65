"""Sampler/trainer mismatch: the rollout/logprob_diff metrics and truncated importance sampling (rollout.tis_cap).

The weighted losses are checked against tests/reference.py in float64 (loss and gradient), the metrics against
their definition on the trainer's own forward, and with identical samplers the weight is exactly 1 and the step is
the step without the correction. No vLLM needed: the sampler log-probs are built here.
"""
import pytest
import torch
import torch.nn.functional as F

from opdistill import DistillationConfig, DistillationLoss, GlobalBatch, PolicyGradientLoss, policy_gradient_loss
from opdistill.train.run.config import ConfigError, load_config
from opdistill.train.steps.step import rollout_mismatch, tis_weights, train_step
from tests.reference import distillation_reference, policy_reference
from tests.test_trainer_step import _setup


def _inputs(seed=0, B=3, S=6, V=11, K=4):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, S, V, generator=g, dtype=torch.float64)
    mask = torch.rand(B, S, generator=g) < 0.7
    mask[0, 0] = True
    t_logits = torch.randn(B, S, V, generator=g, dtype=torch.float64)
    t_lp = F.log_softmax(t_logits, -1)
    lp, ids = t_lp.topk(K, dim=-1)
    sampled = torch.randint(0, V, (B, S), generator=g)
    old = F.log_softmax(z + 0.3 * torch.randn(B, S, V, generator=g, dtype=torch.float64), -1).gather(
        -1, sampled[..., None])[..., 0]
    adv = torch.randn(B, S, generator=g, dtype=torch.float64)
    w = 0.2 + 2 * torch.rand(B, S, generator=g, dtype=torch.float64)  # weights well away from 1
    teacher_sampled = t_lp.gather(-1, sampled[..., None])[..., 0]
    return z, mask, ids, lp, sampled, old, adv, w, teacher_sampled


@pytest.mark.parametrize("cfg", [
    dict(loss_mode="topk", support="tail", divergence="forward", topk=4),
    dict(loss_mode="topk", support="tail", divergence="reverse", topk=4, loss_agg_mode="seq-mean-token-mean"),
    dict(loss_mode="topk", support="truncated", topk=4, use_policy_gradient=True),
    dict(loss_mode="sampled", estimator="k3", loss_agg_mode="token-sum"),
    dict(loss_mode="topk", support="tail", divergence="reverse", topk=4, use_task_rewards=True,
         distillation_coef=0.5),
])
def test_weighted_distillation_loss_and_gradient_equal_the_float64_reference(cfg):
    z, mask, ids, lp, sampled, old, adv, w, t_sampled = _inputs()
    dc = DistillationConfig(**cfg)
    batch = GlobalBatch.from_masks([mask])
    teacher_sig = (ids, lp) if dc.loss_mode == "topk" else t_sampled
    zr = z.clone().requires_grad_(True)
    ref, _ = distillation_reference(zr, mask, teacher_sig, sampled_ids=sampled, old_logprobs=old, advantages=adv,
                                    token_weights=w, **cfg)
    (g_ref,) = torch.autograd.grad(ref, zr)
    zo = z.clone().requires_grad_(True)
    from opdistill import TeacherSampled, TeacherTopK
    teacher = TeacherTopK(ids, lp) if dc.loss_mode == "topk" else TeacherSampled(t_sampled)
    loss, _ = DistillationLoss(dc)(zo, teacher, mask, batch, sampled_ids=sampled, old_logprobs=old,
                                   task_advantages=adv, token_weights=w)
    (g,) = torch.autograd.grad(loss, zo)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-13)
    # and the weights matter: the unweighted gradient is a different one
    unweighted, _ = distillation_reference(zr, mask, teacher_sig, sampled_ids=sampled, old_logprobs=old,
                                           advantages=adv, **cfg)
    (g_un,) = torch.autograd.grad(unweighted, zr)
    assert (g_un - g).abs().max() > 1e-3


def test_weighted_policy_gradient_loss_equals_the_float64_reference():
    z, mask, _, _, sampled, old, adv, w, _ = _inputs(seed=1)
    batch = GlobalBatch.from_masks([mask])
    zr = z.clone().requires_grad_(True)
    ref, _ = policy_reference(zr, mask, sampled, old, adv, token_weights=w)
    (g_ref,) = torch.autograd.grad(ref, zr)
    zo = z.clone().requires_grad_(True)
    logp = F.log_softmax(zo, -1).gather(-1, sampled[..., None])[..., 0]
    loss, _ = policy_gradient_loss(logp, old, adv, mask, batch, token_weights=w)
    (g,) = torch.autograd.grad(loss, zo)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-13)


def test_tis_weights_are_the_truncated_detached_ratio():
    train = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64, requires_grad=True)
    sampler = torch.tensor([-1.0, -1.0, -2.0, -3.5], dtype=torch.float64)
    w = tis_weights(train, sampler, cap=2.0)
    expected = torch.tensor([1.0, torch.e ** -1.0, 2.0, torch.e ** 0.5], dtype=torch.float64)  # e^1.5 > 2: capped
    torch.testing.assert_close(w, expected, rtol=1e-15, atol=0)
    assert not w.requires_grad


def test_token_weights_are_checked():
    z, mask, ids, lp, *_ = _inputs()
    from opdistill import TeacherTopK
    batch = GlobalBatch.from_masks([mask])
    fn = DistillationLoss(DistillationConfig(loss_mode="topk", topk=4))
    with pytest.raises(ValueError, match=r"^token_weights must have the shape of mask \(3, 6\), got \(3, 5\)$"):
        fn(z, TeacherTopK(ids, lp), mask, batch, token_weights=torch.ones(3, 5, dtype=torch.float64))
    bad = torch.ones(3, 6, dtype=torch.float64)
    bad[0, 0] = -1.0
    with pytest.raises(ValueError, match=r"^token_weights must be finite and >= 0 where mask is 1$"):
        fn(z, TeacherTopK(ids, lp), mask, batch, token_weights=bad)


def _trainer_logprobs(model, data, temperature=1.0):
    """The trainer's log-probs of every next token (row t = token t+1), from one plain forward of the full rows."""
    with torch.no_grad():
        logits = model(input_ids=data.input_ids, attention_mask=data.attention_mask).logits.double()
    lp = F.log_softmax(logits / temperature, -1)[:, :-1].gather(-1, data.input_ids[:, 1:, None])[..., 0]
    out = torch.zeros(data.input_ids.shape, dtype=torch.float64)
    out[:, :-1] = lp
    resp = torch.zeros_like(data.response_mask, dtype=torch.bool)
    resp[:, :-1] = data.response_mask[:, 1:].bool()
    return torch.where(resp, out, 0.0), resp


def _step(student, data, method, loss_cfg, mismatch):
    model = type(student)(student.config).to(torch.float64)
    model.load_state_dict(student.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = DistillationLoss(loss_cfg) if method != "rl" else PolicyGradientLoss.from_config(loss_cfg)
    m = train_step(model, opt, data, loss_fn=loss_fn, micro_batch_tokens=10**6, grad_clip=None,
                   mismatch=mismatch)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, m


@pytest.mark.parametrize("method, loss", [
    ("on_policy", {"loss_mode": "topk", "support": "tail", "divergence": "reverse", "topk": 4}),
    ("on_policy", {"loss_mode": "topk", "support": "truncated", "topk": 4, "use_policy_gradient": True}),
    ("rl", {}),
])
def test_identical_samplers_give_weight_one_and_the_same_step(method, loss):
    student, data = _setup()
    data.sampler_logprobs, resp = _trainer_logprobs(student.to(torch.float64), data)
    cfg = load_config(base={"model": {"student": "s", "teacher": "t"}, "loss": loss, "train": {"method": method}})
    plain, m_plain = _step(student, data, method, cfg.loss, None)
    tis, m_tis = _step(student, data, method, cfg.loss, dict(temperature=1.0, tis_cap=2.0))
    assert m_tis["rollout/tis_weight_mean"] == pytest.approx(1.0, abs=1e-12)
    assert m_tis["rollout/tis_clipfrac"] == 0.0
    assert m_tis["rollout/logprob_diff_max"] < 1e-12
    for n in plain:
        torch.testing.assert_close(tis[n], plain[n], rtol=1e-12, atol=1e-14, msg=n)
    assert any(not torch.equal(plain[n], p) for n, p in student.named_parameters())  # the step did move


def test_mismatch_metrics_measure_the_sampler_gap_and_tis_changes_the_step():
    student, data = _setup()
    student = student.to(torch.float64)
    train_lp, resp = _trainer_logprobs(student, data, temperature=0.7)
    g = torch.Generator().manual_seed(5)
    gap = torch.where(resp, 0.5 * torch.randn(resp.shape, generator=g, dtype=torch.float64), 0.0)
    data.sampler_logprobs = train_lp - gap  # the sampler is off by `gap` on every response token
    cfg = load_config(base={"model": {"student": "s", "teacher": "t"},
                            "loss": {"loss_mode": "topk", "support": "tail", "divergence": "reverse", "topk": 4}})
    plain, m = _step(student, data, "on_policy", cfg.loss, dict(temperature=0.7, tis_cap=None))
    assert m["rollout/logprob_diff_mean"] == pytest.approx(float(gap.abs()[resp].mean()), rel=1e-9)
    assert m["rollout/logprob_diff_max"] == pytest.approx(float(gap.abs()[resp].max()), rel=1e-9)
    assert "rollout/tis_weight_mean" not in m
    tis, m_tis = _step(student, data, "on_policy", cfg.loss, dict(temperature=0.7, tis_cap=1.5))
    w = gap.exp().clamp(max=1.5)
    assert m_tis["rollout/tis_weight_mean"] == pytest.approx(float(w[resp].mean()), rel=1e-9)
    assert m_tis["rollout/tis_clipfrac"] == pytest.approx(float((gap.exp() > 1.5)[resp].double().mean()), rel=1e-9)
    assert any(not torch.allclose(tis[n], plain[n]) for n in plain)


def test_mismatch_uses_the_step_forward_through_rollout_mismatch():
    """rollout_mismatch on given logits: the metric is |log_softmax(z / T)[y] - sampler| over the mask."""
    z, mask, _, _, sampled, old, *_ = _inputs(seed=2)
    _, _, metrics = rollout_mismatch(z, sampled, mask, old, temperature=0.5, tis_cap=None)
    out = metrics.reduce()
    diff = (F.log_softmax(z / 0.5, -1).gather(-1, sampled[..., None])[..., 0] - old).abs()[mask]
    assert out["rollout/logprob_diff_mean"] == pytest.approx(float(diff.mean()), rel=1e-12)
    assert out["rollout/logprob_diff_max"] == pytest.approx(float(diff.max()), rel=1e-12)


@pytest.mark.parametrize("overrides, message", [
    ({"rollout": {"tis_cap": 0.5}}, "rollout.tis_cap: expected a number >= 1 or null, got 0.5"),
    ({"rollout": {"engine": "sglang"}}, "rollout.engine: expected one of hf/vllm, got 'sglang'"),
    ({"teacher": {"engine": "vllm"}, "train": {"method": "rl"}, "rollout": {"n": 2}},
     "teacher.engine: expected hf with method rl (no teacher), got 'vllm'"),
    ({"rollout": {"engine": "vllm"}, "train": {"method": "off_policy"}},
     "rollout.engine: expected hf with method off_policy (the teacher writes the samples), got 'vllm'"),
    ({"rollout": {"tis_cap": 2.0}, "train": {"method": "off_policy"}},
     "rollout.tis_cap: expected null with method off_policy (teacher-written samples), got 2.0"),
])
def test_engine_config_refusals(overrides, message):
    base = {"model": {"student": "s", "teacher": "t"}, "loss": {"loss_mode": "topk", "topk": 4}}
    for k, v in overrides.items():
        base.setdefault(k, {}).update(v)
    with pytest.raises(ConfigError) as e:
        load_config(base=base)
    assert str(e.value) == message
