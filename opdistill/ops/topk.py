"""Top-k distillation divergences: ``support`` x ``divergence`` (SPEC 3.1), plus the overlap diagnostics.

The teacher signal is, per position, K ids ``T = (i_1..i_K)`` and their teacher log-probs ``l_k = log nu(i_k)``
(a vLLM/SGLang server with ``prompt_logprobs=K``, teacher at temperature 1).  A slot whose log-prob is ``-inf`` is
*empty*: it is not part of T (no mass, no loss, no overlap).  The student log-probs are ``log_softmax(z / tau)``.

The op is built from named stages that the vocab-parallel and fused variants reuse unchanged:

1. ``student_logprobs_at``   s_k = log pi(i_k) = z_{i_k}/tau - logsumexp(z/tau)          [..., K]
   (vocab-sharded / fused: ``parallel.stages.lse_and_gather``, same values)
2. ``topk_loss_from_logprobs``  the per-token divergence as a function of (s, l) only     [...]
   (the bucket divergence is the one kernel of ``ops.divergence``)
3. ``finish_topk``           masses Q, P, |T cap S| and the overlap advantage -> ``TopKResult``

Because stage 2 depends on the logits only through s, every variant gets its logit gradient from the same rule:
with g_k = dL/ds_k,  dL/dz_j = (1/tau) * (sum_k g_k [i_k = j]  -  (sum_k g_k) * pi_j).

Masked positions: a row whose K slots are all empty (``DistillationLoss`` sends masked rows that way) is replaced
by zeros before the log-softmax, so a NaN/inf the student holds there reaches neither the loss nor any gradient.
With ``validate=True`` a NaN/+inf in a live row is refused (``check_finite_rows``, read off the log-sum-exp).

The student's rest mass of tail, log(1 - Q), is summed directly over the vocabulary outside T (``student_rest_at``;
the sharded stages do the same in their chunk pass), not taken as log(1 - sum_k exp(s_k)): the s_k carry the
rounding of lse (~1e-7 |lse| absolutely), which makes 1 - Q relatively wrong where the student is confident.

Rest-mass floors (documented in docs/losses.md): the student's rest mass 1 - Q is floored at ``TAIL_MASS_EPS``
in every tail divergence (its log would otherwise be -inf when the top-k hold all the mass in fp32, and the
gradient infinite); the teacher's rest mass 1 - P is floored at ``TAIL_MASS_EPS`` in reverse and jsd (it sits in a
denominator there) and is left exact in forward, where a zero teacher rest mass gives a zero term.  Where neither
floor is active every tail divergence is the exact KL/JSD between two K+1-bucket distributions, hence >= 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .checks import check_finite_rows, check_topk_inputs, compute_dtype
from .divergence import canonical, kl
from .divergence import divergence as bucket_divergence

TAIL_MASS_EPS = 1e-6
_LOG_TAIL_EPS = math.log(TAIL_MASS_EPS)
_LOG_ONE_MINUS_EPS = math.log1p(-TAIL_MASS_EPS)


@dataclass(frozen=True)
class TopKResult:
    """Per-token results of a top-k divergence; every field has the leading shape of the logits.

    loss                     differentiable per-token divergence (fp32, fp64 for fp64 inputs)
    student_mass             Q = sum_k pi(i_k), unclamped, detached
    teacher_mass             P = sum_k nu(i_k), unclamped
    overlap_count            |T cap S| (int64), S = the student's own top-K ids
    overlap_token_advantage  -sum_{T cap S} nu_i (l_i - log pi_i) / |T cap S|, 0 where the overlap is empty
    """

    loss: torch.Tensor
    student_mass: torch.Tensor
    teacher_mass: torch.Tensor
    overlap_count: torch.Tensor
    overlap_token_advantage: torch.Tensor


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, accurate at both ends (Maechler 2012): expm1 near 0, log1p far from it."""
    x = x.clamp_max(0.0)
    near = x > -math.log(2.0)
    # Evaluate each branch only where it is accurate and finite so no inf/NaN reaches the backward of the other.
    x_near = torch.where(near, x, -1.0)
    x_far = torch.where(near, -1.0, x)
    return torch.where(near, torch.log(-torch.expm1(x_near)), torch.log1p(-torch.exp(x_far)))


def student_logprobs_at(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, live: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, lse): s_k = log_softmax(z / tau)[i_k] = z_{i_k}/tau - lse, lse = logsumexp(z/tau), in fp32 (fp64 for fp64).

    Gathers before subtracting, so no [.., V] log-prob tensor is kept beyond the one autograd needs.  Rows where
    ``live`` [...] is False are replaced by zeros first (``where``), so whatever they hold never reaches a value or
    a gradient.
    """
    z = logits.to(compute_dtype(logits.dtype))
    if temperature != 1.0:
        z = z / temperature
    if live is not None:
        z = torch.where(live.unsqueeze(-1), z, 0.0)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    return z.gather(-1, ids.long()) - lse, lse.squeeze(-1)


def student_rest_at(logits: torch.Tensor, ids: torch.Tensor, rest_slots: torch.Tensor, temperature: float = 1.0,
                    live: torch.Tensor | None = None) -> torch.Tensor:
    """log(1 - Q) [...], Q = sum over the slots of ``rest_slots`` [..., K] (the non-empty ones) of pi(i_k), summed
    directly over the vocabulary outside T:  log(1 - Q) = logsumexp_{j not in T}(z_j/tau) - logsumexp_j(z_j/tau).

    Unlike log(1 - sum_k exp(s_k)) it keeps its relative precision when Q is close to 1 (the s_k carry the
    rounding of lse, ~1e-7 |lse| absolutely).  Autograd gives d/dz_j = (1/tau)([j not in T] pi_j/(1 - Q) - pi_j).
    A row whose vocabulary is all in T gets -inf (no NaN in the backward); ``live`` as ``student_logprobs_at``.
    """
    z = logits.to(compute_dtype(logits.dtype))
    if temperature != 1.0:
        z = z / temperature
    if live is not None:
        z = torch.where(live.unsqueeze(-1), z, 0.0)
    in_t = torch.zeros(z.shape, dtype=torch.int32, device=z.device)
    in_t.scatter_add_(-1, ids.long(), rest_slots.to(torch.int32))  # ids of T are distinct (validated); count > 0
    outside = in_t == 0
    full = ~outside.any(-1)  # everything in T: keep the log finite, the value is -inf below
    # Both sums relative to the same max m: log R - log S, R = sum_{j not in T} e^{z_j - m}, S = sum_j e^{z_j - m}
    # (two logs of O(1) numbers; the difference of two logsumexp's would carry ~1e-7 |lse| each).
    e = torch.exp(z - z.detach().amax(-1, keepdim=True))
    r = torch.where(outside, e, 0.0).sum(-1)
    rest = torch.log(torch.where(full, 1.0, r)) - torch.log(e.sum(-1))
    return torch.where(full, float("-inf"), rest)


def _whole_vocabulary_rest(slots: torch.Tensor, live: torch.Tensor, lse: torch.Tensor, V: int) -> torch.Tensor | None:
    """``student_rest_at``'s result without its ``[..., V]`` passes when K = V and every slot of every live row is
    non-empty: the K ids of a row are distinct and in the vocabulary (checked, or validated where they were made), so
    T is the whole vocabulary there and log(1 - Q) is -inf; a row that is not live (every slot empty, its logits
    replaced by zeros) has rest exactly 0 (log V - log V). Same values bit for bit, and the same (zero) gradient:
    ``student_rest_at`` sends none through -inf rows, and not-live rows carry no loss. None when the condition does
    not hold (then ``student_rest_at`` runs)."""
    if slots.shape[-1] != V or not bool((slots.all(-1) | ~live).all()):
        return None
    return torch.zeros(lse.shape, dtype=lse.dtype, device=lse.device).masked_fill_(live, float("-inf"))


def _masked_logsumexp(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(torch.where(valid, x, float("-inf")), dim=-1)


def topk_loss_from_logprobs(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, *, support: str,
                            divergence: str, beta: float = 0.5,
                            log_prob_min_clamp: float | None = None,
                            student_rest: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token loss from s_k = log pi(i_k) and l_k = log nu(i_k) ([..., K] each; l = -inf marks an empty slot).

    truncated/forward   L = max(0, sum_k nu'_k (l'_k - s'_k)),  primes: clamp_min(log_prob_min_clamp) if set
    tail/*              the divergence over K+1 buckets: T, and the rest with masses 1 - P, 1 - Q
    renormalized/*      the divergence between nu~ = nu/P and pi~ = pi/Q on T
    The divergence over the buckets is the one kernel ``divergence.divergence`` (its endpoint rules: jsd at beta = 0
    is forward KL, at beta = 1 reverse KL).
    ``student_rest`` [...]: log(1 - Q) computed directly over the vocabulary outside T (``student_rest_at``,
    ``stages.lse_and_gather(rest_out=...)``), used by tail; None falls back to log(1 - sum_k exp(s_k)), which is
    only ~1e-7 |lse|-accurate absolutely in fp32 (every back-end passes it).
    """
    s, t = student_logprobs, teacher_logprobs.to(student_logprobs.dtype)
    valid = t > float("-inf")  # [..., K] non-empty slots
    if support == "truncated":
        if log_prob_min_clamp is not None:
            s = s.clamp_min(log_prob_min_clamp)
            t = torch.where(valid, t.clamp_min(log_prob_min_clamp), t)
        # verl clamps the truncated KL at 0: it is not a divergence (the masses are unnormalised) and can go
        # negative; those tokens then get no gradient.
        return kl(t, s, valid).clamp_min(0.0)

    if support == "tail":
        log_p = _masked_logsumexp(t, valid).clamp_max(0.0)  # P may exceed 1 by rounding (checked <= 1 + tol)
        if student_rest is not None:
            s_rest = student_rest.to(s.dtype).clamp_min(_LOG_TAIL_EPS)  # student rest >= eps
        else:
            log_q = _masked_logsumexp(s, valid).clamp_max(_LOG_ONE_MINUS_EPS)  # student rest >= eps
            s_rest = log1mexp(log_q)
        t_rest = log1mexp(log_p)
        if canonical(divergence, beta) != "forward":
            t_rest = t_rest.clamp_min(_LOG_TAIL_EPS)  # teacher rest sits in a denominator: floor it
        t_b = torch.cat([t, t_rest.unsqueeze(-1)], dim=-1)  # [..., K+1]
        s_b = torch.cat([s, s_rest.unsqueeze(-1)], dim=-1)
        valid_b = torch.cat([valid, torch.ones_like(valid[..., :1])], dim=-1)
        return _nonnegative(bucket_divergence(t_b, s_b, divergence, beta, valid_b))

    # renormalized: distributions on T alone.  Rows without a non-empty slot get 0 (not NaN).
    any_valid = valid.any(-1, keepdim=True)
    log_p = torch.where(any_valid, _masked_logsumexp(t, valid).unsqueeze(-1), 0.0)
    log_q = torch.where(any_valid, _masked_logsumexp(s, valid).unsqueeze(-1), 0.0)
    return _nonnegative(bucket_divergence(t - log_p, s - log_q, divergence, beta, valid))


def _nonnegative(loss: torch.Tensor) -> torch.Tensor:
    """A divergence between two distributions is >= 0; summing p log(p/q) in floating point can land at -1e-18
    when they (nearly) match.  Removing that rounding noise changes nothing else: at such a point the exact
    value and its gradient are ~0."""
    return loss.clamp_min(0.0)


_MEMBER_MASK_ELEMS = 1 << 24  # is_member: a [rows, V] bool mask up to this many elements, else sort + search


def is_member(ids: torch.Tensor, ref: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """[..., K] bool: ``ids[..., k]`` is one of the ids of its row of ``ref`` [..., R] (R >= 1).

    With ``vocab_size`` (every id of ``ref`` in [0, vocab_size)) and a ``[rows, vocab_size]`` mask of at most
    ``_MEMBER_MASK_ELEMS`` elements: scatter ``ref`` into that mask and read it at ``ids`` (ids outside the
    vocabulary are members of nothing), O(K + R + V) per row. Otherwise O((K + R) log R): sort ``ref`` by id,
    binary-search each id, compare the id found. Both give the same answer (never the [..., K, R] all-pairs test)."""
    rows = ref.numel() // max(ref.shape[-1], 1)
    if vocab_size is not None and rows * vocab_size <= _MEMBER_MASK_ELEMS:
        lead = ids.shape[:-1]
        ids2 = ids.reshape(rows, ids.shape[-1]).long()
        table = torch.zeros(rows, vocab_size, dtype=torch.bool, device=ids.device)
        table.scatter_(1, ref.reshape(rows, ref.shape[-1]).long(), True)
        inside = (ids2 >= 0) & (ids2 < vocab_size)
        return (table.gather(1, ids2.clamp(0, vocab_size - 1)) & inside).reshape(*lead, ids.shape[-1])
    ref, ids = ref.to(ids.dtype).sort(dim=-1).values, ids.contiguous()
    at = torch.searchsorted(ref, ids).clamp_max(ref.shape[-1] - 1)
    return ref.gather(-1, at) == ids


def finish_topk(loss: torch.Tensor, student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                teacher_ids: torch.Tensor, student_topk_ids: torch.Tensor | None, log_prob_min_clamp: float | None,
                lead: tuple, vocab_size: int | None = None) -> TopKResult:
    """The ``TopKResult`` of every back-end from the per-token loss and the ``[N, K]`` stages' outputs (detached).

    Q = sum_k pi(i_k), P = sum_k nu(i_k) over the non-empty slots, unclamped.  The overlap is T cap S with S the
    student's own top-K ids; its advantage is -sum_{i in T cap S} nu_i (l_i - log pi_i) / |T cap S|, with nu, l,
    log pi clamped at ``log_prob_min_clamp`` when it is set (as verl does), and 0 where T cap S is empty.
    Everything is reshaped to ``lead`` (the leading shape of the logits / hidden states); ``loss`` keeps its graph.
    ``student_topk_ids`` None: S is the whole vocabulary (K = V), every non-empty slot overlaps. ``vocab_size``: the
    student's vocabulary, when the ids of S are in [0, vocab_size) (``is_member`` may then use a vocabulary mask).
    """
    with torch.no_grad():
        s = student_logprobs.detach()
        t = teacher_logprobs.to(s.dtype)
        valid = t > float("-inf")
        q = torch.where(valid, s.exp(), 0.0).sum(-1)
        p = torch.where(valid, t, float("-inf")).exp().sum(-1)
        if log_prob_min_clamp is not None:
            s = s.clamp_min(log_prob_min_clamp)
            t = torch.where(valid, t.clamp_min(log_prob_min_clamp), t)
        overlap = valid if student_topk_ids is None else valid & is_member(teacher_ids, student_topk_ids,
                                                                            vocab_size)
        count = overlap.sum(-1)
        t_safe = torch.where(overlap, t, 0.0)
        s_safe = torch.where(overlap, s, 0.0)
        contribution = torch.where(overlap, t_safe.exp() * (t_safe - s_safe), 0.0).sum(-1)
        advantage = torch.where(count > 0, -contribution / count.clamp_min(1), 0.0)
    return TopKResult(*(x.reshape(lead) for x in (loss, q, p, count, advantage)))


def union_support(ids: torch.Tensor, logprobs: torch.Tensor, extra_ids: torch.Tensor,
                  extra_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The union of two id sets per position as one top-k signal: ``(ids [..., K + J], log-probs [..., K + J])``.

    ``ids``/``logprobs`` ``[..., K]`` (a teacher's top-k) and ``extra_ids``/``extra_logprobs`` ``[..., J]`` (its
    log-probs at ids somebody else chose, e.g. the student's own top-k and the sampled token) side by side, each id
    kept once: a repeat of an id already in a non-empty slot to its left becomes an empty slot (log-prob -inf), as
    ``topk_divergence`` reads empty slots (no mass, no loss, not part of T). Empty input slots stay empty and never
    hide a real id. With ``support="tail"`` the result gives the union-support loss: the divergence over the union's
    buckets plus one rest bucket (``DistillationConfig(support="union")``)."""
    if ids.shape[:-1] != extra_ids.shape[:-1] or ids.shape != logprobs.shape or extra_ids.shape != extra_logprobs.shape:
        raise ValueError(f"union_support: ids {tuple(ids.shape)} / logprobs {tuple(logprobs.shape)} and extra_ids "
                         f"{tuple(extra_ids.shape)} / extra_logprobs {tuple(extra_logprobs.shape)} must pair up "
                         "(the same leading dims, ids and log-probs of one shape)")
    all_ids = torch.cat([ids.long(), extra_ids.long()], -1)
    lp = torch.cat([logprobs, extra_logprobs.to(logprobs.dtype)], -1)
    live = lp > float("-inf")
    # empty slots get distinct negative keys: they collide with nothing; a stable sort puts an id's first slot first
    slot = torch.arange(all_ids.shape[-1], device=all_ids.device)
    key = torch.where(live, all_ids, -1 - slot)
    sorted_key, order = torch.sort(key, dim=-1, stable=True)
    repeat_sorted = torch.zeros_like(live)
    repeat_sorted[..., 1:] = sorted_key[..., 1:] == sorted_key[..., :-1]
    repeat = torch.zeros_like(live).scatter_(-1, order, repeat_sorted)
    return all_ids, lp.masked_fill(repeat, float("-inf"))


def topk_divergence(
    student_logits: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    support: str = "truncated",
    divergence: str = "forward",
    beta: float = 0.5,
    log_prob_min_clamp: float | None = None,
    temperature: float = 1.0,
    validate: bool | str = True,
) -> TopKResult:
    """Per-token top-k distillation divergence between the teacher's top-k and the student's distribution.

    Args:
        student_logits: ``[..., V]`` student logits (any leading dims: ``[B, S]`` padded or ``[N]`` packed). They
            are divided by ``temperature`` before the log-softmax; bf16/fp16 are computed in fp32.
        teacher_ids: ``[..., K]`` integer ids of the teacher's top-k (row t: the token after position t).
        teacher_logprobs: ``[..., K]`` teacher log-probs (temperature 1) at those ids; ``-inf`` marks an empty slot.
        support: ``"truncated"`` (verl's forward_kl_topk), ``"tail"`` (K+1 buckets) or ``"renormalized"``.
        divergence: ``"forward"`` KL(nu||pi), ``"reverse"`` KL(pi||nu) or ``"jsd"`` (TRL's generalized JSD).
        beta: JSD interpolation, M = beta nu + (1 - beta) pi; beta=0 is forward KL, beta=1 reverse KL.
        log_prob_min_clamp: truncated only: clamp both log-probs at this floor before the KL (verl).
        temperature: student temperature tau.
        validate: refuse NaN/+inf student logits in a row that has a non-empty slot (``ValueError`` naming the first
            such position); False skips every check that reads tensor values (this one and those of the teacher
            signal: ids in range, log-probs, mass, duplicates; each a device-to-host sync) for hot loops whose
            inputs are known to be valid; ``"student"`` keeps the student check and skips the teacher's (a signal
            checked where it was made, ``TeacherTopK(validated=True)``).  Rows with no non-empty slot (masked) are
            zeroed either way: their values never reach the loss or a gradient.

    ``support="truncated", divergence="forward"`` equals verl 0.9.1's FSDP ``forward_kl_topk`` followed by its
    ``clamp_min(0)``, in value and gradient.  Returns a ``TopKResult`` of per-token tensors.
    """
    kw = dict(support=support, divergence=divergence, beta=beta, log_prob_min_clamp=log_prob_min_clamp)
    check_topk_inputs(student_logits, teacher_ids, teacher_logprobs, temperature=temperature, validate=validate, **kw)
    ids = teacher_ids.long()
    live = (teacher_logprobs > float("-inf")).any(-1)  # [...] rows with a non-empty slot
    s, lse = student_logprobs_at(student_logits, ids, temperature, live)  # [..., K], [...]
    if validate:
        check_finite_rows(~torch.isfinite(lse) & live, "student_logits")
    t = teacher_logprobs.to(s.dtype)
    V = student_logits.shape[-1]
    rest = None
    if support == "tail":
        slots = t > float("-inf")
        rest = _whole_vocabulary_rest(slots, live, lse, V)
        if rest is None:
            rest = student_rest_at(student_logits, ids, slots, temperature, live)
    loss = topk_loss_from_logprobs(s, t, student_rest=rest, **kw)
    # top-k of z equals top-k of log_softmax(z / tau): both are monotone in z. K = V: S is every id (no top-k).
    student_topk = None if ids.shape[-1] >= V else torch.topk(student_logits.detach(), k=ids.shape[-1], dim=-1).indices
    return finish_topk(loss, s, t, ids, student_topk, log_prob_min_clamp, tuple(loss.shape), V)
