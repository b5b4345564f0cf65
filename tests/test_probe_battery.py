"""Regressions found by the independent probe battery of issue 9 (docs/reliability.md, "Probe battery").

Each test is one finding: an input an adversary or a careless user can give that ran code, lost or mixed a run,
trained on NaN, or failed late / with a traceback. Every one now fails early, with one line naming what to fix.
"""
import json
import re

import pytest
import torch
import yaml

from opdistill import DistillationConfig, DistillationLoss, GlobalBatch, TeacherSampled
from opdistill.cli import main
from opdistill.data import CARRY_ADD_CHARS, DatasetTask, make_task
from opdistill.errors import ConfigError, DataError, ModelError
from opdistill.loss.distillation import policy_gradient_loss
from opdistill.models import build_tiny_llama, char_tokenizer
from opdistill.train.disk.checkpoint import CheckpointError, load_weights
from opdistill.train.run.config import load_config
from opdistill.train.disk.preflight import check_against_models, check_finite_weights
from opdistill.train.disk.rundir import RunError, RunWarning, check_checkpoint_config, open_run_dir
from tests.trainer_helpers import tiny_config_dict

BASE = {"model": {"student": "s", "teacher": "t"}, "loss": {"topk": 4}}


def _err(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]


# -- config and CLI: one line, exit 2 -------------------------------------------------------------------------------
def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe\x00run_dir: x\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(e.value) == f"{bad}: not a UTF-8 text file (invalid start byte at byte 0); a config is YAML text"


def test_an_empty_run_dir_is_refused_not_the_current_folder():
    with pytest.raises(ConfigError) as e:
        load_config(base=BASE, overrides=["run_dir=''"])
    assert str(e.value) == "run_dir: expected a folder path (an empty one would be the current folder), got ''"


def test_a_learning_rate_beyond_float32_is_refused_at_load():
    # torch casts lr to the float32 weights: 1e300 was a RuntimeError traceback in the first optimizer step
    with pytest.raises(ConfigError) as e:
        load_config(base=BASE, overrides=["optim.lr=1e300"])
    assert str(e.value) == "optim.lr: expected a number > 0 that float32 weights can hold (at most 3.403e+38), got 1e+300"
    assert load_config(base=BASE, overrides=["optim.lr=1e30"]).optim.lr == 1e30  # still a finite float32


def test_task_arguments_checked_by_assert_are_config_errors():
    pytest.importorskip("reasoning_gym", reason="gsm_symbolic needs reasoning_gym")
    with pytest.raises(ConfigError) as e:
        make_task("gsm_symbolic", size=-1)
    assert str(e.value) == "data.task_args: size must be positive"


def test_overrides_after_a_flag_are_overrides(monkeypatch):
    import opdistill.cli as cli

    seen = []
    monkeypatch.setattr(cli, "_cmd_train", seen.append)
    assert main(["train", "--config", "c.yaml", "a.b=1", "--resume", "c.d=2", "e=3"]) == 0
    assert seen[0].overrides == ["a.b=1", "c.d=2", "e=3"] and seen[0].resume


def test_unknown_flags_are_still_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", "c.yaml", "--bogus"])
    assert e.value.code == 2
    assert _err(capsys)[-1] == "opdistill: error: unrecognized arguments: --bogus"


@pytest.mark.parametrize("argv, line", [
    (["demo", "--seeds", "a,b"], "opdistill demo: error: argument --seeds: expected comma-separated integers >= 0 "
                                 "(e.g. 0,1), got 'a,b'"),
    (["demo", "--eval-every", "0"], "opdistill demo: error: argument --eval-every: expected an integer >= 1, got 0"),
    (["demo", "--threads", "x"], "opdistill demo: error: argument --threads: expected an integer >= 1, got 'x'"),
    (["score", "--config", "c", "--out", "o", "--num-prompts", "-3"],
     "opdistill score: error: argument --num-prompts: expected an integer >= 1, got -3"),
])
def test_cli_number_arguments_are_checked_by_the_parser(argv, line, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert _err(capsys)[-1] == line


def test_plot_of_a_folder_without_metrics_is_one_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert _err(capsys) == [f"opdistill plot: run error: {tmp_path / 'nope' / 'metrics.jsonl'}: no metrics to plot (is "
                            f"{tmp_path / 'nope'} a run directory that has logged a step?)"]


def test_score_out_that_is_a_folder_is_refused_before_any_work(tmp_path, capsys):
    assert main(["score", "--config", str(tmp_path / "never-read.yaml"), "--out", str(tmp_path)]) == 2
    assert _err(capsys) == [f"opdistill score: config error: --out: {tmp_path} is a folder; give the cache file's path "
                            f"(e.g. {tmp_path}/cache.safetensors)"]
    assert not list(tmp_path.parent.glob(f".{tmp_path.name}.tmp-*"))


# -- data -------------------------------------------------------------------------------------------------------------
def test_a_data_path_of_another_kind_is_a_data_error_and_runs_no_script(tmp_path):
    txt = tmp_path / "prompts.txt"
    txt.write_text("hello\n")
    with pytest.raises(DataError, match=re.escape(f"data.path: cannot load dataset '{txt}' split 'train': not a local "
                                                  "file or dataset folder, and the hub could not provide it (")):
        DatasetTask(str(txt))
    folder = tmp_path / "ds"  # a dataset folder with a loading script: never imported
    folder.mkdir()
    marker = tmp_path / "ran"
    (folder / "ds.py").write_text(f"open({str(marker)!r}, 'w')\n")
    with pytest.raises(DataError, match=re.escape(f"data.path: cannot load dataset '{folder}' split 'train': ")):
        DatasetTask(str(folder))
    assert not marker.exists()


# -- run directories: no nested run, no foreign checkpoint -------------------------------------------------------------
def _fake_run(path):
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("run_dir: x\n")
    (path / "checkpoints" / "step_00000002").mkdir(parents=True)
    (path / "tensorboard").mkdir()


@pytest.mark.parametrize("inner", ["checkpoints", "checkpoints/step_00000002/sub", "tensorboard/x"])
def test_a_run_dir_inside_another_runs_entries_is_refused(tmp_path, inner):
    outer = tmp_path / "outer"
    _fake_run(outer)
    entry = outer / inner.split("/")[0]
    with pytest.raises(RunError) as e:
        open_run_dir(outer / inner)
    assert str(e.value) == (f"run_dir {outer / inner} is inside {entry}, which belongs to the run in {outer} (its "
                            f"rotation or --overwrite would delete this run); choose a run_dir outside it")
    open_run_dir(outer / "beside").close()  # a sub-folder that is not one of the run's entries is fine


def test_overwrite_never_deletes_a_run_living_inside_the_old_one(tmp_path):
    outer = tmp_path / "outer"
    _fake_run(outer)
    inner = outer / "checkpoints" / "older_run"
    inner.mkdir()
    (inner / ".lock").touch()
    (inner / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunError) as e:
        open_run_dir(outer, overwrite=True)
    assert str(e.value) == (f"--overwrite would delete {outer / 'checkpoints'}, which holds another run ({inner}); move "
                            f"that run out first, or choose another run_dir")
    assert (inner / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_checkpoint_written_with_another_config_is_refused(tmp_path):
    ckpt = tmp_path / "step_00000003"
    ckpt.mkdir()
    saved = {"run_dir": "a", "train": {"seed": 7, "steps": 3}, "optim": {"lr": 0.05, "betas": [0.9, 0.99]}}
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 3, "config": saved}))
    now = {"run_dir": "b", "train": {"seed": 0, "steps": 9}, "optim": {"lr": 0.01, "betas": (0.9, 0.99)}}
    with pytest.raises(RunError) as e:
        check_checkpoint_config(ckpt, now)
    assert str(e.value) == (f"--resume: checkpoint {ckpt} was written with another config than this run's: optim.lr "
                            f"0.05 -> 0.01, train.seed 7 -> 0 (the checkpoint was copied from another run, or "
                            f"config.yaml was edited by hand); resume with the config it was written with, or start "
                            f"another run_dir")
    # resumable keys may differ (run_dir, train.steps), a tuple equals its JSON list, and a state without a config
    # (written before this check) is accepted
    check_checkpoint_config(ckpt, {**now, "train": {"seed": 7, "steps": 9}, "optim": saved["optim"]})
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 3}))
    check_checkpoint_config(ckpt, now)


def test_resume_after_a_hand_edit_of_config_yaml_is_refused(tmp_path, capsys):
    cfg = tiny_config_dict(tmp_path, steps=1, eval={"num_prompts": 0}, checkpoint={"every": 1})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(path)]) == 0
    run = tmp_path / "run"
    state = json.loads((run / "checkpoints" / "step_00000001" / "trainer_state.json").read_text())
    assert state["config"]["optim"]["lr"] == 0.01  # every checkpoint records its config
    stored = yaml.safe_load((run / "config.yaml").read_text())
    stored["optim"]["lr"] = 0.5  # the trainer would have kept training at 0.01 while config.yaml says 0.5
    (run / "config.yaml").write_text(yaml.safe_dump(stored))
    capsys.readouterr()
    assert main(["train", "--config", str(path), "--resume", "optim.lr=0.5", "train.steps=2"]) == 2
    assert _err(capsys)[-1] == (
        f"opdistill train: run error: --resume: checkpoint {run / 'checkpoints' / 'step_00000001'} was written with "
        f"another config than this run's: optim.lr 0.01 -> 0.5 (the checkpoint was copied from another run, or "
        f"config.yaml was edited by hand); resume with the config it was written with, or start another run_dir")
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]


# -- models and checkpoints -------------------------------------------------------------------------------------------
def _tiny(hidden=16, seed=0):
    tok = char_tokenizer(CARRY_ADD_CHARS)
    return tok, build_tiny_llama(tok, hidden_size=hidden, num_layers=1, num_heads=2, seed=seed)


def test_nan_weights_are_refused_when_the_models_load():
    cfg = load_config(base=BASE)
    tok, student = _tiny()
    _, teacher = _tiny(seed=1)
    check_finite_weights(cfg, student, teacher)
    with torch.no_grad():
        teacher.model.embed_tokens.weight[5, 0] = float("nan")  # one row: NaN only where that token appears
    with pytest.raises(ModelError) as e:
        check_finite_weights(cfg, student, teacher)
    assert str(e.value) == ("model.teacher: weight model.embed_tokens.weight of 't' holds NaN/inf (a corrupt or "
                            "diverged model folder); use an intact model folder")
    with torch.no_grad():
        student.model.norm.weight[0] = float("inf")
    with pytest.raises(ModelError, match=r"^model\.student: weight model\.norm\.weight of 's' holds NaN/inf"):
        check_finite_weights(cfg, student, None)


def test_eval_of_a_nan_student_folder_exits_2(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    cfg = tiny_config_dict(tmp_path, steps=1, eval={"num_prompts": 2})
    w = load_file(str(tmp_path / "student" / "model.safetensors"))
    w["model.norm.weight"][0] = float("nan")
    save_file(w, str(tmp_path / "student" / "model.safetensors"), metadata={"format": "pt"})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["eval", "--config", str(path)]) == 2
    assert _err(capsys)[-1] == (f"opdistill eval: model error: model.student: weight model.norm.weight of "
                                f"'{tmp_path / 'student'}' holds NaN/inf (a corrupt or diverged model folder); use an "
                                f"intact model folder")


def test_eval_checks_k_and_lengths_against_the_models_before_generating(tmp_path, capsys):
    cfg = tiny_config_dict(tmp_path, steps=1, eval={"num_prompts": 2})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    vocab = len(char_tokenizer(CARRY_ADD_CHARS))  # the rows of the models' lm_head
    assert main(["eval", "--config", str(path), "eval.topk=100000"]) == 2
    assert _err(capsys)[-1] == f"opdistill eval: config error: eval.topk: expected at most the vocabulary size " \
                               f"{vocab}, got 100000"
    # was a generation of 100000 tokens with a model of far fewer positions
    assert main(["eval", "--config", str(path), "rollout.max_new_tokens=100000"]) == 2
    assert re.fullmatch(r"opdistill eval: config error: rollout\.max_new_tokens: expected at most \d+ \(the model has "
                        r"\d+ positions and a prompt needs at least one\), got 100000", _err(capsys)[-1])


def test_fp16_weights_are_fine_outside_training():
    cfg = load_config(base=BASE, overrides=["model.dtype=float16", "eval.num_prompts=2"])
    tok, student = _tiny()
    student.half()
    with pytest.raises(ConfigError, match=r"^model\.dtype: float16 training is refused"):
        check_against_models(cfg, tok, student, None, make_task("carry_add"))
    check_against_models(cfg, tok, student, None, make_task("carry_add"), training=False)


def test_checkpoint_weights_of_another_shape_are_a_checkpoint_error(tmp_path):
    _, small = _tiny(hidden=16)
    _, big = _tiny(hidden=32)
    big.save_pretrained(tmp_path, safe_serialization=True)  # same tensor names, other shapes
    with pytest.warns(RunWarning, match="no manifest.json; loading model.safetensors unverified"):
        with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path / 'model.safetensors'}: does not match the "
                                                            f"model (size mismatch for ")):
            load_weights(tmp_path, small)


# -- library: the policy-gradient inputs ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["logprobs", "old_logprobs", "advantages"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_policy_gradient_refuses_non_finite_inputs_at_valid_positions(name, poison):
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    x = {"logprobs": -torch.rand(2, 3, generator=g, dtype=torch.float64).requires_grad_(True),
         "old_logprobs": -torch.rand(2, 3, generator=g, dtype=torch.float64),
         "advantages": torch.randn(2, 3, generator=g, dtype=torch.float64)}
    batch = GlobalBatch.from_masks([mask])
    clean, _ = policy_gradient_loss(x["logprobs"], x["old_logprobs"], x["advantages"], mask, batch)
    (clean_grad,) = torch.autograd.grad(clean, x["logprobs"])
    masked = {k: v.detach().clone() for k, v in x.items()}
    masked[name][1, 2] = poison  # a masked position: same loss and gradient, bit for bit
    masked["logprobs"].requires_grad_(True)
    loss, _ = policy_gradient_loss(masked["logprobs"], masked["old_logprobs"], masked["advantages"], mask, batch)
    (grad,) = torch.autograd.grad(loss, masked["logprobs"])
    assert torch.equal(loss, clean) and torch.equal(grad, clean_grad)
    with torch.no_grad():
        masked[name][1, 0] = poison  # a valid position: refused, naming the input and the position
    with pytest.raises(ValueError) as e:
        policy_gradient_loss(masked["logprobs"], masked["old_logprobs"], masked["advantages"], mask, batch)
    assert str(e.value) == (f"{name} is not finite at position (1, 0) (NaN or inf) where the policy-gradient loss "
                            f"reads it; mask that position or fix the {name} that produced it")


def test_distillation_loss_refuses_a_nan_task_advantage():
    mask = torch.ones(2, 3, dtype=torch.bool)
    s = -torch.rand(2, 3, dtype=torch.float64)
    adv = torch.zeros(2, 3, dtype=torch.float64)
    adv[0, 2] = float("nan")  # was a NaN loss and a NaN gradient with no error
    loss_fn = DistillationLoss(DistillationConfig(loss_mode="sampled", use_task_rewards=True))
    z = torch.randn(2, 3, 5, dtype=torch.float64)  # the student's logits (the loss reads its sampled tokens' log-probs)
    with pytest.raises(ValueError, match=re.escape("advantages is not finite at position (0, 2) (NaN or inf)")):
        loss_fn(z, TeacherSampled(s - 0.1), mask, GlobalBatch.from_masks([mask]), old_logprobs=s,
                task_advantages=adv, sampled_ids=torch.zeros(2, 3, dtype=torch.long))


def test_a_duplicate_yaml_key_is_refused_not_silently_replaced(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("model: {student: s, teacher: t}\nloss: {topk: 4}\noptim:\n  lr: 0.1\noptim:\n  lr: 0.2\n")
    with pytest.raises(ConfigError) as e:
        load_config(dup)
    assert str(e.value) == f"{dup}:5: not valid YAML (duplicate key 'optim'; only the last one would count)"
    inner = tmp_path / "inner.yaml"
    inner.write_text("model: {student: s, teacher: t}\nloss: {topk: 4}\noptim: {lr: 0.1, warmup_steps: 2, lr: 0.2}\n")
    with pytest.raises(ConfigError) as e:
        load_config(inner)
    assert str(e.value) == f"{inner}:3: not valid YAML (duplicate key 'lr'; only the last one would count)"
    assert load_config(base=BASE, overrides=["data.task_args={min_digits: 1, max_digits: 2}"]).data.task_args == {
        "min_digits": 1, "max_digits": 2}
