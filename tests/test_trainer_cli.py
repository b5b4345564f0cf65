"""The CLI: train with overrides, unknown keys, --help on every command, plot, score, eval."""
import json

import pytest
import yaml

from opdistill.cli import main
from opdistill.runs.files import read_metrics
from tests.trainer_helpers import tiny_config_dict


@pytest.fixture
def cfg_file(tmp_path):
    cfg = tiny_config_dict(tmp_path, steps=2, checkpoint={"every": 0})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("cmd", [[], ["train"], ["demo"], ["eval"], ["compare"], ["plot"], ["score"]])
def test_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main(cmd + ["--help"])
    assert e.value.code == 0
    assert "usage: opdistill" in capsys.readouterr().out


def test_train_with_overrides_then_eval_plot_score(cfg_file, tmp_path, capsys):
    run = tmp_path / "run2"
    assert main(["train", "--config", str(cfg_file), "train.steps=3", f"run_dir={run}", "loss.divergence=reverse",
                 "optim.lr=5e-3", "log.tensorboard=true"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 3
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 3]  # eval at 0, steps, final eval
    assert "eval/teacher_kl" in rows[0] and "distillation/loss" in rows[1] and "time/rollout_s" in rows[1]
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["train"]["steps"] == 3 and resolved["loss"]["divergence"] == "reverse"
    assert resolved["optim"]["lr"] == 5e-3
    assert (run / "checkpoints" / "step_00000003" / "model.safetensors").exists()
    # log.tensorboard=true: the same scalars as metrics.jsonl, as TensorBoard events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("distillation/loss")]
    assert scalars == [(r["step"], pytest.approx(r["distillation/loss"], rel=1e-6)) for r in rows[1:4]]
    assert [e.step for e in events.Scalars("eval/teacher_kl")] == [0, 3]

    assert main(["eval", "--config", str(cfg_file), f"run_dir={run}", "--checkpoint", "latest"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert {"eval/greedy_acc", "eval/sampled_acc", "eval/teacher_kl", "eval/overlap_ratio"} <= set(ev["metrics"])

    assert main(["plot", str(run)]) == 0
    png = run / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    cache = tmp_path / "cache.safetensors"
    assert main(["score", "--config", str(cfg_file), "--out", str(cache), "--num-prompts", "3"]) == 0
    from opdistill.teachers import load_cache

    c = load_cache(cache)
    assert c["scores"].topk.ids.shape[-1] == 4 and c["input_ids"].shape[0] == 6  # 3 prompts x n=2

    # off-policy KD straight from the cache: no generation, no teacher forward in the training steps
    kd = tmp_path / "kd"
    assert main(["train", "--config", str(cfg_file), "train.method=off_policy", f"data.teacher_cache={cache}",
                 "data.prompts_per_step=2", "train.steps=2", f"run_dir={kd}", "eval.num_prompts=0"]) == 0
    capsys.readouterr()
    steps = [r for r in read_metrics(kd) if "distillation/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["time/rollout_s"] == 0.0 and r["time/teacher_s"] == 0.0 for r in steps)
    assert [r["train/cache_rows_seen"] for r in steps] == [4.0, 6.0]  # 2 prompts x n=2 per step, 6 rows in all
    assert all(r["distillation/loss"] > 0 for r in steps)


def test_unknown_key_and_bad_value_exit_2_with_message(cfg_file, capsys):
    assert main(["train", "--config", str(cfg_file), "train.stepz=3"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and "train.stepz: unknown key" in err
    assert main(["train", "--config", str(cfg_file), "rollout.temperature=-1"]) == 2
    assert "rollout.temperature: expected a number > 0, got -1" in capsys.readouterr().err
