"""Trainer config: YAML + dotted overrides, unknown keys and bad values refused with the dotted key named."""
import pytest

from opdistill import DistillationConfig
from opdistill.train.run.config import ConfigError, TrainerConfig, apply_overrides, load_config

BASE = {"model": {"student": "s", "teacher": "t"}, "loss": {"topk": 4}}  # top-k mode needs K


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: {student: s, teacher: t}\nloss: {topk: 4}\ntrain: {steps: 5}\noptim: {lr: 1e-3}\n")
    cfg = load_config(f, ["train.steps=7", "rollout.temperature=0.7", "loss.divergence=reverse", "optim.grad_clip=null"])
    assert isinstance(cfg, TrainerConfig)
    assert cfg.train.steps == 7 and cfg.rollout.temperature == 0.7 and cfg.optim.lr == 1e-3  # "1e-3" read as a float
    assert cfg.optim.grad_clip is None
    assert isinstance(cfg.loss, DistillationConfig) and cfg.loss.divergence == "reverse"


@pytest.mark.parametrize("override, key", [
    (["trian.steps=3"], "trian"),
    (["train.stpes=3"], "train.stpes"),
    (["rollout.temprature=1"], "rollout.temprature"),
])
def test_unknown_key_is_an_error_naming_it(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(base=BASE, overrides=override)


def test_unknown_loss_key_is_an_error():
    with pytest.raises(ConfigError, match=r"^loss\.topkk: unknown key \(known keys of loss: \['loss_mode', "):
        load_config(base=BASE, overrides=["loss.topkk=3"])


@pytest.mark.parametrize("override, key, what", [
    ("rollout.temperature=-1", "rollout.temperature", "> 0"),
    ("rollout.n=0", "rollout.n", ">= 1"),
    ("rollout.top_p=1.5", "rollout.top_p", r"\(0, 1\]"),
    ("train.steps=abc", "train.steps", "integer"),
    ("train.steps=2.5", "train.steps", "integer"),
    ("train.method=sft", "train.method", "on_policy"),
    ("optim.lr=0", "optim.lr", "> 0"),
    ("optim.schedule=linear", "optim.schedule", "cosine"),
    ("train.bf16=yes please", "train.bf16", "true or false"),
    ("model.dtype=float8", "model.dtype", "float32"),
    ("data.task=sudoku", "data.task", "carry_add"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last", ">= 1"),
])
def test_bad_values_name_the_key(override, key, what):
    with pytest.raises(ConfigError) as e:
        load_config(base=BASE, overrides=[override])
    msg = str(e.value)
    assert msg.startswith(key + ":"), msg
    assert __import__("re").search(what, msg), msg


def test_bad_loss_value_is_reported_under_loss():
    with pytest.raises(ConfigError, match=r"^loss\.loss_mode: must be one of \['topk', 'sampled', 'full'\], got 'nope'$"):
        load_config(base=BASE, overrides=["loss.loss_mode=nope"])


def test_cross_field_rules():
    with pytest.raises(ConfigError, match=r"^rollout\.n:.*rl"):
        load_config(base=BASE, overrides=["train.method=rl", "rollout.n=1"])
    with pytest.raises(ConfigError, match=r"^model\.teacher:"):
        load_config(base={"model": {"student": "s"}})
    with pytest.raises(ConfigError, match=r"^model\.student:"):
        load_config(base={"model": {"teacher": "t"}})
    with pytest.raises(ConfigError, match=r"^loss\.use_policy_gradient:.*off_policy"):
        load_config(base=BASE, overrides=["train.method=off_policy", "loss.use_policy_gradient=true",
                                          "loss.divergence=reverse"])
    with pytest.raises(ConfigError, match=r"^data\.answer_field:.*verifier"):
        load_config(base={"model": {"student": "s"}}, overrides=["train.method=rl", "data.task=dataset", "data.path=x"])
    cfg = load_config(base={"model": {"student": "s"}}, overrides=["train.method=rl"])  # rl needs no teacher
    assert cfg.train.method == "rl"


def test_override_syntax():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        apply_overrides({}, ["train.steps"])
    assert apply_overrides({"a": {"b": 1}}, ["a.c=[1, 2]"]) == {"a": {"b": 1, "c": [1, 2]}}


def test_yaml_top_level_must_be_mapping(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(f)


def test_shipped_configs_load():
    from pathlib import Path

    paths = sorted(Path("configs").glob("*.yaml"))
    assert len(paths) >= 5
    for path in paths:
        cfg = load_config(path)
        assert cfg.model.student and (cfg.model.teacher or cfg.teachers), path


def test_shipped_example_data_builds():
    from opdistill.data import PromptSource
    from opdistill.train.loop import build_task

    cfg = load_config("configs/chat_dataset_heldout.yaml")
    task = build_task(cfg)
    held = PromptSource(task, 0).held_out(cfg.eval.num_prompts)
    assert len(held) == 10 and all(p.prompt[0]["role"] == "system" for p in held)
    train = {p.prompt[-1]["content"] for p in task.rows}
    assert len(train) == 30 and not train & {p.prompt[-1]["content"] for p in held}
    assert all(task.score(p, f"so #### {p.answer}") == 1.0 for p in held)
    rg = load_config("configs/reasoning_gym_task.yaml")
    assert build_task(rg).held_out(2, 0)
    lora = load_config("configs/smollm2_lora_self_distill.yaml")
    assert lora.model.teacher == "self" and lora.model.lora.r == 16 and lora.train.gradient_checkpointing


def test_teacher_cache_only_for_off_policy(tmp_path):
    base = {**BASE, "data": {"teacher_cache": str(tmp_path / "c.safetensors")}}
    with pytest.raises(ConfigError, match="data.teacher_cache"):
        load_config(base=base)
    assert load_config(base=base, overrides=["train.method=off_policy"]).data.teacher_cache.endswith("c.safetensors")
