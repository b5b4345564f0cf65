"""A teacher FSDP2-sharded over the data-parallel group (``model.teacher_sharded: true``; docs/distributed.md).

For a teacher that does not fit one device: every decoder layer and the root (embeddings, final norm, lm_head) are
``fully_shard``-ed over the data-parallel mesh, so each rank keeps 1/D of the weights; a forward gathers one layer at
a time and frees it right after (``reshard_after_forward``). Forward only: no gradient, no optimizer state.

FSDP2 gathers weights with collectives inside the forward, so **every rank must run the same number of teacher
forwards, in the same order**. Ranks do not have the same rows: each scores its own share of the step's rollouts
(or of the held-out set, which splits unevenly), so their row counts, and the number of row chunks, differ.
:meth:`ShardedTeacher.score` therefore agrees on the largest chunk count over the group (one all-reduce) and a rank
with fewer chunks runs a one-token forward for each missing one; a chunk with no scored position (whose forward the
replicated scorer skips) also runs a forward. Every caller runs ``score`` once per step on every rank (the loop's
scoring and the evaluation's, which runs on every rank with at least one problem each), which keeps the calls in
step; nothing else (preflight, caches, ``opdistill eval`` / ``score``) reaches the sharded teacher. Decoding with
the teacher (``train.method: off_policy``) would run a different number of forwards per rank and is refused, as are
a teacher cache, a teacher server and a vLLM teacher engine, which hold no in-process teacher to shard
(:mod:`opdistill.train.config`).

The scores are the replicated teacher's exactly: the same row chunks (``row_chunk`` rows) go through the same
:func:`~opdistill.teacher.score_teacher`, with the all-gathered weights bit-identical to the unsharded ones.
A run without a process group (one plain process) keeps the teacher as it is: sharding over one rank is the
unsharded teacher, so ``teacher_sharded: true`` trains the same at world size 1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from opdistill.batch import shift_for_next_token
from opdistill.fused import backbone_of
from opdistill.teacher import TeacherScores, score_teacher
from opdistill.train.distributed import decoder_layers
from opdistill import TeacherTopK
from opdistill.errors import ConfigError

__all__ = ["ShardedTeacher", "shard_teacher", "check_held_out"]

ROW_CHUNK = 64  # rows per teacher forward: score_teacher's default, so the chunks are the replicated scorer's


class _Scorer(torch.nn.Module):
    """The FSDP2 root around the teacher: one call is one backbone forward over one row chunk (the root's forward
    hook gathers embeddings, final norm and lm_head, each layer's hook gathers that layer), then the chunked head."""

    def __init__(self, teacher):
        super().__init__()
        self.teacher = teacher

    def forward(self, input_ids, attention_mask, k, sampled_ids, positions):
        if input_ids is None or (positions is not None and not bool(positions.any())):
            # nothing to score here, but the other ranks run a forward now: run one too (one token) and discard it
            dummy = torch.zeros(1, 1, dtype=torch.long, device=self.teacher.device)
            backbone_of(self.teacher)(input_ids=dummy, attention_mask=torch.ones_like(dummy))
            return None
        return score_teacher(self.teacher, input_ids, attention_mask, k=k, sampled_ids=sampled_ids,
                             positions=positions, row_chunk=max(1, input_ids.shape[0]))


class ShardedTeacher:
    """The teacher sharded over ``mesh`` (a 1-D data-parallel device mesh); :meth:`score` is what
    :func:`opdistill.train.remote_teacher.score_rows` calls for it. ``module`` is the unwrapped teacher (its
    parameters are DTensor shards between calls)."""

    def __init__(self, teacher, mesh, group, *, row_chunk: int = ROW_CHUNK):
        from torch.distributed.fsdp import fully_shard

        self.module, self.group, self.row_chunk = teacher, group, row_chunk
        self.config = teacher.config
        teacher.requires_grad_(False).eval()
        for layer in decoder_layers(teacher):
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        self._root = _Scorer(teacher)
        # reshard_after_forward given explicitly: FSDP2's default keeps the root's weights gathered after forward
        fully_shard(self._root, mesh=mesh, reshard_after_forward=True)
        self.forwards = 0  # teacher forwards run on this rank (the test checks every rank ran the same number)

    @torch.no_grad()
    def score(self, input_ids, attention_mask, response_mask, *, k: int | None, sampled: bool) -> TeacherScores:
        """Teacher top-k (``k``) and/or next-token log-probs of this rank's padded rows, exactly as the replicated
        :func:`~opdistill.train.remote_teacher.score_rows` returns them. Every rank of the group must call this
        together (any row count, zero included)."""
        targets, scored = shift_for_next_token(input_ids, response_mask)  # only the response positions are scored
        B, S = input_ids.shape
        starts = list(range(0, B, self.row_chunk))
        n = torch.tensor([len(starts)], dtype=torch.long)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
        parts = []
        for i in range(int(n)):
            self.forwards += 1
            if i >= len(starts):
                self._root(None, None, k, None, None)
                continue
            rows = slice(starts[i], starts[i] + self.row_chunk)
            out = self._root(input_ids[rows], attention_mask[rows], k, targets[rows] if sampled else None,
                             scored[rows])
            parts.append((input_ids[rows].shape[0], out))
        return _join(parts, S, k, sampled)


def _join(parts, S: int, k: int | None, sampled: bool) -> TeacherScores:
    """The chunks' scores stacked on rows; a chunk with nothing scored holds empty slots (id 0, log-prob -inf) and
    sampled log-probs 0, what :func:`~opdistill.teacher.score_teacher` writes outside its ``positions``."""
    ids, lps, samp = [], [], []
    for b, out in parts:
        if k:
            ids.append(out.topk.ids if out is not None else torch.zeros(b, S, k, dtype=torch.long))
            lps.append(out.topk.logprobs if out is not None else torch.full((b, S, k), float("-inf")))
        if sampled:
            samp.append(out.sampled_logprobs if out is not None else torch.zeros(b, S))
    topk = None
    if k:
        topk = TeacherTopK(torch.cat(ids) if ids else torch.zeros(0, S, k, dtype=torch.long),
                           torch.cat(lps) if lps else torch.zeros(0, S, k), validated=True)
    sampled_lp = (torch.cat(samp) if samp else torch.zeros(0, S)) if sampled else None
    return TeacherScores(topk, sampled_lp)


def shard_teacher(ctx, cfg, teacher):
    """The teacher as the run places it: :class:`ShardedTeacher` over ``ctx``'s data-parallel mesh when
    ``model.teacher_sharded`` is on and the run has a process group; else ``teacher`` unchanged (replicated on every
    rank, or the one process's)."""
    if not cfg.model.teacher_sharded or teacher is None or not ctx.enabled:
        return teacher
    mesh = ctx.mesh
    if mesh.ndim > 1:  # a (dp, tp) mesh: shard over the data-parallel dimension
        mesh = mesh["dp"]
    return ShardedTeacher(teacher, mesh, mesh.get_group())


def check_held_out(ctx, cfg, num_held_out: int) -> None:
    """A sharded teacher scores in every rank's evaluation, so every data-parallel rank needs at least one held-out
    problem (a rank without one would skip its forwards and the others would wait on it): refused in one line."""
    if not (cfg.model.teacher_sharded and ctx.enabled and cfg.eval.sampled) or num_held_out == 0:
        return
    dp = ctx.dp[1]
    if num_held_out < dp:
        raise ConfigError(f"eval.num_prompts: the held-out set has {num_held_out} problem(s), fewer than the "
                          f"{dp} data-parallel ranks; with model.teacher_sharded every rank evaluates at least one "
                          f"(add held-out rows, or set eval.num_prompts=0)")
