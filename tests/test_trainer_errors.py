"""User errors fail early, as one line naming the key (or the file and line), and the CLI exits 2 without a traceback.

Config refusals at load (issue 8 item 5, issue 9 item 8), checks against the loaded models before any evaluation,
data-file errors (issue 9 item 9), and the CLI's error policy (`--debug` shows the traceback).
"""
import json
import subprocess
import sys
import warnings

import pytest
import torch
import yaml

from opdistill.cli import main
from opdistill.data import CARRY_ADD_CHARS, CarryAdditionTask, DatasetTask, make_task, render_prompt
from opdistill.errors import ConfigError, DataError, ModelError, UserError
from opdistill.models import build_tiny_llama, char_tokenizer, load_model, load_tokenizer
from opdistill.train.run.config import load_config
from opdistill.train.disk.preflight import check_against_models, check_model_folders
from tests.trainer_helpers import tiny_config_dict

BASE = {"model": {"student": "s", "teacher": "t"}, "loss": {"topk": 4}}


def refused(overrides, base=BASE) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(base=base, overrides=overrides)
    return str(e.value)


# -- refused at load -----------------------------------------------------------------------------------------------
def test_full_loss_mode_needs_a_teacher_that_sends_hidden_states():
    """Issue 22: loss_mode full trains from the teacher's hidden states (it was refused before); the sources that
    cannot send them are refused (tests/test_hidden_payload.py has each message)."""
    assert load_config(base=BASE, overrides=["loss.loss_mode=full"]).loss.loss_mode == "full"
    assert refused(["loss.loss_mode=full", "teacher.engine=vllm"]).startswith(
        "loss.loss_mode: expected topk or sampled with teacher.engine vllm")
    assert load_config(base=BASE, overrides=["train.method=rl", "loss.loss_mode=full"]).train.method == "rl"


def test_topk_mode_needs_k():
    assert refused(["loss.topk=null"]) == (
        "loss.topk: expected an int >= 1 with loss.loss_mode topk (the K of the teacher's top-k, e.g. 8), got None")
    assert refused([], base={"model": {"student": "s", "teacher": "t"}}).startswith("loss.topk: expected an int >= 1")
    assert load_config(base=BASE, overrides=["loss.topk=null", "loss.loss_mode=sampled"]).loss.topk is None
    assert load_config(base={"model": {"student": "s"}}, overrides=["train.method=rl"]).loss.topk is None


@pytest.mark.parametrize("override, message", [
    ("eval.max_new_tokens=-1", "eval.max_new_tokens: expected an integer >= 1 or null, got -1"),
    ("optim.lr=-0.1", "optim.lr: expected a number > 0, got -0.1"),
    ("optim.lr=abc", "optim.lr: expected a number > 0, got 'abc'"),
    ("train.steps=-1", "train.steps: expected an integer >= 0, got -1"),
    ("train.steps=true", "train.steps: expected an integer >= 0, got True"),
    ("train.max_nonfinite_steps=0", "train.max_nonfinite_steps: expected an integer >= 1, got 0"),
    ("train.seed=-1", "train.seed: expected an integer in [0, 4294967295], got -1"),
    ("optim.beta2=1", "optim.beta2: expected a number in [0, 1), got 1"),
    ("rollout.top_p=0", "rollout.top_p: expected a number in (0, 1], got 0"),
    ("rollout.top_k=-1", "rollout.top_k: expected an integer >= 0, got -1"),
    ("rollout.min_new_tokens=-1", "rollout.min_new_tokens: expected an integer >= 0, got -1"),
    ("rollout.min_new_tokens=65", "rollout.min_new_tokens: expected an integer in [0, rollout.max_new_tokens=64], got 65"),
    ("eval.topk=0", "eval.topk: expected an integer >= 1, got 0"),
    ("data.eval_seed=-3", "data.eval_seed: expected an integer in [0, 4294967295], got -3"),
    ("data.overlong=drop", "data.overlong: expected one of error/truncate, got 'drop'"),
    ("model.student_from_teacher_layers=0", "model.student_from_teacher_layers: expected an integer >= 1 or null, got 0"),
    ("train.bf16=1", "train.bf16: expected true or false, got 1"),
    ("train=3", "train: expected a mapping of train.* keys, got 3"),
    ("loss.topk=0", "loss.topk: must be an int >= 1 or None, got 0"),
    ("loss.topk=2.0", "loss.topk: expected an integer or null, got 2.0"),
])
def test_numeric_bounds_and_types(override, message):
    assert refused([override]) == message


@pytest.mark.parametrize("override, message", [
    ("optim.weight_decay=.inf", "optim.weight_decay: expected a finite number >= 0, got inf"),
    ("optim.lr=.nan", "optim.lr: expected a finite number > 0, got nan"),
    ("optim.grad_clip=.inf", "optim.grad_clip: expected a finite number > 0 or null, got inf"),
    ("rollout.temperature=.inf", "rollout.temperature: expected a finite number > 0, got inf"),
    ("train.max_time_s=.inf", "train.max_time_s: expected a finite number > 0 or null, got inf"),
    ("loss.beta=.nan", "loss.beta: expected a finite number, got nan"),
    ("loss.temperature=-.inf", "loss.temperature: expected a finite number, got -inf"),
    ("loss.clip_ratio_c=.inf", "loss.clip_ratio_c: expected a finite number, got inf"),
])
def test_non_finite_numbers_are_refused_everywhere(override, message):
    assert refused([override]) == message


def test_new_keys_and_yaml_numbers(tmp_path):
    cfg = load_config(base=BASE, overrides=["optim.lr=3e-4", "optim.weight_decay=1e-2"])
    assert cfg.train.max_nonfinite_steps == 3 and cfg.data.overlong == "error"
    assert cfg.optim.lr == 3e-4 and cfg.optim.weight_decay == 1e-2  # YAML 1.1 would read "3e-4" as a string
    assert load_config(base=BASE, overrides=["data.overlong=truncate", "train.max_nonfinite_steps=1"]).data.overlong \
        == "truncate"


def test_config_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  student: s\n  teacher: [t\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(e.value) == f"{bad}:4: not valid YAML (expected ',' or ']', but got '<stream end>')"
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "missing.yaml")
    assert str(e.value) == f"{tmp_path / 'missing.yaml'}: cannot read the config file (No such file or directory)"
    with pytest.raises(ConfigError) as e:
        load_config(base=BASE, overrides=["optim.lr=[1"])
    assert str(e.value) == "optim.lr: cannot read '[1' as a YAML value (expected ',' or ']', but got '<stream end>')"


def test_every_user_error_is_one_type():
    for cls in (ConfigError, DataError, ModelError):
        assert issubclass(cls, UserError) and issubclass(cls, ValueError)


# -- checks against the loaded models ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    tok = char_tokenizer(CARRY_ADD_CHARS)  # 4 specials + 14 characters = 18 ids
    return tok, build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2, max_position_embeddings=64)


def _cfg(*overrides, base=BASE):
    return load_config(base=base, overrides=["rollout.max_new_tokens=16", "eval.num_prompts=4", *overrides])


def test_k_against_the_vocabulary(tiny):
    tok, model = tiny
    task = CarryAdditionTask(1, 2)
    check_against_models(_cfg("loss.topk=18", "eval.topk=18"), tok, model, model, task)  # K = V is allowed
    with pytest.raises(ConfigError) as e:
        check_against_models(_cfg("loss.topk=19"), tok, model, model, task)
    assert str(e.value) == "loss.topk: expected at most the vocabulary size 18, got 19"
    with pytest.raises(ConfigError) as e:
        check_against_models(_cfg("eval.topk=50"), tok, model, model, task)
    assert str(e.value) == "eval.topk: expected at most the vocabulary size 18, got 50"
    rl = _cfg("loss.topk=19", "train.method=rl", "rollout.n=2")  # rl has no distillation loss: its K is unused
    check_against_models(rl, tok, model, None, task)


def test_fp16_training_is_refused_with_the_reason(tiny):
    tok, model = tiny
    half = build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2, dtype=torch.float16)
    with pytest.raises(ConfigError) as e:
        check_against_models(_cfg("model.dtype=float16"), tok, half, half, CarryAdditionTask(1, 2))
    assert str(e.value) == (
        "model.dtype: float16 training is refused: the trainer has no loss scaling, so small gradients flush to zero "
        "and one overflow turns every weight into NaN; use bfloat16 or float32 (float16 is fine for eval and score)")
    check_against_models(_cfg("model.dtype=float16", "train.steps=0"), tok, half, half, CarryAdditionTask(1, 2))


def test_lengths_against_the_positions(tiny):
    tok, model = tiny  # 64 positions
    with pytest.raises(ConfigError) as e:
        check_against_models(_cfg("rollout.max_new_tokens=64"), tok, model, model, CarryAdditionTask(1, 2))
    assert str(e.value) == ("rollout.max_new_tokens: expected at most 63 (the model has 64 positions and a prompt "
                            "needs at least one), got 64")
    with pytest.raises(ConfigError) as e:
        check_against_models(_cfg("eval.max_new_tokens=70"), tok, model, model, CarryAdditionTask(1, 2))
    assert str(e.value).startswith("eval.max_new_tokens: expected at most 63")
    # carry_add with 30-digit numbers: a 63-id prompt (bos + 30 + '+' + 30 + '=') leaves 1 position for 16 new tokens
    with pytest.raises(ConfigError) as e:
        check_against_models(_cfg("data.task_args={min_digits: 30, max_digits: 30}"), tok, model, model,
                             CarryAdditionTask(30, 30))
    assert str(e.value) == ("data.task_args: carry_add prompts reach 63 tokens, more than the 48 the model allows "
                            "(64 positions - 16 for rollout.max_new_tokens); use smaller task_args or a lower "
                            "rollout.max_new_tokens")


def test_run_training_refuses_before_any_evaluation(tiny, tmp_path, monkeypatch):
    import opdistill.train.loop as loop

    tok, model = tiny
    monkeypatch.setattr(loop, "run_eval", lambda *a, **k: pytest.fail("evaluated before the check"))
    cfg = load_config(base=tiny_config_dict(tmp_path), overrides=["loss.topk=40"])
    with pytest.raises(ConfigError, match=r"^loss\.topk: expected at most the vocabulary size 18, got 40$"):
        loop.run_training(cfg, models=(tok, model, model), quiet=True)


def test_model_folder_errors_name_the_key(tmp_path):
    with pytest.raises(ModelError) as e:
        load_model(tmp_path / "nope", key="model.student")
    assert str(e.value) == f"model.student: no such folder '{tmp_path / 'nope'}'"
    with pytest.raises(ModelError) as e:
        load_tokenizer(tmp_path, key="model.teacher")
    assert str(e.value) == f"model.teacher: '{tmp_path}' holds no config.json (expected a transformers model folder)"
    cfg = load_config(base={"model": {"student": "builtin:demo-student", "teacher": str(tmp_path / "t")},
                            "loss": {"topk": 4}})
    with pytest.raises(ModelError) as e:
        check_model_folders(cfg)
    assert str(e.value) == f"model.teacher: no such folder '{tmp_path / 't'}'"
    with pytest.raises(ConfigError) as e:
        check_model_folders(load_config(base=BASE, overrides=["model.student=builtin:nah"]))
    assert str(e.value).startswith("model.student: unknown builtin 'builtin:nah' (known: ")


@pytest.fixture
def no_hub_cache(monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub import constants

    from opdistill import models

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    models._hub_reason.cache_clear()
    yield constants
    models._hub_reason.cache_clear()


def test_a_hub_name_without_the_hub_is_one_line_at_once(no_hub_cache, cfg_file, monkeypatch, tmp_path, capsys):
    # issue 35 item 6: 52 s of retries and 20 lines before the error; now refused before anything loads
    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    monkeypatch.setattr(no_hub_cache, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelError) as e:
        load_tokenizer(name, key="model.student")
    assert str(e.value) == (f"model.student: '{name}' is no folder here and not in the hub cache ({tmp_path / 'hub'}), "
                            f"and HF_HUB_OFFLINE is set; give a local model folder (or builtin:smollm2), or download "
                            f"it where the hub can be reached")
    monkeypatch.setattr(no_hub_cache, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(no_hub_cache, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    assert main(["check", "--config", str(cfg_file), f"model.teacher={name}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"opdistill check: model error: model.teacher: '{name}' is no folder here and not in the hub cache "
        f"({tmp_path / 'hub'}), and the hub http://127.0.0.1:9 cannot be reached (")


def test_a_cached_hub_name_is_not_probed(monkeypatch):
    import huggingface_hub

    from opdistill import models

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: "/cache/config.json")
    monkeypatch.setattr(models, "_hub_reason", lambda endpoint: pytest.fail("probed the hub for a cached name"))
    assert models.model_folder("org/cached", "model.student") == "org/cached"


def test_task_args_errors_name_the_key():
    with pytest.raises(ConfigError) as e:
        make_task("carry_add", digits=3)
    assert str(e.value) == "data.task_args: carry_add takes ['min_digits', 'max_digits'], got unknown ['digits']"
    with pytest.raises(ConfigError) as e:
        make_task("carry_add", min_digits=4, max_digits=3)
    assert str(e.value) == "data.task_args: carry_add: expected 1 <= min_digits <= max_digits, got 4, 3"


# -- data files ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, text, message", [
    ("e.jsonl", "", "{p}: no rows (the file is empty)"),
    ("e.jsonl", "\n\n", "{p}: no rows (the file is empty)"),
    ("e.csv", "", "{p}: no rows (the file is empty)"),
    ("e.csv", "prompt,answer\n", "{p}: no rows (the file is empty)"),
    ("m.jsonl", '{"prompt": "a"}\n{"prompt": "b" "x": 1}\n', "{p}:2: not valid JSON (Expecting ',' delimiter at column 16)"),
    ("m.jsonl", '{"prompt": "a"}\n[1, 2]\n', "{p}:2: expected a JSON object with the prompt field, got list"),
    ("n.jsonl", '{"prompt": "a"}\n\n{"prompt": null}\n', "{p}:3: 'prompt' is null (data.prompt_field; every row needs it)"),
    ("n.jsonl", '{"prompt": "a"}\n{"prompt": "  "}\n', "{p}:2: 'prompt' is empty (data.prompt_field; every row needs it)"),
    ("n.jsonl", '{"prompt": "a"}\n{"question": "b"}\n', "{p}:2: 'prompt' is missing (data.prompt_field; every row needs it)"),
    ("n.jsonl", '{"prompt": "a"}\n{"prompt": ["b"]}\n',  # a list is a chat prompt: its items must be messages
     "{p}:2: 'prompt' message 0 is not a {{'role': str, 'content': str}} mapping (got 'b')"),
    ("n.jsonl", '{"prompt": "a"}\n{"prompt": {"b": 1}}\n', "{p}:2: 'prompt' is a dict, expected a string or a list of {{role, content}} messages (data.prompt_field)"),
    ("n.csv", "prompt,answer\na,1\n,2\n", "{p}:3: 'prompt' is empty (data.prompt_field; every row needs it)"),
    ("n.csv", "prompt,answer\na,1\nb\n", "{p}:3: 'answer' is null (data.answer_field; every row needs it)"),
    ("n.csv", "prompt,answer\na,1,x\n", "{p}:2: more fields than the header's ['prompt', 'answer']"),
    ("a.json", '[{"prompt": "a", "answer": 1},\n {"prompt": "b", "answer": null}]',
     "{p} item 2: 'answer' is null (data.answer_field; every row needs it)"),
    ("a.json", '[{"prompt": "a"},\n {"prompt": "b",}]', "{p}:2: not valid JSON (Expecting property name enclosed in double quotes at column 17)"),
])
def test_data_errors_name_the_file_and_line(tmp_path, name, text, message):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(DataError) as e:
        DatasetTask(str(p), answer_field="answer" if "answer" in text else None)
    assert str(e.value) == message.format(p=p)


def test_missing_file_and_column(tmp_path):
    with pytest.raises(DataError) as e:
        DatasetTask(str(tmp_path / "no.jsonl"))
    assert str(e.value) == f"data.path: no such file '{tmp_path / 'no.jsonl'}'"
    (tmp_path / "b.bin.jsonl").write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(DataError) as e:
        DatasetTask(str(tmp_path / "b.bin.jsonl"))
    assert str(e.value) == f"{tmp_path / 'b.bin.jsonl'}: not UTF-8 text (invalid start byte at byte 12)"


def _rows(tmp_path, prompts):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in prompts))
    return p


def test_overlong_prompts_refused_or_cut(tmp_path):
    tok = char_tokenizer(CARRY_ADD_CHARS)  # one id per character; the template adds <s>
    p = _rows(tmp_path, ["1+2=", "1" * 30, "2" * 12])
    with pytest.raises(DataError) as e:
        DatasetTask(str(p)).fit_prompts(tok, 10)
    assert str(e.value) == (f"{p}:2: the prompt is 31 tokens, more than the 10 the model allows (its positions minus "
                            "max_new_tokens); 2 prompt(s) are too long: shorten them or set data.overlong=truncate")
    task = DatasetTask(str(p))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        task.fit_prompts(tok, 10, overlong="truncate")
    assert [str(x.message) for x in w] == [f"data: cut the end of 2 prompt(s) of {p} to fit 10 tokens "
                                           f"(data.overlong=truncate; first: {p}:2, 31 tokens)"]
    assert [r.prompt for r in task.rows] == ["1+2=", "1" * 9, "2" * 9]  # the start of the text, <s> + 9 = 10 ids
    assert all(len(render_prompt(tok, r.prompt)) <= 10 for r in task.rows)


def test_unknown_characters_give_one_warning_with_a_count(tmp_path):
    tok = char_tokenizer(CARRY_ADD_CHARS)
    p = _rows(tmp_path, ["1+2=", "1+é=", "ßé+1"])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        DatasetTask(str(p)).fit_prompts(tok, 100)
    assert [str(x.message) for x in w] == [
        f"data: 3 character(s) in 2 prompt(s) of {p} map to the tokenizer's unknown token '<unk>' (first at {p}:2; "
        "most common: 'é', 'ß'): the model cannot tell them apart"]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        DatasetTask(str(_rows(tmp_path, ["1+2=", "3+4="]))).fit_prompts(tok, 100)
    assert w == []


# -- the CLI: one line, exit 2, --debug ----------------------------------------------------------------------------
@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tmp_path, steps=1)))
    return path


@pytest.mark.parametrize("args, line", [
    (["optim.weight_decay=.inf"], "config error: optim.weight_decay: expected a finite number >= 0, got inf"),
    (["loss.topk=null"], "config error: loss.topk: expected an int >= 1 with loss.loss_mode topk (the K of the "
                         "teacher's top-k, e.g. 8), got None"),
    (["model.student={tmp}/gone"], "model error: model.student: no such folder '{tmp}/gone'"),
    (["loss.topk=99"], "config error: loss.topk: expected at most the vocabulary size 18, got 99"),
    (["data.task=dataset", "data.path={tmp}/empty.jsonl"], "data error: {tmp}/empty.jsonl: no rows (the file is empty)"),
    (["data.task_args={{digits: 3}}"], "config error: data.task_args: carry_add takes ['min_digits', 'max_digits'], "
                                       "got unknown ['digits']"),
])
def test_cli_user_errors_are_one_line_exit_2(cfg_file, tmp_path, capsys, args, line):
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["train", "--config", str(cfg_file), *[a.format(tmp=tmp_path) for a in args]]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"opdistill train: {line.format(tmp=tmp_path)}\n"
    assert captured.out == ""


def test_cli_debug_shows_the_traceback(cfg_file, capsys):
    assert main(["--debug", "train", "--config", str(cfg_file), "optim.lr=abc"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert err.endswith("opdistill train: config error: optim.lr: expected a number > 0, got 'abc'\n")
    assert main(["train", "--debug", "--config", str(cfg_file), "optim.lr=abc"]) == 2  # after the command too
    assert capsys.readouterr().err.startswith("Traceback")


def test_cli_eval_without_checkpoint(cfg_file, tmp_path, capsys):
    assert main(["eval", "--config", str(cfg_file), "--checkpoint", "latest"]) == 2
    assert capsys.readouterr().err == f"opdistill eval: run error: no checkpoint under {tmp_path}/run/checkpoints\n"


def test_cli_process_exit_code_and_stderr(cfg_file):
    r = subprocess.run([sys.executable, "-m", "opdistill.cli", "train", "--config", str(cfg_file), "train.steps=-2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr == "opdistill train: config error: train.steps: expected an integer >= 0, got -2\n"


def test_cli_score_sampled_logprobs_are_the_next_tokens(cfg_file, tmp_path):
    """`opdistill score` aligns with shift_for_next_token: row t holds the teacher's log-prob of token t+1."""
    from opdistill.teachers import load_cache

    cache = tmp_path / "c.safetensors"
    assert main(["score", "--config", str(cfg_file), "--out", str(cache), "--num-prompts", "2"]) == 0
    c = load_cache(cache)
    teacher = load_model(tmp_path / "teacher").double()
    with torch.no_grad():
        lp = teacher(input_ids=c["input_ids"].long(), attention_mask=c["attention_mask"].long()).logits.log_softmax(-1)
    ids = c["input_ids"].long()
    expected = lp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # [B, S-1]: log nu(token t+1 | prefix up to t)
    valid = c["response_mask"][:, 1:].bool()  # positions whose next token is a response token
    assert valid.any()
    torch.testing.assert_close(c["scores"].sampled_logprobs[:, :-1][valid], expected[valid].float(), atol=1e-5, rtol=0)


def test_incompatible_models_message_is_one_line_naming_every_difference():
    from opdistill.models import IncompatibleModelsError, check_compatible

    s, t = char_tokenizer(CARRY_ADD_CHARS), char_tokenizer(CARRY_ADD_CHARS + "x", chat_template="{{ bos_token }}")
    with pytest.raises(IncompatibleModelsError) as e:
        check_compatible(s, t)
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, UserError)
    assert msg.startswith("model.teacher: student and teacher are not compatible for distillation: vocabulary "
                          "differs: student has 18 tokens, teacher 19; only in teacher: ['x']; chat template differs")
