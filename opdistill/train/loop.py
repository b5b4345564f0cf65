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
Under torchrun the same loop runs on every rank (opdistill/train/run/distributed.py, docs/distributed.md): each rank
samples and scores its share of the step's prompts, the step's GlobalBatch and metrics are reduced over the
data-parallel group, and rank 0 alone holds the run directory and writes logs and manifests.
``train.max_time_s`` bounds the time spent in rollout + teacher + update phases (evaluation and checkpointing
excluded), which is how the demo gives every method the same wall-clock budget.
"""
from __future__ import annotations

import dataclasses
import json
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from opdistill.runs.values import summarize, values_to_json
from opdistill.data import Task
from opdistill.train.assemble import Given, Run, RunState, assemble, build_task, load_models
from opdistill.train.disk.checkpoint import rng_state
from opdistill.train.run.config import TrainerConfig
from opdistill.train.run.distributed import DistContext, init_distributed
from opdistill.train.steps.evaluate import evaluate_values, gather_values
from opdistill.train.run.interrupt import CALLBACK, StopSignals
from opdistill.train.disk.rundir import NonFiniteError, atomic_write_text
from opdistill.train.steps.step import train_step

__all__ = ["RunState", "run_training", "run_eval", "build_task", "load_models"]


def run_eval(cfg: TrainerConfig, tok, student, teacher, task, held_out, ctx: DistContext = DistContext(),
             values_path: Path | None = None, context=None, env=None) -> dict:
    """Evaluate on ``held_out`` (``teacher``: an ``opdistill.teachers.Teacher``, or None: no teacher metrics);
    under data parallelism each rank takes a contiguous part, sums are reduced exactly. ``values_path``: also write
    the per-problem values there (JSON, atomic, by the main rank): what ``opdistill compare`` pairs over problems.
    ``context``: the teacher's own prompt per problem (``teacher.context``: the teacher's rows; with ``eval.prompts:
    teacher`` the student decodes from it too). ``env``: the student's rollouts are episodes in it (SPEC 6.8)."""
    ec = cfg.eval
    if ec.prompts == "teacher":  # the problems as the context-teacher sees them (its own accuracy)
        held_out = [dataclasses.replace(p, prompt=context(p)) for p in held_out]
        teacher, context = None, None
    offset, count = ctx.split(len(held_out))
    values = gather_values(evaluate_values(
        student, tok, task, held_out[offset:offset + count], teacher=teacher, temperature=cfg.rollout.temperature,
        max_new_tokens=ec.max_new_tokens or cfg.rollout.max_new_tokens, greedy=ec.greedy, sampled=ec.sampled,
        topk=ec.topk, batch_size=ec.batch_size, use_chat_template=cfg.data.use_chat_template,
        seed=cfg.data.eval_seed + 777, num_samples=ec.num_samples, prompt_offset=offset,
        teacher_prompt=context, env=env), ctx.group)
    if values_path is not None and ctx.is_main:
        values_path.parent.mkdir(parents=True, exist_ok=True)  # RUN_DIR/eval: a link there is refused at open
        atomic_write_text(values_path, json.dumps(values_to_json(values)) + "\n")
    return summarize(values, resamples=ec.bootstrap_resamples, seed=cfg.data.eval_seed + 777)


def _stop_nonfinite(cfg: TrainerConfig, state: RunState) -> NonFiniteError:
    n = cfg.train.max_nonfinite_steps
    last = f"step {state.last_save}" if state.last_save >= 0 else "none yet"
    return NonFiniteError(
        f"step {state.step}: the loss or gradient norm was NaN/inf for {state.nonfinite_in_row} steps in a row "
        f"(train.max_nonfinite_steps={n}); none of them was applied and the run is stopped (last checkpoint: {last}). "
        f"Likely causes: fp16 overflow (model.dtype=float16: use bfloat16 or float32), a learning rate too high "
        f"(optim.lr={cfg.optim.lr}), bad data or teacher scores (NaN/inf inputs)")


def run_training(cfg: TrainerConfig, *, resume: bool = False, overwrite: bool = False, models=None,
                 quiet: bool = False, accept_changed: tuple = (), task: Task | None = None, rewards=(),
                 callbacks=(), tools=()) -> dict:
    """Train as configured; returns a summary (steps, time, eval history, the run folder and its last checkpoint;
    ``stopped``: the signal's name when SIGINT/SIGTERM stopped the run early, ``"callback"`` when a callback did,
    else None). The Python API (docs/python_api.md):

    - ``models`` = (tok, student, teacher) already loaded (``teacher``: a model, or {name: model} for ``teachers``;
      None for RL), in place of the folders model.student / model.teacher name;
    - ``task``: an :class:`opdistill.data.Task` (e.g. ``DatasetTask.from_rows(rows)``) in place of the config's
      data.task / data.path;
    - ``rewards``: reward functions (callables, or ``module:function`` names) in place of ``reward.functions``, with
      its signature and checks (opdistill/data/rewards.py);
    - ``callbacks``: ``callback(step, metrics)`` after each step is logged (``metrics``: that step's line of
      metrics.jsonl, the evaluation's metrics included on evaluation steps); returning True stops the run after
      that step, with its checkpoint, as a first Ctrl-C does;
    - ``tools``: the environment's tools (callables, or ``{name: callable}``) in place of ``env.tools``: the student's
      rollouts become episodes in which it calls them (SPEC 6.8, docs/episodes.md).

    What is handed in is fingerprinted in the run's record of its inputs (train/disk/inputs.py), so a resume with
    other objects is refused as a changed folder is.

    ``resume``: continue the run in ``cfg.run_dir`` from its newest intact checkpoint (allowed config changes only);
    ``overwrite``: delete the run in ``cfg.run_dir`` first. Without either, a ``run_dir`` holding a run is refused
    (:class:`RunError`; rules in opdistill/train/disk/rundir.py and docs/reliability.md). ``accept_changed``: input
    names (``teacher``, ``data.path``, ...) whose change since the run started a resume accepts (disk/inputs.py).

    Stopping (docs/reliability.md): a first SIGINT/SIGTERM (main thread) stops the run after the step in progress
    and writes that step's checkpoint; a second raises :class:`~opdistill.train.run.interrupt.Aborted` at once. A step
    that fails part-way in one process (the teacher, an engine or the data raises while the step is collected or
    scored, before its update) writes the checkpoint of the last completed step, then raises with the error's
    ``checkpoint`` attribute naming it; a failing evaluation writes the step's checkpoint with the evaluation
    pending (a resumed run evaluates first)."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    with init_distributed(cfg) as ctx, ExitStack() as stack:  # world size 1 without torchrun: no process group
        run = assemble(cfg, ctx, stack, resume=resume, overwrite=overwrite, models=models, quiet=quiet,
                       accept_changed=accept_changed, given=Given(task, tuple(rewards), tuple(callbacks),
                                                                   tools if isinstance(tools, dict) else tuple(tools)))
        with StopSignals() as stop:
            return _loop(run, stop)


def _evaluate(run: Run) -> dict:
    """The held-out evaluation at the current step (every rank: its share of the problems)."""
    return run.state.record_eval(run_eval(
        run.cfg, run.tok, run.ctx.rollout_model(run.student), run.teachers.eval, run.task, run.held_out, run.ctx,
        values_path=run.rd.path / "eval" / f"step_{run.state.step:06d}.json", context=run.context,
        env=run.env))


def _save(run: Run, kept: "_Completed | None" = None) -> Path:
    """The checkpoint of the current step, or of ``kept`` (the last completed step, when a later one failed before
    its update: the weights, optimizer and scheduler are still that step's)."""
    state, rng = (run.state, None) if kept is None else (kept.state, kept.rng)
    extra = None if run.pipeline is None else run.pipeline.saved_versions(state.step)  # in-flight batches' weights
    path = run.save(step=state.step, state={**state.to_saved(), "config": run.config_dict}, rng=rng, extra=extra)
    run.state.last_save = state.step
    return path


@dataclass
class _Completed:
    """What a checkpoint of the last completed step records besides the weights (the run state, the RNG states at
    the point the loop would have saved), and where the loop is: ``phase`` "step" (collecting, scoring, updating the
    next step: the weights are still this one's), "eval" (evaluating ``run.state.step``, its update applied) or
    "after" (syncing, logging, saving: nothing is saved after a failure there)."""

    state: RunState = None
    rng: dict = None
    phase: str = "step"
    metrics: dict | None = None  # in phase "eval" after a step: the step's metrics, not yet logged

    def capture(self, run: Run) -> None:
        s = run.state
        self.state, self.rng = dataclasses.replace(s, eval_history=list(s.eval_history)), rng_state()
        self.phase, self.metrics = "step", None


def _loop(run: Run, stop: StopSignals) -> dict:
    """The steps (``_steps``), the final evaluation and checkpoint, and what a stop or a failure keeps."""
    cfg, state = run.cfg, run.state
    progress = _Completed()
    progress.capture(run)
    try:
        stopped = _steps(run, stop, progress)
        if stopped and state.last_save != state.step:  # the checkpoint of the last completed step, no final eval
            _save(run)
        if not stopped:
            if cfg.eval.num_prompts and (state.eval_pending or state.last_eval != state.step):
                progress.phase = "eval"
                run.logger.log(state.step, _evaluate(run))
                state.eval_pending = False
            progress.phase = "after"
            if cfg.checkpoint.save_final and state.last_save != state.step:
                _save(run)
    except NonFiniteError:  # its message names the last checkpoint; resuming would meet the same numbers
        raise
    except Exception as e:
        # one process: save what is complete; under torchrun the peers may wait in a collective: name what exists
        e.checkpoint = _save_after_failure(run, progress) if not run.ctx.enabled else _checkpoint_path(run)
        raise
    return {"steps": state.step, "train_time_s": state.train_time, "eval_history": state.eval_history,
            "final_eval": state.eval_history[-1] if state.eval_history else {}, "run_dir": str(run.rd.path),
            "checkpoint": _checkpoint_path(run), "stopped": stop.signal_name if stopped else None,
            "exit_code": 0 if not stopped or stop.signal_name == CALLBACK else 128 + (stop.signum or 15)}


def _checkpoint_path(run: Run) -> str | None:
    s = run.state.last_save
    return None if s < 0 else str(run.rd.checkpoints / f"step_{s:08d}")


def _save_after_failure(run: Run, progress: _Completed) -> str | None:
    """After an exception in phase "step": the checkpoint of the last completed step (unless written already); in
    phase "eval": the step's checkpoint with the evaluation pending. Returns the newest checkpoint, or None; a save
    that fails itself is left out (the original error is the one to report)."""
    state = run.state
    try:
        if progress.phase == "eval":  # the update is applied: this step's checkpoint, its evaluation pending
            if progress.metrics is not None:
                run.logger.log(state.step, progress.metrics)  # the step's own line, as the uninterrupted run has it
            state.eval_pending = True
            return str(_save(run))
        if progress.phase == "step" and progress.state.step != state.last_save:
            return str(_save(run, progress))
    except Exception:  # noqa: BLE001 -- a disk or NaN refusal: report the original failure, name what exists
        pass
    return _checkpoint_path(run)


def _steps(run: Run, stop: StopSignals, progress: _Completed) -> bool:
    """The steps, one straight line each: collect -> update -> log -> evaluate every N -> checkpoint every N.
    Returns True when a signal stopped them early (``stop``)."""
    cfg, ctx, state, logger = run.cfg, run.ctx, run.state, run.logger
    if state.eval_pending or (state.step == 0 and not state.eval_history and cfg.eval.at_start):
        if cfg.eval.num_prompts:  # at the start, or the evaluation a failure left pending (resumed)
            progress.phase = "eval"
            logger.log(state.step, _evaluate(run))
            state.eval_pending = False
    while state.step < cfg.train.steps:
        progress.capture(run)
        if stop.requested(ctx):  # the safe point: between steps (a collective under torchrun)
            return True
        if cfg.train.max_time_s is not None and state.train_time >= cfg.train.max_time_s:
            break
        state.step += 1
        t0 = time.perf_counter()
        if run.pipeline is None:
            data, metrics = run.collect(state.step, ctx.rollout_model(run.student))
        else:  # made ahead, by the weights of step - 1 - max_staleness
            data, metrics = run.pipeline.get(state.step)
        t1 = time.perf_counter()
        metrics.update(train_step(run.student, run.optimizer, data, loss_fn=run.loss_fn,
                                  micro_batch_tokens=cfg.train.micro_batch_tokens, grad_clip=cfg.optim.grad_clip,
                                  bf16=cfg.train.bf16, fused_lm_head=cfg.train.fused_lm_head, group=ctx.group,
                                  mismatch=run.engines.mismatch))
        if run.collect.teacher is not None:
            metrics.update(run.collect.teacher.metrics())  # a pool of servers: what each did this step
        progress.phase = "after"
        if run.pipeline is None:
            run.engines.sync(run.student)  # the new weights into a vLLM student engine, in place
        else:  # version state.step; the pipeline's thread pushes each batch's own version into a vLLM engine
            run.pipeline.publish(state.step, run.student)
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
            progress.phase, progress.metrics = "eval", dict(metrics)
            metrics.update(_evaluate(run))
        logger.log(state.step, metrics)
        logger.advance(state.train_time)
        progress.phase = "after"
        if any([bool(cb(state.step, {"step": state.step, **metrics})) for cb in run.callbacks]):  # each sees each
            stop.ask(CALLBACK)
        if cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0:
            _save(run)
    return stop.signal_name == CALLBACK  # asked on the last step: stopped too (no final evaluation)
