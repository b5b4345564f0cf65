"""Quickstart: distil a toy teacher's top-k into a toy student with the exact loss (no model download, ~2 s).

A "student" is a free table of logits per position; the teacher is a fixed random distribution of which we only
keep the top-k (what a vLLM server returns). Two micro-batches per step, one GlobalBatch per step.
"""

import torch

from opdistill import DistillationConfig, DistillationLoss, GlobalBatch, MetricSums, TeacherTopK

torch.manual_seed(0)
B, S, V, K = 8, 12, 500, 16
teacher_logprobs_full = torch.log_softmax(torch.randn(B, S, V) * 3, dim=-1)
teacher = teacher_logprobs_full.topk(K, dim=-1)  # values = log-probs, indices = ids
mask = torch.arange(S)[None] < torch.randint(4, S + 1, (B, 1))  # ragged responses

student_logits = torch.zeros(B, S, V, requires_grad=True)
opt = torch.optim.Adam([student_logits], lr=0.1)
loss_fn = DistillationLoss(DistillationConfig(loss_mode="topk", support="tail", divergence="reverse", topk=K))

micro = [slice(0, 3), slice(3, B)]  # deliberately uneven: the step's objective does not care
for step in range(61):
    batch = GlobalBatch.from_masks([mask[m] for m in micro])  # one count per optimizer step
    metrics = MetricSums()
    opt.zero_grad()
    for m in micro:
        loss, mb_metrics = loss_fn(student_logits[m], TeacherTopK(teacher.indices[m], teacher.values[m]), mask[m], batch)
        loss.backward()
        metrics.merge(mb_metrics)
    opt.step()
    if step % 20 == 0:
        r = metrics.reduce()
        print(f"step {step:3d}  loss {r['distillation/loss']:.4f}  student_mass {r['distillation/student_mass']:.3f}  "
              f"teacher_mass {r['distillation/teacher_mass']:.3f}  overlap_ratio {r['distillation/overlap_ratio']:.3f}")
