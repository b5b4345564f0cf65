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
(:mod:`opdistill.train.run.config`).

The scores are the replicated teacher's exactly: the same row chunks (``row_chunk`` rows) go through the same
:func:`~opdistill.teachers.local.score_teacher`, with the all-gathered weights bit-identical to the unsharded ones.
"""
from __future__ import annotations

import dataclasses

import torch

from opdistill.fused import backbone_of
from opdistill.loss import TeacherScores, TeacherTopK
from opdistill.engines.sampler import Lockstep
from opdistill.models import decoder_layers, load_shards
from opdistill.teachers.base import Rows, ScoreRequest, Teacher
from opdistill.teachers.local import score_teacher

__all__ = ["ShardedTeacher"]

ROW_CHUNK = 64  # rows per teacher forward: score_teacher's default, so the chunks are the replicated scorer's


class _Scorer(torch.nn.Module):
    """The FSDP2 root around the teacher: one call is one backbone forward over one row chunk (the root's forward
    hook gathers embeddings, final norm and lm_head, each layer's hook gathers that layer), then the chunked head."""

    def __init__(self, teacher):
        super().__init__()
        self.teacher = teacher

    def forward(self, rows: Rows | None, request: ScoreRequest):
        positions = None if rows is None else rows.scored()
        if rows is None or not bool(positions.any()):
            # nothing to score here, but the other ranks run a forward now: run one too (one token) and discard it
            dummy = torch.zeros(1, 1, dtype=torch.long, device=self.teacher.device)
            backbone_of(self.teacher)(input_ids=dummy, attention_mask=torch.ones_like(dummy))
            return None
        return score_teacher(self.teacher, rows.input_ids, rows.attention_mask, k=request.k,
                             sampled_ids=rows.targets() if request.sampled else None, positions=positions,
                             requested_ids=request.requested_ids, temperature=request.temperature,
                             hidden=request.hidden, row_chunk=max(1, rows.num_rows))


class ShardedTeacher(Teacher):
    """The teacher sharded over ``mesh`` (a 1-D data-parallel device mesh) and its ``group``. ``model`` is the
    unwrapped teacher (its parameters are DTensor shards between calls)."""

    key = "model.teacher"
    collective = True  # every forward gathers the shards over the group

    def __init__(self, teacher, mesh, group, *, row_chunk: int = ROW_CHUNK):
        from torch.distributed.fsdp import fully_shard

        self.model, self.group, self.row_chunk = teacher, group, row_chunk
        teacher.requires_grad_(False).eval()
        for layer in decoder_layers(teacher):
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        self._root = _Scorer(teacher)
        # reshard_after_forward given explicitly: FSDP2's default keeps the root's weights gathered after forward
        fully_shard(self._root, mesh=mesh, reshard_after_forward=True)
        if any(p.is_meta for p in teacher.parameters()):  # built without weights (models.empty_model)
            load_shards(teacher, teacher.config._name_or_path, device=mesh.device_type, group=group,
                        key="model.teacher", fallback="model.teacher_sharded=false")
        self.forwards = 0  # teacher forwards run on this rank (the test checks every rank ran the same number)
        self._head = None

    @property
    def head(self):
        """The teacher's lm_head, whole (its shards gathered once: the hidden-state payload's head)."""
        if self._head is None:
            from opdistill.fused import read_lm_head

            h = read_lm_head(self.model)
            full = lambda t: None if t is None else (t.full_tensor() if hasattr(t, "full_tensor") else t)  # noqa: E731
            self._head = dataclasses.replace(h, weight=full(h.weight).detach(), bias=full(h.bias))
        return self._head

    @torch.no_grad()
    def score(self, rows: Rows, request: ScoreRequest) -> TeacherScores:
        """This rank's rows, scored exactly as :class:`~opdistill.teachers.local.LocalTeacher` scores them. Every rank
        of the group must call this together (any row count, zero included)."""
        head = self.head if request.hidden else None  # every rank at the same point: gathering it is a collective
        starts = Lockstep(self.group).pad(range(0, rows.num_rows, self.row_chunk))  # as many forwards as the others
        parts = []
        for start in starts:
            self.forwards += 1
            if start is None:
                self._root(None, request)
                continue
            chunk = torch.arange(start, min(start + self.row_chunk, rows.num_rows))
            parts.append((chunk.numel(), self._root(rows.select(chunk), request.select(chunk, request.what))))
        scores = _join(parts, rows.width, request, head)
        return dataclasses.replace(scores, head=head) if request.hidden else scores


def _join(parts, S: int, request: ScoreRequest, head=None) -> TeacherScores:
    """The chunks' scores stacked on rows; a chunk with nothing scored holds what
    :func:`~opdistill.teachers.local.score_teacher` writes outside its ``positions`` (empty slots, 0, -inf)."""
    k, J = request.k, None if request.requested_ids is None else request.requested_ids.shape[-1]
    H, dt = (head.weight.shape[1], head.weight.dtype) if head is not None else (0, torch.float32)
    filled = []
    for b, out in parts:
        if out is None:  # nothing scored in these b rows
            out = TeacherScores(
                None if not k else _empty_topk(b, S, k),
                torch.zeros(b, S) if request.sampled else None,
                torch.full((b, S, J), float("-inf")) if J is not None else None,
                torch.zeros(b, S, H, dtype=dt) if request.hidden else None)
        filled.append(dataclasses.replace(out, head=head))  # the gathered head, not the forward's unsharded one
    if not filled:
        return TeacherScores(_empty_topk(0, S, k) if k else None, torch.zeros(0, S) if request.sampled else None,
                             torch.zeros(0, S, J) if J is not None else None,
                             torch.zeros(0, S, H, dtype=dt) if request.hidden else None)
    order = torch.arange(sum(b for b, _ in parts))
    return TeacherScores.join(filled, order)


def _empty_topk(b: int, S: int, k: int) -> TeacherTopK:
    return TeacherTopK(torch.zeros(b, S, k, dtype=torch.long), torch.full((b, S, k), float("-inf")), validated=True)
