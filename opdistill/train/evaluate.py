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

from opdistill import DistillationConfig, DistillationLoss, GlobalBatch, MetricSums, shift_for_next_token
from opdistill.data import Problem, Task, render_prompt
from opdistill.rollout import generate_rollouts
from opdistill.train.remote_teacher import score_rows

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(student, tokenizer, task: Task, problems: list[Problem], *, teacher=None, temperature: float = 1.0,
             max_new_tokens: int = 64, greedy: bool = True, sampled: bool = True, topk: int = 8,
             batch_size: int = 256, use_chat_template: bool = True, seed: int = 1234) -> dict:
    out: dict[str, float] = {}
    if not problems:
        return out
    prompts = [render_prompt(tokenizer, p.prompt, use_chat_template=use_chat_template) for p in problems]
    if greedy:
        g = generate_rollouts(student, tokenizer, prompts, greedy=True, max_new_tokens=max_new_tokens,
                              batch_size=batch_size, want_logprobs=False)
        out["eval/greedy_acc"] = sum(task.score(p, t) for p, t in zip(problems, g.texts)) / len(problems)
    if not sampled:
        return out
    s = generate_rollouts(student, tokenizer, prompts, n=1, temperature=temperature, max_new_tokens=max_new_tokens,
                          batch_size=batch_size, seed=seed, step=0, want_logprobs=teacher is not None)
    out["eval/sampled_acc"] = sum(task.score(p, t) for p, t in zip(problems, s.texts)) / len(problems)
    targets, mask = shift_for_next_token(s.input_ids, s.response_mask)
    out["eval/response_len"] = float(mask.sum()) / len(problems)
    if teacher is None:
        return out
    scores = score_rows(teacher, s.input_ids, s.attention_mask, s.response_mask, k=topk, sampled=True,
                        what="evaluation")  # in process, or the teacher.url server
    m = mask.bool()
    k1 = (s.sampler_logprobs - scores.sampled_logprobs)  # [B, S]; sampler log-probs are the student's at temperature
    out["eval/teacher_kl"] = float(k1[m].sum()) / max(int(m.sum()), 1)
    out["eval/teacher_kl_seq"] = float(torch.where(m, k1, 0.0).sum()) / len(problems)
    # Diagnostics from the core loss: one GlobalBatch over all eval rows, no gradient.
    diag = DistillationLoss(DistillationConfig(loss_mode="topk", support="tail", divergence="reverse", topk=topk))
    batch = GlobalBatch.from_masks([mask], group=None)
    sums = MetricSums()
    for r0 in range(0, s.num_rows, batch_size):
        rows = slice(r0, r0 + batch_size)
        logits = student(input_ids=s.input_ids[rows], attention_mask=s.attention_mask[rows]).logits.float()
        _, metrics = diag(logits, type(scores.topk)(scores.topk.ids[rows], scores.topk.logprobs[rows]), mask[rows],
                          batch)
        sums.merge(metrics)
    red = sums.reduce(group=None)
    for name in ("overlap_ratio", "student_mass", "teacher_mass"):
        if f"distillation/{name}" in red:
            out[f"eval/{name}"] = red[f"distillation/{name}"]
    out["eval/topk_reverse_kl"] = red.get("distillation/loss", float("nan"))
    return out
