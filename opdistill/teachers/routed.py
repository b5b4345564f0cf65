"""Several named teachers in one run (``teachers`` + ``routing``): :class:`RoutedTeacher`, a composite Teacher.

Every row carries a routing value (:attr:`Rows.tags`: its prompt's task in a ``data.task: mix``, or a dataset column);
``table`` maps values to teacher names (``default`` takes the rest). A batch's rows go to their teachers, each member
scores its rows with one call, and the scores are put back into the batch's row order. Members that score in a
background thread (remote teachers with ``overlap``) are sent first, so they overlap with the in-process members'
scoring and, in the trainer, with the student's forward; the same bytes arrive in the same tensors either way.

:meth:`RoutedTeacher.groups` names the rows of every member (an empty index for a member without rows), known before
the scores arrive: the trainer cuts micro-batches within a group and reports each group's metrics under
``teacher/<name>/`` (docs/teacher_service.md "Several teachers").
"""
from __future__ import annotations

from concurrent.futures import Future

import torch

from opdistill.errors import DataError
from opdistill.loss import TeacherScores
from opdistill.teachers.base import Rows, ScoreRequest, Teacher, done, in_background

__all__ = ["RoutedTeacher"]


class _Joined(Future):
    """The batch's scores once every member's Future is done (the members' rows put back in order)."""

    def __init__(self, parts: list[tuple[torch.Tensor, Future]]):
        super().__init__()
        self.parts = parts
        self.set_running_or_notify_cancel()

    def result(self, timeout=None):
        if not self.done():
            try:
                scores = [f.result(timeout) for _, f in self.parts]
                self.set_result(TeacherScores.join(scores, torch.cat([rows for rows, _ in self.parts])))
            except BaseException as e:  # noqa: BLE001 -- a member's failure is the batch's
                self.set_exception(e)
        return super().result(timeout)


class RoutedTeacher(Teacher):
    """``members``: {name: Teacher}, in the config's order; ``table``: {routing value: name}; ``default``: the name
    for values the table does not list (None: every value must be listed); ``field``: what the values are, for
    messages."""

    key = "teachers"

    def __init__(self, members: dict[str, Teacher], table: dict, default: str | None, field: str):
        self.members, self.table, self.default, self.field = dict(members), dict(table), default, field
        self.names = tuple(self.members)

    def route(self, rows: Rows) -> torch.Tensor:
        """The member index (into ``names``) of each row, from its tag."""
        if rows.tags is None:
            raise ValueError("RoutedTeacher: the rows carry no tags (routing values)")
        out = []
        for v in rows.tags:
            name = self.table.get(v, self.default)
            if name is None:
                raise DataError(f"routing.table: a prompt has {self.field} {v!r}, which has no teacher (routing.table "
                                f"lists {sorted(self.table)}); add it or set routing.default")
            out.append(self.names.index(name))
        return torch.tensor(out, dtype=torch.long)

    def groups(self, rows: Rows) -> dict[str, torch.Tensor]:
        member = self.route(rows)
        return {name: torch.nonzero(member == j).flatten() for j, name in enumerate(self.names)}

    def submit(self, rows: Rows, request: ScoreRequest) -> Future:
        groups = [(name, idx) for name, idx in self.groups(rows).items() if idx.numel()]
        what = request.what.split(":")[0] if request.what else ""

        def job(name, idx):
            sub = request.select(idx, f"{what}{', ' if what else ''}teacher {name}: {idx.numel()} rows x "
                                      f"{rows.width} positions")
            return lambda: self.members[name].score(rows.select(idx), sub)

        # the background requests first, so they overlap with the in-process members' scoring
        futures = {name: in_background(job(name, idx)) for name, idx in groups if self.members[name].background}
        return _Joined([(idx, futures[name] if name in futures else done(job(name, idx)())) for name, idx in groups])

    @property
    def background(self) -> bool:
        """Whether some member scores in a background thread (its Future may still be running after ``submit``)."""
        return any(m.background for m in self.members.values())

    def score(self, rows: Rows, request: ScoreRequest) -> TeacherScores:
        return self.submit(rows, request).result()

    def named(self) -> dict[str, Teacher]:
        return dict(self.members)

    @property
    def masks(self) -> bool:
        return any(m.masks for m in self.members.values())

    @property
    def sum_names(self) -> tuple:
        """Every member's sum names (a cross-tokenizer member's), once each, in the members' order."""
        return tuple(dict.fromkeys(n for m in self.members.values() for n in m.sum_names))

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for m in self.members.values():
            out.update(m.step_metrics({n: sums[n] for n in m.sum_names}))
        return out

    def metrics(self) -> dict[str, float]:
        """Each member's metrics under ``teacher/<name>/`` (``teacher/server/0/requests`` of member ``a``:
        ``teacher/a/server/0/requests``)."""
        out, seen = {}, {}
        for name, m in self.members.items():
            got = seen[id(m)] if id(m) in seen else seen.setdefault(id(m), m.metrics())
            out.update({f"teacher/{name}/{k.removeprefix('teacher/')}": v for k, v in got.items()})
        return out

    def close(self) -> None:
        closed = set()
        for m in self.members.values():
            if id(m) not in closed:
                closed.add(id(m))
                m.close()
