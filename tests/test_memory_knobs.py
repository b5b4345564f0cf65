"""train.gradient_checkpointing and model.attn_implementation: passed to transformers, same training numbers."""
import json
from pathlib import Path

import pytest

from opdistill.train import load_config, run_training
from opdistill.train.loop import load_models
from tests.trainer_helpers import tiny_config_dict


def _rows(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["distillation/loss"], r["train/grad_norm"]) for r in rows if "distillation/loss" in r]


def test_gradient_checkpointing_is_on_and_changes_no_number(tmp_path):
    out = {}
    for gc in (False, True):
        d = tiny_config_dict(tmp_path, steps=2, train={"gradient_checkpointing": gc}, eval={"num_prompts": 0})
        d["run_dir"] = str(tmp_path / f"gc{gc}")
        cfg = load_config(base=d)
        tok, student, teacher = load_models(cfg)
        run_training(cfg, models=(tok, student, teacher), quiet=True)
        assert student.is_gradient_checkpointing is gc
        out[gc] = _rows(d["run_dir"])
    assert len(out[True]) == 2
    for (s0, l0, g0), (s1, l1, g1) in zip(out[False], out[True]):
        assert s0 == s1 and l0 == pytest.approx(l1, rel=1e-5, abs=1e-7) and g0 == pytest.approx(g1, rel=1e-4)


def test_attn_implementation_is_passed_through(tmp_path):
    d = tiny_config_dict(tmp_path, steps=1)
    tok, student, teacher = load_models(load_config(base=d))
    assert student.config._attn_implementation == "sdpa" and teacher.config._attn_implementation == "sdpa"
    tok, student, teacher = load_models(load_config(base=d, overrides=["model.attn_implementation=eager"]))
    assert student.config._attn_implementation == "eager" and teacher.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match=r"^model\.attn_implementation: expected one of sdpa/eager/"):
        load_config(base=d, overrides=["model.attn_implementation=fast"])
