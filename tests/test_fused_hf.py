"""causal_lm_hidden + the fused ops on tiny random transformers models == the unfused ops on the model's own logits
(values and parameter gradients), tied and untied heads, logit multipliers folded exactly, soft-capping refused."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from opdistill.fused import StudentHidden, causal_lm_hidden, check_lm_head, fused_topk_divergence  # noqa: E402
from opdistill.ops.topk import topk_divergence  # noqa: E402
from tests.conftest import random_teacher_topk, seeded  # noqa: E402

TINY = dict(vocab_size=131, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64)


def tiny(cls_name, cfg_name, **extra):
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**TINY, **extra)
    return getattr(transformers, cls_name)(cfg).float().train()


def teacher(n_tokens, V, K=5, seed=0):
    return random_teacher_topk(seeded(seed), n_tokens, V, K, scale=2)


MODELS = [
    ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=False)),
    ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=True)),
    ("CohereForCausalLM", "CohereConfig", dict(logit_scale=0.25)),
    ("GraniteForCausalLM", "GraniteConfig", dict(logits_scaling=4.0)),
    ("FalconH1ForCausalLM", "FalconH1Config", dict(lm_head_multiplier=3.0, mamba_d_ssm=16, mamba_n_heads=2,
                                                   mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8)),
]


@pytest.mark.parametrize("cls_name,cfg_name,extra", MODELS)
def test_fused_matches_model_logits(cls_name, cfg_name, extra):
    assert hasattr(transformers, cls_name), f"{cls_name} missing from transformers {transformers.__version__}"
    model = tiny(cls_name, cfg_name, **extra)
    x = torch.randint(0, 131, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    check_lm_head(model, x, mask)
    ids, lp = teacher(14, 131)
    ids, lp = ids.reshape(2, 7, 5), lp.reshape(2, 7, 5)
    kw = dict(support="tail", divergence="forward", temperature=0.8)
    params = [p for p in model.parameters() if p.requires_grad]

    ref = topk_divergence(model(input_ids=x, attention_mask=mask).logits, ids, lp, **kw)
    g_ref = torch.autograd.grad(ref.loss.sum(), params, allow_unused=True)
    sh = causal_lm_hidden(model, x, attention_mask=mask)
    assert isinstance(sh, StudentHidden) and sh.hidden.shape == (2, 7, 16)
    if extra.get("tie_word_embeddings"):
        assert sh.weight is model.get_input_embeddings().weight
    kw["temperature"] = sh.temperature(0.8)
    res = fused_topk_divergence(sh.hidden, sh.weight, ids, lp, bias=sh.bias, chunk_size=5, **kw)
    g = torch.autograd.grad(res.loss.sum(), params, allow_unused=True)
    torch.testing.assert_close(res.loss, ref.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.overlap_count, ref.overlap_count)
    for a, b in zip(g_ref, g):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_softcapping_refused():
    model = tiny("Gemma2ForCausalLM", "Gemma2Config", head_dim=8, final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0: the model soft-caps its logits"):
        causal_lm_hidden(model, torch.zeros(1, 3, dtype=torch.long))


def test_unknown_head_transform_refused():
    model = tiny("LlamaForCausalLM", "LlamaConfig")
    model.config.output_logits_multiplier = 2.0
    with pytest.raises(ValueError, match="output_logits_multiplier=2.0 looks like a transform of the lm_head output"):
        causal_lm_hidden(model, torch.zeros(1, 3, dtype=torch.long))


def test_check_lm_head_catches_a_mismatch():
    model = tiny("LlamaForCausalLM", "LlamaConfig")
    model.lm_head.forward = lambda h: torch.nn.functional.linear(h, model.lm_head.weight) * 2.0  # an unknown scale
    with pytest.raises(ValueError, match="differs from the model's logits"):
        check_lm_head(model, torch.zeros(1, 3, dtype=torch.long))


def test_student_hidden_validation():
    with pytest.raises(ValueError, match="StudentHidden.weight has H=4 columns but StudentHidden.hidden has H=3"):
        StudentHidden(torch.randn(2, 3), torch.randn(5, 4))
    with pytest.raises(ValueError, match="StudentHidden.logit_scale must be a finite number > 0"):
        StudentHidden(torch.randn(2, 3), torch.randn(5, 3), logit_scale=0.0)
