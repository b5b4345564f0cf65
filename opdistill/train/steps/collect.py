"""One step's data: the step's prompts, the rows that answer them, the teacher's scores, rewards and advantages.

    make:   prompts(seed, step, this rank's share) -> rows (the student samples; the teacher for off-policy KD; or
            the next rows of a teacher cache) -> rewards -> advantages -> Batch (StepData, the teacher's Rows, metrics)
    ask:    teacher.submit(rows, request) -> a Future
    answer: the scores into the StepData (a mask the teacher sends leaves the step; the sums it sends, metrics)

The sequential loop runs the three in a row (:meth:`Collector.rollouts`); the pipelined step makes rows in its own
thread and decides where the teacher is asked (opdistill/train/steps/pipeline.py).

Sampling is reseeded from (seed, step) at every step and keyed by (seed, step, global prompt index, sample index)
(``opdistill.engines.sampler``), so a resumed run, and a run at another world size, draws the same samples. Under
data parallelism each rank takes a contiguous share of the step's prompts (all ``rollout.n`` samples of a prompt: a
GRPO group stays on one rank); the metrics are reduced over the ranks. Under tensor parallelism only the first tp
rank of a data-parallel rank samples and asks the teacher; its peers receive the result (``Collector.share``). The
teacher's request may still be on its way when the step starts (a remote teacher with ``overlap``:
``StepData.scores`` is then a Future).
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from opdistill.data import PromptSource, Rewards, Task, TeacherPrompt
from opdistill.engines.episodes import EPISODE_SUMS
from opdistill.engines.vllm import EngineSet
from opdistill.env import Environment, prompt_renderer
from opdistill.loss import TeacherScores
from opdistill.teachers import Rows, ScoreRequest, Teacher
from opdistill.train.run.distributed import DistContext
from opdistill.train.steps.share import share_step
from opdistill.train.steps.step import StepData, group_advantages

__all__ = ["Batch", "Collector", "needs_sampler_logprobs", "score_request", "student_choices", "union_ids"]


def needs_sampler_logprobs(cfg, engines: EngineSet | None = None) -> bool:
    """Whether a step reads the sampler's log-probs (the "old" log-probs): the policy-gradient losses (``train.method
    rl``, ``loss.use_policy_gradient``, ``loss.use_task_rewards``) and the rollout mismatch metrics / TIS
    (``engines.mismatch``). Otherwise the rollouts are drawn without them (the same samples: log-probs draw no
    randomness) and ``StepData.sampler_logprobs`` is None."""
    lc = cfg.loss
    return (cfg.train.method == "rl" or lc.use_policy_gradient or lc.use_task_rewards
            or (engines is not None and engines.mismatch is not None))


def union_ids(loss_cfg) -> bool:
    """Whether the loss asks the teacher for its log-probs at ids the student chose (``loss.support: union``)."""
    return loss_cfg.loss_mode == "topk" and loss_cfg.support == "union"


def score_request(loss_cfg, what: str = "", requested_ids: torch.Tensor | None = None) -> ScoreRequest:
    """What the loss ``loss_cfg`` reads of the teacher: its top-K (loss_mode topk; with support union also its
    log-probs at ``requested_ids`` [B, S, J], the student's top-K and sampled token), the sampled tokens' log-probs
    (sampled) or its final hidden states, which its head turns into its full distribution (full)."""
    return ScoreRequest(k=loss_cfg.topk if loss_cfg.loss_mode == "topk" else None,
                        sampled=loss_cfg.loss_mode == "sampled", hidden=loss_cfg.loss_mode == "full", what=what,
                        requested_ids=requested_ids if union_ids(loss_cfg) else None)


def student_choices(input_ids: torch.Tensor, sampler_topk: torch.Tensor) -> torch.Tensor:
    """``[B, S, K + 1]``: at row t the student's top-K ids of token t + 1's distribution and token t + 1 itself (the
    sampled token; the last column of the last row repeats it), the ids a union-support loss has the teacher score."""
    nxt = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
    return torch.cat([sampler_topk, nxt[..., None]], dim=-1)


@dataclass
class Batch:
    """One step's rows on this rank before (or with) the teacher's scores: the step, its :class:`StepData`, the
    :class:`Rows` the teacher scores (None without a teacher) and the local metrics (``sums``: reduced over the
    ranks by :meth:`Collector.reduce`)."""

    step: int
    data: StepData
    rows: Rows | None
    local: dict


class Collector:
    """``collector(step, student) -> (StepData, metrics)`` for a run: ``student`` is the module to decode with
    (``DistContext.rollout_model``), ``writer`` the model that writes off-policy samples (the teacher), ``teacher``
    the training teacher (None for RL), ``engines`` the student's rollout engine, ``cache`` the rows of a teacher
    cache (off-policy KD from ``data.teacher_cache``: no decoding), ``context`` the teacher's own prompt per problem
    (``teacher.context``, SPEC 6.7: the teacher scores, and for off-policy KD writes, under it), ``rewards`` what a
    completion earns (``reward.functions``, opdistill/data/rewards.py; default: the task's verifier), ``env`` the
    environment the rollouts are episodes in (``env.tools``, SPEC 6.8; None: single responses)."""

    def __init__(self, cfg, *, tok, task: Task, source: PromptSource, teacher: Teacher | None, writer=None,
                 engines: EngineSet | None = None, cache: dict | None = None, ctx: DistContext = DistContext(),
                 context: TeacherPrompt | None = None, rewards: Rewards | None = None, env: Environment | None = None):
        self.cfg, self.tok, self.task, self.source, self.ctx, self.env = cfg, tok, task, source, ctx, env
        self.rewards = rewards if rewards is not None else Rewards(task)  # default: the task's verifier
        self.teacher, self.writer, self.cache, self.context = teacher, writer, cache, context
        self.engines = engines or EngineSet()

    def __call__(self, step: int, student) -> tuple[StepData, dict]:
        if self.cache is not None:
            return self._from_cache(step)
        if self.ctx.tp_leader:
            data, local = self.rollouts(step, student)
        else:
            data, local = None, None
            if self.engines.joint:  # the leader's vLLM engine spans its tp ranks: each takes part in its generate
                self.generate(step, student)
        data, local = self.share(data, local)
        return data, self.reduce(local)

    def share(self, data: StepData | None, local: dict | None) -> tuple[StepData, dict]:
        """Under tensor parallelism the first tp rank's ``(data, local)`` on its tp peers, which made none (each
        rollout and teacher request once per data-parallel rank: opdistill/train/steps/share.py); else unchanged."""
        return share_step(self.ctx, data, local, self.teacher)

    def rollouts(self, step: int, student) -> tuple[StepData, dict]:
        """Step ``step``'s rows and scores on this rank, and its metrics before they are reduced over the ranks
        (:meth:`reduce`): :meth:`make`, then the teacher asked (:meth:`ask`) and answered (:meth:`answer`), waited
        for unless it answers in a background thread and its answer does not decide the step's rows (``masks``)."""
        batch = self.make(step, student)
        if batch.rows is not None:
            t0 = time.perf_counter()
            fut = self.ask(batch)
            self.answer(batch, fut if self.teacher.background and not self.teacher.masks else fut.result())
            batch.local["time/teacher_s"] = time.perf_counter() - t0
        return batch.data, batch.local

    def make(self, step: int, student) -> "Batch":
        """Step ``step``'s rows on this rank (the student's samples, or the teacher's for off-policy KD), their
        rewards and advantages and the local metrics; the rows the teacher is to score (None without a teacher). No
        collective of the trainer's runs here (a vLLM engine's over the tp ranks runs on its own group), so the
        pipelined step's thread can make them while the trainer's collectives run."""
        cfg = self.cfg
        t0 = time.perf_counter()
        problems, ro, old, union, x_t = self.generate(step, student)
        t1 = time.perf_counter()
        data = StepData(ro.input_ids, ro.attention_mask, ro.response_mask,
                        sampler_logprobs=ro.sampler_logprobs if old else None,
                        requested_ids=student_choices(ro.input_ids, ro.sampler_topk) if union else None)
        rows = None
        if self.teacher is not None:
            rows = Rows(ro.input_ids, ro.attention_mask, ro.response_mask,
                        tags=tuple(problems[i].task or cfg.data.task for i in ro.prompt_index),
                        prompts=tuple(problems[i].prompt for i in ro.prompt_index),
                        teacher_prompts=None if x_t is None else tuple(x_t[i] for i in ro.prompt_index),
                        tool_results=None if ro.episode_results is None else tuple(ro.episode_results))
        rewards, per_function = self.rewards([problems[i] for i in ro.prompt_index], ro.texts, step)
        if cfg.train.method == "rl" or cfg.loss.use_task_rewards:
            data.advantages = group_advantages(rewards, ro.prompt_index)
        sums = [float(rewards.sum()), float(ro.num_rows), float(ro.response_mask.sum())]
        sums += [0.0] * len(self._sum_names) + (per_function if self.rewards.custom else [])  # answer() fills the 0s
        if self.env is not None:  # an episode's counts (opdistill/engines/episodes.py), summed over the rows
            sums += ro.episode_sums.sum(0).tolist()
        local = {"sums": sums, "time/rollout_s": t1 - t0, "time/teacher_s": 0.0}
        return Batch(step, data, rows, local)

    def ask(self, batch: "Batch") -> Future:
        """The teacher's scores of the batch's rows as a Future (running in a background thread for a teacher that
        answers there); the rows of each member of a composite teacher become metric groups ``teacher/<name>/``."""
        groups = self.teacher.groups(batch.rows)
        if groups is not None:
            batch.data.groups = {f"teacher/{name}/": idx for name, idx in groups.items()}
        return self.teacher.submit(batch.rows, score_request(self.cfg.loss, f"step {batch.step}: "
                                                             f"{batch.rows.describe()}", batch.data.requested_ids))

    def answer(self, batch: "Batch", scores: TeacherScores | Future) -> None:
        """The teacher's scores into the batch (a Future: read where the step first needs them). Scores that are
        here: the positions the teacher has no signal for leave the step (``response_mask``; a cross-tokenizer
        teacher, SPEC 6.6), and the sums they carry join the local metrics (:meth:`Teacher.step_metrics`)."""
        data = batch.data
        data.scores = scores
        if isinstance(scores, Future):
            return
        if scores.mask is not None:
            data.response_mask = data.response_mask.clone()
            data.response_mask[:, 1:] *= scores.mask[:, :-1].to(data.response_mask.dtype)
        got, names = scores.sums or {}, self._sum_names
        batch.local["sums"][3:3 + len(names)] = [got.get(name, 0.0) for name in names]

    @property
    def _sum_names(self) -> tuple:
        return () if self.teacher is None else tuple(self.teacher.sum_names)

    def generate(self, step: int, student):
        """(this rank's problems, their rollouts, whether they carry sampler log-probs, whether the student's top-k
        ids, each problem's teacher prompt or None) of step ``step``: the same on every tp rank of a data-parallel
        rank (its share of prompts, its keys). With a vLLM engine over the tp ranks (``engines.joint``) a collective
        of that engine: every tp rank calls it at the same point (:meth:`__call__`, or each rank's pipeline thread).
        Off-policy KD with ``teacher.context``: the teacher writes under its own prompt, and the rows hold the
        student's prompt before what it wrote (what the student is trained to answer)."""
        cfg, rc = self.cfg, self.cfg.rollout
        offset, count = self.ctx.share(cfg.data.prompts_per_step)
        problems = self.source.batch(step, cfg.data.prompts_per_step)[offset:offset + count]
        render = prompt_renderer(self.tok, self.env, use_chat_template=cfg.data.use_chat_template)
        prompts = [render(p.prompt) for p in problems]
        x_t = None if self.context is None else [self.context(p) for p in problems]
        torch.manual_seed(cfg.train.seed * 1_000_003 + step)
        old = needs_sampler_logprobs(cfg, self.engines)  # else the sampler skips them (a log-sum-exp per token)
        off = cfg.train.method == "off_policy"
        writer = self.writer if off else student
        union = self.teacher is not None and union_ids(cfg.loss)
        written = prompts if not (off and x_t is not None) else [render(x) for x in x_t]
        ro = self.engines.generate_rollouts(writer, self.tok, written, n=rc.n, temperature=rc.temperature,
                                            top_p=rc.top_p, top_k=rc.top_k, max_new_tokens=rc.max_new_tokens,
                                            min_new_tokens=rc.min_new_tokens, batch_size=rc.batch_size,
                                            seed=cfg.train.seed, step=step, prompt_offset=offset, want_logprobs=old,
                                            env=self.env,
                                            **({"want_topk": cfg.loss.topk} if union else {}))
        if written is not prompts:
            ro = ro.with_prompts(prompts, self.tok.pad_token_id)
        return problems, ro, old, union, x_t

    def reduce(self, local: dict) -> dict:
        """The step's metrics from :meth:`rollouts`' local ones, summed over the ranks (a collective)."""
        local = dict(local)
        reward_sum, n_rows, tokens, *rest = self.ctx.sum(local.pop("sums"))
        n_env = len(EPISODE_SUMS) if self.env is not None else 0
        teacher_sums, function_sums = rest[:len(self._sum_names)], rest[len(self._sum_names):len(rest) - n_env]
        out = {"train/reward": reward_sum / n_rows if n_rows else float("nan"),
               "train/response_len": tokens / max(n_rows, 1), "train/generated_tokens": tokens, **local}
        for name, total in zip(self.rewards.names, function_sums):  # reward.functions: each one's mean
            out[f"reward/{name}"] = total / n_rows if n_rows else float("nan")
        if n_env:  # episodes (SPEC 6.8): per episode, except the shares of calls
            env = dict(zip(EPISODE_SUMS, rest[len(rest) - n_env:]))
            per = max(n_rows, 1)
            out.update({"env/turns": env["turns"] / per, "env/tool_calls": env["tool_calls"] / per,
                        "env/bad_calls": env["bad_calls"] / max(env["tool_calls"], 1),
                        "env/tool_errors": env["tool_errors"] / max(env["tool_calls"], 1),
                        "env/cut_results": env["cut_results"] / max(env["tool_calls"], 1),
                        "env/used_tool": env["used_tool"] / per,
                        "env/truncated": env["truncated"] / per, "env/env_tokens": env["env_tokens"] / per})
        if teacher_sums:  # e.g. a cross-tokenizer teacher's counts (SPEC 6.6): over the step's rows on every rank
            out.update(self.teacher.step_metrics(dict(zip(self._sum_names, teacher_sums))))
        return out

    def _from_cache(self, step: int) -> tuple[StepData, dict]:
        """Off-policy KD from a teacher cache: the step's rows are the next prompts_per_step x n rows, wrapping around,
        so the data position is a function of the step (exact resume) and no teacher forward runs in training. Each
        rank takes its contiguous share of them."""
        cfg, cache = self.cfg, self.cache
        total = cache["input_ids"].shape[0]
        n_rows = cfg.data.prompts_per_step * cfg.rollout.n
        offset, count = self.ctx.share(n_rows)
        idx = (torch.arange(offset, offset + count) + (step - 1) * n_rows) % total
        data = StepData(cache["input_ids"][idx], cache["attention_mask"][idx], cache["response_mask"][idx])
        batch = Batch(step, data, Rows(data.input_ids, data.attention_mask, data.response_mask), {"sums": []})
        self.answer(batch, self.ask(batch).result())
        (tokens,) = self.ctx.sum([float(data.response_mask.sum())])
        return data, {"train/response_len": tokens / n_rows, "time/rollout_s": 0.0, "time/teacher_s": 0.0,
                      "train/generated_tokens": tokens, "train/cache_rows_seen": float(min(step * n_rows, total))}
