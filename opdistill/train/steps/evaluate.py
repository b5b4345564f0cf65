"""Held-out evaluation: verifier accuracy (greedy and sampled) and the student's distance to the teacher.

Per problem, :func:`evaluate_values` measures (an :class:`~opdistill.runs.values.EvalValues`, one entry per problem,
easy to concatenate across ranks): greedy correct (0/1), sampled correct out of ``num_samples`` samples, and on the
student's samples (temperature 1, the rollout temperature) the per-response sums of the teacher-KL estimates, the top-k
tail reverse KL, the masses and the overlap, with their token counts. ``opdistill.runs.values.summarize`` turns them
into metrics (``eval/greedy_acc``, ``eval/teacher_kl``, ...: each a ratio of sums over problems with a 95% bootstrap
interval), and the values themselves are kept as JSON: the trainer writes one file per evaluation,
``RUN_DIR/eval/step_NNNNNN.json``, and ``opdistill eval --values FILE`` writes them for any checkpoint, so two
evaluations of the same problems can be compared paired over problems (``opdistill compare``).

Sampling is keyed by a fixed seed (step 0, the prompt's index + ``prompt_offset``, the sample's index), so every
evaluation of a run (and of every method in the demo) sees the same prompts and the same samples' randomness, and a
rank evaluating a slice of the problems draws exactly what one process would.
"""
from __future__ import annotations

import functools
from dataclasses import fields

import torch
import torch.distributed as dist

from opdistill import shift_for_next_token
from opdistill.data import Problem, Task
from opdistill.ops import topk_divergence
from opdistill.engines.episodes import EPISODE_SUMS, run_episodes
from opdistill.engines.rollout import generate_rollouts
from opdistill.engines.sampler import Lockstep, lockstep
from opdistill.env import prompt_renderer
from opdistill.runs.values import EvalValues
from opdistill.teachers import Rows, ScoreRequest, Teacher

__all__ = ["evaluate_values", "gather_values"]


def gather_values(values: EvalValues, group) -> EvalValues:
    """Every rank's values (of its contiguous slice of the problems) joined in rank order, on every rank: two
    all_gathers (the slice sizes, then the measured fields stacked [F, P_max]). Every rank must measure the same
    fields (the same greedy / sampled / teacher settings). ``group=None``: ``values`` as it is."""
    if group is None:
        return values
    world = dist.get_world_size(group)
    size = torch.tensor([values.num_problems], dtype=torch.long)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(n) for n in sizes]
    names = [f.name for f in fields(EvalValues) if getattr(values, f.name) is not None]
    local = torch.zeros(len(names), max(sizes), dtype=torch.float64)  # [F, P_max], zero-padded
    for i, name in enumerate(names):
        local[i, : values.num_problems] = getattr(values, name)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=group)
    joined = torch.cat([part[:, :n] for part, n in zip(parts, sizes)], dim=1)  # [F, P] in rank order
    return EvalValues(**{name: joined[i].clone() for i, name in enumerate(names)})


def _per_problem(values: torch.Tensor, prompt_index: list[int], num_problems: int) -> torch.Tensor:
    """Sum per-row values [B] into their problems [P] (float64)."""
    out = torch.zeros(num_problems, dtype=torch.float64)
    return out.index_add_(0, torch.as_tensor(prompt_index, dtype=torch.long), values.double())


@torch.no_grad()
def evaluate_values(student, tokenizer, task: Task, problems: list[Problem], *, teacher: Teacher | None = None,
                    temperature: float = 1.0, max_new_tokens: int = 64, greedy: bool = True, sampled: bool = True,
                    topk: int = 8, batch_size: int = 256, use_chat_template: bool = True, seed: int = 1234,
                    num_samples: int = 1, prompt_offset: int = 0, teacher_prompt=None, env=None) -> EvalValues:
    """The per-problem measurements of an evaluation (no statistics; :func:`summarize` turns them into metrics, and
    ``opdistill.train.loop.run_eval`` composes both under data parallelism): see the module docstring.
    ``teacher_prompt``: problem -> the teacher's own prompt (``teacher.context``, SPEC 6.7), for the teacher's rows.
    ``env``: the student's rollouts are episodes in it (SPEC 6.8), scored by their last turn; the teacher measures
    the student's tokens only."""
    P = len(problems)
    vals = EvalValues(problems=torch.ones(P, dtype=torch.float64))
    if not problems:
        return vals
    render = prompt_renderer(tokenizer, env, use_chat_template=use_chat_template)
    prompts = [render(p.prompt) for p in problems]
    rollouts = generate_rollouts if env is None else functools.partial(run_episodes, env=env)
    if greedy:
        g = rollouts(student, tokenizer, prompts, greedy=True, max_new_tokens=max_new_tokens,
                              batch_size=batch_size, want_logprobs=False)
        vals.greedy_correct = torch.tensor([float(task.score(p, t)) for p, t in zip(problems, g.texts)],
                                           dtype=torch.float64)
        if env is not None:
            vals.greedy_used_tool = _used_tool(g, P)
    if not sampled:
        return vals
    s = rollouts(student, tokenizer, prompts, n=num_samples, temperature=temperature,
                          max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, step=0,
                          prompt_offset=prompt_offset, want_logprobs=teacher is not None)
    idx = s.prompt_index
    correct = torch.tensor([float(task.score(problems[i], t)) for i, t in zip(idx, s.texts)])
    vals.samples = _per_problem(torch.ones(s.num_rows), idx, P)
    vals.sampled_correct = _per_problem(correct, idx, P)
    if env is not None:
        vals.sampled_used_tool = _used_tool(s, P)
    _, mask = shift_for_next_token(s.input_ids, s.response_mask)
    m = mask.bool()
    vals.tokens = _per_problem(m.sum(-1), idx, P)
    if teacher is None:
        return vals
    x_t = None if teacher_prompt is None else [teacher_prompt(p) for p in problems]
    scores = teacher.score(Rows(s.input_ids, s.attention_mask, s.response_mask,
                                prompts=tuple(problems[i].prompt for i in idx),
                                teacher_prompts=None if x_t is None else tuple(x_t[i] for i in idx),
                                tool_results=None if s.episode_results is None else tuple(s.episode_results)),
                           ScoreRequest(k=topk, sampled=True, what="evaluation"))  # any Teacher (opdistill.teachers)
    if scores.mask is not None:  # a cross-tokenizer teacher: positions without a signal (SPEC 6.6) are not measured,
        # nor the student's tokens its mapped top-K_T gives probability 0 (no sampled-token signal there: the
        # training signal masks them too; kept, the teacher-KL would be +inf)
        m = m & scores.mask & torch.isfinite(scores.sampled_logprobs)
        vals.tokens = _per_problem(m.sum(-1), idx, P)
    # log r = log nu - log pi at the sampled token (sampler log-probs are the student's at the eval temperature)
    log_r = (scores.sampled_logprobs.double() - s.sampler_logprobs.double())
    k1 = torch.where(m, -log_r, 0.0)
    k3 = torch.where(m, torch.expm1(log_r) - log_r, 0.0)  # (r - 1) - log r, in float64, unclamped
    vals.k1_sum, vals.k3_sum = _per_problem(k1.sum(-1), idx, P), _per_problem(k3.sum(-1), idx, P)
    # Top-k diagnostics per token (the core op, gradients off): tail reverse KL, masses, overlap.
    tail, q, p, overlap = (torch.zeros(s.num_rows, dtype=torch.float64) for _ in range(4))
    ids = torch.where(m.unsqueeze(-1), scores.topk.ids, 0)
    lp = torch.where(m.unsqueeze(-1), scores.topk.logprobs, float("-inf"))  # masked rows: empty slots
    dev = next(student.parameters()).device  # train.device cuda: the rows go there, the sums come back
    step = _diagnostic_rows(student, s.input_ids.shape[1], batch_size)
    starts = list(range(0, s.num_rows, step))
    lock = lockstep(student)  # a sharded student (distributed.decode sharded): as many forwards as the other ranks
    forward = lock if lock is not None else Lockstep(None)
    if lock is not None:
        starts = lock.pad(starts)
    for r0 in starts:
        if r0 is None:
            lock.forward(student, device=dev)
            continue
        rows = slice(r0, r0 + step)
        logits = forward.logits(student, s.input_ids[rows].to(dev), attention_mask=s.attention_mask[rows].to(dev),
                                last=False)
        res = topk_divergence(logits.float(), ids[rows].to(dev), lp[rows].to(dev), support="tail",
                              divergence="reverse")
        mr = m[rows]
        for acc, x in ((tail, res.loss), (q, res.student_mass), (p, res.teacher_mass), (overlap, res.overlap_count)):
            acc[rows] = torch.where(mr, x.double().cpu(), 0.0).sum(-1)
    if lock is not None:
        lock.release(student)
    vals.tail_kl_sum, vals.student_mass_sum = _per_problem(tail, idx, P), _per_problem(q, idx, P)
    vals.teacher_mass_sum, vals.overlap_count = _per_problem(p, idx, P), _per_problem(overlap, idx, P)
    vals.overlap_slots = vals.tokens * ids.shape[-1]
    return vals


def _used_tool(episodes, num_problems: int) -> torch.Tensor:
    """Per problem, how many of its episodes got a tool's answer (``used_tool`` of their counts)."""
    return _per_problem(episodes.episode_sums[:, EPISODE_SUMS.index("used_tool")], episodes.prompt_index,
                        num_problems)


DIAGNOSTIC_LOGITS = 1 << 25  # logits (fp32: 128 MiB) per forward of the top-k diagnostics


def _diagnostic_rows(student, seq_len: int, batch_size: int) -> int:
    """Rows per forward of the top-k diagnostics: at most ``batch_size``, and at most DIAGNOSTIC_LOGITS logits
    ([rows, S, V] is the evaluation's one vocabulary-wide buffer; a 64-row batch of 250 tokens at V = 49,152 would
    be 3 GiB per copy, and the op makes several)."""
    head = student.get_output_embeddings() if hasattr(student, "get_output_embeddings") else None
    vocab = int(head.weight.shape[0]) if head is not None and hasattr(head, "weight") else 1
    return max(1, min(batch_size, DIAGNOSTIC_LOGITS // max(1, seq_len * vocab)))
