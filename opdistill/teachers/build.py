"""``build_teacher(config, context)``: THE place that chooses where a run's teacher scores come from.

Nothing else in the package picks a teacher class. From the trainer config (``teacher``, ``teachers``, ``routing``,
``model.teacher``, ``model.teacher_sharded``, ``data.teacher_cache``, ``train.method``) and what the run has loaded
(:class:`TeacherContext`), it returns :class:`Teachers`: the teacher the training steps score with and the one the
evaluation scores with (they differ where the training teacher is a cache or a vLLM engine: the evaluation keeps
the in-process model; several routed teachers: no teacher metrics in the evaluation).

======================================  ==================================================  =====================
config                                  training teacher                                    evaluation teacher
======================================  ==================================================  =====================
``teachers`` + ``routing``              RoutedTeacher of LocalTeacher / RemoteTeacher /     none
                                        StockVllmTeacher members
``teacher.url`` (api opdistill | vllm)  RemoteTeacher | StockVllmTeacher                    the same client
``teacher.url: [url, url, ...]``        TeacherPool of those clients (one teacher)          the same pool
``train.method: rl``                    none                                                 the model, if loaded
``data.teacher_cache``                  CachedTeacher                                       the model
``teacher.engine: vllm``                VllmTeacher (a VllmEngine in this process)          the model
``model.teacher_sharded`` (torchrun)    ShardedTeacher                                      the same
otherwise                               LocalTeacher (``model.teacher``, or the LoRA base)  the same
======================================  ==================================================  =====================

With ``teacher.context`` (privileged context, SPEC 6.7) the chosen teachers are wrapped in a ContextTeacher, which
scores each row's response under the row's own teacher prompt (the evaluation's too, unless the context reads each
row's answer or hint: then the evaluation has no teacher).

With ``xtok.mode`` bpm or sampled (a teacher with another tokenizer, SPEC 6.6) each in-process teacher (and each
routed member with a path) is wrapped in a CrossTokenizerTeacher reading that model's own tokenizer; the evaluation's
always maps by byte prefix (bpm), so its teacher-KL is the same measurement in either mode.

A new kind of teacher is one class in this package and one line here (docs/architecture.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from opdistill.errors import ConfigError
from opdistill.teachers.base import Teacher
from opdistill.teachers.cache import CachedTeacher
from opdistill.teachers.context import ContextTeacher
from opdistill.teachers.local import LocalTeacher
from opdistill.teachers.pool import TeacherPool
from opdistill.teachers.remote import RemoteTeacher
from opdistill.teachers.routed import RoutedTeacher
from opdistill.teachers.sharded import ShardedTeacher
from opdistill.teachers.stock_vllm import StockVllmTeacher
from opdistill.teachers.xtok import CrossTokenizerTeacher

__all__ = ["TeacherContext", "TeacherSource", "Teachers", "build_teacher", "connect", "server_teacher",
           "teacher_sources"]


@dataclass
class TeacherContext:
    """What the run has loaded that a teacher needs.

    tokenizer, student: the student's (a server's ``/info`` is checked against them).
    models: the in-process teacher models by config key (``model.teacher``: the teacher or the LoRA student's base;
        ``teachers.N.path``: a named teacher); a key the config names but this lacks is an error.
    mesh, group: the data-parallel mesh and group a ``model.teacher_sharded`` teacher is sharded over (None: one
        process, where sharding over one rank is the unsharded teacher).
    cache: the loaded ``data.teacher_cache`` (``opdistill.teachers.cache.load_cache``), or None.
    resolve: ``model.*`` name -> model folder (for a vLLM engine, which loads from its folder).
    tools: the schemas of an episode's tools (SPEC 6.8), which a ``teacher.context`` prompt lists; None: no tools.
    """

    tokenizer: object
    student: object = None
    models: dict = field(default_factory=dict)
    mesh: object = None
    group: object = None
    cache: dict | None = None
    resolve: Callable[[str], str] = str
    tools: list | None = None


@dataclass
class Teachers:
    """The run's teachers: ``train`` scores the steps, ``eval`` the held-out evaluation (either None: none)."""

    train: Teacher | None
    eval: Teacher | None

    def close(self) -> None:
        for t in {id(t): t for t in (self.train, self.eval) if t is not None}.values():
            t.close()


@dataclass(frozen=True)
class TeacherSource:
    """A teacher class a config's setting chooses (:func:`teacher_sources`): ``key`` and ``value`` of that setting,
    ``setting`` as a message names it, ``default``: the value that does not choose it."""

    cls: type
    key: str
    value: object
    setting: str
    default: object


def teacher_sources(cfg) -> list[TeacherSource]:
    """The teacher classes the config's settings choose other than the models scored in this process by
    :class:`LocalTeacher` (what the config's rules read ``Teacher.cannot`` of, before anything loads), in the order
    the rules ask: the teacher cache, a vLLM teacher engine, a stock ``vllm serve`` endpoint (``teacher.api``), and
    each named teacher's endpoint."""
    from opdistill.teachers.vllm import VllmTeacher

    out = []
    if cfg.data.teacher_cache is not None:
        out.append(TeacherSource(CachedTeacher, "data.teacher_cache", cfg.data.teacher_cache, "data.teacher_cache",
                                 None))
    if cfg.teacher.engine == "vllm":
        out.append(TeacherSource(VllmTeacher, "teacher.engine", "vllm", "teacher.engine vllm", "hf"))
    if cfg.teacher.api == "vllm":
        out.append(TeacherSource(StockVllmTeacher, "teacher.api", "vllm", "teacher.api vllm", "opdistill"))
    for i, t in enumerate(cfg.teachers or []):
        if t.api == "vllm":
            out.append(TeacherSource(StockVllmTeacher, f"teachers.{i}.api", "vllm", f"teachers.{i}.api vllm",
                                     "opdistill"))
    return out


def connect(cfg, section, key: str, context: TeacherContext) -> Teacher:
    """A remote teacher from a section with the ``teacher`` client keys (``teacher`` or a ``teachers`` entry):
    our server (``api: opdistill``; its /info checked against the student) or a stock ``vllm serve`` endpoint
    (``api: vllm``); ``key`` names its url in messages."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise ConfigError(f"{key}: the teacher client needs the serve extra (httpx is missing): "
                          "pip install 'opdistill[serve]'") from None
    urls = [section.url] if isinstance(section.url, str) else list(section.url)
    clients: list = []
    try:
        for i, url in enumerate(urls):
            kw = dict(overlap=section.overlap, token_file=section.token_file, timeout_s=section.timeout_s,
                      retries=section.retries, backoff_s=section.backoff_s, key=key if len(urls) == 1 else f"{key}.{i}")
            if section.api == "vllm":  # prompt_logprobs (what it cannot do: docs/teacher_service.md)
                clients.append(StockVllmTeacher(url, model=section.model, **kw))
            else:
                clients.append(RemoteTeacher(url, payload=section.payload, hidden_payload=section.hidden_payload, **kw))
        client = clients[0] if len(clients) == 1 else TeacherPool(clients, probe_s=section.probe_s,
                                                                  patience_s=section.patience_s, key=key)
    except BaseException:
        for c in clients:
            c.close()
        raise
    if cfg.xtok.mode != "off" and cfg.train.method != "rl":
        try:
            return _served_across(cfg, client, clients, key, context)
        except BaseException:
            client.close()
            raise
    try:
        lc = cfg.loss
        check = dict(hidden=True) if lc.loss_mode == "full" and section.api != "vllm" else {}
        client.check_student(context.tokenizer, context.student, k=lc.topk if lc.loss_mode == "topk" else None,
                             **check)
    except BaseException:
        client.close()
        raise
    return client


def _cross(cfg, teacher: Teacher, path: str, context: TeacherContext, *, mode: str | None = None) -> Teacher:
    """``teacher`` answering in the student's tokens when ``xtok.mode`` asks (module notes); itself otherwise.
    ``path``: the teacher's model name or folder (its tokenizer); ``mode``: the mapping (default: xtok.mode)."""
    if cfg.xtok.mode == "off" or cfg.train.method == "rl":
        return teacher
    from opdistill.models import load_tokenizer, output_width

    model = getattr(teacher, "model", None)
    return _across(cfg, teacher, context, load_tokenizer(context.resolve(path)), mode=mode or cfg.xtok.mode,
                   teacher_width=output_width(model) if model is not None else None)


def _across(cfg, teacher: Teacher, context: TeacherContext, teacher_tok, *, mode: str, teacher_width: int | None,
            teacher_topk: int | None = None, key: str | None = None) -> CrossTokenizerTeacher:
    """The one place a teacher is wrapped to answer in the student's tokens (in process or served)."""
    return CrossTokenizerTeacher(teacher, context.tokenizer, teacher_tok, mode=mode,
                                 teacher_topk=cfg.xtok.teacher_topk if teacher_topk is None else teacher_topk,
                                 use_chat_template=cfg.data.use_chat_template, teacher_width=teacher_width, key=key,
                                 tools=context.tools)


def _served_across(cfg, client: Teacher, clients: list, key: str, context: TeacherContext) -> Teacher:
    """A teacher server whose tokenizer may differ from the student's (``xtok.mode``): its tokenizer fetched from
    the first server that answers, checked (bytes, chat templates) and against the servers' /info, then the client
    wrapped to answer in the student's tokens (opdistill/teachers/xtok.py)."""
    from opdistill.models import check_compatible
    from opdistill.teachers.http import TeacherServiceError, TeacherUnavailable

    t_tok, last = None, None
    for c in clients:
        try:
            t_tok = c.fetch_tokenizer()
            break
        except TeacherUnavailable as e:
            last = e
    if t_tok is None:
        raise last
    check_compatible(context.tokenizer, t_tok, cross_tokenizer=True, key=key)
    info = client.check_student(t_tok, None, k=None)
    max_k = info.get("max_k")
    k = min(cfg.xtok.teacher_topk, info.get("teacher_vocab_size") or cfg.xtok.teacher_topk)
    if max_k is not None and k > max_k:
        raise TeacherServiceError(f"{key}: xtok.teacher_topk={k} is above the server's max K {max_k}; lower "
                                  f"xtok.teacher_topk or start the server with a larger --max-k")
    return _across(cfg, client, context, t_tok, mode=cfg.xtok.mode, teacher_topk=k,
                   teacher_width=info.get("teacher_vocab_size"), key=key)


def _model(context: TeacherContext, key: str):
    if key not in context.models:
        raise ValueError(f"build_teacher: the config names {key} but no model was loaded for it")
    return context.models[key]


def _in_process(cfg, context: TeacherContext) -> Teacher | None:
    """``model.teacher`` in this process (sharded over the data-parallel ranks when asked and possible), or None."""
    model = context.models.get("model.teacher")
    if model is None:
        return None
    if cfg.model.teacher_sharded and context.mesh is not None:
        return ShardedTeacher(model, context.mesh, context.group)
    return LocalTeacher(model)


def _vllm(cfg, context: TeacherContext) -> Teacher:
    from opdistill.engines.vllm import VllmEngine
    from opdistill.teachers.vllm import VllmTeacher

    rc = cfg.rollout
    k = cfg.loss.topk if cfg.loss.loss_mode == "topk" else 1
    engine = VllmEngine(context.resolve(cfg.model.teacher), role="teacher", max_logprobs=max(k or 1, 20),
                        dtype=cfg.model.dtype, seed=cfg.train.seed, max_model_len=rc.vllm_max_model_len,
                        gpu_memory_utilization=rc.vllm_gpu_memory_utilization, kv_cache_gb=rc.vllm_kv_cache_gb,
                        sleep=rc.vllm_sleep)
    return VllmTeacher(engine)


def _routed(cfg, context: TeacherContext) -> RoutedTeacher:
    members: dict[str, Teacher] = {}
    shared: dict[int, Teacher] = {}  # two names for one loaded model share one LocalTeacher
    try:
        for i, spec in enumerate(cfg.teachers):
            if spec.path is not None:
                model = _model(context, f"teachers.{i}.path")
                members[spec.name] = shared.setdefault(id(model), _cross(
                    cfg, LocalTeacher(model, key=f"teachers.{i}.path"), spec.path, context))
            else:
                members[spec.name] = connect(cfg, spec, f"teachers.{i}.url", context)
    except BaseException:
        for m in members.values():
            m.close()
        raise
    rt = cfg.routing
    return RoutedTeacher(members, rt.table, rt.default, rt.field)


def build_teacher(cfg, context: TeacherContext, *, train: bool = True) -> Teachers:
    """The run's teachers (module docstring). ``train=False``: the evaluation's only (``opdistill eval``; the
    training teacher is None). Closes what it opened if a later part fails. With ``teacher.context`` each is wrapped
    to score under the row's own teacher prompt (:func:`_with_context`)."""
    return _with_context(cfg, _teachers(cfg, context, train=train), context)


def _with_context(cfg, teachers: Teachers, context: TeacherContext) -> Teachers:
    """``teacher.context`` (SPEC 6.7): the teachers wrapped in :class:`ContextTeacher` (one wrapper per teacher
    object); a context that reads each row's answer or hint gives the evaluation no teacher (a held-out problem's
    answer never enters a prompt)."""
    c = cfg.teacher.context
    if c is None:
        return teachers
    from opdistill.data import reads_rows
    from opdistill.models import model_positions

    wrapped: dict[int, Teacher] = {}

    def wrap(t):
        if t is None:
            return None
        if id(t) not in wrapped:
            # the teacher's positions, in the student's tokens (a cross-tokenizer teacher counts in its own)
            positions = None if isinstance(t, CrossTokenizerTeacher) else t.limits.get("max_model_len") or (
                model_positions(t.model) if hasattr(t, "model") else None)
            wrapped[id(t)] = ContextTeacher(t, context.tokenizer, use_chat_template=cfg.data.use_chat_template,
                                            max_positions=positions, tools=context.tools)
        return wrapped[id(t)]

    # dropped, not closed: an evaluation teacher holds nothing of its own (in process), or shares the training
    # teacher's connections (a server, a cross-tokenizer copy); Teachers.close closes what the run holds
    evaluation = None if reads_rows(c.template) or cfg.eval.prompts == "teacher" else teachers.eval
    return Teachers(wrap(teachers.train), wrap(evaluation))


def _teachers(cfg, context: TeacherContext, *, train: bool) -> Teachers:
    if cfg.teachers is not None:
        return Teachers(_routed(cfg, context) if train else None, None)
    if cfg.teacher.url is not None:
        remote = connect(cfg, cfg.teacher, "teacher.url", context)
        evaluation = remote.with_mode("bpm") if isinstance(remote, CrossTokenizerTeacher) else remote
        return Teachers(remote if train else None, evaluation)
    local = _in_process(cfg, context)
    if local is not None and cfg.xtok.mode != "off":
        evaluation = _cross(cfg, local, cfg.model.teacher, context, mode="bpm")
        if cfg.train.method == "rl" or not train:
            return Teachers(None, evaluation)
        return Teachers(evaluation.with_mode(cfg.xtok.mode), evaluation)  # one set of tables for both
    if cfg.train.method == "rl" or not train:
        return Teachers(None, local)
    if context.cache is not None:
        return Teachers(CachedTeacher(context.cache), local)
    if cfg.teacher.engine == "vllm":
        return Teachers(_vllm(cfg, context), local)
    return Teachers(local, local)


def server_teacher(path: str, *, engine: str = "hf", dtype: str = "float32", trust_remote_code: bool = False,
                   max_logprobs: int = 20, max_model_len: int | None = None,
                   gpu_memory_utilization: float = 0.9, key: str = "--model") -> Teacher:
    """The teacher a teacher server scores with (``opdistill serve-teacher``): the model of folder ``path`` in this
    process (``engine`` hf: every request, at any temperature) or a vLLM engine of it (``vllm``: prompt log-probs,
    up to ``max_logprobs`` per position, never put to sleep: a server scores request after request)."""
    if engine == "vllm":
        from opdistill.engines.vllm import VllmEngine
        from opdistill.teachers.vllm import VllmTeacher

        return VllmTeacher(VllmEngine(path, role="teacher", dtype=dtype, max_logprobs=max_logprobs,
                                      max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                                      sleep=False, trust_remote_code=trust_remote_code))
    from opdistill.models import load_model

    model = load_model(path, dtype=dtype, trust_remote_code=trust_remote_code, key=key)
    return LocalTeacher(model.requires_grad_(False), key=key)
