"""Refusals a run can decide from its config, the process layout and the model folders' metadata come before any
model is loaded (issue 21): each case here runs ``opdistill train`` (or the assembly under a stand-in process layout)
with a model loader that fails the test if it is called, and expects the one-line refusal instead.

Each of these refusals used to come after the models were loaded (some after the checkpoint was restored)."""
import json
from contextlib import ExitStack

import pytest
import torch

from opdistill.errors import ConfigError, DataError, IncompatibleModelsError
from opdistill.models import build_tiny_llama, char_tokenizer
from opdistill.train import load_config, run_training
from opdistill.train.assemble import assemble
from opdistill.train.run.distributed import DistContext
from tests.trainer_helpers import make_model_dir, tiny_config_dict


@pytest.fixture
def no_loading(monkeypatch):
    """Any attempt to load or build a model's weights fails the test."""
    from transformers import AutoModelForCausalLM

    def boom(*a, **k):
        pytest.fail("a model was loaded before the refusal")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", boom)
    monkeypatch.setattr(AutoModelForCausalLM, "from_config", boom)


def _cfg(tmp_path, **sections):
    c = tiny_config_dict(tmp_path)
    for k, v in sections.items():
        c[k] = {**c.get(k, {}), **v} if isinstance(v, dict) else v
    return c


def _refused(c, exc=ConfigError):
    with pytest.raises(exc) as e:
        run_training(load_config(base=c), quiet=True)
    return str(e.value)


def _edit_config_json(folder, **keys):
    p = folder / "config.json"
    d = json.loads(p.read_text())
    d.update(keys)
    p.write_text(json.dumps(d))


def test_fp16_training(tmp_path, no_loading):
    assert _refused(_cfg(tmp_path, model={"dtype": "float16"})).startswith(
        "model.dtype: float16 training is refused: the trainer has no loss scaling")


def test_topk_and_eval_topk_above_the_vocabulary(tmp_path, no_loading):
    assert _refused(_cfg(tmp_path, loss={"topk": 19})) == "loss.topk: expected at most the vocabulary size 18, got 19"
    assert _refused(_cfg(tmp_path, eval={"topk": 40})) == "eval.topk: expected at most the vocabulary size 18, got 40"


def test_max_new_tokens_against_the_positions(tmp_path, no_loading):
    assert _refused(_cfg(tmp_path, rollout={"max_new_tokens": 256})) == (
        "rollout.max_new_tokens: expected at most 255 (the model has 256 positions and a prompt needs at least one), "
        "got 256")


def test_generated_prompts_that_do_not_fit(tmp_path, no_loading):
    msg = _refused(_cfg(tmp_path, rollout={"max_new_tokens": 200},
                        data={"task_args": {"min_digits": 30, "max_digits": 30}}))
    assert msg == ("data.task_args: carry_add prompts reach 63 tokens, more than the 56 the model allows (256 positions "
                   "- 200 for rollout.max_new_tokens); use smaller task_args or a lower rollout.max_new_tokens")


def test_dataset_prompt_that_does_not_fit(tmp_path, no_loading):
    rows = tmp_path / "p.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "1" * n, "answer": "1"}) + "\n" for n in (3, 250)))
    c = _cfg(tmp_path, data={"task": "dataset", "path": str(rows), "answer_field": "answer", "task_args": {}})
    msg = _refused(c, DataError)
    assert msg.startswith(f"{rows}:2: the prompt is ") and "data.overlong" in msg


def test_tokenizers_or_widths_that_differ(tmp_path, no_loading):
    c = _cfg(tmp_path)
    other = make_model_dir(tmp_path / "other", hidden=32, layers=1, seed=1, chars="0123456789+=,>ab")
    c["model"]["teacher"] = other
    msg = _refused(c, IncompatibleModelsError)
    assert msg.startswith("model.teacher: student and teacher are not compatible for distillation: vocabulary "
                          "differs: student has 18 tokens, teacher 20")


def test_a_named_teachers_tokenizer_that_differs(tmp_path, no_loading):
    c = _cfg(tmp_path, data={"task": "mix", "task_args": {"tasks": {"a": {"task": "carry_add", "min_digits": 1,
                                                                          "max_digits": 1}}}})
    other = make_model_dir(tmp_path / "other", hidden=32, layers=1, seed=1, chars="0123456789+=,>ab")
    c["model"]["teacher"] = None
    c["teachers"] = [{"name": "a", "path": other}]
    c["routing"] = {"table": {"a": "a"}}
    assert _refused(c, IncompatibleModelsError).startswith(
        "teachers.0.path: student and teacher are not compatible for distillation: vocabulary differs")


def test_a_teacher_head_transform_opdistill_does_not_know(tmp_path, no_loading):
    c = _cfg(tmp_path)
    _edit_config_json(tmp_path / "teacher", output_logits_multiplier=2.0)
    with pytest.raises(ValueError, match=r"LlamaConfig\.output_logits_multiplier=2\.0 looks like a transform"):
        run_training(load_config(base=c), quiet=True)


def test_a_soft_capped_student_with_the_fused_head(tmp_path, no_loading):
    c = _cfg(tmp_path, train={"fused_lm_head": True})
    _edit_config_json(tmp_path / "student", final_logit_softcapping=30.0)
    assert _refused(c) == ("train.fused_lm_head: the student soft-caps its logits (c * tanh(z / c)), which the fused "
                           "lm_head path does not implement; set train.fused_lm_head=false")


def test_student_layers_beyond_the_model(tmp_path, no_loading):
    assert _refused(_cfg(tmp_path, model={"student_from_teacher_layers": 3})) == (
        "model.student_from_teacher_layers: expected 1..1 (the layers of this model), got 3")


def test_routing_values_a_dataset_does_not_have(tmp_path, no_loading):
    rows = tmp_path / "p.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "1+1=", "answer": "2", "kind": k}) + "\n" for k in ("x", "y")))
    c = _cfg(tmp_path, data={"task": "dataset", "path": str(rows), "answer_field": "answer", "task_args": {}})
    c["model"]["teacher"] = None
    c["teachers"] = [{"name": "t", "path": str(tmp_path / "teacher")}]
    c["routing"] = {"field": "kind", "table": {"x": "t", "z": "t"}}
    assert _refused(c) == f"routing.table.z: no row of {rows} has kind 'z' (values: ['x', 'y'])"


def test_missing_extras(tmp_path, no_loading, monkeypatch):
    import importlib.util

    from opdistill.engines import vllm as ev

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("peft", "httpx") else real(name, *a))
    monkeypatch.setattr(ev, "vllm_available", lambda: False)
    assert _refused(_cfg(tmp_path, model={"lora": {"r": 2}})) == (
        "model.lora: LoRA students need the peft package (the lora extra): pip install 'opdistill[lora]'")
    assert _refused(_cfg(tmp_path, teacher={"url": "http://127.0.0.1:9"})) == (
        "teacher.url: the teacher client needs the serve extra (httpx is missing): pip install 'opdistill[serve]'")
    assert _refused(_cfg(tmp_path, rollout={"engine": "vllm"})).startswith(
        "rollout.engine: vllm, but the vllm package is not installed; install the vllm extra")


def test_cuda_without_a_gpu(tmp_path, no_loading, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _refused(_cfg(tmp_path, train={"device": "cuda"})).startswith(
        "train.device: cuda, but torch sees no CUDA device here")


def test_a_teacher_cache_that_cannot_serve_the_loss(tmp_path, no_loading):
    from opdistill.teachers import TeacherCacheError

    c = _cfg(tmp_path, train={"method": "off_policy"}, data={"teacher_cache": str(tmp_path / "nope.safetensors")})
    assert _refused(c, TeacherCacheError).startswith(f"{tmp_path / 'nope.safetensors'}: no such teacher cache file")


def _assemble(c, ctx):
    with ExitStack() as stack:
        assemble(load_config(base=c), ctx, stack, resume=False, overwrite=False)


def test_vllm_engines_under_torchrun(tmp_path, no_loading, monkeypatch):
    """One engine per rank, or over a data-parallel rank's tp ranks (issue 24): refused, before any model loads,
    with a vLLM teacher engine at tp > 1, with the pipelined step over the tp ranks on CUDA, with a tp size vLLM
    cannot shard the student's attention heads by, with an architecture vLLM does not implement (at any world
    size), and on CPU when the node's ranks' KV caches do not fit its memory."""
    from opdistill.train.disk.preflight import check_engines_fit

    with pytest.raises(ConfigError) as e:
        _assemble(_cfg(tmp_path, rollout={"engine": "vllm"}, teacher={"engine": "vllm"}, distributed={"tp_size": 2}),
                  DistContext(rank=0, world=2))
    assert str(e.value) == ("teacher.engine: vllm with distributed.tp_size 2: a data-parallel rank's teacher requests "
                            "are made by its first tp rank alone, and a vLLM engine over the tp ranks needs every one "
                            "of them in each request; serve the teacher (teacher.url) or use distributed.tp_size=1")
    monkeypatch.setattr("opdistill.engines.vllm.vllm_available", lambda: True)  # the model's check, past the install's
    monkeypatch.setattr("opdistill.engines.vllm.supported_architectures", lambda: {"LlamaForCausalLM"})
    with pytest.raises(ConfigError) as e:  # the tiny student has 2 attention heads
        _assemble(_cfg(tmp_path, rollout={"engine": "vllm"}, distributed={"tp_size": 3}, data={"prompts_per_step": 2}),
                  DistContext(rank=0, world=3))
    assert str(e.value) == ("distributed.tp_size: rollout.engine vllm shards the student's attention heads and MLP "
                            "over the 3 tp ranks, and its 2 attention heads do not divide by 3; use a tp_size that "
                            "divides 2 and 32, or the hf engines")
    with pytest.raises(ConfigError) as e:  # the engine's NCCL collectives in the pipeline's thread: not on CUDA
        _assemble(_cfg(tmp_path, rollout={"engine": "vllm", "correction": "tis", "tis_cap": 2.0},
                       distributed={"tp_size": 2}, train={"max_staleness": 1, "device": "cuda"}),
                  DistContext(rank=0, world=2))
    assert str(e.value) == ("train.max_staleness: expected 0 with rollout.engine vllm over the tp ranks "
                            "(distributed.tp_size 2) on CUDA: the pipeline's thread would run the engine's NCCL "
                            "collectives while the trainer's run on another communicator, which NCCL does not order "
                            "(tested on CPU/gloo only), got 1")
    # an architecture vLLM does not implement (here: any but GPT-2), for the rollout or the teacher engine
    monkeypatch.setattr("opdistill.engines.vllm.supported_architectures", lambda: {"GPT2LMHeadModel"})
    for over, key, model in (({"rollout": {"engine": "vllm"}}, "rollout.engine", "model.student"),
                             ({"teacher": {"engine": "vllm"}}, "teacher.engine", "model.teacher")):
        with pytest.raises(ConfigError) as e:
            _assemble(_cfg(tmp_path, **over), DistContext())
        assert str(e.value) == (f"{key}: vllm does not implement {model}'s architecture LlamaForCausalLM (its "
                                f"config.json); use the hf engines for it")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cfg = load_config(base=_cfg(tmp_path, rollout={"engine": "vllm", "vllm_kv_cache_gb": 2}, teacher={"engine":
                                                                                                     "vllm"}))
    engines = ["rollout.engine", "teacher.engine"]
    check_engines_fit(cfg, engines, available=16 << 30)  # 4 ranks x 2 engines x 2 GiB = 16 GiB: fits
    with pytest.raises(ConfigError) as e:
        check_engines_fit(cfg, engines, available=(16 << 30) - 1)
    assert str(e.value) == ("rollout.vllm_kv_cache_gb: 4 rank(s) on this node x 2 vLLM engine(s) x 2 GiB of KV cache "
                            "= 16 GiB, more than the 16.0 GiB available; lower rollout.vllm_kv_cache_gb or start "
                            "fewer ranks per node")


def test_tp_size_above_the_vocabulary(tmp_path, no_loading):
    with pytest.raises(ConfigError) as e:
        _assemble(_cfg(tmp_path, distributed={"tp_size": 32}), DistContext(rank=0, world=32))
    assert str(e.value) == ("distributed.tp_size=32: larger than the student's vocabulary (18); set "
                            "distributed.tp_size to a divisor of the world size of at most 18")


def test_a_sharded_teacher_with_a_rank_without_held_out_problems(tmp_path, no_loading):
    with pytest.raises(ConfigError) as e:
        _assemble(_cfg(tmp_path, model={"teacher_sharded": True}, eval={"num_prompts": 1}),
                  DistContext(rank=0, world=2))
    assert str(e.value).startswith("eval.num_prompts: the held-out set has 1 problem(s), fewer than the 2 "
                                   "data-parallel ranks")


def test_the_refusals_leave_no_run_behind(tmp_path, no_loading):
    """A refusal before loading never touched the run directory (it is opened after the refusals)."""
    c = _cfg(tmp_path, loss={"topk": 19})
    with pytest.raises(ConfigError):
        run_training(load_config(base=c), quiet=True)
    assert not (tmp_path / "run").exists()


def test_the_loader_guard_can_fail(tmp_path, no_loading):
    """The fixture does catch a load: a config with no refusal reaches the loader and fails the test's way."""
    with pytest.raises(pytest.fail.Exception, match="a model was loaded before the refusal"):
        run_training(load_config(base=_cfg(tmp_path)), quiet=True)


def test_handed_in_models_are_checked_by_the_same_rules(tmp_path):
    tok = char_tokenizer("0123456789+=,>")
    model = build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2, max_position_embeddings=64)
    c = load_config(base=_cfg(tmp_path, rollout={"max_new_tokens": 64}))
    with pytest.raises(ConfigError) as e:
        run_training(c, models=(tok, model, model), quiet=True)
    assert str(e.value).startswith("rollout.max_new_tokens: expected at most 63")
