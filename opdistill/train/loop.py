"""The training loop, as one straight line per step:

    prompts(step) -> rollouts (student; the teacher for off-policy KD) -> teacher scoring -> rewards/advantages
      -> train_step (GlobalBatch, token-budget micro-batches, loss, backward, clip, AdamW) -> scheduler
      -> log (metrics.jsonl, TensorBoard, progress bar) -> evaluate every N -> checkpoint every N

State is passed explicitly: what changes from step to step lives in one ``RunState`` (saved in every checkpoint),
and the run directory's rules (lock, one run per folder, config check on resume, no symlinks) are applied by
``rundir.open_run_dir`` before any model loads (docs/reliability.md). The data position is the step number (prompts
are a pure function of seed and step), and the sampling RNG is reseeded from (seed, step) at the start of every step,
so a run resumed from a checkpoint draws exactly the prompts and samples the uninterrupted run drew; RNG states are
saved as well for anything outside that.
Under torchrun the same loop runs on every rank (opdistill/train/distributed.py, docs/distributed.md): each rank
samples and scores its share of the step's prompts, the step's GlobalBatch and metrics are reduced over the
data-parallel group, and rank 0 alone holds the run directory and writes logs and manifests.
``train.max_time_s`` bounds the time spent in rollout + teacher + update phases (evaluation and checkpointing
excluded), which is how the demo gives every method the same wall-clock budget.
"""
from __future__ import annotations

import functools
import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from opdistill import DistillationLoss, TeacherTopK, shift_for_next_token
from opdistill.fused import check_lm_head
from opdistill.engines.vllm import EngineSet, open_engines
from opdistill.data import DatasetTask, PromptSource, Task, make_task, render_prompt
from opdistill.models import check_compatible, load_model, load_tokenizer, resolve_model_path, truncate_layers
from opdistill.teacher import TeacherCacheError, load_cache
from opdistill.train.checkpoint import load_checkpoint, resume_checkpoint, save_checkpoint, set_aside_newer
from opdistill.errors import ConfigError
from opdistill.train.config import TrainerConfig, config_to_dict, load_config
from opdistill.train.distributed import DistContext, init_distributed, wrap_student
from opdistill.train.evaluate import evaluate_values, gather_values, summarize, values_to_json
from opdistill.train.logger import NullLogger, RunLogger
from opdistill.train.lora import SELF, apply_lora, enable_gradient_checkpointing, self_teacher
from opdistill.train.optim import build_optimizer
from opdistill.train.rundir import (NonFiniteError, RunDir, RunWarning, atomic_write_text, check_checkpoint_config,
                                   open_run_dir)
from opdistill.train.wandb_log import open_wandb
from opdistill.train.preflight import check_against_models, check_finite_weights
from opdistill.train.remote_teacher import connect_teacher
from opdistill.train.teachers import attach_scores, open_teachers
from opdistill.train.sharded_teacher import check_held_out, shard_teacher
from opdistill.train.placement import place_models, run_device
from opdistill.train.step import StepData, group_advantages, train_step

__all__ = ["RunState", "run_training", "run_eval", "resolve_model_path", "build_task", "load_models", "lr_lambda"]

def build_task(cfg: TrainerConfig) -> Task:
    dc = cfg.data
    if dc.task == "dataset":
        return DatasetTask(dc.path, dc.prompt_field, dc.answer_field, split=dc.split, subset=dc.subset,
                           eval_path=dc.eval_path, eval_split=dc.eval_split, eval_fraction=dc.eval_fraction,
                           answer_match=dc.answer_match, task_field=cfg.routing.field if cfg.routing else None)
    return make_task(cfg.data.task, **cfg.data.task_args)


def load_models(cfg: TrainerConfig):
    """(tokenizer, student, teacher or None); refuses incompatible pairs before any training."""
    mc = cfg.model
    student_path = resolve_model_path(mc.student)
    teacher = None
    if mc.teacher and mc.teacher != SELF and cfg.teacher.url is None:  # teacher.url: the server scores
        teacher_path = resolve_model_path(mc.teacher)
        teacher = load_model(teacher_path, dtype=mc.dtype, trust_remote_code=mc.trust_remote_code,
                             attn_implementation=mc.attn_implementation)
        teacher.requires_grad_(False)
        t_tok = load_tokenizer(teacher_path, trust_remote_code=mc.trust_remote_code)
    tok = load_tokenizer(student_path, trust_remote_code=mc.trust_remote_code)
    student = load_model(student_path, dtype=mc.dtype, trust_remote_code=mc.trust_remote_code,
                         attn_implementation=mc.attn_implementation)
    if mc.student_from_teacher_layers:
        student = truncate_layers(student, mc.student_from_teacher_layers)
    if mc.lora is not None:  # only the adapters train; model.teacher "self" = the base with them off (train/lora.py)
        student = apply_lora(student, mc.lora)
    if mc.teacher == SELF:
        teacher = self_teacher(student)
    elif teacher is not None:
        check_compatible(tok, t_tok, student, teacher)
    check_finite_weights(cfg, student, teacher)  # a corrupt folder is refused before any eval, score or step
    return tok, student, teacher


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
    checksum, every value; opdistill/teacher.py) and against the loss, before any training (None when unset)."""
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


def _collect_from_cache(cfg: TrainerConfig, step: int, cache: dict, ctx: DistContext):
    """Off-policy KD from a teacher cache: the step's rows are the next prompts_per_step x n rows, wrapping around,
    so the data position is a function of the step (exact resume) and no teacher forward runs in training. Each
    rank takes its contiguous share of them."""
    total = cache["input_ids"].shape[0]
    rows = cfg.data.prompts_per_step * cfg.rollout.n
    offset, count = ctx.share(rows)
    idx = (torch.arange(offset, offset + count) + (step - 1) * rows) % total
    scores = cache["scores"]
    data = StepData(cache["input_ids"][idx], cache["attention_mask"][idx], cache["response_mask"][idx],
                    teacher_topk=None if scores.topk is None else TeacherTopK(scores.topk.ids[idx],
                                                                            scores.topk.logprobs[idx],
                                                                            validated=scores.topk.validated),
                    teacher_sampled=None if scores.sampled_logprobs is None else scores.sampled_logprobs[idx])
    (tokens,) = ctx.sum([float(data.response_mask.sum())])
    return data, {"train/response_len": tokens / rows, "time/rollout_s": 0.0, "time/teacher_s": 0.0,
                  "train/generated_tokens": tokens, "train/cache_rows_seen": float(min(step * rows, total))}


def needs_sampler_logprobs(cfg: TrainerConfig, engines: EngineSet | None = None) -> bool:
    """Whether a step reads the sampler's log-probs (the "old" log-probs): the policy-gradient losses (``train.method
    rl``, ``loss.use_policy_gradient``, ``loss.use_task_rewards``) and the rollout mismatch metrics / TIS
    (``engines.mismatch``). Otherwise the rollouts are drawn without them (the same samples: log-probs draw no
    randomness) and ``StepData.sampler_logprobs`` is None."""
    lc = cfg.loss
    return (cfg.train.method == "rl" or lc.use_policy_gradient or lc.use_task_rewards
            or (engines is not None and engines.mismatch is not None))


def _collect(cfg: TrainerConfig, step: int, tok, student, teacher, task: Task, source: PromptSource, cache=None,
             ctx: DistContext = DistContext(), engines: EngineSet | None = None):
    """Rollouts (or cached rows), teacher scores and advantages for one step; returns (StepData, metrics).
    ``student``: the module to decode with. Under data parallelism this rank's share of the step's prompts (all
    ``rollout.n`` samples of each: a GRPO group stays on one rank), keyed by their global index; metrics reduced.
    ``engines``: rollout.engine / teacher.engine (opdistill/engines/vllm.py); default: our sampler, HF scoring."""
    engines = engines or EngineSet()
    if cache is not None:
        return _collect_from_cache(cfg, step, cache, ctx)
    rc, method = cfg.rollout, cfg.train.method
    offset, count = ctx.share(cfg.data.prompts_per_step)
    problems = source.batch(step, cfg.data.prompts_per_step)[offset:offset + count]
    prompts = [render_prompt(tok, p.prompt, use_chat_template=cfg.data.use_chat_template) for p in problems]
    torch.manual_seed(cfg.train.seed * 1_000_003 + step)
    t0 = time.perf_counter()
    writer = teacher if method == "off_policy" else student
    old = needs_sampler_logprobs(cfg, engines)  # else the sampler skips them (a log-sum-exp per token)
    ro = engines.generate_rollouts(writer, tok, prompts, n=rc.n, temperature=rc.temperature, top_p=rc.top_p,
                                   top_k=rc.top_k, max_new_tokens=rc.max_new_tokens, min_new_tokens=rc.min_new_tokens,
                                   batch_size=rc.batch_size, seed=cfg.train.seed, step=step, prompt_offset=offset,
                                   want_logprobs=old)
    t1 = time.perf_counter()
    data = StepData(ro.input_ids, ro.attention_mask, ro.response_mask,
                    sampler_logprobs=ro.sampler_logprobs if old else None)
    if method != "rl":  # in process, a vLLM teacher engine, the teacher.url server, or routed (train/teachers.py)
        attach_scores(data, engines.teacher or teacher, ro, problems, cfg, step)
    t2 = time.perf_counter()
    rewards = torch.tensor([task.score(problems[i], t) for i, t in zip(ro.prompt_index, ro.texts)])
    if method == "rl" or cfg.loss.use_task_rewards:
        data.advantages = group_advantages(rewards, ro.prompt_index)
    reward_sum, rows, tokens = ctx.sum([float(rewards.double().sum()), float(ro.num_rows),
                                        float(ro.response_mask.sum())])
    metrics = {
        "train/reward": reward_sum / rows if rows else float("nan"),
        "train/response_len": tokens / max(rows, 1),
        "time/rollout_s": t1 - t0,
        "time/teacher_s": t2 - t1,
        "train/generated_tokens": tokens,
    }
    return data, metrics


def run_eval(cfg: TrainerConfig, tok, student, teacher, task, held_out, ctx: DistContext = DistContext(),
             values_path: Path | None = None) -> dict:
    """Evaluate on ``held_out``; under data parallelism each rank takes a contiguous part, sums are reduced exactly.
    ``values_path``: also write the per-problem values there (JSON, atomic, by the main rank): what ``opdistill
    compare`` pairs over problems."""
    ec = cfg.eval
    offset, count = ctx.split(len(held_out))
    values = gather_values(evaluate_values(
        student, tok, task, held_out[offset:offset + count], teacher=teacher, temperature=cfg.rollout.temperature,
        max_new_tokens=ec.max_new_tokens or cfg.rollout.max_new_tokens, greedy=ec.greedy, sampled=ec.sampled,
        topk=ec.topk, batch_size=ec.batch_size, use_chat_template=cfg.data.use_chat_template,
        seed=cfg.data.eval_seed + 777, num_samples=ec.num_samples, prompt_offset=offset), ctx.group)
    if values_path is not None and ctx.is_main:
        values_path.parent.mkdir(parents=True, exist_ok=True)  # RUN_DIR/eval: a link there is refused at open
        atomic_write_text(values_path, json.dumps(values_to_json(values)) + "\n")
    return summarize(values, resamples=ec.bootstrap_resamples, seed=cfg.data.eval_seed + 777)


@dataclass
class RunState:
    """What changes from step to step besides the weights, optimizer, scheduler and RNG states; saved in every
    checkpoint (``to_saved``) so a resumed run continues with the same counters."""

    step: int = 0  # optimizer steps taken = the data position (prompts are a function of (seed, step))
    train_time: float = 0.0  # seconds in the rollout + teacher + update phases (train.max_time_s)
    eval_history: list = field(default_factory=list)
    nonfinite_steps: int = 0  # steps not applied because the loss or gradient norm was NaN/inf
    nonfinite_in_row: int = 0  # ... consecutively, up to this step (train.max_nonfinite_steps stops the run)
    last_eval: int = 0
    last_save: int = 0

    @classmethod
    def from_saved(cls, saved: dict) -> "RunState":
        step = saved["step"]
        return cls(step=step, train_time=saved["train_time"], eval_history=saved.get("eval_history", []),
                   nonfinite_steps=saved.get("nonfinite_steps", 0), nonfinite_in_row=saved.get("nonfinite_in_row", 0),
                   last_eval=step, last_save=step)

    def to_saved(self) -> dict:
        return {"train_time": self.train_time, "eval_history": self.eval_history, "data_position": self.step,
                "nonfinite_steps": self.nonfinite_steps, "nonfinite_in_row": self.nonfinite_in_row}

    def record_eval(self, metrics: dict) -> dict:
        self.eval_history.append({"step": self.step, "train_time_s": self.train_time, **metrics})
        self.last_eval = self.step
        return metrics

    def count_update(self, applied: bool) -> None:
        self.nonfinite_steps += not applied
        self.nonfinite_in_row = 0 if applied else self.nonfinite_in_row + 1


def _stop_nonfinite(cfg: TrainerConfig, state: RunState) -> NonFiniteError:
    n = cfg.train.max_nonfinite_steps
    last = f"step {state.last_save}" if state.last_save else "none yet"
    return NonFiniteError(
        f"step {state.step}: the loss or gradient norm was NaN/inf for {state.nonfinite_in_row} steps in a row "
        f"(train.max_nonfinite_steps={n}); none of them was applied and the run is stopped (last checkpoint: {last}). "
        f"Likely causes: fp16 overflow (model.dtype=float16: use bfloat16 or float32), a learning rate too high "
        f"(optim.lr={cfg.optim.lr}), bad data or teacher scores (NaN/inf inputs)")


def _open_run(cfg: TrainerConfig, resume: bool, overwrite: bool):
    """Lock the run directory and apply its rules before any model loads: (RunDir, checkpoint to resume or None)."""
    rd = open_run_dir(cfg.run_dir, resume=resume, overwrite=overwrite)
    try:
        if not resume:
            return rd, None
        ckpt = resume_checkpoint(rd.path, hint="; start the run again with --overwrite, or use another run_dir")
        changes = rd.check_resume_config(rd.effective_config(lambda p: config_to_dict(load_config(p))),
                                         config_to_dict(cfg), step=int(ckpt.name.split("_")[1]))
        check_checkpoint_config(ckpt, config_to_dict(cfg))  # a copied checkpoint or a hand-edited config.yaml
        if "train.steps" in changes and cfg.optim.schedule == "cosine":
            warnings.warn(f"train.steps changed {changes['train.steps'][0]} -> {cfg.train.steps}: the cosine "
                          f"schedule now decays over {cfg.train.steps} steps, so the learning rate from the resumed "
                          f"step on differs from the original run's", RunWarning, stacklevel=3)
        set_aside_newer(rd.path, ckpt)
        return rd, ckpt
    except BaseException:
        rd.close()
        raise


def run_training(cfg: TrainerConfig, *, resume: bool = False, overwrite: bool = False, models=None,
                 quiet: bool = False) -> dict:
    """Train as configured; returns a summary (steps, time, eval history). ``models`` = (tok, student, teacher).

    ``resume``: continue the run in ``cfg.run_dir`` from its newest intact checkpoint (allowed config changes only);
    ``overwrite``: delete the run in ``cfg.run_dir`` first. Without either, a ``run_dir`` holding a run is refused
    (:class:`RunError`; rules in opdistill/train/rundir.py and docs/reliability.md)."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    with init_distributed(cfg) as ctx:  # world size 1 without torchrun: no process group (docs/distributed.md)
        return _train(cfg, ctx, resume=resume, overwrite=overwrite, models=models, quiet=quiet)


def _train(cfg: TrainerConfig, ctx: DistContext, *, resume: bool, overwrite: bool, models, quiet: bool) -> dict:
    # rank 0 alone locks the run directory and applies its rules; the others wait for its verdict
    opened = ctx.from_main(_open_run, cfg, resume, overwrite)
    rd, ckpt = opened if opened is not None else (RunDir(Path(cfg.run_dir), None), None)
    shared = ctx.broadcast_text(None if ckpt is None else str(ckpt))  # every rank resumes from rank 0's choice
    ckpt = None if shared is None else Path(shared)
    with rd:
        torch.manual_seed(cfg.train.seed)
        tok, student, teacher = models if models is not None else load_models(cfg)
        task = build_task(cfg)
        check_against_models(cfg, tok, student, None if isinstance(teacher, dict) else teacher, task)  # before eval
        remote = connect_teacher(cfg, tok, student)  # teacher.url: the server, checked against the student
        routed = open_teachers(cfg, tok, student, task, teacher if isinstance(teacher, dict) else None)  # teachers
        teacher = routed if routed is not None else teacher
        source = PromptSource(task, cfg.train.seed, cfg.data.eval_seed)
        held_out = source.held_out(cfg.eval.num_prompts)
        check_held_out(ctx, cfg, len(held_out))  # a sharded teacher: every rank evaluates (its forwards)
        if cfg.train.gradient_checkpointing:
            enable_gradient_checkpointing(student)
        if cfg.train.fused_lm_head:  # refuse a head the fused path would compute differently, before any training
            check_lm_head(student, torch.arange(min(16, student.config.vocab_size))[None])
        student, teacher = place_models(run_device(cfg), student, teacher,  # train.device: cpu | cuda:LOCAL_RANK
                                        teacher_sharded=ctx.enabled and cfg.model.teacher_sharded)
        student = wrap_student(ctx, student)  # FSDP2 or DDP under torchrun; unchanged in one process
        teacher = shard_teacher(ctx, cfg, teacher)  # model.teacher_sharded: FSDP2 over the data-parallel group
        oc = cfg.optim
        params = [p for p in student.parameters() if p.requires_grad]
        optimizer = build_optimizer(params, oc)  # AdamW, fused where available (opdistill/train/optim.py)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(oc, cfg.train.steps))
        loss_fn = DistillationLoss(cfg.loss, **ctx.vocab_kwargs) if cfg.train.method != "rl" else None
        cache = open_teacher_cache(cfg, tok, teacher)
        pg_kwargs = dict(loss_agg_mode=cfg.loss.loss_agg_mode, clip_ratio_low=cfg.loss.clip_ratio_low,
                         clip_ratio_high=cfg.loss.clip_ratio_high, clip_ratio_c=cfg.loss.clip_ratio_c)

        state = RunState()
        if ckpt is not None:
            state = RunState.from_saved(load_checkpoint(ckpt, student, optimizer, scheduler, group=ctx.world_group))
        elif ctx.is_main:  # written once the models and the config's checks passed: a run refused at start-up
            rd.write_config(config_to_dict(cfg))
        logger = RunLogger(rd.path, start_step=state.step, tensorboard=cfg.log.tensorboard,
                           progress=cfg.log.progress and not quiet, total_steps=cfg.train.steps,
                           wandb=open_wandb(cfg.log, rd.path, config_to_dict(cfg), start_step=state.step)) \
            if ctx.is_main else NullLogger()
        engines = EngineSet()

        def evaluate_now() -> dict:  # several teachers: no teacher metrics in the evaluation
            return run_eval(cfg, tok, ctx.rollout_model(student), remote or (None if routed else teacher), task,
                            held_out, ctx, values_path=rd.path / "eval" / f"step_{state.step:06d}.json")

        cfg_dict = config_to_dict(cfg)  # recorded in every checkpoint: a resume from another run's is refused
        save = functools.partial(save_checkpoint, rd.path, model=student, optimizer=optimizer, scheduler=scheduler,
                                 keep_last=cfg.checkpoint.keep_last, tokenizer=tok, group=ctx.world_group)

        try:
            if ctx.world > 1 and "vllm" in (cfg.rollout.engine, cfg.teacher.engine):
                raise ConfigError("rollout.engine / teacher.engine: vllm engines run in one process in this version "
                                  "(one engine per rank under torchrun is not wired yet); use hf with torchrun")
            engines = open_engines(cfg, tok, student, resolve_model_path)  # after the checkpoint load: its weights
            if state.step == 0 and cfg.eval.num_prompts and cfg.eval.at_start:
                logger.log(0, state.record_eval(evaluate_now()))
            while state.step < cfg.train.steps:
                if cfg.train.max_time_s is not None and state.train_time >= cfg.train.max_time_s:
                    break
                state.step += 1
                t0 = time.perf_counter()
                data, metrics = _collect(cfg, state.step, tok, ctx.rollout_model(student), remote or teacher, task,
                                         source, cache, ctx, engines)
                t1 = time.perf_counter()
                metrics.update(train_step(student, optimizer, data, method=cfg.train.method, loss_fn=loss_fn,
                                          micro_batch_tokens=cfg.train.micro_batch_tokens, grad_clip=oc.grad_clip,
                                          bf16=cfg.train.bf16, loss_scale_factor=cfg.loss.loss_scale_factor,
                                          pg_kwargs=pg_kwargs, fused_lm_head=cfg.train.fused_lm_head,
                                          group=ctx.group, mismatch=engines.mismatch, vocab=ctx.vocab_kwargs))
                engines.sync(student)  # the new weights into a vLLM student engine, in place
                state.count_update(applied=not metrics["train/nonfinite"])
                metrics["train/nonfinite_steps"] = float(state.nonfinite_steps)
                metrics["train/lr"] = scheduler.get_last_lr()[0]
                scheduler.step()  # a skipped update still consumes its step: the schedule follows the data position
                t2 = time.perf_counter()
                state.train_time += ctx.max(t2 - t0)  # the slowest rank's time: every rank stops at the same step
                metrics.update({"time/update_s": t2 - t1, "time/step_s": t2 - t0,
                                "time/train_total_s": state.train_time,
                                "perf/tokens_per_s": metrics["train/generated_tokens"] / max(t2 - t0, 1e-9)})
                if state.nonfinite_in_row >= cfg.train.max_nonfinite_steps:
                    logger.log(state.step, metrics)
                    raise _stop_nonfinite(cfg, state)
                if cfg.eval.every and state.step % cfg.eval.every == 0 and cfg.eval.num_prompts:
                    metrics.update(state.record_eval(evaluate_now()))
                logger.log(state.step, metrics)
                logger.advance()
                if cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0:
                    save(step=state.step, state={**state.to_saved(), "config": cfg_dict})
                    state.last_save = state.step
            if state.last_eval != state.step and cfg.eval.num_prompts:
                logger.log(state.step, state.record_eval(evaluate_now()))
            if cfg.checkpoint.save_final and state.last_save != state.step:
                save(step=state.step, state={**state.to_saved(), "config": cfg_dict})
                state.last_save = state.step
        finally:
            engines.close()
            logger.close()
            if remote is not None:
                remote.close()
            if routed is not None:
                routed.close()
    return {"steps": state.step, "train_time_s": state.train_time, "eval_history": state.eval_history,
            "final_eval": state.eval_history[-1] if state.eval_history else {}}
