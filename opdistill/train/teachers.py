"""Several teachers in one run (``teachers`` + ``routing``), and teacher requests overlapped with the student's work.

Routing (docs/teacher_service.md "Several teachers"): every prompt carries a routing value (``routing.field``: its
task's name in a ``data.task: mix``, or a dataset column); ``routing.table`` maps values to teacher names
(``routing.default`` takes the rest). A step's rows go to their teachers, each teacher scores its rows in one
dispatch (:func:`~opdistill.train.remote_teacher.score_rows`: in process, or its server), and the scores are put back
into the step's row order. The loss is then the ordinary step loss: ONE ``GlobalBatch`` over all the step's rows, so
routing changes nothing about the aggregation (SPEC section 4); only the micro-batches are cut per teacher (every
micro-batch holds one teacher's rows, which the gradient does not depend on) so that each micro-batch's exact
metrics belong to one teacher.

Per-teacher metrics (:class:`TeacherMetrics`), reduced with the step's ``MetricSums`` (sums over micro-batches and
data-parallel ranks, divided once):

- ``teacher/<name>/token_frac``: the teacher's share of the step's response tokens (they sum to 1; all 0 when the
  step has no response token);
- ``teacher/<name>/loss``: its share of ``distillation/loss`` -- the sum of its micro-batches' contributions to the
  one aggregated loss, so the shares add up to ``distillation/loss`` (to float64 rounding);
- every other ``distillation/*`` metric restricted to its rows: ``teacher/<name>/divergence``, ``.../teacher_mass``,
  ``.../student_mass``, ``.../overlap_ratio``, ``.../overlap_token_advantage``, ``.../loss_min|max`` ...

A teacher that gets no tokens in a step still reports every name (every rank records the same names): token_frac 0,
loss 0, and 0 for its means, ratios and extrema (the MetricSums rule for an empty selection): never NaN.

Overlap: a remote teacher's request (``teacher.url``, or a ``teachers`` entry with a url; ``overlap: true``, the
default) runs in a background thread while the main thread goes on with the step: the other teachers' in-process
scoring, the rewards, and the student's forward of the first micro-batch; the scores are waited for where the loss
first needs them (``StepData.pending``). The same bytes arrive in the same tensors, so the step is bit-identical with
overlap on or off (tested).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from opdistill import TeacherTopK
from opdistill.engines.remote import RemoteTeacher
from opdistill.errors import ConfigError, DataError, IncompatibleModelsError
from opdistill.models import resolve_model_path
from opdistill.metrics import MetricSums
from opdistill.teacher import TeacherScores
from opdistill.train.placement import scores_to
from opdistill.train.remote_teacher import connect_teacher, score_rollouts, score_rows

__all__ = ["TeacherSet", "PendingScores", "TeacherMetrics", "open_teachers", "attach_scores", "routed_split"]


@dataclass
class Member:
    name: str
    scorer: object  # a model in process, or a RemoteTeacher
    overlap: bool  # a remote teacher whose requests run in a background thread


class TeacherSet:
    """The named teachers of a run and the routing rule (``routing``): :meth:`route` gives each row its teacher."""

    def __init__(self, members: list[Member], table: dict, default: str | None, field: str):
        self.members, self.table, self.default, self.field = members, dict(table), default, field
        self.names = tuple(m.name for m in members)

    def route(self, values: list[str]) -> torch.Tensor:
        """The teacher index (into ``names``) of each row, from its routing value."""
        out = []
        for v in values:
            name = self.table.get(v, self.default)
            if name is None:
                raise DataError(f"routing.table: a prompt has {self.field} {v!r}, which has no teacher (routing.table "
                                f"lists {sorted(self.table)}); add it or set routing.default")
            out.append(self.names.index(name))
        return torch.tensor(out, dtype=torch.long)

    def close(self) -> None:
        for m in self.members:
            if isinstance(m.scorer, RemoteTeacher):
                m.scorer.close()


def _load_named(cfg, spec, key: str, tok, student):
    """An in-process named teacher, loaded and checked like model.teacher (folder, tokenizer and head compatibility
    with the student, finite weights), errors naming ``key``."""
    from opdistill.models import check_compatible, load_model, load_tokenizer, model_folder
    from opdistill.train.preflight import check_finite_model

    mc = cfg.model
    try:
        path = resolve_model_path(spec.path)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"{key}: {str(e).removeprefix('model: ')}") from None
    model_folder(path, key)
    teacher = load_model(path, dtype=mc.dtype, trust_remote_code=mc.trust_remote_code,
                         attn_implementation=mc.attn_implementation)
    teacher.requires_grad_(False)
    try:
        check_compatible(tok, load_tokenizer(path, trust_remote_code=mc.trust_remote_code), student, teacher)
    except IncompatibleModelsError as e:
        raise IncompatibleModelsError(f"{key}: " + str(e).removeprefix("model.teacher: ")) from None
    check_finite_model(key, teacher, spec.path)
    return teacher


def open_teachers(cfg, tok, student, task, models: dict | None = None) -> TeacherSet | None:
    """The ``teachers`` of ``cfg`` loaded (``path``: in process; ``models``: {name: model} already loaded) or
    connected (``url``: /info checked against the student), each checked against the student as a single teacher
    is; a dataset's routing values checked against ``routing``. None without ``teachers``."""
    if cfg.teachers is None:
        return None
    from opdistill.data import DatasetTask
    from opdistill.train.preflight import check_against_models, model_positions

    rt = cfg.routing
    if isinstance(task, DatasetTask):  # the values are known once the rows are read
        values = {p.task for p in task.rows + task.eval_rows}
        for v in rt.table:
            if v not in values:
                raise ConfigError(f"routing.table.{v}: no row of {cfg.data.path} has {rt.field} {v!r} (values: "
                                  f"{sorted(values)[:10]})")
        missing = sorted(v for v in values if v not in rt.table)
        if missing and rt.default is None:
            raise ConfigError(f"routing.table: {rt.field} {missing[0]!r} of {cfg.data.path} has no teacher "
                              f"({len(missing)} value(s) unrouted); add it to routing.table or set routing.default")
    members: list[Member] = []
    loaded: dict[str, object] = {}  # two names for one folder share one copy of the weights
    try:
        for i, spec in enumerate(cfg.teachers):
            key = f"teachers.{i}"
            if spec.path is not None:
                model = (models or {}).get(spec.name)
                if model is None:
                    if spec.path not in loaded:
                        loaded[spec.path] = _load_named(cfg, spec, f"{key}.path", tok, student)
                    model = loaded[spec.path]
                members.append(Member(spec.name, model, False))
            else:
                members.append(Member(spec.name, connect_teacher(cfg, tok, student, tc=spec, key=f"{key}.url"),
                                      spec.overlap))
        local = [m.scorer for m in members if not isinstance(m.scorer, RemoteTeacher)]
        shortest = min(local, key=lambda t: model_positions(t) or float("inf"), default=None)
        if shortest is not None:  # prompt length against the fewest positions of any in-process teacher, K, ...
            check_against_models(cfg, tok, student, shortest, task)
    except BaseException:
        TeacherSet(members, {}, None, rt.field).close()
        raise
    return TeacherSet(members, rt.table, rt.default, rt.field)


def _in_background(fn) -> Future:
    fut: Future = Future()

    def run():
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 -- re-raised in the main thread by Future.result()
                fut.set_exception(e)

    threading.Thread(target=run, daemon=True, name="opdistill-teacher-request").start()
    return fut


class PendingScores:
    """A step's teacher scores, some still on their way: ``parts`` = [(rows or None, TeacherScores or Future)].
    ``rows`` [b] are the step rows a part scored (None: all rows, in order). :meth:`fill` waits and puts the scores
    into the step's row order."""

    def __init__(self, parts: list):
        self.parts = parts

    @property
    def waiting(self) -> bool:
        return any(isinstance(s, Future) for _, s in self.parts)

    def result(self) -> TeacherScores:
        parts = [(rows, s.result() if isinstance(s, Future) else s) for rows, s in self.parts]
        if len(parts) == 1 and parts[0][0] is None:
            return parts[0][1]
        order = torch.cat([rows for rows, _ in parts])
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel())

        def join(get):
            xs = [get(s) for _, s in parts]
            return None if xs[0] is None else torch.cat([x.to(xs[0].dtype) for x in xs])[inv]

        topk = None
        if parts[0][1].topk is not None:
            topk = TeacherTopK(join(lambda s: s.topk.ids), join(lambda s: s.topk.logprobs),
                               validated=all(s.topk.validated for _, s in parts))
        return TeacherScores(topk=topk, sampled_logprobs=join(lambda s: s.sampled_logprobs))

    def fill(self, data) -> None:
        """Wait for every part and set ``data.teacher_topk`` / ``data.teacher_sampled`` on the device of ``data``'s
        rows (``train.device: cuda`` moved them there before the scores arrived); ``data.pending`` cleared."""
        scores = self.result()
        data.teacher_topk, data.teacher_sampled = scores_to(scores.topk, scores.sampled_logprobs,
                                                            data.input_ids.device)
        data.pending = None


def attach_scores(data, scorer, ro, problems, cfg, step: int) -> None:
    """Teacher scores of the step's rollouts ``ro`` into ``data`` (a StepData): from one teacher (a model, a vLLM
    engine, a RemoteTeacher) or a :class:`TeacherSet` (rows routed by their ``problems``' values, ``data.row_teacher``
    set). Requests of remote teachers with overlap on are left running (``data.pending``; :class:`PendingScores`)."""
    lc = cfg.loss
    k, sampled = (lc.topk if lc.loss_mode == "topk" else None), lc.loss_mode == "sampled"
    if isinstance(scorer, TeacherSet):
        values = [problems[i].task or cfg.data.task for i in ro.prompt_index]
        row_teacher = scorer.route(values)
        data.row_teacher, data.teacher_names = row_teacher, scorer.names
        groups = [(m, torch.nonzero(row_teacher == j).flatten()) for j, m in enumerate(scorer.members)]
        groups = [(m, rows) for m, rows in groups if rows.numel()]

        def job(m, rows):
            return lambda: score_rows(m.scorer, ro.input_ids[rows], ro.attention_mask[rows], ro.response_mask[rows],
                                      k=k, sampled=sampled, what=f"step {step}, teacher {m.name}: {rows.numel()} rows "
                                                                 f"x {ro.input_ids.shape[1]} positions")
        # the background requests first, so they overlap with the in-process teachers' scoring
        futures = {m.name: _in_background(job(m, rows)) for m, rows in groups if m.overlap}
        pending = PendingScores([(rows, futures[m.name] if m.name in futures else job(m, rows)())
                                 for m, rows in groups])
    elif isinstance(scorer, RemoteTeacher) and cfg.teacher.overlap:
        pending = PendingScores([(None, _in_background(lambda: score_rollouts(scorer, ro, lc, step)))])
    else:
        scores = score_rollouts(scorer, ro, lc, step)
        data.teacher_topk, data.teacher_sampled = scores.topk, scores.sampled_logprobs
        return
    if pending.waiting:
        data.pending = pending
    else:
        pending.fill(data)


def routed_split(lengths: list[int], budget: int, row_teacher: torch.Tensor, split) -> list[list[int]]:
    """Micro-batches (``split(lengths, budget)``: token_budget_split) cut within each teacher's rows: every
    micro-batch holds one teacher's rows, in teacher order, rows ascending within a teacher."""
    out = []
    for j in row_teacher.unique().tolist():
        rows = torch.nonzero(row_teacher == j).flatten().tolist()
        out += [[rows[i] for i in g] for g in split([lengths[r] for r in rows], budget)]
    return out


class TeacherMetrics:
    """Per-teacher metrics of a routed step (module docstring), recorded into the step's ``MetricSums``."""

    def __init__(self, names: tuple, row_teacher: torch.Tensor, mask: torch.Tensor):
        self.names, self.row_teacher = names, row_teacher
        self.tokens = mask.sum(-1)  # [B] response tokens per row

    def add(self, rows: list[int], micro: MetricSums, sums: MetricSums) -> None:
        """A micro-batch (all ``rows`` one teacher's) and its metrics ``micro``: its teacher's share into ``sums``."""
        j = int(self.row_teacher[rows[0]])
        n = self.tokens[torch.tensor(rows)].sum()
        for i, name in enumerate(self.names):
            sums.add_ratio(f"teacher/{name}/token_frac", n if i == j else torch.zeros(()), n)
        sums.merge(micro.renamed("distillation/", f"teacher/{self.names[j]}/"))

    def finish(self, sums: MetricSums) -> None:
        """Every teacher reports every name (0 where it had no tokens): the same names on every rank and step."""
        template = sums.renamed("distillation/", "", empty=True)
        for name in self.names:
            sums.merge(template.renamed("", f"teacher/{name}/", empty=True))
