"""A vLLM engine in this process as the teacher (``teacher.engine: vllm``, ``serve-teacher --engine vllm``).

Scores are vLLM's prompt log-probs (``opdistill.teachers.prompt_logprobs``): the top-K entries by rank and the log-prob
of each row's own next token, at temperature 1 (the raw logits), on rows sent unpadded, so rows must be right-padded.
vLLM returns nothing at ids the caller names, so requested ids are refused, as is another temperature; K is capped
by the engine's ``max_logprobs``. Rows without a scored position are not sent.
"""
from __future__ import annotations

import torch

from opdistill.loss import TeacherScores
from opdistill.teachers.base import Rows, ScoreRequest, Teacher, TeacherError
from opdistill.teachers.prompt_logprobs import scores_from_prompt_logprobs

__all__ = ["VllmTeacher"]


class VllmTeacher(Teacher):
    """The teacher side of an :class:`~opdistill.engines.vllm.VllmEngine` (role ``teacher``). ``limits`` is what
    the engine cannot do, as a teacher server states it in ``/info``."""

    cannot = {"hidden": "vLLM's prompt log-probs do not carry", "requested": "which vLLM's prompt log-probs cannot "
              "answer", "mapped": "is scored through opdistill's own teachers"}

    engine_name = "vllm"

    def __init__(self, engine, *, key: str = "teacher.engine"):
        self.engine, self.key = engine, key

    @property
    def max_k(self) -> int:
        return self.engine.max_logprobs

    @property
    def limits(self) -> dict:
        return {"fixed_temperature": 1.0, "padding": "right", "max_model_len": self.engine.max_model_len,
                "max_requested_ids": 0, "max_k": self.max_k}

    def _refusal(self, rows: Rows, request: ScoreRequest) -> str | None:
        if request.temperature != 1.0:
            return (f"temperature {request.temperature:g}: vLLM's prompt log-probs are those of the raw logits, so it "
                    f"scores at temperature 1 only")
        if request.requested_ids is not None:
            return "requested ids: vLLM returns only its top-K and the actual next token, nothing at other ids"
        if request.hidden:
            return "hidden states (loss_mode full): vLLM's prompt log-probs carry no hidden states; use teacher.engine hf"
        if request.k is not None and request.k > self.max_k:
            return f"k={request.k} is above the engine's max_logprobs {self.max_k}"
        lengths = rows.attention_mask.sum(-1)
        prefix = torch.arange(rows.width)[None] < lengths[:, None]
        if not torch.equal(prefix, rows.attention_mask.bool()):
            return "vLLM scores each row unpadded, so rows must be right-padded (attention_mask 1 on a prefix)"
        return None

    def score(self, rows: Rows, request: ScoreRequest) -> TeacherScores:
        why = self._refusal(rows, request)
        if why is not None:
            raise TeacherError(f"{self.key} vllm cannot score {request.what or rows.describe()}: {why}")
        live = rows.scored().any(-1)
        lengths = rows.attention_mask.sum(-1).tolist()
        send = [b for b in range(rows.num_rows) if bool(live[b])]
        got = self.engine.prompt_logprobs([rows.input_ids[b, : int(lengths[b])].tolist() for b in send],
                                          request.k or 0) if send else []
        entries: list = [None] * rows.num_rows
        for b, e in zip(send, got):
            entries[b] = e

        def fail(b, t, found):
            return TeacherError(f"{self.key} vllm: got {found} of K={request.k} prompt log-probs at row {b} position "
                                f"{t}; raise the engine's max_logprobs")

        return scores_from_prompt_logprobs(rows, entries, k=request.k, sampled=request.sampled, fail=fail)

    def close(self) -> None:
        self.engine.close()
