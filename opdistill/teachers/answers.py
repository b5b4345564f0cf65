"""A remote teacher's answer checked before the trainer reads it: the rules of a teacher cache file.

A server is another program: a bug, a wrong model or a hostile host can answer ids outside the vocabulary, NaN or
positive log-probs, duplicate ids or arrays of the wrong shape. Unchecked, those reach the loss and fail there (a
traceback from deep inside the step) or, worse, pass as numbers. :func:`answer_problem` applies to every answer the
rules :func:`opdistill.teachers.cache.load_cache` applies to a cache file, plus the two the loss would apply later:

- shapes: ``next_logprobs [P]``; ``topk_ids`` / ``topk_logprobs [P, K]`` when top-k was asked; ``requested_logprobs
  [P, J]`` when ids were named (P: the request's scored positions);
- ids: integers in ``[0, V)`` (V: the vocabulary the server's ``/info`` states and the student's lm_head has), no id
  twice among a position's non-empty slots (a slot with log-prob -inf is empty);
- log-probs: finite or -inf, at most :data:`LOGPROB_TOL` above 0 (fp16 rounding of a near-certain token);
- top-k mass: at most 1 + :data:`~opdistill.ops.checks.MASS_TOLERANCE` per position.

It returns the first problem as one phrase naming the array, the value and its position (row-major), or None; the
client raises it as a one-line error naming the server and the request (never retried: the same request would get
the same answer). Pure numpy on the ``[P, ...]`` arrays: one pass, no device.
"""
from __future__ import annotations

import numpy as np

from opdistill.ops.checks import MASS_TOLERANCE

__all__ = ["LOGPROB_TOL", "answer_problem"]

# A log-prob may exceed 0 by this much: fp32 log-softmax of a near-certain token, then fp16 rounding (a cache's rule).
LOGPROB_TOL = 1e-3


def _at(bad: np.ndarray, values: np.ndarray, name: str, rule: str) -> str | None:
    if not bad.any():
        return None
    i = int(np.flatnonzero(bad.reshape(-1))[0])
    pos = list(np.unravel_index(i, bad.shape))
    v = values.reshape(-1)[i]
    shown = f"{float(v):.6g}" if np.issubdtype(values.dtype, np.floating) else str(int(v))
    return f"{name} holds {shown} at {[int(p) for p in pos]}; {rule}"


def _shape(name: str, a, shape: tuple) -> str | None:
    if a is None:
        return f"{name} is missing (expected shape {list(shape)})"
    if tuple(a.shape) != shape:
        return f"{name} has shape {list(a.shape)}, expected {list(shape)}"
    return None


def _logprobs(name: str, x: np.ndarray) -> str | None:
    return (_at(np.isnan(x) | np.isposinf(x), x, name, "log-probs must be finite or -inf")
            or _at(x > LOGPROB_TOL, x, name, f"log-probs must be <= 0 (tolerance {LOGPROB_TOL})"))


def answer_problem(result, *, positions: int, k: int | None, num_requested: int | None,
                   vocab_size: int | None) -> str | None:
    """The first way ``result`` (a :class:`~opdistill.teachers.wire.ScoreResult`) breaks the module's rules for a
    request of ``positions`` scored positions, top-``k`` (None: none asked), ``num_requested`` ids per position (None:
    none named) and a vocabulary of ``vocab_size`` (None: unknown, only ``>= 0`` is checked), or None."""
    P = positions
    why = _shape("next_logprobs", result.next_logprobs, (P,)) or _logprobs("next_logprobs", result.next_logprobs)
    if why:
        return why
    if k:
        ids, lp = result.topk_ids, result.topk_logprobs
        why = _shape("topk_ids", ids, (P, k)) or _shape("topk_logprobs", lp, (P, k))
        if why:
            return why
        high = vocab_size if vocab_size is not None else np.iinfo(np.int64).max
        vocab = f"[0, {vocab_size})" if vocab_size is not None else "[0, V)"
        why = _at((ids < 0) | (ids >= high), ids, "topk_ids", f"token ids must lie in {vocab} (the teacher's "
                                                              f"vocabulary)") or _logprobs("topk_logprobs", lp)
        if why:
            return why
        if k > 1 and P:  # an id twice among a position's non-empty slots would count its mass twice
            filled = np.where(np.isneginf(lp), -1 - np.arange(k)[None, :], ids)  # empty slots: distinct sentinels
            order = np.sort(filled, axis=1)
            dup = order[:, 1:] == order[:, :-1]
            if dup.any():
                row = int(np.flatnonzero(dup.any(axis=1))[0])
                twice = int(order[row, 1:][dup[row]][0])
                return (f"topk_ids names id {twice} twice at position {row}; the ids of a position's top-k are "
                        f"distinct (its mass would count twice)")
        mass = np.exp(lp.astype(np.float64)).sum(axis=1)
        why = _at(mass > 1.0 + MASS_TOLERANCE, mass, "the top-k mass", f"a distribution's mass is at most 1 (+"
                                                                        f"{MASS_TOLERANCE} rounding)")
        if why:
            return why
    if num_requested is not None:
        req = result.requested_logprobs
        why = _shape("requested_logprobs", req, (P, num_requested)) or _logprobs("requested_logprobs", req)
        if why:
            return why
    return None
