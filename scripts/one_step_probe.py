"""One optimizer step of each loss family at a few learning rates, from the same student on the same real batch:
does the step lower the exact (full-vocabulary) teacher-KL on the batch it was taken on and on unseen positions?

Batch A (the step's) and batch B (unseen prompts) are on-policy samples of the untrained student, scored by the
teacher (the trainer's own ``Collector``). For each (family, lr): a fresh copy of the student, AdamW as the trainer
builds it (``optim`` section, constant lr, the config's grad_clip), ONE ``train_step`` on A; then, teacher-forced on
A and on B, per response position the exact KL(pi || nu) and KL(nu || pi) (float64 from full logits), the student's
mass outside the teacher's top-K, and the tail-bucket reverse KL, averaged over positions.

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/one_step_probe.py --lrs 1e-5,1e-6
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys

import torch
import torch.nn.functional as F


@torch.no_grad()
def exact_kls(student, data, t_logs, k: int) -> dict:
    """Mean over response positions of exact reverse/forward KL, student rest mass and tail reverse KL."""
    student.eval()
    acc = {"rkl": 0.0, "fkl": 0.0, "student_rest": 0.0, "rkl_tail": 0.0}
    n_all = 0
    for r, lt in enumerate(t_logs):
        n = int(data.attention_mask[r].sum())
        pos = torch.nonzero(data.response_mask[r, 1:n].bool()).squeeze(-1)
        if pos.numel() == 0:
            continue
        ls = F.log_softmax(student(input_ids=data.input_ids[r, :n][None]).logits[0, pos].double(), -1)
        top = lt.topk(k, -1).indices
        out = torch.ones_like(lt, dtype=torch.bool).scatter(-1, top, False)
        s_rest = torch.where(out, ls, -torch.inf).logsumexp(-1)
        t_rest = torch.where(out, lt, -torch.inf).logsumexp(-1)
        sb = torch.cat([ls.gather(-1, top), s_rest[:, None]], -1)
        tb = torch.cat([lt.gather(-1, top), t_rest[:, None]], -1)
        acc["rkl"] += float((ls.exp() * (ls - lt)).sum())
        acc["fkl"] += float((lt.exp() * (lt - ls)).sum())
        acc["student_rest"] += float(s_rest.exp().sum())
        acc["rkl_tail"] += float((sb.exp() * (sb - tb)).sum())
        n_all += pos.numel()
    return {key: v / n_all for key, v in acc.items()} | {"positions": n_all}


@torch.no_grad()
def teacher_logs(teacher, data):
    out = []
    for r in range(data.input_ids.shape[0]):
        n = int(data.attention_mask[r].sum())
        pos = torch.nonzero(data.response_mask[r, 1:n].bool()).squeeze(-1)
        out.append(F.log_softmax(teacher(input_ids=data.input_ids[r, :n][None]).logits[0, pos].double(), -1))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/smollm2_gsm_symbolic.yaml")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--lrs", default="1e-5,1e-6")
    ap.add_argument("--families", default="sampled_k1_pg,tail_forward,tail_reverse")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    import importlib.util
    from pathlib import Path

    from opdistill import DistillationConfig, DistillationLoss
    from opdistill.data import PromptSource
    from opdistill.train import load_config
    from opdistill.teachers import LocalTeacher, Rows, ScoreRequest
    from opdistill.train.steps.collect import Collector
    from opdistill.train.loop import build_task, load_models
    from opdistill.train.run.optim import build_optimizer
    from opdistill.train.steps.step import train_step

    spec = importlib.util.spec_from_file_location("chk", Path(__file__).with_name("check_trainer_gradients.py"))
    chk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chk)
    cfg = load_config(a.config, [f"model.student_from_teacher_layers={a.layers}", f"data.prompts_per_step={a.prompts}",
                                 f"rollout.max_new_tokens={a.max_new_tokens}", "loss.loss_mode=topk",
                                 f"loss.topk={a.k}", "loss.use_policy_gradient=false", "train.threads=1"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tok, student, teacher = load_models(cfg)
    task = build_task(cfg)
    source = PromptSource(task, cfg.train.seed, cfg.data.eval_seed)
    batches = []
    # the sampler's log-probs are drawn only when the config's loss reads them: the policy-gradient update below does
    with_old = cfg.model_copy(update={"loss": dataclasses.replace(cfg.loss, use_policy_gradient=True)})
    for step in (1, 2):  # A: the step's batch; B: unseen prompts
        data, _ = Collector(with_old, tok=tok, task=task, source=source, teacher=None)(step, student)
        data.scores = LocalTeacher(teacher).score(Rows(data.input_ids, data.attention_mask, data.response_mask),
                                                  ScoreRequest(k=a.k, sampled=True))
        batches.append((data, teacher_logs(teacher, data)))
    (A, tA), (B, tB) = batches
    res = {"base": {"A": exact_kls(student, A, tA, a.k), "B": exact_kls(student, B, tB, a.k)}}
    print("base", json.dumps(res["base"]), flush=True)
    for fam in a.families.split(","):
        for lr in [float(x) for x in a.lrs.split(",")]:
            s = copy.deepcopy(student)
            params = [p for p in s.parameters() if p.requires_grad]
            opt = build_optimizer(params, cfg.optim.model_copy(update={"lr": lr}))
            lc = chk.FAMILIES[fam]
            loss_fn = DistillationLoss(DistillationConfig(**lc, topk=a.k if lc["loss_mode"] == "topk" else None))
            m = train_step(s, opt, A, loss_fn=loss_fn, micro_batch_tokens=1024, grad_clip=cfg.optim.grad_clip)
            row = {"A": exact_kls(s, A, tA, a.k), "B": exact_kls(s, B, tB, a.k), "grad_norm": m["train/grad_norm"]}
            res[f"{fam}@{lr:g}"] = row
            print(f"{fam}@{lr:g}", json.dumps(row), flush=True)
            del s, opt
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
