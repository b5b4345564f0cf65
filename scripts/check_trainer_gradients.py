"""Plumbing check on a real model: the gradient the trainer applies, per loss family, against a float64 reference.

For one batch of real on-policy rollouts (the trainer's own ``Collector``: student samples, teacher scores), each loss
family runs ONE ``train_step`` (the trainer's micro-batching by token budget, ``GlobalBatch`` aggregation, backward,
optionally the fused lm_head path) with an optimizer that only records ``param.grad`` when ``step()`` is called, i.e.
the gradient the optimizer would apply (``grad_clip`` off, so it is the raw gradient). The reference is written here
from SPEC.md, independently of opdistill's loss code: a float64 copy of the student and of the teacher, each row run
alone without padding, full-vocabulary log-softmax at every position whose next token is a response token, the
teacher's top-K set and its rest bucket computed here from the teacher's full float64 distribution, the per-token
objective in float64, token-mean over all the step's response tokens, autograd to the same parameters.

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/check_trainer_gradients.py            # SmolLM2, 20-layer student
    PYTHONPATH=. python scripts/check_trainer_gradients.py --layers 8 --prompts 1 --max-new-tokens 32

Prints one line per family and path: the relative L2 error ||g_trainer - g_ref|| / ||g_ref|| on each parameter
checked (the tied embedding / lm_head, the final norm, one middle layer, the first layer) and their cosine.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

EPS = 1e-6  # the documented rest-mass floor of the tail divergences (SPEC 3.1, docs/losses.md)

# (name, loss config). The families the trainer offers (loss_mode "full" needs teacher logits the trainer does not
# keep: refused by the trainer, so not here).
FAMILIES = {
    "sampled_k1_pg": dict(loss_mode="sampled", estimator="k1", use_policy_gradient=True),
    "sampled_k3": dict(loss_mode="sampled", estimator="k3"),
    "sampled_k2": dict(loss_mode="sampled", estimator="k2"),
    "tail_forward": dict(loss_mode="topk", support="tail", divergence="forward"),
    "tail_reverse": dict(loss_mode="topk", support="tail", divergence="reverse"),
    "tail_jsd": dict(loss_mode="topk", support="tail", divergence="jsd", beta=0.5),
    "truncated_forward": dict(loss_mode="topk", support="truncated", divergence="forward"),
    "truncated_forward_clamp": dict(loss_mode="topk", support="truncated", divergence="forward",
                                    log_prob_min_clamp=-10.0),
    "renormalized_forward": dict(loss_mode="topk", support="renormalized", divergence="forward"),
    "renormalized_reverse": dict(loss_mode="topk", support="renormalized", divergence="reverse"),
    "renormalized_jsd": dict(loss_mode="topk", support="renormalized", divergence="jsd", beta=0.5),
}


class GradSpy:
    """Stands in for the optimizer: ``step()`` records the gradients it would apply and changes nothing."""

    def __init__(self, params):
        self.params = list(params)
        self.grads = None

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        self.grads = [None if p.grad is None else p.grad.detach().double().clone() for p in self.params]


def checked_params(model):
    """(name, parameter) pairs checked: tied embedding / lm_head, final norm, a middle layer, the first layer."""
    layers = model.model.layers
    mid = len(layers) // 2
    named = dict(model.named_parameters())
    names = ["model.embed_tokens.weight", "model.norm.weight", f"model.layers.{mid}.mlp.down_proj.weight",
             f"model.layers.{mid}.self_attn.q_proj.weight", f"model.layers.{mid}.input_layernorm.weight",
             "model.layers.0.self_attn.v_proj.weight"]
    if "lm_head.weight" in named and named["lm_head.weight"] is not named["model.embed_tokens.weight"]:
        names.insert(1, "lm_head.weight")
    return [(n, named[n]) for n in names]


# ----------------------------------------------------------------------------------------------------------------
# float64 reference, from SPEC.md only


def reference_positions(student64, teacher64, data, temperature: float):
    """Row by row, without padding: (student log-probs [N, V] with graph, teacher log-probs [N, V], the sampled next
    tokens [N], the sampler's old log-probs [N]), over the positions whose next token is a response token."""
    s_rows, t_rows, y_rows, old_rows, where = [], [], [], [], []
    for r in range(data.input_ids.shape[0]):
        n = int(data.attention_mask[r].sum())
        ids = data.input_ids[r, :n][None]
        resp = data.response_mask[r, :n].bool()
        pos = torch.nonzero(resp[1:]).squeeze(-1)  # position t predicts token t + 1, a response token
        if pos.numel() == 0:
            continue
        zs = student64(input_ids=ids).logits[0, pos]  # [n_r, V] float64, graph kept
        with torch.no_grad():
            zt = teacher64(input_ids=ids).logits[0, pos]
        s_rows.append(F.log_softmax(zs / temperature, dim=-1))
        t_rows.append(F.log_softmax(zt, dim=-1))  # the teacher scores at temperature 1 (SPEC 2)
        y_rows.append(ids[0, pos + 1])
        old_rows.append(data.sampler_logprobs[r, pos].double())
        where += [(r, int(t)) for t in pos]
    return torch.cat(s_rows), torch.cat(t_rows), torch.cat(y_rows), torch.cat(old_rows), where


def _kl(p_log, q_log):
    """sum p (log p - log q) over the last dim, 0 log 0 = 0."""
    p = p_log.exp()
    return torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p)).sum(-1)


def _div(t_log, s_log, kind, beta):
    if kind == "forward":
        return _kl(t_log, s_log)
    if kind == "reverse":
        return _kl(s_log, t_log)
    m_log = torch.logaddexp(t_log + math.log(beta), s_log + math.log(1 - beta))
    return beta * _kl(t_log, m_log) + (1 - beta) * _kl(s_log, m_log)


def reference_per_token(cfg: dict, s_log, t_log, y, old, k: int):
    """Per-token objective of ``cfg`` in float64 from full log-probs; for policy gradient the PPO-clip surrogate."""
    mode = cfg["loss_mode"]
    if mode == "sampled":
        d = s_log.gather(-1, y[:, None])[:, 0] - t_log.gather(-1, y[:, None])[:, 0]
        est = cfg["estimator"]
        if est == "k1":
            per = d
        elif est == "k2":
            per = 0.5 * d ** 2
        else:  # k3
            r = (-d).clamp(-20, 20)
            per = (r.exp() - r - 1).clamp(-10, 10)
        if not cfg.get("use_policy_gradient"):
            return per
        adv = -per.detach()
        logp = s_log.gather(-1, y[:, None])[:, 0]
        ratio = torch.exp((logp - old).clamp(-20, 20))
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        return torch.where(adv < 0, torch.minimum(pg, -adv * 3.0), pg)
    top = t_log.topk(k, dim=-1).indices  # the teacher's top-K set, from its full float64 distribution
    t = t_log.gather(-1, top)
    s = s_log.gather(-1, top)
    support, kind, beta = cfg["support"], cfg["divergence"], cfg.get("beta", 0.5)
    if support == "truncated":
        c = cfg.get("log_prob_min_clamp")
        if c is not None:
            s, t = s.clamp_min(c), t.clamp_min(c)
        return (t.exp() * (t - s)).sum(-1).clamp_min(0.0)
    if support == "renormalized":
        return _div(t - t.logsumexp(-1, keepdim=True), s - s.logsumexp(-1, keepdim=True), kind, beta)
    # tail: the rest bucket's mass summed over the full vocabulary outside the top-K set
    outside = torch.ones_like(t_log, dtype=torch.bool).scatter(-1, top, False)
    neg = torch.tensor(float("-inf"), dtype=t_log.dtype)
    t_rest = torch.where(outside, t_log, neg).logsumexp(-1)
    s_rest = torch.where(outside, s_log, neg).logsumexp(-1).clamp_min(math.log(EPS))
    if kind != "forward":
        t_rest = t_rest.clamp_min(math.log(EPS))
    return _div(torch.cat([t, t_rest[:, None]], -1), torch.cat([s, s_rest[:, None]], -1), kind, beta)


# ----------------------------------------------------------------------------------------------------------------


def collect_batch(cfg, tok, student, teacher, k: int):
    """One step of real rollouts through the trainer's own ``Collector`` with both teacher signals and the sampler's
    log-probs attached (the policy-gradient family reads them; the collector draws them only when ``cfg``'s loss
    needs them, and the samples are the same either way)."""
    from opdistill.data import PromptSource
    from opdistill.teachers import LocalTeacher, Rows, ScoreRequest
    from opdistill.train.steps.collect import Collector
    from opdistill.train.loop import build_task

    task = build_task(cfg)
    source = PromptSource(task, cfg.train.seed, cfg.data.eval_seed)
    with_old = cfg.model_copy(update={"loss": dataclasses.replace(cfg.loss, use_policy_gradient=True)})
    data, _ = Collector(with_old, tok=tok, task=task, source=source, teacher=None)(1, student)
    assert data.sampler_logprobs is not None
    data.scores = LocalTeacher(teacher).score(Rows(data.input_ids, data.attention_mask, data.response_mask),
                                              ScoreRequest(k=k, sampled=True))
    return data


def run_check(student, teacher, data, *, k: int, micro_batch_tokens: int, families=None, fused=(False, True),
              temperature: float = 1.0, tie_gap: float = 1e-3, log=print) -> list[dict]:
    """Trainer gradient vs float64 reference for each family x path; returns one dict per (family, fused).
    ``families``: names (each run on every path of ``fused``) or (name, fused) pairs."""
    from opdistill import DistillationConfig, DistillationLoss
    from opdistill.train.steps.step import train_step

    families = families or list(FAMILIES)
    student64 = copy.deepcopy(student).double()
    teacher64 = copy.deepcopy(teacher).double()
    student64.train()  # same mode as train_step (no dropout in these models either way)
    checked = checked_params(student)
    checked64 = [p for _, p in checked_params(student64)]
    t0 = time.perf_counter()
    s_log, t_log, y, old, where = reference_positions(student64, teacher64, data, temperature)
    # The top-K set is only defined up to near-ties at the K-th place: the float32 teacher the trainer runs and the
    # float64 one here can order two tokens whose log-probs differ by ~1e-5 differently, and then the two compute
    # different (equally valid) objectives there. Such positions (a gap < tie_gap between the K-th and the
    # (K+1)-th float64 teacher log-probs) are left out of both sides (masked in the step's response mask).
    top2 = t_log.topk(k + 1, dim=-1).values
    tie = (top2[:, k - 1] - top2[:, k]) < tie_gap
    if bool(tie.any()):
        data = dataclasses.replace(data, response_mask=data.response_mask.clone())
        for j in torch.nonzero(tie).squeeze(-1).tolist():
            r, t = where[j]
            data.response_mask[r, t + 1] = 0
        keep = ~tie
        s_log, t_log, y, old = s_log[keep], t_log[keep], y[keep], old[keep]
    n_tok = s_log.shape[0]
    log(f"{n_tok} response positions ({int(tie.sum())} near-ties at the K-th place left out), "
        f"{data.input_ids.shape[0]} rows; reference forward {time.perf_counter() - t0:.0f} s")
    # how often the trainer's (float32 teacher) top-K set still differs from the float64 one
    mask = data.response_mask.bool()[:, 1:]
    tr_ids = data.scores.topk.ids[:, :-1][mask].sort(-1).values
    ref_ids = t_log.topk(k, dim=-1).indices.sort(-1).values
    set_diff = int((tr_ids != ref_ids).any(-1).sum())
    log(f"top-{k} set of the trainer's teacher differs from the float64 one at {set_diff} of them")
    results = []
    for i, name in enumerate(families):
        name, paths = (name, fused) if isinstance(name, str) else (name[0], (name[1],))
        lc = FAMILIES[name]
        per = reference_per_token(lc, s_log, t_log, y, old, k)
        ref_loss = per.sum() / n_tok  # token-mean over every response token of the step
        ref = torch.autograd.grad(ref_loss, checked64, retain_graph=i < len(families) - 1)
        for fl in paths:
            cfg = DistillationConfig(**lc, topk=k if lc["loss_mode"] == "topk" else None, temperature=temperature)
            spy = GradSpy(p for p in student.parameters() if p.requires_grad)
            t1 = time.perf_counter()
            out = train_step(student, spy, data, loss_fn=DistillationLoss(cfg),
                             micro_batch_tokens=micro_batch_tokens, grad_clip=None, fused_lm_head=fl)
            by_param = {id(p): g for p, g in zip(spy.params, spy.grads)}
            errs, coss = {}, {}
            for (pname, p), g_ref in zip(checked, ref):
                g = by_param[id(p)]
                errs[pname] = float((g - g_ref).norm() / g_ref.norm().clamp_min(1e-300))
                coss[pname] = float(F.cosine_similarity(g.flatten(), g_ref.flatten(), dim=0))
            row = dict(family=name, fused=fl, positions=n_tok, micro_batches=int(out["train/micro_batches"]),
                       max_rel_err=max(errs.values()), min_cos=min(coss.values()), rel_err=errs,
                       ref_loss=float(ref_loss.detach()), trainer_divergence=out.get("distillation/divergence"),
                       topk_set_diff_positions=set_diff, seconds=time.perf_counter() - t1)
            results.append(row)
            log(f"{name:24s} fused={str(fl):5s} micro_batches={row['micro_batches']} "
                f"max rel err {row['max_rel_err']:.2e} min cos {row['min_cos']:.7f} "
                f"(ref loss {row['ref_loss']:.5f}, trainer divergence {row['trainer_divergence']:.5f}) "
                f"{row['seconds']:.0f} s")
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/smollm2_gsm_symbolic.yaml")
    ap.add_argument("--layers", type=int, default=20, help="model.student_from_teacher_layers")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--n", type=int, default=2, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--micro-batch-tokens", type=int, default=384)
    ap.add_argument("--families", default="all", help="comma-separated subset of: " + ",".join(FAMILIES))
    ap.add_argument("--fused", default="both", choices=["both", "off", "on"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-3, help="largest relative L2 error accepted")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    from opdistill.train import load_config
    from opdistill.train.loop import load_models

    cfg = load_config(a.config, [f"model.student_from_teacher_layers={a.layers}", f"data.prompts_per_step={a.prompts}",
                                 f"rollout.n={a.n}", f"rollout.max_new_tokens={a.max_new_tokens}",
                                 f"train.seed={a.seed}", "loss.loss_mode=topk", f"loss.topk={a.k}",
                                 "loss.use_policy_gradient=false"])
    torch.manual_seed(cfg.train.seed)
    tok, student, teacher = load_models(cfg)
    data = collect_batch(cfg, tok, student, teacher, a.k)
    fused = {"both": (False, True), "off": (False,), "on": (True,)}[a.fused]
    fams = list(FAMILIES) if a.families == "all" else a.families.split(",")
    res = run_check(student, teacher, data, k=a.k, micro_batch_tokens=a.micro_batch_tokens, families=fams,
                    fused=fused)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    bad = [r for r in res if not r["max_rel_err"] <= a.tol]
    print("OK: every family within" if not bad else f"FAILED ({len(bad)}): beyond", f"rel err {a.tol}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
