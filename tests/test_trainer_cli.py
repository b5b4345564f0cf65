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
                 "optim.lr=5e-3", "log.tensorboard=true", "--json"]) == 0
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

    assert main(["eval", "--config", str(cfg_file), f"run_dir={run}", "--checkpoint", "latest", "--json"]) == 0
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


def test_train_and_eval_print_their_files_and_a_table_for_a_person(cfg_file, tmp_path, capsys):
    run = tmp_path / "human"
    assert main(["train", "--config", str(cfg_file), f"run_dir={run}", "checkpoint.every=1",
                 "log.tensorboard=true"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:4] == [f"run folder:  {run}",
                       f"checkpoints: {run / 'checkpoints'} (newest: step_00000002)",
                       f"metrics:     {run / 'metrics.jsonl'} (opdistill plot {run})",
                       f"tensorboard: {run / 'tensorboard'} (tensorboard --logdir {run / 'tensorboard'})"]
    assert out[5].startswith("2 steps, ") and out[5].endswith(" s of training")
    assert out[7] == "held-out evaluation at step 2 (2 evaluations in metrics.jsonl):"
    assert out[9:11] == ["| metric | value | 95% interval |", "|---|---|---|"]
    final = [r for r in read_metrics(run) if "eval/greedy_acc" in r][-1]
    row = next(line for line in out if line.startswith("| eval/teacher_kl |"))
    assert row == (f"| eval/teacher_kl | {final['eval/teacher_kl']:.4g} | [{final['eval/teacher_kl_lo']:.4g}, "
                   f"{final['eval/teacher_kl_hi']:.4g}] |")
    assert not any("_lo |" in line or "_hi |" in line or line.lstrip().startswith("{") for line in out)

    assert main(["eval", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"checkpoint: {run / 'checkpoints' / 'step_00000002'}; 4 held-out problems, 1 sample(s) each; "
                      f"intervals: bootstrap over problems (1000 resamples)")
    assert out[2:4] == ["| metric | value | 95% interval |", "|---|---|---|"]
    assert any(line.startswith("| eval/greedy_acc | ") for line in out)


def test_every_option_says_what_it_does_and_its_default():
    import argparse

    from opdistill.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) == {"train", "demo", "eval", "compare", "plot", "score", "export", "serve-teacher", "check"}
    missing = []
    for name, sub in commands.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            positional, required = not action.option_strings, action.required
            if not action.help or not (positional or required or "default" in action.help):
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}: {action.help!r}")
    assert missing == []


def test_version_and_bare_opdistill_prints_the_help(capsys):
    from opdistill import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"opdistill {__version__}\n"
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: opdistill") and "check" in out and "train" in out


def test_check_prints_the_resolved_config_and_refuses_without_loading(cfg_file, tmp_path, capsys, monkeypatch):
    from opdistill.train import assemble

    def no_loading(*a, **k):
        raise AssertionError("check loaded a model")

    monkeypatch.setattr(assemble, "load_models", no_loading)
    run = tmp_path / "checked"
    for argv in (["check", "--config", str(cfg_file), f"run_dir={run}"],
                 ["train", "--config", str(cfg_file), f"run_dir={run}", "--dry-run"]):
        assert main(argv) == 0
        out, err = capsys.readouterr()
        resolved = yaml.safe_load(out)
        assert resolved["run_dir"] == str(run) and resolved["optim"]["weight_decay"] is not None  # defaults filled
        assert err == (f"# ok: the config, the model folders' metadata, the data (4 held-out problems) and the teacher "
                       f"settings pass every check made before loading; run_dir {run} is free\n")
        assert not run.exists()  # nothing written
    # a refusal that needs the model folders' metadata (the vocabulary), exit 2 in one line
    assert main(["check", "--config", str(cfg_file), "loss.topk=999"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("opdistill check: config error: loss.topk") and "999" in err[0]


@pytest.mark.parametrize("args, line", [
    (["distributed.tp_size=2", "model.lora={r: 4}"],
     "model.lora: not supported with distributed.tp_size > 1 (the adapters would sit on a vocabulary-sharded "
     "lm_head); set distributed.tp_size=1"),
    (["distributed.tp_size=2", "train.fused_lm_head=true"],
     "train.fused_lm_head: not supported with distributed.tp_size > 1 (the vocab-parallel lm_head already keeps "
     "only [tokens, V/tp] logits); set train.fused_lm_head=false"),
    (["--nproc", "3", "distributed.strategy=fsdp2", "train.fused_lm_head=true"],
     "train.fused_lm_head: not supported with distributed.strategy=fsdp2 (the fused loss reads the whole lm_head); "
     "use distributed.strategy=ddp or train.fused_lm_head=false"),
    (["distributed.tp_size=2", "distributed.strategy=ddp"],
     "distributed.tp_size=2: needs distributed.strategy=fsdp2 (DDP over a tensor-parallel student is not wired in "
     "this version), got ddp"),
    (["model.lora={target_modules: [q_proj, lm_head]}"],
     "model.lora.target_modules: lm_head is frozen in opdistill (the teacher signal and the fused path read its "
     "weight); remove it, got ['q_proj', 'lm_head']"),
    (["--nproc", "3", "distributed.tp_size=2"],
     "distributed.tp_size: expected a divisor of the world size 3 (the ranks form a (data-parallel, "
     "tensor-parallel) mesh of 3 / tp_size x tp_size), got 2"),
])
def test_check_refuses_what_torchrun_or_the_model_load_would(cfg_file, capsys, monkeypatch, args, line):
    """What the config alone decides is refused by ``opdistill check`` (and ``--nproc N``: as N processes would
    run it) in one line, exit 2, with the message the run itself would give later, before any model loads."""
    from opdistill.train import assemble

    monkeypatch.setattr(assemble, "load_models", lambda *a, **k: pytest.fail("check loaded a model"))
    assert main(["check", "--config", str(cfg_file), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"opdistill check: config error: {line}"]


def test_check_as_several_processes(cfg_file, capsys):
    assert main(["check", "--config", str(cfg_file), "--nproc", "3", "data.prompts_per_step=3"]) == 0
    assert "pass every check made before loading as 3 processes (torchrun --nproc-per-node 3)" in \
        capsys.readouterr().err
    assert main(["check", "--config", str(cfg_file), "--nproc", "2", "data.prompts_per_step=3"]) == 2
    assert capsys.readouterr().err.strip() == ("opdistill check: config error: data.prompts_per_step: expected a "
                                               "multiple of the data-parallel size 2 (each rank samples an equal "
                                               "share of the step's prompts), got 3")


def test_warnings_of_other_libraries_are_labelled_as_theirs():
    import transformers

    from opdistill.cli import _one_line_warning
    from opdistill.errors import RunWarning

    theirs = _one_line_warning("`foo` is deprecated", FutureWarning, transformers.__file__, 1)
    assert theirs == "opdistill: warning from transformers (FutureWarning): `foo` is deprecated\n"
    ours = _one_line_warning("skipped", RunWarning, transformers.__file__, 1)
    assert ours == "opdistill: warning: skipped\n"
    import opdistill.train.loop as loop

    assert _one_line_warning("x", UserWarning, loop.__file__, 1) == "opdistill: warning: x\n"
    import subprocess

    assert _one_line_warning("y", ResourceWarning, subprocess.__file__, 1) == \
        "opdistill: warning from python (ResourceWarning): y\n"
