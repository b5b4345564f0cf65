"""The vocab-sharded stages: every path that needs log pi over a (possibly sharded) vocabulary calls these.

``parallel/`` calls them on a rank's shard of the logits; ``fused/`` on one token chunk of z = h W^T (+ b) computed in
fp32 from its shard of the lm_head; the plain, unsharded case is a ``VocabShard`` of one rank (no collective).
A rank holds the columns ``[start, start + width)`` of the vocabulary (``shard.VocabShard``).  With z = x / tau:

``lse_and_gather``  (2 collectives for any number of logit tensors, any K, with or without the entropy)
    m      = max_j z_j                             all-reduce MAX of the local maxima (+ the layout check)   [N, X]
    S      = sum_j exp(z_j - m)                    all-reduce SUM of the local sums                          [N, X]
    z_ik   = z at the teacher id i_k               same SUM message: only the owning rank contributes        [N, K]
    T      = sum_j exp(z_j - m) (z_j - m)          same SUM message, only when the entropy is asked          [N]
    R      = sum_{j not in T} exp(z_j - m)         same SUM message, only when the rest mass is asked (tail) [N]
             log(1 - Q) = log R - log S, summed directly (never 1 - sum_k pi(i_k)): exact relative precision
    lse    = m + log S,     s_k = z_ik - lse = log pi(i_k),     E = -sum_j pi_j log pi_j = log S - T / S
  identical on every rank.  Ids owned by another rank gather at local index 0 with a zero weight
  (``where(owned, ., 0)``), so a real token at local index 0 is never disturbed.

``logit_grad``  (no collective) for any per-token loss that reaches the logits only through s (and E),
  g_k = dL/ds_k, gE = dL/dE:
    dL/dz_j = (1/tau) * (sum_k g_k [i_k = j]  -  (sum_k g_k) pi_j  -  gE pi_j (log pi_j + E)),   pi_j = exp(z_j - lse)
  and with g_r = dL/d log(1 - Q) (tail):  + (1/tau) g_r ([j not in T] pi_j / (1 - Q) - pi_j)
  g is the same on every rank; pi_j is recomputed chunk-wise from the saved logits (their own dtype) and lse, and
  each rank scatter-adds only the g_k of the ids it owns (duplicates add up, as the single-device gather's backward).

``global_topk``  (1 collective) the student's own top-k ids: local top-k, one all_gather of [values | ids], global
  top-k of the P*k candidates.

``divergence_step``  (3 collectives) the full-vocabulary KL or JSD of one chunk of both sides' logits, value and
  logit gradient in one pass over buffers it owns: two exps per element (and a log for the JSD), the rest in place;
  what the fused two-head ops run (their chunks are theirs to overwrite).  The vocab-parallel JSD, whose logits
  belong to autograd and are kept for backward, runs the next two instead.

``jsd_totals`` / ``jsd_logit_grad``  (1 collective / none) the full-vocabulary JSD, student and teacher sharded alike:
    J = sum_j phi(s_j, t_j),  A = sum_j a_j  (a_j = d phi / d s_j)       one all-reduce SUM of [N, 2]
    dJ/dz_j = (1/tau) * grad * (a_j - pi_j A)                           (the log-softmax backward; no collective)
  phi and a are the one kernel of ``ops.divergence`` (endpoint rules included), summed column chunk by chunk.

Padding columns (global id >= vocab_size) are never read: no mass, no top-k candidate, gradient 0.  Rows where
``live`` is False (masked positions) are replaced by zeros as they are read, and their g by 0, so whatever they hold
reaches no value and no gradient.  Each stage walks the rows in chunks of about ``shard.CHUNK_ELEMENTS`` logits, so
no fp32 copy of a whole low-precision ``[N, Vl]`` block exists.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops.divergence import divergence, divergence_grad
from .shard import VocabShard, all_gather_cat, all_reduce_, all_reduce_max_checked, row_chunks


def scaled(x: torch.Tensor, tau: float, dtype: torch.dtype, live: torch.Tensor | None = None) -> torch.Tensor:
    """z = x / tau in the compute dtype (the arithmetic of ``ops.topk.student_logprobs_at``); dead rows -> 0."""
    z = x.to(dtype)
    z = z / tau if tau != 1.0 else z
    return z if live is None else torch.where(live[:, None], z, 0.0)


def block(x: torch.Tensor, rows: slice, w: int, tau: float, dtype, live: torch.Tensor | None = None) -> torch.Tensor:
    """One row chunk of this rank's real columns, scaled: ``scaled(x[rows, :w], ...)``."""
    return scaled(x[rows, :w], tau, dtype, None if live is None else live[rows])


def owned_local_ids(shard: VocabShard, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(owned [N, K] bool, local index [N, K]): ids not in this rank's real columns map to local index 0."""
    owned = (ids >= shard.start) & (ids < shard.start + shard.width)
    return owned, torch.where(owned, ids - shard.start, 0)


def outside_mask(local: torch.Tensor, in_t: torch.Tensor, rows: slice, w: int) -> torch.Tensor:
    """[n, w] bool: column j of this rank is NOT a teacher id of its row (j not in T), for one row chunk.

    ``local`` [N, K] from ``owned_local_ids``, ``in_t`` [N, K] bool: the slots that are in T here (owned and
    non-empty).  Built by a scatter-add of counts, so slots of other ranks (local index 0, count 0) never mark the
    real column 0."""
    count = torch.zeros((local[rows].shape[0], w), dtype=torch.int32, device=local.device)
    count.scatter_add_(1, local[rows], in_t[rows].to(torch.int32))
    return count == 0


def lse_and_gather(shard: VocabShard, xs: tuple[torch.Tensor, ...], ids: torch.Tensor | None, tau: float,
                   dtype: torch.dtype, *, live: torch.Tensor | None = None, entropy: bool = False,
                   keep_exp: torch.Tensor | None = None, rest_slots: torch.Tensor | None = None,
                   rest_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                  torch.Tensor | None]:
    """(lse [N, X], z/tau of xs[0] at ids [N, K] (None without ids), entropy of xs[0] [N] (None unless asked)).

    ``xs``: X logit blocks ``[N, Vl]`` sharded the same way (the JSD passes student and teacher); ``live`` [N] bool.
    Two collectives in all: an all-reduce MAX of [N, X] and an all-reduce SUM of [N, X + K (+ 1)].
    ``keep_exp`` [N] (the fused chunk buffer: xs[0] in the compute dtype, no live, no entropy): xs[0] is overwritten
    in place by exp(z - m) and keep_exp receives 1 / S, so that pi = xs[0] * keep_exp (``logit_grad``'s pi_scale).
    ``rest_slots`` [N, K] bool (the slots of ids that are in T: the non-empty ones) with ``rest_out`` [N]: rest_out
    receives log(1 - Q) = log R - log S of xs[0], R = sum_{j not in T} exp(z_j - m) summed directly over the
    columns outside T (one more column of the same SUM message, no extra collective), so 1 - Q keeps its relative
    precision however close Q is to 1 (1 - sum_k exp(s_k) would only be known to ~1e-7 |lse| absolutely).
    """
    n, w, nx = xs[0].shape[0], shard.width, len(xs)
    k = 0 if ids is None else ids.shape[1]
    dev = xs[0].device
    chunks = list(row_chunks(n, w)) if w > 0 else []
    m = torch.full((n, nx), float("-inf"), dtype=dtype, device=dev)
    for rows in chunks:
        for i, x in enumerate(xs):
            m[rows, i] = block(x, rows, w, tau, dtype, live).amax(-1)
    m = all_reduce_max_checked(m, shard)  # collective 1: the global max (and the layout check)
    m = torch.where(torch.isfinite(m), m, 0.0)  # rows of -inf only (or NaN): keep exp() finite, as torch.logsumexp
    rest = rest_out is not None
    # [N, X + K (+1) (+1)]: S, z at ids, (entropy T), (rest R)
    buf = torch.zeros((n, nx + k + int(entropy) + int(rest)), dtype=dtype, device=dev)
    ent_col = nx + k
    if k and w > 0:
        owned, local = owned_local_ids(shard, ids)
        in_t = owned & rest_slots if rest else None
        picked = scaled(xs[0].gather(1, local), tau, dtype, live)
        buf[:, nx : nx + k] = torch.where(owned, picked, 0.0)
    for rows in chunks:
        for i, x in enumerate(xs):
            if keep_exp is not None and i == 0:  # in the buffer: it becomes exp(z - m)
                d = x[rows, :w] if tau == 1.0 else x[rows, :w].div_(tau)
                d.sub_(m[rows, 0:1])
            else:
                d = block(x, rows, w, tau, dtype, live) - m[rows, i : i + 1]
            if not (entropy and i == 0):
                e = d.exp_()
                buf[rows, i] = e.sum(-1)
            else:
                e = torch.exp(d)
                buf[rows, i] = e.sum(-1)
                buf[rows, ent_col] = torch.where(e > 0, e * d, 0.0).sum(-1)  # exp(-inf) * -inf would be NaN
            if rest and i == 0:  # R = sum_{j not in T} exp(z_j - m): a masked sum, never S - sum_T
                out_t = outside_mask(local, in_t, rows, w) if k else torch.ones_like(e, dtype=torch.bool)
                buf[rows, -1] = torch.where(out_t, e, 0.0).sum(-1)
    all_reduce_(buf, dist.ReduceOp.SUM, shard)  # collective 2: sums, owned logits and entropy terms, one message
    lse = m + torch.log(buf[:, :nx])
    if keep_exp is not None:
        torch.reciprocal(buf[:, 0], out=keep_exp)
    if rest:
        rest_out.copy_(torch.log(buf[:, -1]) - torch.log(buf[:, 0]))  # log(1 - Q) = log R - log S (-inf if R = 0)
    ent = torch.log(buf[:, 0]) - buf[:, ent_col] / buf[:, 0] if entropy else None
    return lse, (buf[:, nx : nx + k] if ids is not None else None), ent


def logit_grad(shard: VocabShard, x: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, tau: float, *,
               live: torch.Tensor | None = None, g_entropy: torch.Tensor | None = None,
               entropy: torch.Tensor | None = None, out: torch.Tensor | None = None,
               pi_scale: torch.Tensor | None = None, g_rest: torch.Tensor | None = None,
               log_rest: torch.Tensor | None = None, rest_slots: torch.Tensor | None = None) -> torch.Tensor:
    """dL/dx [N, Vl] from g = dL/ds [N, K] (and gE = dL/dE [N] with the entropy E [N]); see the module docstring.

    ``lse`` [N] (its dtype is the compute dtype).  ``out``: where to write (default a new tensor in x's dtype);
    ``out=x`` overwrites the logits in place, one row chunk after it was read (the fused path's chunk buffer);
    ``pi_scale`` [N] with ``out=x``: x holds exp(z - m) from ``lse_and_gather(keep_exp=pi_scale)``, pi = x * pi_scale.
    ``g_rest`` [N] = dL/d log(1 - Q) with ``log_rest`` [N] and ``rest_slots`` [N, K] (``lse_and_gather``'s rest):
    d log(1 - Q)/dz_j = (1/tau)([j not in T] pi_j / (1 - Q) - pi_j) adds to the rule above.
    Padding columns get 0.  No collective.
    """
    dtype = lse.dtype
    out = torch.zeros_like(x) if out is None else out
    w = shard.width
    out[:, w:] = 0
    if w == 0 or x.shape[0] == 0:
        return out
    if live is not None:  # dead rows get no gradient, whatever the upstream gradient holds there
        g = torch.where(live[:, None], g, 0.0)
        g_entropy = None if g_entropy is None else torch.where(live, g_entropy, 0.0)
    owned, local = owned_local_ids(shard, ids)
    g_owned = torch.where(owned, g, 0.0).to(dtype)  # [N, K] other ranks' ids add 0 at local index 0
    g_sum = g.sum(-1, keepdim=True).to(dtype)  # [N, 1]
    if g_rest is not None:
        g_rest = g_rest.to(dtype) if live is None else torch.where(live, g_rest, 0.0).to(dtype)
        # dL/dz_j = (1/tau)(sum_k g_k [i_k = j] - (sum_k g_k + g_r) pi_j + [j not in T] g_r pi_j / (1 - Q))
        g_sum = g_sum + g_rest[:, None]
        w_rest = torch.where(g_rest == 0, 0.0, g_rest * torch.exp(-log_rest.to(dtype)))[:, None]  # g_r / (1 - Q)
        in_t = owned & rest_slots
    in_place = out is x and x.dtype == dtype and live is None and g_entropy is None  # the fused chunk buffer
    for rows in row_chunks(x.shape[0], w):
        # coef_j: the factor of pi_j, -(sum g) [n, 1], or with the rest term [n, w]: -(sum g + g_r) + [j not in T] w_r
        coef = -g_sum[rows]
        if g_rest is not None:
            coef = torch.where(outside_mask(local, in_t, rows, w), coef + w_rest[rows], coef)
        if in_place and pi_scale is not None:  # one pass: pi = exp(z - m) / S, already in the buffer
            grad = out[rows, :w]
            grad.mul_(coef * pi_scale[rows, None]) if g_rest is None else grad.mul_(pi_scale[rows, None]).mul_(coef)
        elif in_place:  # the same arithmetic, in the buffer: no [n, w] temporary
            grad = out[rows, :w]
            if tau != 1.0:
                grad.div_(tau)
            grad.sub_(lse[rows, None]).exp_().mul_(coef)
        elif g_entropy is None:
            grad = coef * torch.exp(block(x, rows, w, tau, dtype, live) - lse[rows, None])
        else:  # coef pi - gE pi (log pi + E)
            logp = block(x, rows, w, tau, dtype, live) - lse[rows, None]  # [n, w]
            grad = torch.exp(logp) * (coef - g_entropy[rows, None].to(dtype) * (logp + entropy[rows, None]))
        grad.scatter_add_(1, local[rows], g_owned[rows])  # duplicates add up, as in gather's backward
        if tau != 1.0:
            grad.div_(tau)
        if not in_place:
            out[rows, :w] = grad.to(out.dtype)
    return out


def global_topk(shard: VocabShard, x: torch.Tensor, k: int) -> torch.Tensor:
    """The student's own top-k ids [N, k] over the whole vocabulary: local top-k, one all_gather, global top-k.

    Top-k of x equals top-k of log_softmax(x / tau) (monotone).  Values and ids travel in one message of the compute
    dtype: fp32 holds bf16/fp16/fp32 logits exactly and ids below 2**24; fp64 logits or a larger vocabulary use fp64.
    Ties between equal logits may pick a different id than a single-device ``torch.topk`` (its order is unspecified).
    """
    n, w = x.shape[0], shard.width
    if shard.size == 1 and w >= k:  # one shard: the local top-k is the answer
        return torch.topk(x[:, :w], k, dim=-1).indices
    exact = torch.float32 if x.dtype != torch.float64 and shard.vocab_size <= 1 << 24 else torch.float64
    cand = torch.full((n, 2 * k), float("-inf"), dtype=exact, device=x.device)  # [values | ids]
    cand[:, k:] = -1.0
    kl = min(k, w)
    if kl > 0:
        for rows in row_chunks(n, w):
            v, i = torch.topk(x[rows, :w], kl, dim=-1)
            cand[rows, :kl] = v.to(exact)
            cand[rows, k : k + kl] = (i + shard.start).to(exact)
    both = all_gather_cat(cand.unsqueeze(0), shard, dim=0)  # collective: [P, N, 2k]
    values = both[..., :k].permute(1, 0, 2).reshape(n, shard.size * k)  # [N, P*k]
    cand_ids = both[..., k:].permute(1, 0, 2).reshape(n, shard.size * k)
    best = torch.topk(values, k, dim=-1).indices
    return cand_ids.gather(1, best).long()


def _log_probs_pair(xs, xt, lse, rows, w, tau):
    """(s, t) = log pi, log nu on one row chunk of this rank's columns, from the all-reduced lse [N, 2]."""
    return block(xs, rows, w, tau, lse.dtype) - lse[rows, 0:1], block(xt, rows, w, tau, lse.dtype) - lse[rows, 1:2]


def jsd_totals(
    shard: VocabShard, xs: torch.Tensor, xt: torch.Tensor, lse: torch.Tensor, tau: float, beta: float
) -> torch.Tensor:
    """(J, A) [N, 2] of the full-vocabulary JSD from student / teacher logits sharded alike, lse [N, 2] from
    ``lse_and_gather(shard, (xs, xt), None, ...)``.  One all-reduce SUM.

        J = sum_j phi(s_j, t_j)    the per-token divergence (``ops.divergence.divergence``, summed by columns)
        A = sum_j a_j,             a_j = d phi / d s_j (``ops.divergence.divergence_grad``), for the backward
    """
    n, w = xs.shape[0], shard.width
    totals = torch.zeros((n, 2), dtype=lse.dtype, device=xs.device)
    for rows in row_chunks(n, w) if w > 0 else ():
        s, t = _log_probs_pair(xs, xt, lse, rows, w, tau)
        totals[rows, 0] = divergence(t, s, "jsd", beta)
        totals[rows, 1] = divergence_grad(t, s, "jsd", beta).sum(-1)
    return all_reduce_(totals, dist.ReduceOp.SUM, shard)


def jsd_logit_grad(shard: VocabShard, xs: torch.Tensor, xt: torch.Tensor, lse: torch.Tensor, A: torch.Tensor,
                   grad: torch.Tensor, tau: float, beta: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """dJ/dxs [N, Vl] for the incoming grad [N]: the log-softmax backward of phi with the all-reduced A,

        dJ/dxs_j = grad * (1/tau) * (a_j - pi_j A),     pi_j = exp(s_j)

    chunk-wise from the saved logits; ``out`` as ``logit_grad`` (``out=xs`` overwrites in place).  No collective.
    """
    out = torch.zeros_like(xs) if out is None else out
    w = shard.width
    out[:, w:] = 0
    grad = grad.to(lse.dtype)
    for rows in row_chunks(xs.shape[0], w) if w > 0 else ():
        s, t = _log_probs_pair(xs, xt, lse, rows, w, tau)
        g = grad[rows, None] * (divergence_grad(t, s, "jsd", beta) - torch.exp(s) * A[rows, None])
        if tau != 1.0:
            g = g / tau
        out[rows, :w] = g.to(out.dtype)
    return out


def divergence_step(shard: VocabShard, zs: torch.Tensor, zt: torch.Tensor, tau: float, kind: str, beta: float,
                    grad=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(J [c], lse [c, 2]) of the full-vocabulary divergence between student logits ``zs`` and teacher logits
    ``zt`` (this rank's columns, the compute dtype, buffers the caller gives away: both are overwritten); ``kind`` the
    ``ops.divergence.canonical`` one: "reverse" KL(pi || nu), "forward" KL(nu || pi) or "jsd" with ``beta`` strictly
    inside (0, 1). With ``grad`` (a function of J giving the incoming gradient per row [c], e.g. a weight that is 0
    where a clamp is active), ``zs`` holds dJ/dzs [c, Vl] (times that gradient; 0 on padding columns) on return.

    With s = log pi, t = log nu (both over z / tau), e_s = exp(z_s / tau - m_s), S_s = sum e_s (likewise t):

        reverse   J = sum_j pi_j (s_j - t_j)                                a_j = pi_j (s_j - t_j + 1)
        forward   J = sum_j nu_j (t_j - s_j)                                a_j = -nu_j
        jsd       J = sum_j beta nu_j t_j + (1-beta) pi_j s_j - M_j m_j     a_j = (1-beta) pi_j (s_j - m_j)
                  (M = beta nu + (1-beta) pi, m = log M: TRL's mixture)
        dJ/dz_j = (1/tau) (a_j - pi_j A),   A = sum_j a_j                   (``jsd_logit_grad``'s rule)

    the values of ``ops.divergence`` and the rule of ``jsd_logit_grad`` (tests check them against both); sums of
    probabilities that are 1 but for rounding are summed, not assumed.

    The [c, Vl] work is what the KL needs and no more: the max shift in place (exact near the max, where the mass
    is), two exps, then only unnormalised forms -- s - t = (x_s - x_t) - (l_s - l_t) with x the shifted logits and
    l = log S, sums of e divided by S per row, the gradient's per-row factors (g / S, 1 - A - delta, ...) folded
    into one or two passes. Reverse KL: 13 elementwise passes over the chunk and one temporary; forward: 12 and
    two; the JSD (one log more): 21 and two. Collectives: MAX of (m_s, m_t), SUM of (S_s, S_t), SUM of (J, A) -- the three of
    ``lse_and_gather`` + ``jsd_totals``. A mixture that underflows (M = 0, where pi and nu are 0 too) contributes
    0: M is raised to the smallest normal number first.
    """
    w, c = shard.width, zs.shape[0]
    cd, dev = zs.dtype, zs.device
    xs, xt = zs[:, :w], zt[:, :w]
    if tau != 1.0:
        xs.div_(tau)
        xt.div_(tau)
    m = torch.stack([xs.amax(-1), xt.amax(-1)], -1) if w > 0 else torch.full((c, 2), float("-inf"), dtype=cd,
                                                                                device=dev)
    m = all_reduce_max_checked(m, shard)
    m = torch.where(torch.isfinite(m), m, 0.0)
    # x <- x - m in place (exact near the max, where the mass is), e = exp(x); nothing below builds s or t
    # themselves: s = x_s - l_s, t = x_t - l_t with l = log S, so s - t = (x_s - x_t) - delta, delta = l_s - l_t
    xs.sub_(m[:, 0:1])
    xt.sub_(m[:, 1:2])
    et = torch.exp(xt)
    local = torch.empty((c, 2), dtype=cd, device=dev)  # this rank's (S_s, S_t)
    local[:, 1] = et.sum(-1)
    es = torch.exp(xs, out=et) if kind == "reverse" else torch.exp(xs)  # reverse: e_t is spent
    local[:, 0] = es.sum(-1)
    share = local.clone()  # the local shares of S, for the shares of sum pi and sum nu
    S = all_reduce_(local, dist.ReduceOp.SUM, shard)
    ls = torch.log(S)  # l_s, l_t
    lse = m + ls
    delta = (ls[:, 0] - ls[:, 1])[:, None]
    p_sum, q_sum = share[:, 0] / S[:, 0], share[:, 1] / S[:, 1]  # this rank's sum pi, sum nu
    tot = torch.empty((c, 2), dtype=cd, device=dev)
    if kind == "reverse":  # J = sum pi (x_s - x_t) - delta sum pi,  A = J + sum pi
        torch.sub(xs, xt, out=xt)
        tot[:, 0] = torch.linalg.vecdot(es, xt) / S[:, 0] - delta[:, 0] * p_sum
        tot[:, 1] = tot[:, 0] + p_sum
    elif kind == "forward":  # J = sum nu (x_t - x_s) + delta sum nu,  A = -sum nu
        xt.sub_(xs)
        tot[:, 0] = torch.linalg.vecdot(et, xt) / S[:, 1] + delta[:, 0] * q_sum
        tot[:, 1] = -q_sum
    else:  # J = beta sum nu t + (1-beta) sum pi s - sum M m,  A = (1-beta) sum pi (s - m)
        l_s, l_t = ls[:, 0], ls[:, 1]
        tot[:, 0] = (beta * (torch.linalg.vecdot(et, xt) / S[:, 1] - l_t * q_sum)
                     + (1.0 - beta) * (torch.linalg.vecdot(es, xs) / S[:, 0] - l_s * p_sum))
        et.mul_((beta / S[:, 1])[:, None]).addcmul_(es, ((1.0 - beta) / S[:, 0])[:, None])  # M
        et.clamp_min_(torch.finfo(cd).tiny)
        torch.log(et, out=xt)  # m (x_t is spent)
        tot[:, 0] -= torch.linalg.vecdot(et, xt)
        xs.sub_(xt)  # x_s - m = s - m + l_s
        tot[:, 1] = (1.0 - beta) * (torch.linalg.vecdot(es, xs) / S[:, 0] - l_s * p_sum)
    all_reduce_(tot, dist.ReduceOp.SUM, shard)
    J, A = tot[:, 0].clone(), tot[:, 1]
    if grad is None:
        return J, lse
    g = grad(J).to(cd) / tau  # [c]
    pi_g = (g / S[:, 0])[:, None]  # pi * g = e_s * pi_g
    if kind == "reverse":  # g pi (s - t + 1 - A) = e_s pi_g ((x_s - x_t) + 1 - A - delta)
        torch.add(xt, (1.0 - A)[:, None] - delta, out=xs).mul_(es).mul_(pi_g)
    elif kind == "forward":  # g (pi sum nu - nu) = e_s pi_g (-A) - e_t g / S_t
        torch.mul(es, pi_g * -A[:, None], out=xs).addcmul_(et, (-g / S[:, 1])[:, None])
    else:  # g pi ((1-beta)(s - m) - A) = e_s pi_g ((1-beta)(x_s - m) - (1-beta) l_s - A)
        xs.mul_(1.0 - beta).sub_(((1.0 - beta) * ls[:, 0] + A)[:, None]).mul_(es).mul_(pi_g)
    zs[:, w:] = 0
    return J, lse
