"""vLLM's prompt log-probs as teacher scores: the one reading shared by the in-process vLLM teacher engine
(:class:`~opdistill.teachers.vllm.VllmTeacher`) and the stock ``vllm serve`` client
(:class:`~opdistill.teachers.stock_vllm.StockVllmTeacher`).

With ``prompt_logprobs=K`` vLLM returns, for every prompt position p >= 1, a map {token id: (log-prob, rank)} holding
the K entries of rank 1..K and the actual token at p (position 0 has none). Entry p + 1 is the trainer's next-token
row p. Prompt log-probs are those of the raw logits (temperature 1).
"""
from __future__ import annotations

import torch

from opdistill.loss import TeacherScores, TeacherTopK
from opdistill.teachers.base import Rows

__all__ = ["scores_from_prompt_logprobs"]


def _top(entry: dict, k: int) -> list[tuple[int, float]] | None:
    """The entries of rank 1..k by rank (ties broken by id), or None when fewer than k are there."""
    best = sorted((rank, tid, lp) for tid, (lp, rank) in entry.items() if rank is not None and rank <= k)[:k]
    return None if len(best) < k else [(tid, lp) for _, tid, lp in best]


def scores_from_prompt_logprobs(rows: Rows, entries: list, *, k: int | None, sampled: bool, fail) -> TeacherScores:
    """``TeacherScores`` of ``rows`` from ``entries[b][p]`` (the map of row b's prompt position p, ``{id: (logprob,
    rank)}``; one list per row, unpadded), at the scored positions only. ``fail(b, t, found)`` builds the exception
    raised when position t of row b has fewer than k ranked entries."""
    keep = rows.scored()
    B, S = keep.shape
    ids = torch.zeros(B, S, k or 0, dtype=torch.long)
    lp = torch.full((B, S, k or 0), float("-inf"))
    samp = torch.zeros(B, S)
    for b in range(B):
        for t in torch.nonzero(keep[b]).flatten().tolist():
            entry = entries[b][t + 1]
            if sampled:
                samp[b, t] = float(entry[int(rows.input_ids[b, t + 1])][0])
            if k:
                top = _top(entry, k)
                if top is None:
                    raise fail(b, t, sum(1 for lp_rank in entry.values() if lp_rank[1] is not None
                                         and lp_rank[1] <= k))
                ids[b, t] = torch.tensor([i for i, _ in top])
                lp[b, t] = torch.tensor([float(v) for _, v in top])
    return TeacherScores(TeacherTopK(ids, lp) if k else None, samp if sampled else None)
