"""Student/teacher compatibility check and model loading (tiny models built from a config)."""
import pytest
import torch

from opdistill.data import CARRY_ADD_CHARS
from opdistill.errors import ConfigError
from opdistill.models import (IncompatibleModelsError, build_tiny_llama, char_tokenizer, check_compatible, load_model,
                              load_tokenizer, truncate_layers)
from tests.trainer_helpers import make_model_dir


def test_compatible_pair_passes():
    a, b = char_tokenizer(CARRY_ADD_CHARS), char_tokenizer(CARRY_ADD_CHARS)
    check_compatible(a, b, build_tiny_llama(a, hidden_size=16, num_layers=1), build_tiny_llama(b, hidden_size=32))


def test_vocabulary_difference_is_refused_and_described():
    s, t = char_tokenizer(CARRY_ADD_CHARS), char_tokenizer(CARRY_ADD_CHARS[::-1] + "x")
    with pytest.raises(IncompatibleModelsError) as e:
        check_compatible(s, t)
    msg = str(e.value)
    assert "vocabulary differs" in msg and "student has 18 tokens, teacher 19" in msg
    assert "only in teacher: ['x']" in msg and "same token, different id" in msg


def test_chat_template_difference_is_refused():
    s = char_tokenizer(CARRY_ADD_CHARS)
    t = char_tokenizer(CARRY_ADD_CHARS, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(IncompatibleModelsError, match="chat template differs"):
        check_compatible(s, t)


def test_special_token_difference_is_refused():
    s, t = char_tokenizer(CARRY_ADD_CHARS), char_tokenizer(CARRY_ADD_CHARS)
    t.eos_token = "<pad>"
    with pytest.raises(IncompatibleModelsError, match="special token eos_token differs"):
        check_compatible(s, t)


def test_output_width_difference_is_refused():
    s, t = char_tokenizer(CARRY_ADD_CHARS), char_tokenizer(CARRY_ADD_CHARS)
    ms, mt = build_tiny_llama(s, hidden_size=16), build_tiny_llama(t, hidden_size=16)
    mt.resize_token_embeddings(len(t) + 4)
    with pytest.raises(IncompatibleModelsError, match="output vocabulary width differs"):
        check_compatible(s, t, ms, mt)


def test_load_roundtrip_and_trainer_refuses_mismatch(tmp_path):
    from opdistill.train import load_config
    from opdistill.train.loop import load_models

    sdir = make_model_dir(tmp_path / "s", hidden=16)
    tdir = make_model_dir(tmp_path / "t", hidden=32, chars=CARRY_ADD_CHARS + "x")
    m = load_model(sdir)
    assert not m.training and next(m.parameters()).dtype == torch.float32
    assert load_tokenizer(sdir).pad_token_id == 0
    cfg = load_config(base={"model": {"student": sdir, "teacher": tdir}, "loss": {"topk": 4}})
    with pytest.raises(IncompatibleModelsError, match="vocabulary differs"):
        load_models(cfg)


def test_truncate_layers():
    tok = char_tokenizer(CARRY_ADD_CHARS)
    m = build_tiny_llama(tok, hidden_size=16, num_layers=3)
    truncate_layers(m, 1)
    assert len(m.model.layers) == 1 and m.config.num_hidden_layers == 1
    m(torch.tensor([[1, 5, 6]]))
    with pytest.raises(ConfigError, match=r"^model\.student_from_teacher_layers: expected 1\.\.1 \(the layers of this model\), got 2$"):
        truncate_layers(m, 2)
