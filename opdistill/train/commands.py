"""The commands besides ``train``, assembled as a run is: ``opdistill eval`` (:func:`evaluate_run`), ``opdistill
score`` (:func:`score_cache`) and ``opdistill export`` (:func:`export_run`). Each reads the config, refuses what
it cannot run before a weight loads where it can, loads the models (``load_models``), builds its teachers through
``build_teacher`` and does its work; the CLI only parses arguments and prints (opdistill/cli.py).

``export``: a run's student as a plain transformers folder.

The folder holds ``model.safetensors`` (LoRA adapters merged into the base weights; no peft needed to load it),
``config.json``, ``generation_config.json`` and the tokenizer files: ``AutoModelForCausalLM.from_pretrained(DIR)``
and vLLM load it as they load any Hugging Face model. The checkpoint is verified (manifest) before it is read; the
folder is written into a temporary sibling and renamed into place, and an existing non-empty ``--out`` is refused, as
is an ``--out`` inside a run's entries (a checkpoint folder, ``eval/``, ...: the run's rotation would delete the
export; ``opdistill.runs.outputs``) and an ``--out`` another process is exporting to (a file lock beside it).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from opdistill.data import PromptSource
from opdistill.engines.vllm import EngineSet
from opdistill.env import prompt_renderer
from opdistill.errors import ConfigError
from opdistill.models import resolve_model_path
from opdistill.runs.outputs import check_output_path, output_lock
from opdistill.runs.values import nest_intervals
from opdistill.teachers import Rows, ScoreRequest, TeacherContext, build_teacher, save_cache
from opdistill.train.assemble import build_context, build_env, build_task, load_models
from opdistill.train.disk.checkpoint import checkpoint_step, load_weights, resume_checkpoint, verify_checkpoint
from opdistill.train.disk.inputs import check_inputs, local_inputs, remote_inputs
from opdistill.train.disk.preflight import ModelInfo, check_against_models, check_context, check_model_folders
from opdistill.train.disk.rundir import CheckpointError, follow_umask
from opdistill.train.loop import run_eval
from opdistill.train.run.config import load_config
from opdistill.train.run.lora import apply_lora, merged_model

__all__ = ["EvalReport", "evaluate_run", "export_run", "score_cache"]


@dataclass
class EvalReport:
    """What ``opdistill eval`` measured: the checkpoint evaluated (None: the configured student), the problems, and
    the metrics with their intervals (``as_json``: the report's JSON)."""

    checkpoint: str | None
    num_problems: int
    num_samples: int
    bootstrap_resamples: int
    metrics: dict

    def as_json(self) -> str:
        return json.dumps({"checkpoint": self.checkpoint, "num_problems": self.num_problems,
                           "num_samples": self.num_samples, "bootstrap_resamples": self.bootstrap_resamples,
                           "level": 0.95, "metrics": nest_intervals(self.metrics)}, indent=1)


def evaluate_run(cfg, *, checkpoint: str | None = None, run_dir: Path | None = None, accept: tuple = (),
                 values_path: Path | None = None) -> EvalReport:
    """The held-out evaluation of ``cfg``'s student (``checkpoint``: a checkpoint folder, ``latest``: the run's
    newest, None: the configured student) by ``cfg``'s evaluation teacher. ``run_dir``: the run whose record of its
    inputs (student, teacher, data files, a server's identity) the inputs are checked against (``accept``: the
    changes accepted; train/disk/inputs.py). ``values_path``: also write the per-problem values there."""
    check_model_folders(cfg)
    if run_dir is not None:  # the student, teacher and data files against the run's record (train/disk/inputs.py)
        check_inputs(run_dir, local_inputs(cfg), accept, what="eval")
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    tok, student, teacher = load_models(cfg)
    ckpt = resume_checkpoint(cfg.run_dir) if checkpoint == "latest" else checkpoint
    if ckpt:
        load_weights(ckpt, student)  # the weights only (safetensors, verified): never the trainer state
    task = build_task(cfg)
    env = build_env(cfg, tok)  # tools: episodes (SPEC 6.8)
    check_against_models(cfg, tok, student, teacher, task, training=False, env=env)  # K, lengths: before generating
    source = PromptSource(task, cfg.train.seed, cfg.data.eval_seed)
    held_out = source.held_out(cfg.eval.num_prompts)
    context = build_context(cfg, task, tok)  # teacher.context: the teacher's own prompts (SPEC 6.7)
    if context is not None:
        check_context(cfg, context, tok, ModelInfo("model.student", None, student, tok),
                      [] if teacher is None else [ModelInfo("model.teacher", None, teacher)], source, held_out, env)
    models = {} if teacher is None else {"model.teacher": teacher}
    teachers = build_teacher(cfg, TeacherContext(tokenizer=tok, student=student, models=models,
                                                 resolve=resolve_model_path,
                                                 tools=None if env is None else env.tools.schemas), train=False)
    try:
        if run_dir is not None:  # a teacher server against the run's record
            check_inputs(run_dir, remote_inputs(cfg, teachers), accept, what="eval")
        metrics = run_eval(cfg, tok, student, teachers.eval, task, held_out, values_path=values_path,
                           context=context, env=env)
    finally:
        teachers.close()
    return EvalReport(str(ckpt) if ckpt else None, len(held_out), cfg.eval.num_samples,
                      cfg.eval.bootstrap_resamples, metrics)


def score_cache(cfg, out, *, num_prompts: int, writer: str = "teacher", fp16: bool = False) -> tuple[Path, int, int]:
    """``opdistill score``: ``num_prompts`` prompts of step 0, ``rollout.n`` rows each written by ``writer`` (the
    teacher or the student; with tools, episodes: SPEC 6.8), scored by ``model.teacher`` in this process, saved as a
    teacher cache at ``out`` (opdistill/teachers/cache.py). Returns (the cache's path, its rows, their response
    tokens: the writer's own)."""
    if cfg.teacher.context is not None:
        raise ConfigError("teacher.context: expected null for opdistill score (a teacher cache holds scores made "
                          "under the student's prompts, which data.teacher_cache trains on)")
    if cfg.xtok.mode != "off":
        raise ConfigError(f"xtok.mode: expected off for opdistill score (a teacher cache holds the teacher's scores "
                          f"of the student's own token ids), got {cfg.xtok.mode!r}")
    check_model_folders(cfg)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    tok, student, teacher = load_models(cfg)
    if teacher is None:
        raise ConfigError("model.teacher: expected a model folder to score with, got None")
    task = build_task(cfg)
    env = build_env(cfg, tok)  # tools: the rows are episodes
    check_against_models(cfg, tok, student, teacher, task, training=False, env=env)  # K, lengths: before generating
    problems = PromptSource(task, cfg.train.seed).batch(0, num_prompts)
    render = prompt_renderer(tok, env, use_chat_template=cfg.data.use_chat_template)
    prompts = [render(p.prompt) for p in problems]
    rc = cfg.rollout
    torch.manual_seed(cfg.train.seed)
    ro = EngineSet().generate_rollouts(teacher if writer == "teacher" else student, tok, prompts, env=env, n=rc.n,
                                       temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k,
                                       max_new_tokens=rc.max_new_tokens, min_new_tokens=rc.min_new_tokens,
                                       batch_size=rc.batch_size, seed=cfg.train.seed, step=0)
    scorer = build_teacher(cfg, TeacherContext(tokenizer=tok, student=student, models={"model.teacher": teacher}),
                           train=False).eval  # model.teacher in this process
    scores = scorer.score(Rows(ro.input_ids, ro.attention_mask, ro.response_mask),
                          ScoreRequest(k=cfg.loss.topk, sampled=True, what="opdistill score"))
    path = save_cache(out, input_ids=ro.input_ids, attention_mask=ro.attention_mask,
                      response_mask=ro.response_mask, scores=scores, teacher=teacher, tokenizer=tok,
                      logprob_dtype=torch.float16 if fp16 else torch.float32)
    follow_umask(Path(path))  # safetensors writes 0600; the cache is data other users' runs may read
    return Path(path), ro.num_rows, int(ro.response_mask.sum())


EXPORT_RECORD = "opdistill_export.json"  # in an exported folder: the run and the checkpoint it was written from


def export_run(run_dir: str | os.PathLike, out: str | os.PathLike, checkpoint: str = "latest",
               accept_changed: tuple = ()) -> Path:
    """Write RUN_DIR's student at ``checkpoint`` (``latest``: the newest intact one; or a checkpoint folder) to
    ``out`` as a plain transformers folder, with :data:`EXPORT_RECORD` naming the run and checkpoint; return its
    path. The student folder (a LoRA run's base, the tokenizer)
    must be the one the run recorded (train/disk/inputs.py) unless ``accept_changed`` names ``model.student``."""
    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"RUN_DIR: '{run_dir}' holds no config.yaml (expected the run_dir of an opdistill train run)")
    _check_out(out)
    check_output_path(out, "--out")
    with output_lock(out, "--out"):
        _check_out(out)  # again, under the lock: another export may have finished in between
        return _export(run_dir, out, checkpoint, tuple(accept_changed))


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out: '{out}' exists and is not an empty folder; choose a new folder")


def _export(run_dir: Path, out: Path, checkpoint: str, accept: tuple) -> Path:
    from opdistill.models import load_model, load_tokenizer, truncate_layers

    cfg = load_config(run_dir / "config.yaml")
    check_inputs(run_dir, local_inputs(cfg, only=("model.student",)), accept, what="export")
    if checkpoint == "latest":
        ckpt = resume_checkpoint(run_dir)
    else:
        ckpt = Path(checkpoint)
        verify_checkpoint(ckpt)
    mc = cfg.model
    path = resolve_model_path(mc.student)
    tok = load_tokenizer(path, trust_remote_code=mc.trust_remote_code, key="model.student")
    model = load_model(path, dtype=mc.dtype, trust_remote_code=mc.trust_remote_code, key="model.student")
    if mc.student_from_teacher_layers:
        model = truncate_layers(model, mc.student_from_teacher_layers)
    if mc.lora is not None:
        model = apply_lora(model, mc.lora)
    load_weights(ckpt, model)
    model = merged_model(model)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        if not (tmp / "model.safetensors").is_file() and not (tmp / "model.safetensors.index.json").is_file():
            raise CheckpointError(f"{tmp}: transformers wrote no safetensors weights")
        (tmp / EXPORT_RECORD).write_text(json.dumps({"run_dir": str(run_dir.resolve()), "checkpoint": ckpt.name,
                                                     "step": checkpoint_step(ckpt)}, indent=1) + "\n")
        follow_umask(tmp)  # safetensors writes 0600: a vLLM server running as another user could not read it
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
