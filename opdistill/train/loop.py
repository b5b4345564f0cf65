"""The training loop, as one straight line per step:

    prompts(step) -> rollouts (student; the teacher for off-policy KD) -> teacher scoring -> rewards/advantages
      -> train_step (GlobalBatch, token-budget micro-batches, loss, backward, clip, AdamW) -> scheduler
      -> log (metrics.jsonl, TensorBoard, progress bar) -> evaluate every N -> checkpoint every N

The run is assembled before it runs (``opdistill.train.assemble``: every refusal the config and the model folders
decide before any model loads, then the run directory's rules, the models, the optimizer, the engines and the
teachers, each resource held in one ``ExitStack``); state is passed explicitly: what changes from step to step lives
in one ``RunState`` (saved in every checkpoint). The data position is the step number (prompts
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

import json
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from opdistill.runs.values import summarize, values_to_json
from opdistill.train.assemble import Run, RunState, assemble, build_task, load_models
from opdistill.train.config import TrainerConfig
from opdistill.train.distributed import DistContext, init_distributed
from opdistill.train.evaluate import evaluate_values, gather_values
from opdistill.train.rundir import NonFiniteError, atomic_write_text
from opdistill.train.step import train_step

__all__ = ["RunState", "run_training", "run_eval", "build_task", "load_models"]


def run_eval(cfg: TrainerConfig, tok, student, teacher, task, held_out, ctx: DistContext = DistContext(),
             values_path: Path | None = None) -> dict:
    """Evaluate on ``held_out`` (``teacher``: an ``opdistill.teachers.Teacher``, or None: no teacher metrics);
    under data parallelism each rank takes a contiguous part, sums are reduced exactly. ``values_path``: also write
    the per-problem values there (JSON, atomic, by the main rank): what ``opdistill compare`` pairs over problems."""
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


def _stop_nonfinite(cfg: TrainerConfig, state: RunState) -> NonFiniteError:
    n = cfg.train.max_nonfinite_steps
    last = f"step {state.last_save}" if state.last_save else "none yet"
    return NonFiniteError(
        f"step {state.step}: the loss or gradient norm was NaN/inf for {state.nonfinite_in_row} steps in a row "
        f"(train.max_nonfinite_steps={n}); none of them was applied and the run is stopped (last checkpoint: {last}). "
        f"Likely causes: fp16 overflow (model.dtype=float16: use bfloat16 or float32), a learning rate too high "
        f"(optim.lr={cfg.optim.lr}), bad data or teacher scores (NaN/inf inputs)")


def run_training(cfg: TrainerConfig, *, resume: bool = False, overwrite: bool = False, models=None,
                 quiet: bool = False, accept_changed: tuple = ()) -> dict:
    """Train as configured; returns a summary (steps, time, eval history). ``models`` = (tok, student, teacher)
    already loaded (``teacher``: a model, or {name: model} for ``teachers``).

    ``resume``: continue the run in ``cfg.run_dir`` from its newest intact checkpoint (allowed config changes only);
    ``overwrite``: delete the run in ``cfg.run_dir`` first. Without either, a ``run_dir`` holding a run is refused
    (:class:`RunError`; rules in opdistill/train/rundir.py and docs/reliability.md). ``accept_changed``: input names
    (``teacher``, ``data.path``, ...) whose change since the run started a resume accepts (train/inputs.py)."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    with init_distributed(cfg) as ctx, ExitStack() as stack:  # world size 1 without torchrun: no process group
        run = assemble(cfg, ctx, stack, resume=resume, overwrite=overwrite, models=models, quiet=quiet,
                       accept_changed=accept_changed)
        return _loop(run)


def _evaluate(run: Run) -> dict:
    """The held-out evaluation at the current step (every rank: its share of the problems)."""
    return run.state.record_eval(run_eval(
        run.cfg, run.tok, run.ctx.rollout_model(run.student), run.teachers.eval, run.task, run.held_out, run.ctx,
        values_path=run.rd.path / "eval" / f"step_{run.state.step:06d}.json"))


def _save(run: Run) -> None:
    run.save(step=run.state.step, state={**run.state.to_saved(), "config": run.config_dict})
    run.state.last_save = run.state.step


def _loop(run: Run) -> dict:
    """The steps, one straight line each: collect -> update -> log -> evaluate every N -> checkpoint every N."""
    cfg, ctx, state, logger = run.cfg, run.ctx, run.state, run.logger
    if state.step == 0 and cfg.eval.num_prompts and cfg.eval.at_start:
        logger.log(0, _evaluate(run))
    while state.step < cfg.train.steps:
        if cfg.train.max_time_s is not None and state.train_time >= cfg.train.max_time_s:
            break
        state.step += 1
        t0 = time.perf_counter()
        data, metrics = run.collect(state.step, ctx.rollout_model(run.student))
        t1 = time.perf_counter()
        metrics.update(train_step(run.student, run.optimizer, data, loss_fn=run.loss_fn,
                                  micro_batch_tokens=cfg.train.micro_batch_tokens, grad_clip=cfg.optim.grad_clip,
                                  bf16=cfg.train.bf16, fused_lm_head=cfg.train.fused_lm_head, group=ctx.group,
                                  mismatch=run.engines.mismatch))
        run.engines.sync(run.student)  # the new weights into a vLLM student engine, in place
        state.count_update(applied=not metrics["train/nonfinite"])
        metrics["train/nonfinite_steps"] = float(state.nonfinite_steps)
        metrics["train/lr"] = run.scheduler.get_last_lr()[0]
        run.scheduler.step()  # a skipped update still consumes its step: the schedule follows the data position
        t2 = time.perf_counter()
        state.train_time += ctx.max(t2 - t0)  # the slowest rank's time: every rank stops at the same step
        metrics.update({"time/update_s": t2 - t1, "time/step_s": t2 - t0, "time/train_total_s": state.train_time,
                        "perf/tokens_per_s": metrics["train/generated_tokens"] / max(t2 - t0, 1e-9)})
        if state.nonfinite_in_row >= cfg.train.max_nonfinite_steps:
            logger.log(state.step, metrics)
            raise _stop_nonfinite(cfg, state)
        if cfg.eval.every and state.step % cfg.eval.every == 0 and cfg.eval.num_prompts:
            metrics.update(_evaluate(run))
        logger.log(state.step, metrics)
        logger.advance()
        if cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0:
            _save(run)
    if state.last_eval != state.step and cfg.eval.num_prompts:
        logger.log(state.step, _evaluate(run))
    if cfg.checkpoint.save_final and state.last_save != state.step:
        _save(run)
    return {"steps": state.step, "train_time_s": state.train_time, "eval_history": state.eval_history,
            "final_eval": state.eval_history[-1] if state.eval_history else {}}
