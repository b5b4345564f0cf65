"""Produce the demo's teacher and student-start checkpoints from scratch (no download).

    python scripts/make_demo_models.py --out opdistill/assets/demo

Both models are character-level Llamas on the ``carry_add`` task (see opdistill/data/tasks.py), trained by plain
supervised next-token cross-entropy on the worked solutions:

- teacher: 4 layers, hidden 128 -- trained until greedy held-out accuracy >= --teacher-target (or --teacher-steps);
- teacher-bpe: the teacher's size on a byte-level BPE tokenizer trained here on the task's text (--bpe-vocab ids):
  the demo's cross-tokenizer teacher (``builtin:demo-teacher-bpe``), to the same accuracy target as the teacher;
- student start: 2 layers, hidden 128 -- trained only until its greedy accuracy first reaches --student-target, so the
  demo's methods start from a student that knows the answer format but gets most problems wrong;
- tool-teacher / tool-student (``--only tool-teacher`` / ``--only tool-student``): the same sizes on the
  ``lookup_add`` task, whose answer needs a tool call (opdistill/env/demo.py): trained on whole worked episodes (the
  call, the tool's result as the environment writes it, the worked addition), the loss on the model's own turns
  only; accuracy is that of greedy episodes in the demo environment (docs/episodes.md).

Weights are stored in float16 (each file well under 2 MB) and loaded back as float32; the accuracies printed at the
end are measured after that round trip. Deterministic for a given --seed and thread count.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from opdistill.data import CARRY_ADD_CHARS, CarryAdditionTask, LookupAdditionTask, render_prompt
from opdistill.engines.episodes import run_episodes
from opdistill.engines.rollout import generate_rollouts
from opdistill.env.demo import TOOL_CHARS, TOOL_TEMPLATE, demo_environment
from opdistill.models import bpe_tokenizer, build_tiny_llama, char_tokenizer, load_model

TEACHER = dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=256)
STUDENT = dict(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=256)


def worked(tok, p, env=None):
    """(ids, loss mask) of a worked answer: the prompt and the solution; with ``env``, the whole worked episode
    (each turn closed by EOS, the environment's answer between them, masked)."""
    if env is None:
        prompt = render_prompt(tok, p.prompt)
        resp = tok(p.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return prompt + resp, [0] * len(prompt) + [1] * len(resp)
    ids = env.prompt(p.prompt)
    mask = [0] * len(ids)
    turns = LookupAdditionTask.script(p)
    for i, text in enumerate(turns):
        t = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids, mask = ids + t, mask + [1] * len(t)
        if i + 1 < len(turns):
            obs = env.respond(text).ids
            ids, mask = ids + obs, mask + [0] * len(obs)
    return ids, mask


def sft_batch(tok, problems, env=None):
    seqs, masks = [], []
    for p in problems:
        ids, mask = worked(tok, p, env)
        seqs.append(ids)
        masks.append(mask)
    S = max(map(len, seqs))
    ids = torch.full((len(seqs), S), tok.pad_token_id)
    m = torch.zeros(len(seqs), S)
    for i, (s, k) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        m[i, : len(k)] = torch.tensor(k, dtype=torch.float)
    return ids, m


def bpe_corpus(task, seed, n=20000):
    """Prompts and worked solutions as the teacher reads them: each a text of its own (a prompt and its response are
    tokenized apart, so no merge crosses the boundary between them)."""
    rng = random.Random(f"bpe/{seed}")
    for _ in range(n):
        p = task.sample(rng)
        yield p.prompt
        yield p.solution


def accuracy(model, tok, task, problems, env=None):
    if env is not None:  # greedy episodes: the last turn is the answer
        out = run_episodes(model, tok, [env.prompt(p.prompt) for p in problems], env, greedy=True, max_new_tokens=64)
        return sum(task.score(p, t) for p, t in zip(problems, out.texts)) / len(problems)
    prompts = [render_prompt(tok, p.prompt) for p in problems]
    out = generate_rollouts(model, tok, prompts, greedy=True, max_new_tokens=64)
    return sum(task.score(p, t) for p, t in zip(problems, out.texts)) / len(problems)


def train(model, tok, task, *, seed, steps, lr, batch, target, eval_every, held_out, label, min_steps=0, env=None):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    # linear warmup over 50 steps, then cosine decay to 5% at `steps` (a constant rate leaves accuracy oscillating)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    rng = random.Random(f"sft/{label}/{seed}")
    t0 = time.time()
    acc = accuracy(model, tok, task, held_out, env)
    print(f"[{label}] step 0 acc {acc:.3f}", flush=True)
    for step in range(1, steps + 1):
        ids, m = sft_batch(tok, [task.sample(rng) for _ in range(batch)], env)
        model.train()
        logits = model(ids, attention_mask=(ids != tok.pad_token_id).long()).logits[:, :-1]
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        loss = (ce * m[:, 1:].reshape(-1)).sum() / m[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % eval_every == 0:
            acc = accuracy(model, tok, task, held_out, env)
            print(f"[{label}] step {step} loss {loss.item():.4f} acc {acc:.3f} ({time.time() - t0:.0f}s)", flush=True)
            if acc >= target and step >= min_steps:
                break
    return step, acc


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="opdistill/assets/demo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--teacher-steps", type=int, default=2500)
    ap.add_argument("--teacher-target", type=float, default=0.99)
    ap.add_argument("--student-steps", type=int, default=2000)
    ap.add_argument("--student-target", type=float, default=0.15)
    ap.add_argument("--student-layers", type=int, default=STUDENT["num_layers"],
                    help="a smaller student (e.g. 1 layer, hidden 64) for a larger capacity gap to the teacher")
    ap.add_argument("--student-hidden", type=int, default=STUDENT["hidden_size"],
                    help="the student's hidden size; its MLP is twice that")
    ap.add_argument("--bpe-vocab", type=int, default=320, help="teacher-bpe's vocabulary: 4 specials, 256 bytes, "
                    "the rest merges")
    ap.add_argument("--only", choices=["teacher", "student", "teacher-bpe", "tool-teacher", "tool-student"],
                    default=None, help="build one model (default: teacher and student; teacher-bpe and the tool "
                    "models only when named)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    task = CarryAdditionTask()
    tok = char_tokenizer(CARRY_ADD_CHARS)
    held_out = [task.sample(random.Random(f"sft-eval/{args.seed}/{i}")) for i in range(200)]
    out = Path(args.out)
    meta = out / "README.json"
    info = json.loads(meta.read_text())["models"] if meta.exists() else {}
    student = dict(STUDENT, num_layers=args.student_layers, hidden_size=args.student_hidden,
                   intermediate_size=2 * args.student_hidden)
    specs = [("teacher", TEACHER, args.teacher_steps, 3e-3, args.teacher_target, 100),
             ("student", student, args.student_steps, 2e-3, args.student_target, 25),
             ("teacher-bpe", TEACHER, args.teacher_steps, 3e-3, args.teacher_target, 100),
             ("tool-teacher", TEACHER, args.teacher_steps, 3e-3, args.teacher_target, 100),
             ("tool-student", student, args.student_steps, 2e-3, args.student_target, 25)]
    for label, spec, steps, lr, target, every in specs:
        if label != args.only and (args.only or label in ("teacher-bpe", "tool-teacher", "tool-student")):
            continue
        env = None
        if label == "teacher-bpe":
            tok = bpe_tokenizer(bpe_corpus(task, args.seed), vocab_size=args.bpe_vocab)
        if label.startswith("tool-"):  # lookup_add in the demo environment (opdistill/env/demo.py)
            task = LookupAdditionTask()
            tok = char_tokenizer(TOOL_CHARS, chat_template=TOOL_TEMPLATE)
            env = demo_environment(tok)
            held_out = [task.sample(random.Random(f"sft-eval/{args.seed}/{i}")) for i in range(200)]
        model = build_tiny_llama(tok, seed=args.seed + label.endswith("student"), **spec)
        step, acc = train(model, tok, task, seed=args.seed, steps=steps, lr=lr, batch=64, target=target,
                          eval_every=every, held_out=held_out, label=label, env=env)
        d = out / label
        d.mkdir(parents=True, exist_ok=True)
        model.half().save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)
        reloaded = load_model(d, dtype="float32")
        acc = accuracy(reloaded, tok, task, held_out, env)
        n_params = sum(p.numel() for p in reloaded.parameters())
        info[label] = dict(steps=step, greedy_acc_after_fp16=acc, params=n_params, **spec)
        print(f"[{label}] saved to {d}: {n_params} params, greedy acc after fp16 round trip {acc:.3f}", flush=True)
    meta.write_text(json.dumps(dict(seed=args.seed, models=info), indent=1))


if __name__ == "__main__":
    main()
