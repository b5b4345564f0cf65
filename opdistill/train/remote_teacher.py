"""Where the trainer's teacher scores come from: the in-process teacher or a teacher server (``teacher.url``).

:func:`connect_teacher` opens the client and checks the server against the student before any training;
:func:`score_rollouts` is the one place the loop asks for teacher scores, and returns the same
:class:`~opdistill.teacher.TeacherScores` either way (docs/teacher_service.md).
"""
from __future__ import annotations

from opdistill.batch import shift_for_next_token
from opdistill.engines.remote import RemoteTeacher, VLLMPromptLogprobsTeacher
from opdistill.engines.vllm import VllmEngine
from opdistill.teacher import TeacherScores, score_teacher
from opdistill.train.sharded_teacher import ShardedTeacher

__all__ = ["connect_teacher", "score_rows", "score_rollouts"]


def connect_teacher(cfg, tokenizer, student, tc=None, key: str = "teacher.url") -> RemoteTeacher | None:
    """The ``teacher.url`` client (``teacher.api``: our server, its /info checked against the student; or a stock
    ``vllm serve`` endpoint), None when no url is set. ``tc``: another section with the same keys (a ``teachers``
    entry; default ``cfg.teacher``), ``key``: its url's dotted key for the messages."""
    tc = cfg.teacher if tc is None else tc
    if tc.url is None:
        return None
    try:
        import httpx  # noqa: F401
    except ImportError:
        from opdistill.errors import ConfigError

        raise ConfigError(f"{key}: the teacher client needs the serve extra (httpx is missing): "
                          "pip install 'opdistill[serve]'") from None
    kw = dict(token_file=tc.token_file, timeout_s=tc.timeout_s, retries=tc.retries, backoff_s=tc.backoff_s, key=key)
    if tc.api == "vllm":  # a stock `vllm serve` endpoint: prompt_logprobs (what it cannot do: docs/teacher_service.md)
        client = VLLMPromptLogprobsTeacher(tc.url, model=tc.model, **kw)
    else:
        client = RemoteTeacher(tc.url, payload=tc.payload, **kw)
    try:
        client.check_student(tokenizer, student, k=cfg.loss.topk if cfg.loss.loss_mode == "topk" else None)
    except BaseException:
        client.close()
        raise
    return client


def score_rows(teacher, input_ids, attention_mask, response_mask, *, k: int | None, sampled: bool,
               what: str = "") -> TeacherScores:
    """Teacher top-k (``k``) and/or next-token log-probs of padded rows, from ``teacher``: a model (in process) or a
    :class:`RemoteTeacher` (our server or, as its subclass, a vLLM endpoint), an in-process vLLM teacher engine
    (``teacher.engine: vllm``), or a :class:`ShardedTeacher` (``model.teacher_sharded``); the same TeacherScores
    either way. The one place that chooses the scorer."""
    if isinstance(teacher, RemoteTeacher):
        return teacher.score(input_ids, attention_mask, response_mask, k=k, sampled=sampled,
                             what=what or f"{input_ids.shape[0]} rows x {input_ids.shape[1]} positions")
    if isinstance(teacher, ShardedTeacher):  # model.teacher_sharded: every rank calls this together
        return teacher.score(input_ids, attention_mask, response_mask, k=k, sampled=sampled)
    targets, scored = shift_for_next_token(input_ids, response_mask)  # only the response positions are scored
    if isinstance(teacher, VllmEngine):
        return teacher.score(input_ids, attention_mask, k=k, sampled_ids=targets if sampled else None)
    return score_teacher(teacher, input_ids, attention_mask, k=k, sampled_ids=targets if sampled else None,
                         positions=scored)


def score_rollouts(teacher, ro, loss_cfg, step: int) -> TeacherScores:
    """Teacher scores of a step's rollouts ``ro`` for the loss ``loss_cfg`` (see :func:`score_rows`)."""
    return score_rows(teacher, ro.input_ids, ro.attention_mask, ro.response_mask,
                      k=loss_cfg.topk if loss_cfg.loss_mode == "topk" else None,
                      sampled=loss_cfg.loss_mode == "sampled",
                      what=f"step {step}: {ro.input_ids.shape[0]} rows x {ro.input_ids.shape[1]} positions")
