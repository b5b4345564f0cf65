"""Float64 reference implementations written from SPEC.md, independent of opdistill's code.

They favour obviousness over speed: full-vocabulary softmax, explicit bucket vectors, one row at a time.  Their
gradients (autograd through these plain formulas) are the reference gradients.  Nothing here imports opdistill.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

TAIL_EPS = 1e-6  # documented rest-mass floor (docs/losses.md)


def kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum_i p_i log(p_i / q_i) with 0 log 0 = 0, on probability vectors."""
    terms = [pi * (torch.log(pi) - torch.log(qi)) for pi, qi in zip(p, q) if float(pi.detach()) > 0]
    return torch.stack(terms).sum() if terms else p.sum() * 0


def divergence(p: torch.Tensor, q: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    """teacher p, student q: forward KL(p||q), reverse KL(q||p), jsd with TRL endpoints and M = beta p + (1-beta) q."""
    if kind == "forward" or (kind == "jsd" and beta == 0):
        return kl(p, q)
    if kind == "reverse" or (kind == "jsd" and beta == 1):
        return kl(q, p)
    m = beta * p + (1 - beta) * q
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


def topk_row(z, ids, lp, support, div, beta=0.5, clamp=None, tau=1.0):
    """One position: z [V] student logits, ids [K], lp [K] teacher log-probs (-inf = empty slot)."""
    logpi = F.log_softmax(z.double() / tau, dim=-1)
    keep = [k for k in range(len(ids)) if math.isfinite(float(lp[k]))]
    s = torch.stack([logpi[int(ids[k])] for k in keep]) if keep else logpi[:0]
    t = torch.stack([lp[k].double() for k in keep]) if keep else logpi[:0].detach()
    if not keep:
        return z.sum() * 0
    if support == "truncated":
        if clamp is not None:
            s, t = torch.clamp(s, min=clamp), torch.clamp(t, min=clamp)
        return torch.clamp((t.exp() * (t - s)).sum(), min=0.0)
    nu, pi = t.exp(), s.exp()
    if support == "renormalized":
        return divergence(nu / nu.sum(), pi / pi.sum(), div, beta)
    # tail: K+1 buckets; student rest floored at eps; teacher rest exact in forward, floored in reverse/jsd
    teacher_rest = torch.clamp(1 - nu.sum(), min=0.0)
    if not (div == "forward" or (div == "jsd" and beta == 0)):
        teacher_rest = torch.clamp(teacher_rest, min=TAIL_EPS)
    student_rest = torch.clamp(1 - pi.sum(), min=TAIL_EPS)
    return divergence(torch.cat([nu, teacher_rest[None]]), torch.cat([pi, student_rest[None]]), div, beta)


def topk_reference(z, ids, lp, support, div, beta=0.5, clamp=None, tau=1.0):
    """[..., V] x [..., K] -> per-token loss [...], by rows."""
    lead = z.shape[:-1]
    zf, idf, lf = z.reshape(-1, z.shape[-1]), ids.reshape(-1, ids.shape[-1]), lp.reshape(-1, lp.shape[-1])
    rows = [topk_row(zf[r], idf[r], lf[r], support, div, beta, clamp, tau) for r in range(zf.shape[0])]
    return (torch.stack(rows) if rows else zf.sum(-1)).reshape(lead)


def diagnostics_reference(z, ids, lp, clamp=None, tau=1.0):
    """(Q, P, overlap_count, overlap_token_advantage) per position, by rows, from the SPEC definitions."""
    lead = z.shape[:-1]
    K = ids.shape[-1]
    zf, idf, lf = z.reshape(-1, z.shape[-1]).double(), ids.reshape(-1, K), lp.reshape(-1, K).double()
    out = []
    for r in range(zf.shape[0]):
        logpi = F.log_softmax(zf[r] / tau, dim=-1)
        student_top = set(torch.argsort(zf[r], descending=True)[:K].tolist())
        Q = P = adv_sum = 0.0
        count = 0
        for k in range(K):
            if not math.isfinite(float(lf[r, k])):
                continue
            i = int(idf[r, k])
            Q += math.exp(float(logpi[i]))
            P += math.exp(float(lf[r, k]))
            if i in student_top:
                s, t = float(logpi[i]), float(lf[r, k])
                if clamp is not None:
                    s, t = max(s, clamp), max(t, clamp)
                count += 1
                adv_sum += math.exp(t) * (t - s)
        out.append((Q, P, count, -adv_sum / count if count else 0.0))
    cols = list(zip(*out)) if out else [(), (), (), ()]
    return (
        torch.tensor(cols[0], dtype=torch.float64).reshape(lead),
        torch.tensor(cols[1], dtype=torch.float64).reshape(lead),
        torch.tensor(cols[2], dtype=torch.int64).reshape(lead),
        torch.tensor(cols[3], dtype=torch.float64).reshape(lead),
    )


# --- peers, transcribed from their published formulas (the shared cases we must agree with) ---------------------
def verl_forward_kl_topk(student_logits, teacher_ids, teacher_logprobs, log_prob_min_clamp=None):
    """verl 0.9.1 FSDP forward_kl_topk (gather - logsumexp in fp32, optional clamp_min of both log-probs,
    sum p (log p - log q) in fp32) followed by the clamp_min(0) of its loss wrapper."""
    x = student_logits.float()
    s = x.gather(-1, teacher_ids) - torch.logsumexp(x, dim=-1, keepdim=True)
    s = s.to(student_logits.dtype)
    student_mass = s.exp().sum(-1)
    t = teacher_logprobs
    teacher_mass = t.exp().sum(-1)
    if log_prob_min_clamp is not None:
        s = s.clamp_min(log_prob_min_clamp)
        t = t.clamp_min(log_prob_min_clamp)
    lp, lq = t.float(), s.float()
    loss = (lp.exp() * (lp - lq)).sum(-1)
    student_top = torch.topk(student_logits, k=teacher_ids.shape[-1], dim=-1).indices
    overlap = (teacher_ids.unsqueeze(-1) == student_top.unsqueeze(-2)).any(-1)
    count = overlap.sum(-1)
    token_kl = t.exp() * (t - s)
    adv = (-token_kl * overlap).sum(-1) / count.clamp_min(1)
    adv = torch.where(count > 0, adv, torch.zeros_like(adv))
    return loss.clamp_min(0.0), student_mass, teacher_mass, count, adv


def verl_kl_penalty(logprob, ref_logprob, mode):
    """verl core_algos.kl_penalty_forward for k1/abs/k2/k3 and aliases."""
    if mode in ("kl", "k1"):
        return logprob - ref_logprob
    if mode == "abs":
        return (logprob - ref_logprob).abs()
    if mode in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if mode in ("low_var_kl", "k3"):
        kl_ = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(kl_) - kl_ - 1, min=-10, max=10)
    raise ValueError(mode)


def trl_generalized_jsd(student_logits, teacher_logits, beta=0.5, temperature=1.0):
    """TRL GKDTrainer.generalized_jsd_loss with reduction='none', summed over the vocabulary per token."""
    s = F.log_softmax(student_logits / temperature, dim=-1)
    t = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(s, t, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=s.dtype)
        m = torch.logsumexp(torch.stack([s + torch.log(1 - b), t + torch.log(b)]), dim=0)
        jsd = b * F.kl_div(m, t, reduction="none", log_target=True) + (1 - b) * F.kl_div(m, s, reduction="none", log_target=True)
    return jsd.sum(-1)


def ppo_reference(logp, old, adv, lo=0.2, hi=0.2, c=3.0):
    """Dual-clip PPO per token, written elementwise from SPEC 3.4."""
    out = []
    for lp_, o, a in zip(logp.reshape(-1), old.reshape(-1), adv.reshape(-1)):
        r = torch.exp(torch.clamp(lp_ - o, -20, 20))
        pg = torch.maximum(-a * r, -a * torch.clamp(r, 1 - lo, 1 + hi))
        if float(a) < 0:
            pg = torch.minimum(pg, -a * c)
        out.append(pg)
    return torch.stack(out).reshape(logp.shape) if out else logp * 0


def aggregate_reference(loss, mask, mode, *, loss_scale_factor=None):
    """Full-batch objective over padded [B, S] from the SPEC table with D = 1 (no splitting at all)."""
    rows = []
    for l_row, m_row in zip(loss, mask):
        vals = [l for l, m in zip(l_row, m_row) if bool(m)]
        rows.append(vals)
    tokens = [v for r in rows for v in r]
    nonempty = [r for r in rows if r]
    zero = loss.sum() * 0
    if mode == "token-mean":
        return torch.stack(tokens).sum() / len(tokens) if tokens else zero
    if mode == "token-sum":
        return torch.stack(tokens).sum() if tokens else zero
    if not nonempty:
        return zero
    if mode == "seq-mean-token-sum":
        return torch.stack([torch.stack(r).sum() for r in nonempty]).sum() / len(nonempty)
    if mode == "seq-mean-token-mean":
        return torch.stack([torch.stack(r).sum() / len(r) for r in nonempty]).sum() / len(nonempty)
    if mode == "seq-mean-token-sum-norm":
        return torch.stack([torch.stack(r).sum() for r in nonempty]).sum() / (len(nonempty) * loss_scale_factor)
    raise ValueError(mode)


# --- the whole loss (SPEC 3.4 + 4), composed from the definitions above ------------------------------------------
def _masked_mean(x, mask):
    vals = [v for v, m in zip(x.reshape(-1), mask.reshape(-1)) if bool(m)]
    return float(torch.stack(vals).mean()) if vals else 0.0


def distillation_reference(z, mask, teacher, *, loss_mode="topk", support="tail", divergence="forward", beta=0.5,
                           topk=None, estimator="k3", use_policy_gradient=False, clip_ratio_low=0.2,
                           clip_ratio_high=0.2, clip_ratio_c=3.0, loss_max_clamp=None, log_prob_min_clamp=None,
                           loss_agg_mode="token-mean", loss_scale_factor=None, temperature=1.0,
                           use_task_rewards=False, distillation_coef=1.0, sampled_ids=None, old_logprobs=None,
                           advantages=None, token_weights=None):
    """One padded micro-batch [B, S] that is the whole step (D = 1), from SPEC 3 and 4: returns (objective, metrics).

    z [B, S, V] student logits (float64, differentiable); the keyword arguments are a DistillationConfig's fields;
    teacher: (ids [B, S, K], log-probs [B, S, K]) for topk, log-probs [B, S] of ``sampled_ids`` for sampled, teacher
    logits [B, S, V] for full.  Only positions with mask 1 are read.  Metrics are the global values by name.
    token_weights [B, S]: every per-token term (loss, PPO surrogate, task surrogate) times its weight before the
    aggregation (truncated importance sampling); the metrics stay unweighted.
    """
    wt = (lambda x: x) if token_weights is None else (lambda x: x * token_weights.double())
    tau = temperature
    valid = [(b, s) for b in range(mask.shape[0]) for s in range(mask.shape[1]) if bool(mask[b, s])]
    zero = z.sum() * 0

    def per_position(fn):
        vals = {p: fn(*p) for p in valid}
        return torch.stack([vals.get((b, s), zero) for b in range(mask.shape[0])
                            for s in range(mask.shape[1])]).reshape(mask.shape)

    def logp(b, s, i):
        return F.log_softmax(z[b, s] / tau, dim=-1)[int(i)]

    if loss_mode == "topk":
        ids, lp = teacher
        per = per_position(lambda b, s: topk_row(z[b, s], ids[b, s], lp[b, s], support, divergence, beta,
                                                 log_prob_min_clamp, tau))
    elif loss_mode == "sampled":
        per = per_position(lambda b, s: verl_kl_penalty(logp(b, s, sampled_ids[b, s]), teacher[b, s].double(),
                                                        estimator))
    else:
        per = per_position(lambda b, s: trl_generalized_jsd(z[b, s], teacher[b, s].double(), beta, tau))
    clamped = per.clamp(-loss_max_clamp, loss_max_clamp) if loss_max_clamp is not None else per
    agg = dict(loss_scale_factor=loss_scale_factor)
    ppo = dict(lo=clip_ratio_low, hi=clip_ratio_high, c=clip_ratio_c)
    metrics = {"distillation/divergence": _masked_mean(clamped.detach(), mask)}
    metrics["distillation/loss_min"] = min((float(per.detach()[p]) for p in valid), default=0.0)
    metrics["distillation/loss_max"] = max((float(per.detach()[p]) for p in valid), default=0.0)
    if use_policy_gradient or use_task_rewards:
        logp_y = per_position(lambda b, s: logp(b, s, sampled_ids[b, s]))
    if use_policy_gradient:
        pg = ppo_reference(logp_y, old_logprobs.double(), -clamped.detach(), **ppo)
        distill = aggregate_reference(wt(pg), mask, loss_agg_mode, **agg)
        metrics["distillation/pg_loss"] = float(distill.detach())
    else:
        distill = aggregate_reference(wt(clamped), mask, loss_agg_mode, **agg)
    metrics["distillation/loss"] = float(distill.detach())
    if loss_mode == "topk":
        q, p, count, adv = diagnostics_reference(z.detach(), ids, lp, log_prob_min_clamp, tau)
        n = len(valid)
        metrics["distillation/student_mass"] = _masked_mean(q, mask)
        metrics["distillation/teacher_mass"] = _masked_mean(p, mask)
        metrics["distillation/overlap_ratio"] = float(count[mask.bool()].sum()) / (ids.shape[-1] * n) if n else 0.0
        metrics["distillation/overlap_token_advantage"] = _masked_mean(adv, mask.bool() & (count > 0))
    if loss_mode == "sampled":
        metrics["distillation/abs_loss"] = _masked_mean(per.detach().abs(), mask)
    if not use_task_rewards:
        return distill, metrics
    task = aggregate_reference(wt(ppo_reference(logp_y, old_logprobs.double(), advantages.double(), **ppo)), mask,
                               loss_agg_mode, **agg)
    total = task + distillation_coef * distill
    metrics["task/loss"], metrics["loss/total"] = float(task.detach()), float(total.detach())
    return total, metrics


def policy_reference(z, mask, sampled_ids, old_logprobs, advantages, *, temperature=1.0, loss_agg_mode="token-mean",
                     loss_scale_factor=None, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                     token_weights=None):
    """The task-reward policy loss alone (the trainer's RL method): aggregate(PPO-clip(log pi(y) at tau, old, A))."""
    logp = F.log_softmax(z.double() / temperature, dim=-1).gather(-1, sampled_ids[..., None])[..., 0]
    keep = mask.bool()
    pg = ppo_reference(torch.where(keep, logp, 0.0), torch.where(keep, old_logprobs.double(), 0.0),
                       torch.where(keep, advantages.double(), 0.0), clip_ratio_low, clip_ratio_high, clip_ratio_c)
    if token_weights is not None:
        pg = pg * token_weights.double()
    loss = aggregate_reference(pg, mask, loss_agg_mode, loss_scale_factor=loss_scale_factor)
    return loss, {"policy/loss": float(loss.detach())}
