"""A run assembled before it runs: every refusal first, then the models, then everything the loop holds.

:func:`assemble` reads as its list of named setup steps:

    refusals        config + process layout + model folders' metadata (``preflight.check_before_loading``):
                    nothing loaded yet
    run directory   lock, one run per folder, the resume rules: the config, the checkpoint, the fingerprints of what
                    the run reads from files (rank 0; the others wait for its verdict)
    models          the student (LoRA, the LoRA base as teacher), the in-process teachers, finite weights, the fused
                    head check; placed on the device, wrapped for data parallelism (FSDP2 / DDP)
    training        optimizer, schedule, the loss object, the teacher cache (its provenance against the teacher),
                    the checkpoint to resume
    engines         the student's rollout engine (vLLM), then the teachers (``opdistill.teachers.build_teacher``);
                    the servers' fingerprints, and the record of every input written (rank 0; train/disk/inputs.py)
    logging         metrics.jsonl, TensorBoard, wandb (rank 0)

Every resource the run holds (the run directory's lock, engines, teacher connections, the logger) is entered into
one ``ExitStack``, closed in reverse order however the run ends.
"""
from __future__ import annotations

import functools
import logging
import math
import warnings
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from opdistill import DistillationLoss, PolicyGradientLoss
from opdistill.data import DatasetTask, PromptSource, Rewards, Task, TeacherPrompt, make_task
from opdistill.engines.vllm import EngineSet, open_engines
from opdistill.env import CallFormat, Environment, Tools
from opdistill.errors import ConfigError, IncompatibleModelsError
from opdistill.fused import check_lm_head
from opdistill.models import (check_compatible, empty_model, load_model, load_shards, load_tokenizer, model_config,
                              resolve_model_path, truncate_layers)
from opdistill.teachers import TeacherCacheError, TeacherContext, Teachers, build_teacher, load_cache
from opdistill.teachers.cache import check_provenance
from opdistill.train.disk.checkpoint import (checkpoint_step, load_checkpoint, resume_checkpoint, save_checkpoint,
                                            set_aside_newer)
from opdistill.train.steps.collect import Collector
from opdistill.train.run.config import TrainerConfig, config_to_dict, load_config
from opdistill.train.run.distributed import DistContext, wrap_student
from opdistill.train.disk.inputs import check_inputs, local_inputs, object_inputs, record_inputs, remote_inputs
from opdistill.train.disk.logger import NullLogger, RunLogger
from opdistill.train.run.lora import SELF, apply_lora, enable_gradient_checkpointing, self_teacher
from opdistill.train.run.optim import build_optimizer
from opdistill.train.steps.pipeline import Pipeline
from opdistill.train.run.placement import place_models, run_device
from opdistill.train.disk.preflight import (ModelInfo, check_before_loading, check_context, check_finite_model,
                                       check_finite_weights, check_loaded, check_model_folders, resolve_folder)
from opdistill.train.run.rules import check_layout
from opdistill.train.disk.rundir import (RunDir, RunWarning, check_checkpoint_config, check_holds_run, open_run_dir,
                                    set_aside_evaluations)
from opdistill.train.disk.wandb_log import open_wandb

log = logging.getLogger(__name__)

__all__ = ["Given", "Run", "RunState", "assemble", "check_run", "build_task", "build_context",
           "build_rewards",
           "load_models", "lr_lambda", "open_teacher_cache"]


def build_task(cfg: TrainerConfig) -> Task:
    dc = cfg.data
    hint = cfg.teacher.context.hint_field if cfg.teacher.context is not None else None
    if dc.task == "dataset":
        return DatasetTask(dc.path, dc.prompt_field, dc.answer_field, split=dc.split, subset=dc.subset,
                           eval_path=dc.eval_path, eval_split=dc.eval_split, eval_fraction=dc.eval_fraction,
                           answer_match=dc.answer_match, task_field=cfg.routing.field if cfg.routing else None,
                           final_assistant=dc.final_assistant, hint_field=hint)
    return make_task(cfg.data.task, **cfg.data.task_args, **({"hint_field": hint} if hint is not None else {}))


BANNED_EVAL_DRAWS = 1000  # a task without its own held-out set: its first evaluation draws never enter x'


def build_context(cfg: TrainerConfig, task: Task, tok) -> TeacherPrompt | None:
    """The teacher's own prompt per problem (``teacher.context``, SPEC 6.7), or None: its examples drawn from the
    training problems, never a held-out one: the task's own held-out set, or for a generated task without one the
    first ``max(BANNED_EVAL_DRAWS, eval.num_prompts)`` evaluation draws (any evaluation of up to that many problems,
    whatever its ``eval.num_prompts``: the same examples in training and in ``opdistill eval``). A dataset without
    held-out rows is evaluated on its training rows (a warning says so): nothing to ban."""
    c = cfg.teacher.context
    if c is None:
        return None
    banned = task.held_out_all()
    if banned is None and not isinstance(task, DatasetTask):
        banned = PromptSource(task, cfg.train.seed, cfg.data.eval_seed).held_out(
            max(BANNED_EVAL_DRAWS, cfg.eval.num_prompts))
    return TeacherPrompt(task, examples=c.examples, examples_path=c.examples_path, examples_seed=c.examples_seed,
                         system=c.system, template=c.template, hint_field=c.hint_field, held_out=banned or [],
                         chat=cfg.data.use_chat_template and bool(getattr(tok, "chat_template", None)))


def load_models(cfg: TrainerConfig, tok=None, *, teacher_shards: bool = False, student_shards: bool = False):
    """(tokenizer, student, teacher or None) as the config asks (``tok``: the student's tokenizer, when already
    read); refuses incompatible pairs and NaN/inf weights before any training. The teacher is ``model.teacher``
    (None with ``teacher.url`` or ``teachers``), or for ``model.teacher: self`` the student's starting weights: the
    LoRA student's base (no copy), else a frozen copy read from the student's folder.
    ``teacher_shards``: the teacher is built without its weights (``model.teacher_sharded`` under torchrun: each
    rank reads only its shards when it is sharded, ``opdistill.teachers.sharded``); ``student_shards``: the student
    too (``distributed.decode: sharded``: :func:`_load` reads each rank's shards once FSDP2 has sharded it)."""
    mc = cfg.model
    student_path = resolve_model_path(mc.student)
    teacher = None
    if mc.teacher and mc.teacher != SELF and cfg.teacher.url is None:  # teacher.url: the server scores
        teacher_path = resolve_model_path(mc.teacher)
        teacher = (empty_model if teacher_shards else load_model)(
            teacher_path, dtype=mc.dtype, trust_remote_code=mc.trust_remote_code,
            attn_implementation=mc.attn_implementation)
        teacher.requires_grad_(False)
        t_tok = load_tokenizer(teacher_path, trust_remote_code=mc.trust_remote_code)
    tok = tok if tok is not None else load_tokenizer(student_path, trust_remote_code=mc.trust_remote_code)
    student = (empty_model if student_shards else load_model)(
        student_path, dtype=mc.dtype, trust_remote_code=mc.trust_remote_code,
        attn_implementation=mc.attn_implementation)
    if mc.student_from_teacher_layers:
        student = truncate_layers(student, mc.student_from_teacher_layers)
    if mc.lora is not None:  # only the adapters train; model.teacher "self": the base with them off (run/lora.py)
        student = apply_lora(student, mc.lora)
    if mc.teacher == SELF and cfg.teacher.url is not None:  # the server scores: no teacher in this process
        pass
    elif mc.teacher == SELF and mc.lora is not None:
        teacher = self_teacher(student)
    elif mc.teacher == SELF:  # the student's starting weights, frozen: one copy read from the student's folder
        teacher = load_model(student_path, dtype=mc.dtype, trust_remote_code=mc.trust_remote_code,
                             attn_implementation=mc.attn_implementation).requires_grad_(False)
    elif teacher is not None:
        check_compatible(tok, t_tok, student, teacher, cross_tokenizer=cfg.xtok.mode != "off")
    check_finite_weights(cfg, student, teacher)  # a corrupt folder is refused before any eval, score or step
    return tok, student, teacher


def load_named_teachers(cfg: TrainerConfig, tok, student, given: dict | None = None) -> dict:
    """The ``teachers`` entries with a path, loaded (``given``: {name: model} already loaded) and checked like
    model.teacher (tokenizer and head compatibility with the student, finite weights), errors naming their key:
    ``{"teachers.N.path": model}``; two entries of one folder share one copy of the weights."""
    mc, out, loaded = cfg.model, {}, {}
    for i, spec in enumerate(cfg.teachers or []):
        if spec.path is None:
            continue
        key = f"teachers.{i}.path"
        model = (given or {}).get(spec.name)
        if model is None:
            if spec.path not in loaded:
                path = resolve_folder(spec.path, key)
                model = load_model(path, dtype=mc.dtype, trust_remote_code=mc.trust_remote_code,
                                   attn_implementation=mc.attn_implementation).requires_grad_(False)
                try:
                    check_compatible(tok, load_tokenizer(path, trust_remote_code=mc.trust_remote_code), student,
                                     model, cross_tokenizer=cfg.xtok.mode != "off", key=key)
                except IncompatibleModelsError as e:
                    raise IncompatibleModelsError(f"{key}: " + str(e).removeprefix("model.teacher: ")) from None
                check_finite_model(key, model, spec.path)
                loaded[spec.path] = model
            model = loaded[spec.path]
        out[key] = model
    return out


def _infos(cfg: TrainerConfig, models) -> tuple:
    """(student tokenizer, student info, in-process teachers' infos) without loading a weight: from the folders'
    config.json and tokenizers, or from the models handed in (``models``: (tok, student, teacher))."""
    mc = cfg.model
    if models is not None:
        tok, student, teacher = models
        teachers = [] if teacher is None or isinstance(teacher, dict) or mc.teacher == SELF else \
            [ModelInfo("model.teacher", None, teacher, tok)]
        return tok, ModelInfo("model.student", None, student, tok), teachers
    check_model_folders(cfg)
    trc = mc.trust_remote_code
    path = resolve_model_path(mc.student)
    tok = load_tokenizer(path, trust_remote_code=trc, key="model.student")
    student = ModelInfo("model.student", path, model_config(path, trust_remote_code=trc, key="model.student"), tok)
    teachers = []
    if mc.teacher and mc.teacher != SELF and cfg.teacher.url is None:
        path = resolve_model_path(mc.teacher)
        teachers.append(ModelInfo("model.teacher", path, model_config(path, trust_remote_code=trc, key="model.teacher"),
                                  load_tokenizer(path, trust_remote_code=trc, key="model.teacher")))
    for i, spec in enumerate(cfg.teachers or []):
        if spec.path is not None:
            key = f"teachers.{i}.path"
            path = resolve_folder(spec.path, key)
            teachers.append(ModelInfo(key, path, model_config(path, trust_remote_code=trc, key=key),
                                      load_tokenizer(path, trust_remote_code=trc, key=key)))
    return tok, student, teachers


def lr_lambda(optim_cfg, total_steps: int):
    warm = optim_cfg.warmup_steps

    def fn(step: int) -> float:  # step = number of optimizer steps already taken
        if step < warm:
            return (step + 1) / warm
        if optim_cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total_steps - warm))
        return optim_cfg.min_lr_ratio + (1 - optim_cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def open_teacher_cache(cfg: TrainerConfig, tok=None, teacher=None) -> dict | None:
    """The ``data.teacher_cache`` rows, verified against the run's tokenizer and teacher (when given: provenance,
    checksum, every value; opdistill/teachers/cache.py) and against the loss (None when unset)."""
    if cfg.data.teacher_cache is None:
        return None
    cache = load_cache(cfg.data.teacher_cache, teacher=teacher, tokenizer=tok)
    scores, lc = cache["scores"], cfg.loss
    if lc.loss_mode == "topk" and scores.topk is None:
        raise TeacherCacheError(f"data.teacher_cache={cfg.data.teacher_cache!r} holds no top-k scores "
                                f"(loss.loss_mode=topk)")
    if lc.loss_mode == "topk" and lc.topk is not None and scores.topk.ids.shape[-1] != lc.topk:
        raise TeacherCacheError(f"data.teacher_cache={cfg.data.teacher_cache!r} holds top-{scores.topk.ids.shape[-1]} "
                                f"scores but loss.topk={lc.topk}")
    if lc.loss_mode == "sampled" and scores.sampled_logprobs is None:
        raise TeacherCacheError(f"data.teacher_cache={cfg.data.teacher_cache!r} holds no sampled-token log-probs")
    return cache


@dataclass
class RunState:
    """What changes from step to step besides the weights, optimizer, scheduler and RNG states; saved in every
    checkpoint (``to_saved``) so a resumed run continues with the same counters."""

    step: int = 0  # optimizer steps taken = the data position (prompts are a function of (seed, step))
    train_time: float = 0.0  # seconds in the rollout + teacher + update phases (train.max_time_s)
    eval_history: list = None
    nonfinite_steps: int = 0  # steps not applied because the loss or gradient norm was NaN/inf
    nonfinite_in_row: int = 0  # ... consecutively, up to this step (train.max_nonfinite_steps stops the run)
    last_eval: int = 0
    last_save: int = -1  # the step of the newest checkpoint of this run (-1: none yet)
    eval_pending: bool = False  # the evaluation of ``step`` failed: a resumed run runs it first

    def __post_init__(self):
        self.eval_history = [] if self.eval_history is None else self.eval_history

    @classmethod
    def from_saved(cls, saved: dict) -> "RunState":
        step, history = saved["step"], saved.get("eval_history", [])
        # the step last evaluated: a run stopped after its last step (a callback) is evaluated when resumed
        last_eval = history[-1].get("step", step) if history and isinstance(history[-1], dict) else step
        return cls(step=step, train_time=saved["train_time"], eval_history=history,
                   nonfinite_steps=saved.get("nonfinite_steps", 0), nonfinite_in_row=saved.get("nonfinite_in_row", 0),
                   last_eval=last_eval, last_save=step, eval_pending=saved.get("eval_pending", False))

    def to_saved(self) -> dict:
        return {"train_time": self.train_time, "eval_history": self.eval_history, "data_position": self.step,
                "nonfinite_steps": self.nonfinite_steps, "nonfinite_in_row": self.nonfinite_in_row,
                "eval_pending": self.eval_pending}

    def record_eval(self, metrics: dict) -> dict:
        self.eval_history.append({"step": self.step, "train_time_s": self.train_time, **metrics})
        self.last_eval = self.step
        return metrics

    def count_update(self, applied: bool) -> None:
        self.nonfinite_steps += not applied
        self.nonfinite_in_row = 0 if applied else self.nonfinite_in_row + 1


@dataclass
class Run:
    """Everything the loop holds, assembled by :func:`assemble`."""

    cfg: TrainerConfig
    ctx: DistContext
    rd: RunDir
    tok: object
    student: torch.nn.Module  # wrapped for data parallelism (FSDP2 / DDP) under torchrun
    task: Task
    held_out: list
    optimizer: torch.optim.Optimizer
    scheduler: object
    loss_fn: object  # DistillationLoss or PolicyGradientLoss
    state: RunState
    logger: object
    engines: EngineSet
    teachers: Teachers
    collect: Collector
    save: object  # save(step=, state=): an atomic, verified checkpoint
    config_dict: dict  # recorded in every checkpoint: a resume from another run's is refused
    pipeline: Pipeline | None = None  # train.max_staleness > 0: batches made ahead (train/steps/pipeline.py)
    context: TeacherPrompt | None = None  # teacher.context: the teacher's own prompt per problem (SPEC 6.7)
    callbacks: tuple = ()  # callback(step, metrics) -> True to stop: what a Python caller handed in
    env: Environment | None = None  # env.tools: the student's episodes run in it (SPEC 6.8)


@dataclass
class _Opened:
    """What rank 0 decided about the run directory before any model loads."""

    rd: RunDir
    ckpt: Path | None
    inputs: dict  # the fingerprints of what the run reads from files (train/disk/inputs.py)
    accepted: dict  # their changes the user named (--accept-changed), to record


def _open_run(cfg: TrainerConfig, resume: bool, overwrite: bool, accept: tuple = (), objects: dict | None = None
              ) -> _Opened:
    """Lock the run directory and apply its rules before any model loads: the checkpoint to resume, the config and
    the inputs (their fingerprints against the run's record: train/disk/inputs.py; ``objects``: those of what a
    Python caller handed in)."""
    rd = open_run_dir(cfg.run_dir, resume=resume, overwrite=overwrite)
    try:
        local = local_inputs(cfg, given=objects)
        if not resume:
            return _Opened(rd, None, local, {})
        ckpt, step, changes, accepted = _resume_checks(rd, cfg, local, accept)
        log.info("resuming %s from step %d (%s)", rd.path, step, ckpt)
        for key, (was, now) in changes.items():  # allowed, recorded in config_history.jsonl, and said
            log.info("--resume changes %s: %r -> %r (recorded in config_history.jsonl)", key, was, now)
        if "train.steps" in changes and cfg.optim.schedule == "cosine":
            warnings.warn(f"train.steps changed {changes['train.steps'][0]} -> {cfg.train.steps}: the cosine "
                          f"schedule now decays over {cfg.train.steps} steps, so the learning rate from the resumed "
                          f"step on differs from the original run's", RunWarning, stacklevel=3)
        set_aside_newer(rd.path, ckpt)
        set_aside_evaluations(rd.path, step)  # as metrics.jsonl is trimmed to the checkpoint
        return _Opened(rd, ckpt, local, accepted)
    except BaseException:
        rd.close()
        raise


def _resume_checks(rd: RunDir, cfg: TrainerConfig, local: dict, accept: tuple, *, record: bool = True) -> tuple:
    """The refusals of a resume: (the checkpoint, its step, the config's allowed changes, the input changes
    accepted). Its newest intact checkpoint; the config against the run's (``record``: its allowed changes appended
    to config_history.jsonl); the checkpoint's own config; what the run reads against its record."""
    ckpt = resume_checkpoint(rd.path, hint="; start the run again with --overwrite, or use another run_dir")
    step = checkpoint_step(ckpt)
    changes = rd.check_resume_config(rd.effective_config(lambda p: config_to_dict(load_config(p))),
                                     config_to_dict(cfg), step=step, record=record)
    check_checkpoint_config(ckpt, config_to_dict(cfg))  # a copied checkpoint or a hand-edited config.yaml
    accepted = check_inputs(rd.path, local, accept, what="--resume")  # a folder or file changed under the run
    return ckpt, step, changes, accepted


def _check_resume(cfg: TrainerConfig, task: Task, accept: tuple) -> tuple[int, dict]:
    """Every refusal a resume of ``cfg.run_dir`` makes before a model loads (a run there, an intact checkpoint, the
    config's changes, the fingerprints of what it reads, ``task`` included), nothing written or locked: (the step
    it would resume from, the config's allowed changes)."""
    path = Path(cfg.run_dir)
    check_holds_run(path)
    local = local_inputs(cfg, given=object_inputs(task=task))
    ckpt, step, changes, _ = _resume_checks(RunDir(path, None), cfg, local, accept, record=False)
    return step, changes


def _record_inputs(cfg: TrainerConfig, opened: _Opened, teachers, accept: tuple, step: int) -> None:
    """The servers' fingerprints (their /info, read when the teachers connected) checked like the files' on a
    resume; then the run's record of what it reads written (train/disk/inputs.py). Rank 0."""
    remote = remote_inputs(cfg, teachers)
    accepted = dict(opened.accepted)
    if opened.ckpt is not None:
        accepted |= check_inputs(opened.rd.path, remote, accept, what="--resume")
    record_inputs(opened.rd, {**opened.inputs, **remote}, accepted, step=step)


def build_rewards(cfg: TrainerConfig, task: Task, given: tuple = ()) -> Rewards:
    """What a completion earns (opdistill/data/rewards.py): ``reward.functions``, or the callables (or names) a
    Python caller handed in (``given``; the config then names none), each imported and its signature checked."""
    if given and cfg.reward.functions:
        raise ConfigError(f"rewards: {len(given)} given in Python and reward.functions={cfg.reward.functions} in the "
                          f"config; name the reward functions in one place")
    return Rewards(task, given or cfg.reward.functions, cfg.reward.weights,  # the weights of either
                   key="rewards" if given else "reward.functions")


def build_env(cfg: TrainerConfig, tok, given: tuple | dict = ()) -> Environment | None:
    """The environment of a run's episodes (SPEC 6.8; opdistill/env): ``env.tools`` or the callables a Python caller
    handed in (``given``), imported and their signatures checked, the student's chat template checked for tool
    messages; None without tools (single responses)."""
    if given and cfg.env.tools:
        raise ConfigError(f"tools: {len(given)} given in Python and env.tools={cfg.env.tools} in the config; name "
                          "the tools in one place")
    if not (given or cfg.env.tools):
        return None
    ec = cfg.env
    limits = dict(timeout_s=ec.tool_timeout_s, max_result_chars=ec.max_result_chars)
    tools = Tools(given, key="tools", **limits) if given else Tools.from_specs(ec.tools, **limits)
    return Environment(tools, tok, max_turns=ec.max_turns, max_episode_tokens=ec.max_episode_tokens,
                       call_format=CallFormat(ec.call_open, ec.call_close),
                       use_chat_template=cfg.data.use_chat_template, calls_in_prompt=ec.calls_in_prompt)


def _refuse_early(cfg: TrainerConfig, ctx: DistContext, models, given: "Given") -> tuple:
    """Every refusal the config, the process layout and the model folders' metadata decide: (tokenizer, task,
    source, held-out problems, the teacher cache or None, the teacher's own prompt per problem or None, the
    rewards). Nothing is loaded yet: the cache file is checked here (format, checksum, values, K, tokenizer), its
    teacher once the teacher is loaded; the reward functions are imported."""
    tok, student_info, teacher_infos = _infos(cfg, models)
    task = given.task if given.task is not None else build_task(cfg)
    rewards = build_rewards(cfg, task, tuple(given.rewards))
    source = PromptSource(task, cfg.train.seed, cfg.data.eval_seed)
    held_out = source.held_out(cfg.eval.num_prompts)
    context = build_context(cfg, task, tok)
    env = build_env(cfg, tok, given.tools)
    check_before_loading(cfg, tok, student_info, teacher_infos, task, world=ctx.world, dp=ctx.dp[1],
                         held_out=len(held_out), env=env)
    if context is not None:
        check_context(cfg, context, tok, student_info, teacher_infos, source, held_out, env)
    return tok, task, source, held_out, open_teacher_cache(cfg, tok), context, rewards, env


def check_run(cfg: TrainerConfig, ctx: DistContext = DistContext(), *, nproc: int | None = None,
              resume_accept: tuple | None = None) -> dict:
    """``opdistill check`` (a dry run): every refusal :func:`assemble` makes before loading a weight (the config, the
    process layout, the model folders' metadata, the data, the teacher cache), and nothing else: no lock, no file
    written, no weight read. ``nproc``: check as that many processes would run it (torchrun's world size; default:
    this process's). ``resume_accept``: also every refusal a resume makes (``train --dry-run --resume``; the inputs
    whose change it accepts). Returns what it found: {"held_out": problems, "tokenizer_vocab": size} and, for a
    resume, "resume_step" and "resume_changes" (the config's allowed changes)."""
    if nproc is not None and nproc > 1:
        dp = check_layout(cfg, nproc)  # opdistill/train/run/rules.py: what torchrun's start-up refuses
        ctx = DistContext(rank=0, world=nproc, dp_rank=0, dp_world=dp)
    tok, task, source, held_out, cache, context, rewards, env = _refuse_early(cfg, ctx, None, Given())
    found = {"held_out": len(held_out), "tokenizer_vocab": len(tok)}
    if resume_accept is not None:  # train --dry-run --resume: the resume's own refusals too
        found["resume_step"], found["resume_changes"] = _check_resume(cfg, task, resume_accept)
    return found


def _open_run_dir(cfg: TrainerConfig, ctx: DistContext, resume: bool, overwrite: bool, accept: tuple = (),
                  objects: dict | None = None):
    """(RunDir, checkpoint to resume or None, rank 0's :class:`_Opened` or None): rank 0 alone locks the run directory
    and applies its rules; the others wait for its verdict and resume from its choice."""
    opened = ctx.from_main(_open_run, cfg, resume, overwrite, accept, objects)
    rd, ckpt = (opened.rd, opened.ckpt) if opened is not None else (RunDir(Path(cfg.run_dir), None), None)
    shared = ctx.broadcast_text(None if ckpt is None else str(ckpt))
    return rd, None if shared is None else Path(shared), opened


def _load(cfg: TrainerConfig, ctx: DistContext, tok, models):
    """(student, {config key: in-process teacher model}), loaded, checked, placed and wrapped."""
    torch.manual_seed(cfg.train.seed)
    # distributed.decode sharded (FSDP2, no replica): no rank ever holds the whole student, loading included
    shards = models is None and ctx.enabled and ctx.strategy == "fsdp2" and ctx.decode == "sharded" and \
        cfg.model.lora is None
    _, student, teacher = models if models is not None else load_models(
        cfg, tok, teacher_shards=ctx.enabled and cfg.model.teacher_sharded, student_shards=shards)
    given = teacher if isinstance(teacher, dict) else None
    teacher = None if isinstance(teacher, dict) else teacher
    if models is not None:  # handed in: what load_models checks, before any evaluation
        check_loaded(cfg, student, teacher)
    named = load_named_teachers(cfg, tok, student, given)
    if cfg.train.gradient_checkpointing:
        enable_gradient_checkpointing(student)
    if cfg.train.fused_lm_head:  # refuse a head the fused path would compute differently, before any training
        check_lm_head(student, torch.arange(min(16, student.config.vocab_size))[None])
    student, teacher = place_models(run_device(cfg), student, teacher,  # train.device: cpu | cuda:LOCAL_RANK
                                    teacher_sharded=ctx.enabled and cfg.model.teacher_sharded,
                                    student_sharded=shards)
    student = wrap_student(ctx, student)  # FSDP2 or DDP under torchrun; unchanged in one process
    if shards:  # each rank reads only its rows of every weight (models.load_shards)
        load_shards(student, student.config._name_or_path, device=run_device(cfg), group=ctx.group,
                    key="model.student", fallback="distributed.decode=replica")
    return student, ({} if teacher is None else {"model.teacher": teacher}) | named


def _loss(cfg: TrainerConfig, ctx: DistContext):
    """The step's loss object: the distillation loss, or the policy-gradient loss of RL from rewards alone."""
    if cfg.train.method == "rl":
        return PolicyGradientLoss.from_config(cfg.loss, **ctx.vocab_kwargs)
    return DistillationLoss(cfg.loss, **ctx.vocab_kwargs)


@dataclass(frozen=True)
class Given:
    """What a Python caller hands ``run_training`` besides the models (docs/python_api.md): its own ``task`` (in
    place of the config's data section's task), reward functions (in place of ``reward.functions``) and
    ``callbacks`` (called with each step's metrics: :func:`opdistill.train.loop.run_training`)."""

    task: Task | None = None
    rewards: tuple = ()
    callbacks: tuple = ()
    tools: tuple | dict = ()  # the environment's tools (callables, or {name: callable}), in place of env.tools


def assemble(cfg: TrainerConfig, ctx: DistContext, stack: ExitStack, *, resume: bool, overwrite: bool, models=None,
             quiet: bool = False, accept_changed: tuple = (), given: Given = Given()) -> Run:
    """The run of ``cfg`` in ``ctx``, its resources entered into ``stack`` (module docstring). ``accept_changed``:
    the inputs whose change since the run started a resume accepts (``--accept-changed``; train/disk/inputs.py).
    ``models``, ``given``: what a Python caller hands in (models, a task, rewards, callbacks)."""
    tok, task, source, held_out, cache, context, rewards, env = _refuse_early(cfg, ctx, models, given)
    objects = object_inputs(models, task) if ctx.is_main else None  # their fingerprints (train/disk/inputs.py)
    rd, ckpt, opened = _open_run_dir(cfg, ctx, resume, overwrite, tuple(accept_changed), objects)
    stack.enter_context(rd)
    student, teacher_models = _load(cfg, ctx, tok, models)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg.optim)  # AdamW, fused where available (opdistill/train/run/optim.py)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, cfg.train.steps))
    loss_fn = _loss(cfg, ctx)
    if cache is not None and "model.teacher" in teacher_models:  # the cache's teacher against the loaded one
        check_provenance(cfg.data.teacher_cache, cache, teacher=teacher_models["model.teacher"])
    state, saved_tensors = RunState(), {}
    if ckpt is not None:
        saved = load_checkpoint(ckpt, student, optimizer, scheduler, group=ctx.world_group)
        saved_tensors = saved.pop("extra_tensors", {})
        state = RunState.from_saved(saved)
    elif ctx.is_main:  # written once the models and the config's checks passed: a run refused at start-up
        rd.write_config(config_to_dict(cfg))
    logger = stack.enter_context(_closing(RunLogger(
        rd.path, start_step=state.step, tensorboard=cfg.log.tensorboard, progress=cfg.log.progress and not quiet,
        total_steps=cfg.train.steps, wandb=open_wandb(cfg.log, rd.path, config_to_dict(cfg), start_step=state.step),
        budget_s=cfg.train.max_time_s, desc=rd.path.name,
        sigterm=False)  # the loop's StopSignals owns SIGTERM: a stop at the next step, then this logger closes
        if ctx.is_main else NullLogger()))
    save = functools.partial(save_checkpoint, rd.path, model=student, optimizer=optimizer, scheduler=scheduler,
                             keep_last=cfg.checkpoint.keep_last, tokenizer=tok, group=ctx.world_group)
    try:
        engines = stack.enter_context(_closing(open_engines(cfg, tok, student, resolve_model_path)))  # after the ckpt
        teachers = stack.enter_context(_closing(build_teacher(cfg, TeacherContext(
            tokenizer=tok, student=getattr(student, "module", student), models=teacher_models,
            mesh=ctx.mesh if ctx.enabled else None,
            group=ctx.group, cache=cache, resolve=resolve_model_path,
            tools=None if env is None else env.tools.schemas))))
    except Exception as e:  # an engine or a teacher that cannot start (a server away): the run stays resumable
        e.checkpoint = _keep_start(cfg, ctx, ckpt, state, save)
        raise
    if cfg.loss.loss_mode == "full" and teachers.train is not None:  # every rank: a sharded head is gathered
        ctx.from_main(rd.check_teacher_heads, _teacher_heads(teachers.train), ckpt is not None)
    ctx.from_main(lambda: _record_inputs(cfg, opened, teachers, tuple(accept_changed), state.step))
    collect = Collector(cfg, tok=tok, task=task, source=source, teacher=teachers.train,
                        writer=teacher_models.get("model.teacher"), engines=engines, cache=cache, ctx=ctx,
                        context=context, rewards=rewards, env=env)
    pipeline = None
    if cfg.train.max_staleness:  # last: its thread starts generating at once
        pipeline = stack.enter_context(_closing(Pipeline(
            collect, student, max_staleness=cfg.train.max_staleness, start=state.step, steps=cfg.train.steps,
            versions=Pipeline.versions_from(saved_tensors))))
    return Run(cfg, ctx, rd, tok, student, task, held_out, optimizer, scheduler, loss_fn, state, logger, engines,
               teachers, collect, save, config_to_dict(cfg), pipeline, context, tuple(given.callbacks), env)


def _teacher_heads(teacher) -> dict[str, str]:
    """{where the teacher comes from: SHA-256 of its lm_head} for the hidden-state payload (each routed member)."""
    from opdistill.teachers.wire import head_sha256

    out = {}
    for name, t in teacher.named().items():
        head = t.head
        if head is not None:
            out[f"{t.key}" + (f" ({name})" if name else "")] = head_sha256(head.weight, head.bias)
    return out


def _keep_start(cfg: TrainerConfig, ctx: DistContext, ckpt: Path | None, state: RunState, save) -> str | None:
    """The checkpoint a run failing before its first step can be resumed from (the teachers' messages say
    ``--resume``): the one it resumed from, or, for a new run in one process, a checkpoint of step 0 (the start's
    weights and optimizer); None when none can be written (under torchrun the peers may be elsewhere)."""
    if ckpt is not None:
        return str(ckpt)
    if ctx.enabled:
        return None
    try:
        path = save(step=0, state={**state.to_saved(), "config": config_to_dict(cfg)})
    except Exception:  # noqa: BLE001 -- the original failure is the one to report
        return None
    state.last_save = 0
    return str(path)


class _closing:
    """``with _closing(x) as x``: ``x.close()`` on exit."""

    def __init__(self, thing):
        self.thing = thing

    def __enter__(self):
        return self.thing

    def __exit__(self, *exc):
        self.thing.close()
