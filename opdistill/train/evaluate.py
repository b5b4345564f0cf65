"""Held-out evaluation: verifier accuracy (greedy and sampled) and the student's distance to the teacher.

``eval/teacher_kl`` is the mean over response tokens of log pi(y_t) - log nu(y_t) on the student's own samples
(temperature 1, the rollout temperature): a per-token Monte-Carlo estimate of the reverse KL(pi || nu) along the
student's trajectories, the quantity on-policy distillation minimizes. ``eval/teacher_kl_seq`` is the same summed
over each response and averaged over responses. Overlap ratio and masses come from the core top-k diagnostics
(``DistillationLoss`` with a top-k tail config, gradients off). Sampling is keyed by a fixed seed (step 0, the prompt's
index), so every evaluation of a run (and of every method in the demo) sees the same prompts and the same samples'
randomness.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from opdistill import DistillationConfig, DistillationLoss, GlobalBatch, MetricSums, shift_for_next_token
from opdistill.data import Problem, Task, render_prompt
from opdistill.rollout import generate_rollouts
from opdistill.teacher import score_teacher

__all__ = ["evaluate"]


def _sum(values: list[float], group) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.tolist()


@torch.no_grad()
def evaluate(student, tokenizer, task: Task, problems: list[Problem], *, teacher=None, temperature: float = 1.0,
             max_new_tokens: int = 64, greedy: bool = True, sampled: bool = True, topk: int = 8,
             batch_size: int = 256, use_chat_template: bool = True, seed: int = 1234, group=None,
             prompt_offset: int = 0) -> dict:
    """Evaluate on ``problems``. Under data parallelism (``group``) each rank passes its contiguous part of the
    held-out set and ``prompt_offset`` (the part's first index): every number is a sum reduced over ``group`` before
    it is divided, so the result equals one process evaluating the whole set (every rank must call this)."""
    out: dict[str, float] = {}
    if not problems and group is None:
        return out
    prompts = [render_prompt(tokenizer, p.prompt, use_chat_template=use_chat_template) for p in problems]
    (total,) = _sum([len(problems)], group)
    if greedy:
        g = generate_rollouts(student, tokenizer, prompts, greedy=True, max_new_tokens=max_new_tokens,
                              batch_size=batch_size, want_logprobs=False)
        (correct,) = _sum([sum(task.score(p, t) for p, t in zip(problems, g.texts))], group)
        out["eval/greedy_acc"] = correct / total
    if not sampled:
        return out
    s = generate_rollouts(student, tokenizer, prompts, n=1, temperature=temperature, max_new_tokens=max_new_tokens,
                          batch_size=batch_size, seed=seed, step=0, prompt_offset=prompt_offset,
                          want_logprobs=teacher is not None)
    targets, mask = shift_for_next_token(s.input_ids, s.response_mask)
    correct, tokens = _sum([sum(task.score(p, t) for p, t in zip(problems, s.texts)), float(mask.sum())], group)
    out["eval/sampled_acc"] = correct / total
    out["eval/response_len"] = tokens / total
    if teacher is None:
        return out
    scores = score_teacher(teacher, s.input_ids, s.attention_mask, k=topk, sampled_ids=targets)
    m = mask.bool()
    k1 = (s.sampler_logprobs - scores.sampled_logprobs).double()  # [B, S]; the student's log-probs at temperature
    kl_sum, kl_tokens = _sum([float(k1[m].sum()), float(m.sum())], group)
    out["eval/teacher_kl"] = kl_sum / max(kl_tokens, 1)
    out["eval/teacher_kl_seq"] = kl_sum / total
    # Diagnostics from the core loss: one GlobalBatch over all eval rows (of every rank), no gradient.
    diag = DistillationLoss(DistillationConfig(loss_mode="topk", support="tail", divergence="reverse", topk=topk))
    batch = GlobalBatch.from_masks([mask], group=group)
    sums = MetricSums()
    for r0 in range(0, s.num_rows, batch_size):
        rows = slice(r0, r0 + batch_size)
        logits = student(input_ids=s.input_ids[rows], attention_mask=s.attention_mask[rows]).logits.float()
        _, metrics = diag(logits, type(scores.topk)(scores.topk.ids[rows], scores.topk.logprobs[rows]), mask[rows],
                          batch, group=group)
        sums.merge(metrics)
    red = sums.reduce(group=group)
    for name in ("overlap_ratio", "student_mass", "teacher_mass"):
        if f"distillation/{name}" in red:
            out[f"eval/{name}"] = red[f"distillation/{name}"]
    out["eval/topk_reverse_kl"] = red.get("distillation/loss", float("nan"))
    return out
