"""scripts/gpu_check.py (the one GPU check, issue 11 item 9) and ``train.device``, on a machine without CUDA.

The GPU itself is never needed: the refusal without CUDA (exact message, exit 2), the argument checks, the verdict
logic on crafted run records, and one dry run of the whole script with ``--device cpu`` (the same torchrun launches,
worker and checks, on gloo: two one-process launches of the demo config with tiny overrides).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opdistill.errors import ConfigError
from opdistill.train.run.config import load_config

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

BASE = {"model": {"student": "s", "teacher": "t"}, "loss": {"loss_mode": "topk", "topk": 4}}


def test_without_cuda_the_script_refuses_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    err = capsys.readouterr().err
    assert err == (f"gpu_check: FAIL: no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, "
                   f"built with CUDA {torch.version.cuda}); run this on a machine with a GPU, or use --device cpu "
                   f"for the gloo dry run\n")


@pytest.mark.parametrize("argv, message", [
    (["--steps", "1"], "--steps: expected an int >= 2 (the first step is not timed), got 1"),
    (["--prompts", "0"], "--prompts and --max-new-tokens: expected ints >= 1"),
    (["--rel", "0"], "--rel and --budget-s: expected numbers > 0"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_arguments_exit_2_naming_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"gpu_check: error: {message}"


def _record(**changes):
    rec = {"enabled": True, "world": 1, "backend": "cpu:gloo,cuda:nccl", "student_device": "cuda:0",
           "teacher": "LlamaForCausalLM", "steps": [1, 2, 3], "loss": [0.5, 0.4, 0.3], "grad_norm": [1.0, 0.9, 0.8]}
    return {**rec, **changes}


@pytest.mark.parametrize("changes, why", [
    ({}, None),
    ({"error": "exit 1: boom"}, "exit 1: boom"),
    ({"backend": "gloo"}, "expected the nccl backend, got 'gloo'"),
    ({"student_device": "cpu"}, "expected the student on cuda, got 'cpu'"),
    ({"world": 2}, "expected a torchrun process group of 1 rank, got world=2 enabled=True"),
    ({"teacher": "ShardedTeacher"}, "expected no ShardedTeacher, got a ShardedTeacher"),
    ({"steps": [1, 2]}, "expected one metrics line per step 1..3, got steps [1, 2]"),
    ({"grad_norm": [1.0, math.nan, 0.8]}, "non-finite or zero loss / gradient norm: loss [0.5, 0.4, 0.3], "
                                          "grad_norm [1.0, nan, 0.8]"),
    ({"grad_norm": [1.0, 0.0, 0.8]}, "non-finite or zero loss / gradient norm: loss [0.5, 0.4, 0.3], "
                                     "grad_norm [1.0, 0.0, 0.8]"),
])
def test_the_verdict_on_a_run_record(changes, why):
    args = gpu_check.parse_args(["--steps", "3"])
    assert gpu_check.check_run(_record(**changes), args, backend="nccl", device="cuda", sharded=False) == why


def test_train_device_cuda_without_cuda_is_one_config_error(monkeypatch):
    from opdistill.train.run.placement import run_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as e:
        run_device(load_config(base={**BASE, "train": {"device": "cuda"}}))
    assert str(e.value) == (f"train.device: cuda, but torch sees no CUDA device here (torch.cuda.is_available() is "
                            f"False; torch {torch.__version__}, built with CUDA {torch.version.cuda}); use "
                            f"train.device=cpu or a machine with a GPU")
    assert run_device(load_config(base=BASE)) == torch.device("cpu")


def test_nccl_on_cpu_is_refused_naming_the_backend():
    """Before any process group is made: rank 0 of a (mocked) 2-process torchrun job with train.device cpu."""
    from unittest import mock

    import torch.distributed as dist

    from opdistill.train.run.distributed import init_distributed

    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    cfg = load_config(base={**BASE, "distributed": {"backend": "nccl"}})
    with mock.patch.dict(os.environ, env), mock.patch.object(dist, "is_initialized", return_value=False), \
            mock.patch.object(dist, "init_process_group") as init, pytest.raises(ConfigError) as e:
        init_distributed(cfg)
    init.assert_not_called()
    assert str(e.value) == ("distributed.backend: nccl does not fit train.device=cpu (nccl is for CUDA, gloo for CPU); "
                            "use distributed.backend=auto (docs/distributed.md)")


def test_dry_run_on_cpu_runs_the_scripts_whole_logic(tmp_path):
    """``--device cpu``: the three torchrun launches (replicated teacher, model.teacher_sharded, distributed.decode
    sharded), the worker's records, the verdicts and the summary, on gloo; vllm is skipped when it does not
    import."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--steps", "2", "--prompts", "2",
                        "--max-new-tokens", "8", "--out", str(tmp_path), "--skip-vllm"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and [c["status"] for c in summary["checks"]] == ["PASS", "PASS", "PASS", "SKIP"]
    rep, sh = summary["runs"]["replicated"], summary["runs"]["sharded"]
    assert (rep["backend"], rep["student_device"], rep["world"]) == ("gloo", "cpu", 1)
    assert rep["teacher"] != "ShardedTeacher" and sh["teacher"] == "ShardedTeacher"
    assert rep["steps"] == sh["steps"] == [1, 2]
    assert sh["loss"] == rep["loss"]  # the one-rank sharded teacher scores exactly as the replicated one
    dec = summary["runs"]["decode_sharded"]  # rollouts decoded by the FSDP2 student itself (HF forward, no replica)
    assert dec["steps"] == [1, 2] and dec["loss"] == pytest.approx(rep["loss"], rel=1e-5)
    assert summary["bf16_step_time_s"] == pytest.approx(rep["step_s"][1])
    assert r.stdout.splitlines()[-1].startswith("gpu_check: PASS (cpu: bf16 step time ")
