"""One step's data made once per data-parallel rank and shared with its tensor-parallel peers (``distributed.tp_size
> 1``; issue 24).

The tp ranks of a data-parallel rank train on the same rows, so only its first tp rank (``DistContext.tp_leader``)
decodes the rollouts, asks the teacher (a server gets one request, not tp_size) and computes the rewards; its
:class:`~opdistill.train.steps.step.StepData` and local metrics reach the peers in one broadcast over the tp group
(:func:`share_step`). The payload is a safetensors blob (no pickle between ranks): the rows, the sampler's log-probs,
advantages, metric groups, the teacher's scores (top-k, sampled, requested log-probs, hidden states; a
:class:`~opdistill.loss.signals.GroupedScores` part by part) and the local metric sums. A teacher's output head (the
hidden-state payload's) is never sent: every rank holds the teacher, and the peer takes the head of the member the
leader named.
"""
from __future__ import annotations

import json
import struct

import torch

from opdistill.loss.signals import GroupedScores, TeacherScores, TeacherTopK
from opdistill.train.run.distributed import DistContext, broadcast_bytes
from opdistill.train.steps.step import StepData

__all__ = ["share_step", "pack_step", "unpack_step"]

_ROWS = ("input_ids", "attention_mask", "response_mask", "sampler_logprobs", "advantages", "requested_ids")
_SCORES = ("sampled_logprobs", "requested_logprobs", "hidden", "requested_ids")


def _head_name(head, teacher) -> str:
    """The name of ``teacher``'s member whose output head ``head`` is (``""``: the teacher itself)."""
    for name, t in teacher.named().items():
        h = t.head
        if h is not None and h.weight is head.weight:
            return name
    raise ValueError("share_step: the teacher's scores carry an output head that no member of the teacher holds")


def _pack_scores(scores: TeacherScores, prefix: str, teacher, tensors: dict, meta: dict) -> None:
    if scores.topk is not None:
        tensors[prefix + "topk_ids"], tensors[prefix + "topk_logprobs"] = scores.topk.ids, scores.topk.logprobs
        meta[prefix + "topk_validated"] = str(bool(scores.topk.validated))
    for name in _SCORES:
        x = getattr(scores, name)
        if x is not None:
            tensors[prefix + name] = x
    if scores.head is not None:
        meta[prefix + "head"] = _head_name(scores.head, teacher)


def _unpack_scores(prefix: str, teacher, tensors: dict, meta: dict) -> TeacherScores:
    topk = None
    if prefix + "topk_ids" in tensors:
        topk = TeacherTopK(tensors[prefix + "topk_ids"], tensors[prefix + "topk_logprobs"],
                           validated=meta[prefix + "topk_validated"] == "True")
    head = None
    if prefix + "head" in meta:
        head = teacher.named()[meta[prefix + "head"]].head
    get = tensors.get
    return TeacherScores(topk, get(prefix + "sampled_logprobs"), get(prefix + "requested_logprobs"),
                         get(prefix + "hidden"), head, get(prefix + "requested_ids"))


def pack_step(data: StepData, local: dict, teacher=None) -> bytes:
    """``data`` (its scores waited for) and the local metrics (``Collector.rollouts``) as one safetensors blob."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {}
    for name in _ROWS:
        x = getattr(data, name)
        if x is not None:
            tensors["rows/" + name] = x
    for prefix, idx in (data.groups or {}).items():
        tensors["groups/" + prefix] = idx
    if data.groups:  # their order cuts the micro-batches: kept (safetensors sorts its names)
        meta["groups"] = json.dumps(list(data.groups))
    scores = data.teacher_scores()
    if isinstance(scores, GroupedScores):
        for i, (rows, part) in enumerate(scores.parts):
            tensors[f"parts/{i}/rows"] = rows
            _pack_scores(part, f"parts/{i}/", teacher, tensors, meta)
    elif scores is not None:
        meta["scores"] = "1"
        _pack_scores(scores, "scores/", teacher, tensors, meta)
    tensors["local/sums"] = torch.tensor(local["sums"], dtype=torch.float64)
    for k, v in local.items():
        if k != "sums":
            tensors["local/" + k] = torch.tensor(float(v), dtype=torch.float64)
    return save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata=meta)


def unpack_step(body: bytes, teacher=None) -> tuple[StepData, dict]:
    """The inverse of :func:`pack_step` (``teacher``: this rank's, whose heads the hidden states use)."""
    from safetensors.torch import load

    tensors = load(body)
    n = struct.unpack("<Q", body[:8])[0]  # the safetensors header: its length, then JSON with the metadata
    meta = json.loads(body[8:8 + n]).get("__metadata__") or {}
    data = StepData(**{name: tensors.get("rows/" + name) for name in _ROWS})
    data.groups = {k: tensors["groups/" + k] for k in json.loads(meta["groups"])} if "groups" in meta else None
    parts = sorted({int(k.split("/")[1]) for k in tensors if k.startswith("parts/")})
    if parts:
        data.scores = GroupedScores(tuple((tensors[f"parts/{i}/rows"], _unpack_scores(f"parts/{i}/", teacher,
                                                                                       tensors, meta))
                                          for i in parts))
    elif meta.get("scores") == "1":
        data.scores = _unpack_scores("scores/", teacher, tensors, meta)
    local = {k[len("local/"):]: float(v) for k, v in tensors.items() if k.startswith("local/") and k != "local/sums"}
    local["sums"] = tensors["local/sums"].tolist()
    return data, local


def share_step(ctx: DistContext, data: StepData | None, local: dict | None, teacher=None) -> tuple[StepData, dict]:
    """The tp leader's ``(data, local)`` on every rank of its tp group (the leader passes its own, the peers None);
    unchanged at tp_size 1. A collective over the tp group: every tp rank calls it at the same point."""
    if ctx.tp is None:
        return data, local
    body = pack_step(data, local, teacher) if ctx.tp_leader else None
    body = broadcast_bytes(body, ctx.tp.group)
    if ctx.tp_leader:
        return data, local
    return unpack_step(body, teacher)
