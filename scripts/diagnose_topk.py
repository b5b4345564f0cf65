"""What the held-out teacher-KL measures against what the top-k tail losses optimize, on the student's own samples.

Draws the held-out samples exactly as ``opdistill eval`` does (same problems, same keyed sampling), then at every
response position computes, from the student's and the teacher's FULL next-token distributions (float64):

    rkl_full        KL(pi || nu) over the vocabulary (what the k1 teacher-KL estimates, position by position)
    fkl_full        KL(nu || pi)
    rkl_tail        the top-K tail reverse KL (K+1 buckets: the teacher's top-K ids and the rest)
    fkl_tail        the top-K tail forward KL
    rkl_in_rest     rkl_full - rkl_tail = (1 - Q) KL(pi_rest || nu_rest): the part of the reverse KL inside the
                    rest bucket, which no tail loss sees (chain rule of the KL over the bucket partition)
    student_rest    1 - Q, the student's mass outside the teacher's top-K;  teacher_rest  1 - P
    sampled_out     fraction of sampled tokens outside the teacher's top-K
    k1, k1_out      log pi(y) - log nu(y) per token, and its part from tokens outside the teacher's top-K
    k3              (r - 1) - log r, r = nu(y) / pi(y)  (k1 and k3 are eval/teacher_kl and eval/teacher_kl_k3)
    sampled_acc     the verifier's accuracy of the samples (per sample)

each a per-token mean over response tokens with a 95% bootstrap interval over problems (opdistill.runs.stats).

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/diagnose_topk.py RUN_DIR [--base] [overrides...]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

NAMES = ("rkl_full", "fkl_full", "rkl_tail", "fkl_tail", "rkl_in_rest", "student_rest", "teacher_rest",
         "sampled_out", "k1", "k1_out", "k3")


@torch.no_grad()
def diagnose(cfg, tok, student, teacher, task, problems, k: int) -> dict:
    from opdistill import shift_for_next_token
    from opdistill.data import render_prompt
    from opdistill.engines.rollout import generate_rollouts
    from opdistill.runs.stats import ratio_intervals

    ec = cfg.eval
    prompts = [render_prompt(tok, p.prompt, use_chat_template=cfg.data.use_chat_template) for p in problems]
    s = generate_rollouts(student, tok, prompts, n=ec.num_samples, temperature=cfg.rollout.temperature,
                          max_new_tokens=ec.max_new_tokens or cfg.rollout.max_new_tokens, batch_size=ec.batch_size,
                          seed=cfg.data.eval_seed + 777, step=0, prompt_offset=0, want_logprobs=False)
    tgt, m = shift_for_next_token(s.input_ids, s.response_mask)
    m = m.bool()
    P = len(problems)
    sums = {n: torch.zeros(P, dtype=torch.float64) for n in NAMES}
    tokens = torch.zeros(P, dtype=torch.float64)
    tau = cfg.rollout.temperature
    for r in range(s.num_rows):
        n = int(s.attention_mask[r].sum())
        pos = torch.nonzero(m[r, :n]).squeeze(-1)
        if pos.numel() == 0:
            continue
        ids = s.input_ids[r, :n][None]
        ls = F.log_softmax(student(input_ids=ids).logits[0, pos].double() / tau, -1)
        lt = F.log_softmax(teacher(input_ids=ids).logits[0, pos].double(), -1)
        y = tgt[r, pos]
        top = lt.topk(k, -1).indices
        out = torch.ones_like(lt, dtype=torch.bool).scatter(-1, top, False)
        ps, pt = ls.exp(), lt.exp()
        rkl = (ps * (ls - lt)).sum(-1)
        fkl = (pt * (lt - ls)).sum(-1)
        s_rest = torch.where(out, ls, -torch.inf).logsumexp(-1)
        t_rest = torch.where(out, lt, -torch.inf).logsumexp(-1)
        sb = torch.cat([ls.gather(-1, top), s_rest[:, None]], -1)
        tb = torch.cat([lt.gather(-1, top), t_rest[:, None]], -1)
        rkl_tail = (sb.exp() * (sb - tb)).sum(-1)
        fkl_tail = (tb.exp() * (tb - sb)).sum(-1)
        k1 = ls.gather(-1, y[:, None])[:, 0] - lt.gather(-1, y[:, None])[:, 0]
        y_out = out.gather(-1, y[:, None])[:, 0]
        vals = dict(rkl_full=rkl, fkl_full=fkl, rkl_tail=rkl_tail, fkl_tail=fkl_tail, rkl_in_rest=rkl - rkl_tail,
                    student_rest=s_rest.exp(), teacher_rest=t_rest.exp(), sampled_out=y_out.double(), k1=k1,
                    k1_out=torch.where(y_out, k1, 0.0), k3=torch.expm1(-k1) + k1)
        i = s.prompt_index[r]
        for name, v in vals.items():
            sums[name][i] += v.sum()
        tokens[i] += pos.numel()
    correct = torch.zeros(P, dtype=torch.float64)
    samples = torch.zeros(P, dtype=torch.float64)
    for i, text in zip(s.prompt_index, s.texts):
        correct[i] += float(task.score(problems[i], text))
        samples[i] += 1
    ratios = {n: (sums[n].numpy(), tokens.numpy()) for n in NAMES}
    ratios["sampled_acc"] = (correct.numpy(), samples.numpy())
    ivs = ratio_intervals(ratios, seed=0)
    return {n: {"value": iv.value, "lo": iv.lo, "hi": iv.hi} for n, iv in ivs.items()} | {
        "tokens": float(tokens.sum()), "samples": s.num_rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", help="a run directory (its config.yaml and newest checkpoint)")
    ap.add_argument("--base", action="store_true", help="the untrained student (ignore the checkpoints)")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args(argv)
    from opdistill.data import PromptSource
    from opdistill.train import load_config
    from opdistill.train.disk.checkpoint import load_weights, resume_checkpoint
    from opdistill.train.loop import build_task, load_models

    cfg = load_config(Path(a.run_dir) / "config.yaml", [f"run_dir={a.run_dir}", *a.overrides])
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    tok, student, teacher = load_models(cfg)
    ckpt = None
    if not a.base:
        ckpt = resume_checkpoint(cfg.run_dir)
        load_weights(ckpt, student)
    student.eval()
    task = build_task(cfg)
    problems = PromptSource(task, cfg.train.seed, cfg.data.eval_seed).held_out(cfg.eval.num_prompts)
    res = {"checkpoint": None if ckpt is None else str(ckpt), "problems": len(problems), "k": a.k,
           **diagnose(cfg, tok, student, teacher, task, problems, a.k)}
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
