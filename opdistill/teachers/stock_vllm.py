"""A stock ``vllm serve`` OpenAI endpoint as the teacher (``teacher.url`` with ``teacher.api: vllm``).

``POST /v1/completions`` with the rows' token ids as prompts, ``max_tokens: 1`` and ``prompt_logprobs: K``; the
answer's ``prompt_logprobs`` (per prompt position a ``{"<id>": {"logprob", "rank", "decoded_token"}}`` dict, position
0 null) is read like the in-process vLLM teacher's (``opdistill.teachers.prompt_logprobs``).

What this mode cannot do (docs/teacher_service.md): no check of the server's tokenizer against the student's (vLLM's
API does not expose a fingerprint; only the served model name is read from ``/v1/models``); no log-probs at ids the
client names; temperature is vLLM's business (its prompt log-probs are those of the raw model logits in recent
versions); K is capped by the server's ``--max-logprobs`` (20 by default); rows must be right-padded (attention 1 on
a prefix); the JSON answer is ~20x the size of our binary fp32 payload.
"""
from __future__ import annotations

import torch

from opdistill.loss import TeacherScores
from opdistill.teachers.answers import answer_problem
from opdistill.teachers.base import Rows, ScoreRequest
from opdistill.teachers.http import HttpClient, HttpTeacher, TeacherServiceError
from opdistill.teachers.prompt_logprobs import scores_from_prompt_logprobs
from opdistill.teachers.wire import ScoreResult

__all__ = ["StockVllmTeacher"]


class StockVllmTeacher(HttpTeacher):
    """A client of a stock ``vllm serve`` endpoint; ``model``: the served model name (default: the first of
    ``/v1/models``); ``overlap`` and the other keyword arguments as :class:`~opdistill.teachers.remote.RemoteTeacher`'s
    (the payload is always vLLM's JSON)."""

    cannot = {"hidden": "a stock vllm serve endpoint does not return", "requested": "which a stock vllm serve "
              "endpoint cannot answer", "mapped": "needs its top-k and sampled log-probs together"}

    def __init__(self, url: str, *, model: str | None = None, overlap: bool = False, token_file: str | None = None,
                 timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 0.5, key: str = "teacher.url"):
        self.http = HttpClient(url, token_file=token_file, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
                               key=key)
        self.url, self.key, self.model, self.background = self.http.url, key, model, overlap
        self.info: dict | None = None
        self.vocab_size: int | None = None  # the student's lm_head width (check_student): ids must lie below it

    def check_student(self, tokenizer, student=None, *, k: int | None = None) -> dict:
        """Only the served model is checked (vLLM's API has no tokenizer fingerprint): ``teacher.model`` must be
        among ``/v1/models`` (default: the first served)."""
        resp = self.http.request("GET", "/v1/models", "served models")
        try:
            ids = [m["id"] for m in resp.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise TeacherServiceError(f"{self.http.where()}: GET /v1/models answered no model list; is this a vllm "
                                      f"serve endpoint?") from None
        if self.model is None:
            if not ids:
                raise TeacherServiceError(f"{self.http.where()}: GET /v1/models lists no model")
            self.model = ids[0]
        elif self.model not in ids:
            raise TeacherServiceError(f"{self.http.where()}: teacher.model={self.model!r} is not served (served: "
                                      f"{ids})")
        self.info = {"model": self.model, "served": ids}
        if student is not None:
            self.vocab_size = int(student.get_output_embeddings().weight.shape[0])
        return self.info

    def score(self, rows: Rows, request: ScoreRequest) -> TeacherScores:
        if self.model is None:
            self.check_student(None)
        k, B, S = request.k, rows.num_rows, rows.width
        what = request.what or rows.describe()
        if request.requested_ids is not None or request.hidden:
            asked = "requested ids" if request.requested_ids is not None else "hidden states (loss_mode full)"
            raise TeacherServiceError(f"{self.http.where()}: a stock vllm serve endpoint cannot score {asked} "
                                      f"({what}): it returns only its top-K and the actual next token; use an "
                                      f"opdistill serve-teacher server (teacher.api=opdistill)")
        lengths = rows.attention_mask.sum(1)
        prefix = torch.arange(S)[None] < lengths[:, None]
        if not torch.equal(prefix, rows.attention_mask.bool()):
            raise TeacherServiceError(f"{self.http.where()}: POST /v1/completions ({what}): vLLM scores unpadded "
                                      f"prompts, so rows must be right-padded (attention_mask 1 on a prefix)")
        prompts = [rows.input_ids[b, : int(lengths[b])].tolist() for b in range(B)]
        body = {"model": self.model, "prompt": prompts, "max_tokens": 1, "prompt_logprobs": k or 0,
                "temperature": 1.0}
        try:
            resp = self.http.request("POST", "/v1/completions", what, json=body)
        except TeacherServiceError as e:  # vLLM's 400 names the limit, not the key: add the fix
            if k and "was refused: HTTP 400" in str(e) and "prompt logprobs" in str(e):
                raise TeacherServiceError(f"{e}; lower loss.topk to at most the server's --max-logprobs, or restart "
                                          f"vllm serve with --max-logprobs >= {k}") from None
            raise
        try:
            choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
            if len(choices) != B:
                raise ValueError(f"{len(choices)} choices for {B} prompts")
            entries = []
            for b, choice in enumerate(choices):
                pl = choice["prompt_logprobs"]
                if len(pl) != len(prompts[b]):
                    raise ValueError(f"prompt {b}: {len(pl)} prompt_logprobs for {len(prompts[b])} tokens")
                entries.append([None if d is None else {int(i): (v["logprob"], v.get("rank")) for i, v in d.items()}
                                for d in pl])

            def fail(b, t, found):
                return ValueError(f"prompt {b}, position {t + 1}: {found} entries of rank <= {k}")

            scores = scores_from_prompt_logprobs(rows, entries, k=k, sampled=request.sampled, fail=fail)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError, RecursionError) as e:
            raise TeacherServiceError(f"{self.http.where()}: POST /v1/completions ({what}) answered no usable "
                                      f"prompt_logprobs ({type(e).__name__}: {' '.join(str(e).split())[:300]}); is "
                                      f"this a vllm serve endpoint (teacher.api=vllm) with --max-logprobs >= "
                                      f"{k}?") from None
        self._check_answer(rows, scores, k, what)
        return scores

    def _check_answer(self, rows: Rows, scores: TeacherScores, k: int | None, what: str) -> None:
        """Refuse scores that break a teacher cache's rules at the scored positions (``opdistill.teachers.answers``):
        ids outside the vocabulary, NaN or positive log-probs, an id twice, a mass above 1."""
        keep = rows.scored()
        top = scores.topk
        sampled = scores.sampled_logprobs
        answer = ScoreResult(None if top is None else top.ids[keep].numpy(),
                             None if top is None else top.logprobs[keep].numpy(),
                             (sampled[keep] if sampled is not None else torch.zeros(int(keep.sum()))).numpy(), None,
                             1.0)
        why = answer_problem(answer, positions=int(keep.sum()), k=k, num_requested=None, vocab_size=self.vocab_size)
        if why:
            raise TeacherServiceError(f"{self.http.where()}: POST /v1/completions ({what}) answered invalid "
                                      f"prompt_logprobs: {why}; the server is broken or serves another model (the "
                                      f"rules of a teacher cache file)")
