"""The one lm_head reader (``opdistill.fused.read_lm_head``) on tiny random transformers models: the teacher's
chunked scores equal log_softmax of the model's own ``.logits`` (its head transform included), for plain heads,
logit multipliers (Cohere, Granite, Falcon-H1) and soft-capping (Gemma 2); unknown transforms are refused by the
teacher and the fused path alike."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from opdistill.fused import causal_lm_hidden, read_lm_head  # noqa: E402
from opdistill.teachers import score_teacher  # noqa: E402

TINY = dict(vocab_size=131, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64)
MAMBA = dict(mamba_d_ssm=16, mamba_n_heads=2, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8)
# (model class, config class, head-related keys, expected LMHead.logit_scale, expected softcap)
MODELS = [
    ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=True), 1.0, None),
    ("CohereForCausalLM", "CohereConfig", dict(logit_scale=0.25), 0.25, None),
    ("GraniteForCausalLM", "GraniteConfig", dict(logits_scaling=4.0), 0.25, None),
    ("FalconH1ForCausalLM", "FalconH1Config", dict(lm_head_multiplier=3.0, **MAMBA), 3.0, None),
    ("Gemma2ForCausalLM", "Gemma2Config", dict(head_dim=8, final_logit_softcapping=2.0), 1.0, 2.0),
]


def tiny(cls_name, cfg_name, **extra):
    assert hasattr(transformers, cls_name), f"{cls_name} missing from transformers {transformers.__version__}"
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(getattr(transformers, cfg_name)(**TINY, **extra)).float().eval()
    with torch.no_grad():  # a visible head transform: logits of order 10, so scale and soft-cap matter
        model.get_output_embeddings().weight.mul_(20.0)
    return model


@pytest.mark.parametrize("cls_name,cfg_name,extra,scale,cap", MODELS, ids=[m[0] for m in MODELS])
def test_teacher_scores_equal_the_model_logits(cls_name, cfg_name, extra, scale, cap):
    model = tiny(cls_name, cfg_name, **extra)
    head = read_lm_head(model)
    assert (head.logit_scale, head.softcap) == (scale, cap)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 131, (3, 9), generator=g)
    am = torch.ones_like(x)
    targets = torch.randint(0, 131, (3, 9), generator=g)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=x, attention_mask=am).logits.double(), -1)  # [3, 9, V]
    sc = score_teacher(model, x, am, k=5, sampled_ids=targets, row_chunk=2, token_chunk=4)
    ref_v, _ = lp.topk(5, -1)
    torch.testing.assert_close(sc.topk.logprobs.double(), ref_v, atol=1e-4, rtol=0)
    torch.testing.assert_close(lp.gather(-1, sc.topk.ids), ref_v, atol=1e-4, rtol=0)
    torch.testing.assert_close(sc.sampled_logprobs.double(), lp.gather(-1, targets[..., None])[..., 0],
                               atol=1e-4, rtol=0)


def test_unknown_head_transform_refused_by_teacher_and_fused_path():
    model = tiny("LlamaForCausalLM", "LlamaConfig")
    model.config.output_logits_multiplier = 2.0
    msg = r"LlamaConfig.output_logits_multiplier=2.0 looks like a transform of the lm_head output"
    with pytest.raises(ValueError, match=msg):
        score_teacher(model, torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long), k=2)
    with pytest.raises(ValueError, match=msg):
        causal_lm_hidden(model, torch.zeros(1, 3, dtype=torch.long))


def test_unknown_teacher_head_refused_at_load():
    from opdistill.models import char_tokenizer, check_compatible

    tok = char_tokenizer("abcdefgh")
    student, teacher = tiny("LlamaForCausalLM", "LlamaConfig"), tiny("LlamaForCausalLM", "LlamaConfig")
    teacher.config.output_logits_multiplier = 2.0
    with pytest.raises(ValueError, match=r"LlamaConfig.output_logits_multiplier=2.0 looks like a transform"):
        check_compatible(tok, tok, student, teacher)


def test_bad_multiplier_and_wrapped_head_refused():
    model = tiny("GraniteForCausalLM", "GraniteConfig", logits_scaling=4.0)
    model.config.logits_scaling = 0.0
    with pytest.raises(ValueError, match=r"^GraniteConfig.logits_scaling=0.0: expected a finite positive number$"):
        read_lm_head(model)
    model = tiny("LlamaForCausalLM", "LlamaConfig")

    class Wrapped(torch.nn.Module):  # e.g. a LoRA wrapper: has a weight, computes more than h @ W^T
        def __init__(self, inner):
            super().__init__()
            self.inner, self.weight = inner, inner.weight

        def forward(self, h):
            return self.inner(h) * 2.0

    model.lm_head = Wrapped(model.lm_head)
    with pytest.raises(TypeError, match="LlamaForCausalLM's lm_head is a Wrapped, not a plain linear layer"):
        read_lm_head(model)
