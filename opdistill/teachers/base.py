"""The one teacher interface: ``Teacher.score(rows, request) -> TeacherScores``.

Every source of teacher scores is a class with this method (docs/architecture.md lists them): the model in this
process, the model FSDP2-sharded over the data-parallel ranks, a vLLM engine in this process, our teacher server,
a stock ``vllm serve`` endpoint, the disk cache (a wrapper), and several named teachers routed by a field of the
data (a composite). The trainer, the evaluation and the teacher server call only this interface;
:func:`opdistill.teachers.build_teacher` is the one place that chooses a class.

- :class:`Rows`: padded rows ``[B, S]`` (prompt + response, right-padded), their response mask, and optional per-row
  tags (the prompt's task or dataset column: what routing reads). Position t of a row is *scored* when token t + 1
  is a response token: only those positions are computed anywhere.
- :class:`ScoreRequest`: what to compute at every scored position: the top-K (``k``), the log-prob of the row's own
  next token (``sampled``), log-probs at ids the caller names (``requested_ids`` ``[B, S, J]``), at ``temperature``;
  or the teacher's final hidden states (``hidden``), which its head (``TeacherScores.head``) turns into its logits.
- :class:`~opdistill.loss.TeacherScores`: the answer in the ``[B, S, ...]`` layout the losses read.
- ``submit`` returns a :class:`concurrent.futures.Future` of the scores: done at once for a teacher that scores in
  this thread, running in a background thread for a remote teacher with ``overlap`` (the trainer goes on with the
  student's forward meanwhile; the same bytes arrive either way). ``groups`` names the rows each member of a
  composite scored (metric groups: ``teacher/<name>/...``), known before the scores arrive.
"""
from __future__ import annotations

import abc
import dataclasses
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from opdistill.batch import shift_for_next_token
from opdistill.errors import UserError
from opdistill.loss import TeacherScores

__all__ = ["Rows", "ScoreRequest", "Teacher", "WrappedTeacher", "TeacherError", "done", "in_background"]


class TeacherError(UserError, ValueError):
    """A request a teacher cannot answer as asked (an engine limit, an option its source does not have); the message
    is one line naming the key to change."""

    kind = "teacher error"


@dataclass(frozen=True)
class Rows:
    """Padded rows to score: ``input_ids``, ``attention_mask``, ``response_mask`` ``[B, S]`` (0/1 masks), ``tags``
    (one string per row, or None): the value a routed teacher reads (a prompt's task, a dataset column),
    ``prompts`` (each row's prompt as the data gave it, a string or chat messages, or None): what a teacher with
    another tokenizer renders through its own chat template (opdistill/teachers/xtok.py), and ``teacher_prompts``
    (each row's teacher-side prompt x', SPEC 6.7, or None): what a privileged-context teacher scores the response
    under (opdistill/teachers/context.py), and ``tool_results`` (an episode's, SPEC 6.8: per row, per environment
    answer in it, its (tool name, text) pairs, or None): what a cross-tokenizer teacher writes through its own chat
    template between the student's turns."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    tags: tuple | None = None
    prompts: tuple | None = None
    teacher_prompts: tuple | None = None
    tool_results: tuple | None = None

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])

    def scored(self) -> torch.Tensor:
        """Bool ``[B, S]``: position t of row b is scored when ``response_mask[b, t + 1] == 1`` (the next-token mask
        of :func:`opdistill.shift_for_next_token`)."""
        return shift_for_next_token(self.input_ids, self.response_mask)[1]

    def targets(self) -> torch.Tensor:
        """``[B, S]``: the next token of each position (0 at the last), the ids ``sampled`` scores."""
        return shift_for_next_token(self.input_ids, self.response_mask)[0]

    def response_starts(self) -> torch.Tensor:
        """``[B]``: where each row's response starts (its first response token; a row without one: its length)."""
        resp = self.response_mask.bool()
        return torch.where(resp.any(-1), resp.int().argmax(-1), self.attention_mask.sum(-1))

    def select(self, rows: torch.Tensor) -> "Rows":
        """Rows ``rows`` (an index tensor), tags and prompts included."""
        pick = rows.tolist()

        def take(values):
            return None if values is None else tuple(values[i] for i in pick)

        return Rows(self.input_ids[rows], self.attention_mask[rows], self.response_mask[rows], take(self.tags),
                    take(self.prompts), take(self.teacher_prompts), take(self.tool_results))

    def describe(self) -> str:
        return f"{self.num_rows} rows x {self.width} positions"


@dataclass(frozen=True)
class ScoreRequest:
    """What a teacher computes at every scored position (see the module notes); ``what`` describes the rows in
    messages (``step 3: 8 rows x 40 positions``)."""

    k: int | None = None
    sampled: bool = False
    requested_ids: torch.Tensor | None = None  # [B, S, J]
    temperature: float = 1.0
    what: str = ""
    hidden: bool = False

    def __post_init__(self):
        if self.k is not None and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1):
            raise ValueError(f"ScoreRequest.k: expected an int >= 1 or None, got {self.k!r}")
        if self.k is None and not self.sampled and self.requested_ids is None and not self.hidden:
            raise ValueError("ScoreRequest: ask for top-k (k=...), sampled-token scores (sampled=True), log-probs at "
                             "requested ids (requested_ids=...) or hidden states (hidden=True)")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or t == float("inf"):
            raise ValueError(f"ScoreRequest.temperature: expected a finite number > 0, got {t!r}")

    def select(self, rows: torch.Tensor, what: str) -> "ScoreRequest":
        """The request for rows ``rows`` of its batch (the requested ids follow their rows)."""
        req = None if self.requested_ids is None else self.requested_ids[rows]
        return dataclasses.replace(self, requested_ids=req, what=what)


def done(scores: TeacherScores) -> Future:
    """A finished Future holding ``scores``."""
    fut: Future = Future()
    fut.set_result(scores)
    return fut


def in_background(fn, name: str = "opdistill-teacher-request") -> Future:
    """Run ``fn()`` in a daemon thread; its result (or exception) in the returned Future."""
    fut: Future = Future()

    def run():
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread by Future.result()
                fut.set_exception(e)

    threading.Thread(target=run, daemon=True, name=name).start()
    return fut


class Teacher(abc.ABC):
    """A source of teacher scores. Subclasses implement :meth:`score`; the rest has defaults."""

    #: where the teacher comes from, for messages (the config key: ``model.teacher``, ``teacher.url``, ...)
    key: str = "teacher"
    #: True: :meth:`submit` runs the request in a background thread (a remote teacher with ``overlap``)
    background: bool = False
    #: True: :meth:`score` runs collectives on the run's group (a sharded teacher): every rank calls it at the same
    #: point, from the trainer's thread (the pipelined step scores it there: opdistill/train/steps/pipeline.py)
    collective: bool = False
    #: what computes the scores, as a teacher server's ``/info`` names it
    engine_name: str = "hf"
    #: the names of the sums its answers carry (``TeacherScores.sums``), which :meth:`step_metrics` reads
    sum_names: tuple = ()
    #: what it cannot answer, by capability, each with the end of the sentence that says why (the config's rules read
    #: it to refuse a setting before anything loads: opdistill/train/run/rules.py): ``hidden`` (its final hidden states,
    #: ``loss.loss_mode: full``), ``requested`` (log-probs at ids the caller names, ``loss.support: union``),
    #: ``mapped`` (what a cross-tokenizer teacher reads of the teacher it wraps, ``xtok.mode``)
    cannot: dict = {}
    #: True: its answers may carry a mask (positions without a signal, ``TeacherScores.mask``), which decides the
    #: step's rows: a caller waits for the answer before it plans the step (a cross-tokenizer teacher)
    masks: bool = False

    @property
    def limits(self) -> dict:
        """What this teacher cannot answer, in a teacher server's ``/info`` terms (None: no limit):
        ``fixed_temperature``, ``padding`` ("any" or "right"), ``max_model_len``, ``max_requested_ids``, ``max_k``."""
        return {"fixed_temperature": None, "padding": "any", "max_model_len": None, "max_requested_ids": None,
                "max_k": None}

    @abc.abstractmethod
    def score(self, rows: Rows, request: ScoreRequest) -> TeacherScores:
        """The teacher's scores of ``rows`` (module notes); every rank of a sharded teacher calls it together."""

    def submit(self, rows: Rows, request: ScoreRequest) -> Future:
        """The scores as a Future: computed now, or in a background thread when :attr:`background`."""
        if self.background:
            return in_background(lambda: self.score(rows, request))
        return done(self.score(rows, request))

    def groups(self, rows: Rows) -> dict[str, torch.Tensor] | None:
        """Which rows each member of a composite teacher scores (``{name: row indices}``, every member named), or
        None for a single teacher."""
        return None

    def metrics(self) -> dict[str, float]:
        """What the teacher reports since the last call, as step metrics (a pool of servers: per server); the default
        reports nothing."""
        return {}

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """A step's metrics from the sums its scores carried (``TeacherScores.sums``), summed over the step's rows on
        every rank (a cross-tokenizer teacher's ``xtok/*``); the default: none."""
        return {}

    @property
    def head(self):
        """The output head that turns this teacher's hidden states into its logits (``opdistill.fused.LMHead``:
        loss_mode full), or None: a teacher that sends no hidden states, or several heads (a composite: each
        member's, :meth:`named`)."""
        return None

    def named(self) -> dict[str, "Teacher"]:
        """The teachers that score this one's rows, by name: a composite's members, else ``{"": self}``."""
        return {"": self}

    def served_by(self) -> "Teacher | None":
        """The client of the server(s) whose identity (``url``, ``/info``) stands for this teacher's scores (what a
        run records of it), or None for a teacher in this process."""
        return None

    def close(self) -> None:
        """Release what the teacher holds (connections, engines); the default holds nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class WrappedTeacher(Teacher):
    """A teacher around another (``inner``) that changes how rows are asked or answered (a cache, another tokenizer,
    the teacher's own prompts): everything it does not override is the inner teacher's (its key, whether it answers
    in a background thread or by a collective, its engine, limits, groups, metrics, head, members, server), and
    closing it closes the inner teacher. ``inner`` None (a cache that stands alone): the defaults of
    :class:`Teacher`."""

    def __init__(self, inner: Teacher | None):
        self.inner = inner
        if inner is not None:
            self.key, self.background, self.collective = inner.key, inner.background, inner.collective
            self.engine_name, self.sum_names, self.masks = inner.engine_name, inner.sum_names, inner.masks

    @property
    def limits(self) -> dict:
        return super().limits if self.inner is None else self.inner.limits

    def groups(self, rows: Rows):
        return None if self.inner is None else self.inner.groups(rows)

    def metrics(self) -> dict[str, float]:
        return {} if self.inner is None else self.inner.metrics()

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {} if self.inner is None else self.inner.step_metrics(sums)

    @property
    def head(self):
        return None if self.inner is None else self.inner.head

    def named(self) -> dict[str, Teacher]:
        return {"": self} if self.inner is None else self.inner.named()

    def served_by(self) -> Teacher | None:
        return None if self.inner is None else self.inner.served_by()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
