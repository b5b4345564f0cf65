"""What one step's collection computes: the sampler's log-probs only when a loss or metric reads them (the same
samples either way), and teacher scores at K = V in vocabulary order feeding the same loss as sorted ones."""
import pytest
import torch

import opdistill.engines.rollout as rollout_mod
from opdistill import DistillationLoss, TeacherScores, TeacherTopK
from opdistill.data import PromptSource
from opdistill.teachers import LocalTeacher
from opdistill.train import loop
from opdistill.train.steps.collect import Collector, needs_sampler_logprobs
from opdistill.train.run.config import load_config
from opdistill.train.steps.step import train_step
from tests.trainer_helpers import tiny_config_dict


def _collect(tmp_path, monkeypatch, overrides=()):
    cfg = load_config(base=tiny_config_dict(tmp_path), overrides=list(overrides))
    tok, student, teacher = loop.load_models(cfg)
    asked = []
    real = rollout_mod.sample

    def spy(*a, **k):
        asked.append(k["want_logprobs"])
        return real(*a, **k)

    monkeypatch.setattr(rollout_mod, "sample", spy)
    source = PromptSource(loop.build_task(cfg), cfg.train.seed, cfg.data.eval_seed)
    collect = Collector(cfg, tok=tok, task=loop.build_task(cfg), source=source, teacher=LocalTeacher(teacher),
                        writer=teacher)
    data, _ = collect(2, student)
    monkeypatch.undo()
    return cfg, (tok, student, teacher), data, asked


@pytest.mark.parametrize("overrides,needed", [
    ((), False),
    (("loss.use_task_rewards=true",), True),
    (("loss.loss_mode=sampled", "loss.estimator=k1", "loss.use_policy_gradient=true"), True),
    (("train.method=rl", "loss.loss_mode=sampled"), True),
])
def test_sampler_logprobs_only_when_read(tmp_path, monkeypatch, overrides, needed):
    cfg, _, data, asked = _collect(tmp_path, monkeypatch, overrides)
    assert asked == [needed] and needs_sampler_logprobs(cfg) is needed
    assert (data.sampler_logprobs is not None) is needed
    _, _, ref, _ = _collect(tmp_path, monkeypatch, ("loss.use_task_rewards=true",))  # log-probs on
    assert torch.equal(data.input_ids, ref.input_ids) and torch.equal(data.response_mask, ref.response_mask)
    if needed:
        assert torch.equal(data.sampler_logprobs, ref.sampler_logprobs) and bool(data.sampler_logprobs.any())


def test_whole_vocabulary_step_equals_the_sorted_slots_step(tmp_path, monkeypatch):
    """K = V: the scorer's vocabulary-order slots and the same pairs sorted by log-prob give the same step (loss,
    metrics, gradients up to fp32 rounding)."""
    cfg0 = load_config(base=tiny_config_dict(tmp_path))
    V = len(loop.load_models(cfg0)[0])
    cfg, (tok, student, teacher), data, _ = _collect(tmp_path, monkeypatch, (f"loss.topk={V}",))
    t = data.scores.topk
    m = data.response_mask.bool()
    assert t.ids.shape[-1] == V and torch.equal(t.ids[:, :-1][m[:, 1:]][0], torch.arange(V))
    lp, order = t.logprobs.sort(-1, descending=True)
    sorted_t = TeacherTopK(t.ids.gather(-1, order), lp, validated=True)
    out, grads = [], []
    for topk in (t, sorted_t):
        model = loop.load_models(cfg)[1]
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        data.scores = TeacherScores(topk, data.scores.sampled_logprobs)
        out.append(train_step(model, opt, data, loss_fn=DistillationLoss(cfg.loss),
                              micro_batch_tokens=cfg.train.micro_batch_tokens, grad_clip=None))
        grads.append([p.grad.clone() for p in model.parameters()])
    assert out[0].keys() == out[1].keys()
    for key in out[0]:
        assert out[0][key] == pytest.approx(out[1][key], rel=1e-5, abs=1e-6), key
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_scoring_and_training_forwards_build_no_kv_cache(tmp_path, monkeypatch):
    """The teacher's scoring forward and the student's training forward are single forwards: they pass
    ``use_cache=False`` (``no_cache_kwargs``), so transformers builds no KV cache to throw away; same outputs."""
    from opdistill.fused import backbone_of, no_cache_kwargs
    from opdistill.teachers import score_teacher

    cfg, (tok, student, teacher), data, _ = _collect(tmp_path, monkeypatch)
    assert no_cache_kwargs(student) == {"use_cache": False} and no_cache_kwargs(torch.nn.Linear(2, 2)) == {}

    class Wrapped(torch.nn.Module):  # a DDP-style wrapper: looked through
        def __init__(self, m):
            super().__init__()
            self.module = m

    assert no_cache_kwargs(Wrapped(student)) == {"use_cache": False}
    caches = []
    hooks = [backbone_of(teacher).register_forward_hook(lambda m, a, out: caches.append(("teacher", out.past_key_values))),
             student.register_forward_hook(lambda m, a, out: caches.append(("student", out.past_key_values)))]
    try:
        scores = score_teacher(teacher, data.input_ids, data.attention_mask, k=4)
        train_step(student, torch.optim.SGD(student.parameters(), lr=0.0), data,
                   loss_fn=DistillationLoss(cfg.loss), micro_batch_tokens=cfg.train.micro_batch_tokens, grad_clip=None)
    finally:
        for h in hooks:
            h.remove()
    assert [who for who, _ in caches] == ["teacher"] + ["student"] * (len(caches) - 1) and len(caches) >= 2
    assert all(c is None for _, c in caches)
    with torch.no_grad():  # the same scores as the model's own (cache-building) forward
        lp = torch.log_softmax(teacher(input_ids=data.input_ids, attention_mask=data.attention_mask).logits, -1)
    torch.testing.assert_close(scores.topk.logprobs, lp.topk(4, -1).values, atol=1e-5, rtol=0)
