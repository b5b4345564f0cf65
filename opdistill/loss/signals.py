"""What the teacher sends per position, validated at construction: ``TeacherTopK``, ``TeacherSampled``,
``TeacherLogits`` (the fused back-end's full-vocabulary teacher is ``opdistill.fused.TeacherHidden``), and
``TeacherScores``: what a teacher returns for a batch of padded rows (every source of ``opdistill.teachers``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.checks import check_float, check_int


@dataclass(frozen=True)
class TeacherTopK:
    """The teacher's top-k next-token distribution per position: ids ``[..., K]`` (int), log-probs ``[..., K]``.

    ``validated``: the values were checked where they were made (ids distinct within a row and in the vocabulary,
    log-probs <= 0 with mass <= 1), as our own scorer does (``teacher.score_teacher``, ``teacher.load_cache``); the
    loss then skips those per-call checks (a sort and several device-to-host syncs) and still checks the student.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    validated: bool = False

    def __post_init__(self):
        check_int(self.ids, "TeacherTopK.ids")
        check_float(self.logprobs, "TeacherTopK.logprobs")
        if not isinstance(self.validated, bool):
            raise TypeError(f"TeacherTopK.validated must be a bool, got {self.validated!r}")


@dataclass(frozen=True)
class TeacherSampled:
    """The teacher's log-prob of the token the student sampled, per position ``[...]``."""

    logprobs: torch.Tensor

    def __post_init__(self):
        check_float(self.logprobs, "TeacherSampled.logprobs")


@dataclass(frozen=True)
class TeacherLogits:
    """The teacher's full logits per position ``[..., V]`` (in-process teacher; full-vocabulary JSD)."""

    logits: torch.Tensor

    def __post_init__(self):
        check_float(self.logits, "TeacherLogits.logits")


@dataclass(frozen=True)
class TeacherScores:
    """A teacher's scores of padded rows ``[B, S]`` in the next-token layout (row t scores token t + 1), what every
    teacher source returns (``opdistill.teachers``). Positions that were not scored hold the values the loss turns
    masked positions into anyway: empty top-k slots (id 0, log-prob -inf), sampled log-prob 0, requested log-prob
    -inf.

    topk                ids / log-probs ``[B, S, K]`` (None when not asked for)
    sampled_logprobs    ``[B, S]``: the teacher's log-prob of the next token of the row (None when not asked for)
    requested_logprobs  ``[B, S, J]``: log-probs at the ids the request named (None when not asked for)
    requested_ids       ``[B, S, J]``: those ids (the request's; attached by whoever asked, e.g. the trainer's step)
    hidden              ``[B, S, H]``: the teacher's final hidden states (after its final norm; 0 where not scored),
                        what ``head`` turns into its logits (SPEC 6.4; None when not asked for)
    head                the teacher's output head for ``hidden`` (``opdistill.fused.LMHead``: weight, bias, logit
                        scale, soft-cap), held once by the trainer
    mask                ``[B, S]`` bool: False at a scored position the teacher has no signal for (a cross-tokenizer
                        teacher, SPEC 6.6: the trainer drops those tokens from the step and counts them); None: all
    sums                named sums over the rows that the teacher turns into step metrics once they are summed over
                        the step on every rank (``Teacher.step_metrics``: a cross-tokenizer teacher's ``positions``,
                        ``exact``, ``masked``, ``residual`` -> ``xtok/*``); None: none
    """

    topk: TeacherTopK | None = None
    sampled_logprobs: torch.Tensor | None = None
    requested_logprobs: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    head: object = None
    requested_ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    sums: dict | None = None

    def micro(self, rows: torch.Tensor, length: int) -> "TeacherScores":
        """The scores of rows ``rows`` (index tensor) and their first ``length`` positions (one micro-batch)."""
        def take(x):
            return None if x is None else x[rows, :length]

        topk = None if self.topk is None else TeacherTopK(take(self.topk.ids), take(self.topk.logprobs),
                                                          validated=self.topk.validated)
        return TeacherScores(topk, take(self.sampled_logprobs), take(self.requested_logprobs), take(self.hidden),
                             self.head, take(self.requested_ids), take(self.mask))

    def to(self, device) -> "TeacherScores":
        """Every per-row tensor on ``device`` (itself when already there); the head stays where it is held."""
        def move(x):
            return None if x is None else x.to(device)

        topk = None if self.topk is None else TeacherTopK(move(self.topk.ids), move(self.topk.logprobs),
                                                          validated=self.topk.validated)
        return TeacherScores(topk, move(self.sampled_logprobs), move(self.requested_logprobs), move(self.hidden),
                             self.head, move(self.requested_ids), move(self.mask), self.sums)

    @staticmethod
    def join(parts: list["TeacherScores"], order: torch.Tensor) -> "TeacherScores | GroupedScores":
        """Scores of disjoint row subsets put back together: ``parts[i]`` scored rows ``order[n_0 + ... : ...]`` (its
        rows, in order), so row ``order[j]`` of the result is row j of the concatenated parts. Hidden states that go
        through different heads (several teachers) cannot share one tensor: they stay apart (:class:`GroupedScores`)."""
        if parts[0].hidden is not None and any((p.head is None) != (parts[0].head is None) or p.head is not None
                                               and p.head.weight is not parts[0].head.weight for p in parts):
            sizes = [p.hidden.shape[0] for p in parts]
            return GroupedScores(tuple(zip(torch.split(order, sizes), parts)))
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel())

        def cat(xs):
            return None if xs[0] is None else torch.cat([x.to(xs[0].dtype) for x in xs])[inv]

        topk = None
        if parts[0].topk is not None:
            topk = TeacherTopK(cat([p.topk.ids for p in parts]), cat([p.topk.logprobs for p in parts]),
                               validated=all(p.topk.validated for p in parts))
        mask = sums = None
        if any(p.mask is not None for p in parts):  # a member without one scored every position it was asked
            mask = cat([p.mask if p.mask is not None else torch.ones(p.scored_shape(), dtype=torch.bool)
                        for p in parts])
        if any(p.sums is not None for p in parts):
            sums = {}
            for p in parts:
                for name, v in (p.sums or {}).items():
                    sums[name] = sums.get(name, 0.0) + v
        return TeacherScores(topk, cat([p.sampled_logprobs for p in parts]),
                             cat([p.requested_logprobs for p in parts]), cat([p.hidden for p in parts]),
                             parts[0].head, cat([p.requested_ids for p in parts]), mask, sums)

    def scored_shape(self) -> tuple:
        """``(B, S)`` of the rows these scores are of."""
        for x in (self.topk.ids if self.topk is not None else None, self.sampled_logprobs, self.requested_logprobs,
                  self.hidden):
            if x is not None:
                return tuple(x.shape[:2])
        raise ValueError("TeacherScores: no scores to take the rows' shape from")


@dataclass(frozen=True)
class GroupedScores:
    """The scores of disjoint groups of a batch's rows kept apart: ``parts`` = ((rows [n], TeacherScores of those n
    rows), ...). What several teachers with different heads send as hidden states; a micro-batch reads one group."""

    parts: tuple

    def micro(self, rows: torch.Tensor, length: int) -> TeacherScores:
        """As :meth:`TeacherScores.micro`, for rows of one group."""
        for group_rows, scores in self.parts:
            pos = {int(r): i for i, r in enumerate(group_rows.tolist())}
            if int(rows[0]) in pos:
                if any(int(r) not in pos for r in rows.tolist()):
                    raise ValueError("GroupedScores.micro: the rows of one micro-batch span several groups")
                return scores.micro(torch.tensor([pos[int(r)] for r in rows.tolist()]), length)
        raise ValueError(f"GroupedScores.micro: row {int(rows[0])} is in no group")

    def to(self, device) -> "GroupedScores":
        return GroupedScores(tuple((rows, s.to(device)) for rows, s in self.parts))


SIGNAL_FOR_MODE = {"topk": TeacherTopK, "sampled": TeacherSampled, "full": TeacherLogits}
