"""benchmarks/bench_trainer.py: deterministic assets, the timing arithmetic, and one opdistill child end to end
(so a change to the trainer's loop that the benchmark's hooks no longer match fails here, not in the lead's run)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_trainer", ROOT / "benchmarks" / "bench_trainer.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_summary_arithmetic():
    clock = bench.PhaseClock()
    # warm-up step ends at t=10; two timed steps of 0.5 s and 1.5 s
    clock.current = {"sampling": 9.0}
    clock.end_step(10.0, 512)
    clock.current = {"sampling": 0.2, "teacher": 0.1, "loss": 0.05}
    clock.end_step(10.5, 512)
    clock.current = {"sampling": 1.0, "optimizer": 0.25}
    clock.end_step(12.0, 256)
    s = bench._summarize(clock, 1, clock.steps[0]["t_end"])
    assert s["steps"] == 2 and s["wall_s"] == 2.0 and s["steps_per_s"] == 1.0
    assert s["tokens_per_s"] == 384.0 and s["tokens_per_step"] == 384.0
    assert s["ms/sampling"] == pytest.approx(600.0) and s["ms/teacher"] == pytest.approx(50.0)
    assert s["ms/loss"] == pytest.approx(25.0) and s["ms/optimizer"] == pytest.approx(125.0)
    assert s["ms/backward"] == 0.0
    # the rest of the loop: (0.5 - 0.35) and (1.5 - 1.25) seconds
    assert s["ms/loop_rest"] == pytest.approx(200.0)
    rows = [dict(s, label="a", kind="opdistill", peak_rss_mib=100.0), dict(s, label="t", kind="trl",
                                                                           peak_rss_mib=90.0, tokens_per_s=192.0)]
    table = bench.print_table(rows)
    assert "| a (n=1) | 1.00 | 384 | 2.00x | 100 |" in table and "| t (n=1) | 1.00 | 192 | 1.00x | 90 |" in table


def test_assets_are_deterministic(tmp_path):
    a = bench.build_assets(tmp_path / "a")
    b = bench.build_assets(tmp_path / "b")
    assert a == b
    prompts = [json.loads(x)["prompt"] for x in (tmp_path / "a" / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 512 and all(len(p) == 8 and p[3] == "+" and p[7] == "=" for p in prompts)
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "a" / "student")
    assert len(tok) == 128 and tok.decode(tok("123+456=")["input_ids"]) == "123+456="
    t, s = AutoConfig.from_pretrained(tmp_path / "a" / "teacher"), AutoConfig.from_pretrained(tmp_path / "a" / "student")
    assert (t.model_type, t.num_hidden_layers, t.hidden_size, t.vocab_size) == ("qwen2", 4, 128, 128)
    assert (s.model_type, s.num_hidden_layers, s.hidden_size, s.vocab_size) == ("qwen2", 2, 64, 128)


def test_opdistill_child_runs_the_real_trainer(tmp_path):
    bench.build_assets(tmp_path / "assets")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_trainer.py"), "--child", "opdistill",
                           "--assets", str(tmp_path / "assets"), "--run-dir", str(tmp_path / "run"), "--steps", "1",
                           "--warmup", "1", "--k", "8"], env=env, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    r = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert r["steps"] == 1 and r["tokens_per_step"] == 16 * 32  # 16 prompts x 32 forced completion tokens
    for phase in bench.PHASES[:-1]:
        assert r[f"ms/{phase}"] > 0, phase  # every hook saw its phase
    # the timing hooks are off while sampling: the rollouts took the sampler's lean decode step, as in training
    assert r["sampler_lean_decode"] is True
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2] and rows[-1]["train/generated_tokens"] == 512
