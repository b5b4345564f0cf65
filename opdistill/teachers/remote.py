"""A client of ``opdistill serve-teacher`` (``teacher.url``, ``teacher.api: opdistill``): :class:`RemoteTeacher`.

It sends the padded rows as they are and reads the answer at the scored positions (``opdistill.teachers.wire``), so
with the fp32 (or JSON) payload it returns the in-process teacher's scores bit for bit. At start
(:meth:`RemoteTeacher.check_student`) the server's ``/info`` is checked against the student's tokenizer (the teacher
cache's fingerprint: vocabulary, special tokens, chat template) and lm_head width, and refused with a diff. Every
answer is checked by a teacher cache file's rules before it is read (``opdistill.teachers.answers``), and against
the ``/info`` accepted at start: its teacher identity and ``model`` (:class:`~opdistill.teachers.http.TeacherChanged`
otherwise), its hidden states' width and dtype; ``/info``, the lm_head and a served tokenizer's files are checked by
type, range and shape before use (:func:`info_problem`, :func:`head_problem`, :func:`tokenizer_files_problem`). What the
server's engine cannot answer (its limits in ``/info``) is refused before a request is sent
(:func:`~opdistill.teachers.wire.engine_refusal`). Rows above the server's per-request token limit go in several
requests.
"""
from __future__ import annotations

import json
import math

import numpy as np
import torch

from opdistill.loss import TeacherScores
from opdistill.teachers.answers import answer_problem
from opdistill.teachers.base import Rows, ScoreRequest
from opdistill.teachers.fingerprint import ANSWER_IDENTITY_FIELDS, TOKENIZER_FIELDS, tokenizer_fingerprint
from opdistill.teachers.http import HttpClient, HttpTeacher, TeacherChanged, TeacherServiceError
from opdistill.teachers.wire import (HIDDEN_DTYPES, LOGPROB_CODECS, MEDIA_BINARY, MEDIA_JSON, ScoreResult, count_field,
                                     decode_head, decode_result, engine_refusal, from_wire)

__all__ = ["RemoteTeacher", "TeacherServiceError"]


def _short(field: str, value):
    return value[:12] if field.endswith("_sha256") and isinstance(value, str) else value


# /info fields a client reads, by kind: a server stating "64" for max_k is refused, never compared as a string
_INFO_COUNTS = ("max_k", "max_requested_ids", "max_model_len", "max_request_tokens", "max_batch_tokens",
                "max_body_bytes", "teacher_vocab_size", "tokenizer_vocab_size", "vocab_size", "hidden_size",
                "requests", "batches")
_INFO_STRINGS = ("model", "engine", "padding", "teacher_dtype", "dtype", "teacher_weights_sha256",
                 "teacher_config_sha256", "tokenizer_sha256", "lm_head_sha256")
# the names a served tokenizer's files may have (what save_pretrained writes), and their sizes
TOKENIZER_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                             "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                             "chat_template.json", "generation_config.json", "config.json"})
MAX_TOKENIZER_FILE_CHARS = 256 << 20
MAX_TOKENIZER_CHARS = 512 << 20


def info_problem(info: dict) -> str | None:
    """The first field of a server's ``/info`` whose type or range is wrong (one phrase naming it), or None."""
    for f in _INFO_COUNTS:
        try:
            count_field(info, f)
        except ValueError as e:
            return str(e)
    for f in _INFO_STRINGS:
        v = info.get(f)
        if v is not None and not isinstance(v, str):
            return f"{f}: expected a string or null, got {v!r:.60}"
    t = info.get("fixed_temperature")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf")):
        return f"fixed_temperature: expected a finite number > 0 or null, got {t!r:.60}"
    if not isinstance(info.get("hidden", False), bool):
        return f"hidden: expected true or false, got {info.get('hidden')!r:.60}"
    fields = info.get("answer_identity")
    if fields is not None and not (isinstance(fields, list) and all(isinstance(f, str) for f in fields)):
        return f"answer_identity: expected a list of field names, got {fields!r:.60}"
    return None


def head_problem(head, info: dict) -> str | None:
    """The first way a served lm_head (an ``opdistill.fused.LMHead``) disagrees with the server's ``/info`` (dtype,
    shape) or cannot give logits (NaN or inf weights, a logit scale that is not a finite number > 0), or None."""
    w, b = head.weight, head.bias
    dtype, want = str(w.dtype).removeprefix("torch."), info.get("teacher_dtype")
    if want is not None and dtype != want:
        return f"its weight is {dtype}, the teacher's dtype (teacher_dtype) is {want}"
    V, H = info.get("teacher_vocab_size"), info.get("hidden_size")
    if w.ndim != 2 or (V is not None and w.shape[0] != V) or (H is not None and w.shape[1] != H):
        return f"its weight has shape {list(w.shape)}, expected [{V}, {H}] (teacher_vocab_size, hidden_size)"
    if b is not None and (tuple(b.shape) != (w.shape[0],) or b.dtype != w.dtype):
        return f"its bias is {str(b.dtype).removeprefix('torch.')} {list(b.shape)}, expected {dtype} [{w.shape[0]}]"
    for name, t in (("weight", w), ("bias", b)):
        if t is not None and not all(bool(torch.isfinite(t[i : i + 4096]).all()) for i in range(0, t.shape[0], 4096)):
            return f"its {name} holds NaN or inf"
    for name, v in (("logit_scale", head.logit_scale), ("softcap", head.softcap)):
        if v is not None and not (isinstance(v, float) and math.isfinite(v) and v > 0):
            return f"{name} is {v!r}, expected a finite number > 0"
    return None


def tokenizer_files_problem(files: dict, width: int | None) -> str | None:
    """The first way a served tokenizer's files (``{name: text}``) break the bounds (names among
    :data:`TOKENIZER_FILES`, sizes, JSON files JSON objects, ``tokenizer.json``'s shape, its ids below the teacher's
    output ``width``), as a phrase naming the file, or None."""
    total = 0
    for name, text in files.items():
        if name not in TOKENIZER_FILES:
            return f"a file named {name!r:.80}, not one of the tokenizer files {sorted(TOKENIZER_FILES)}"
        total += len(text)
        if len(text) > MAX_TOKENIZER_FILE_CHARS or total > MAX_TOKENIZER_CHARS:
            return (f"{name} of {len(text)} characters, above the bounds ({MAX_TOKENIZER_FILE_CHARS} a file, "
                    f"{MAX_TOKENIZER_CHARS} in all)")
    parsed = {}
    for name, text in files.items():
        if name.endswith(".json"):
            try:
                parsed[name] = json.loads(text)
            except (ValueError, RecursionError) as e:
                return f"{name} that is not JSON ({' '.join(str(e).split())[:100]})"
            if not isinstance(parsed[name], dict):
                return f"{name} that is not a JSON object"
    tj = parsed.get("tokenizer.json")
    if tj is None:
        return None
    model, added = tj.get("model"), tj.get("added_tokens", [])
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if not isinstance(model, dict) or not isinstance(vocab, (dict, list)) or not isinstance(added, list):
        return "tokenizer.json without the shape of one (an object 'model' with a 'vocab', a list 'added_tokens')"
    ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1] if vocab else []
    ids += [a.get("id") if isinstance(a, dict) else a for a in added]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return "tokenizer.json whose token ids are not all integers >= 0 (model.vocab, added_tokens)"
    if width is not None and ids and max(ids) >= width:
        return (f"tokenizer.json with token ids up to {max(ids)}, above the teacher's output width {width} "
                f"(teacher_vocab_size in its /info): ids above it cannot be scored")
    return None


class RemoteTeacher(HttpTeacher):
    """Our teacher server's client. ``payload``: json | fp32 | fp16 | int8 (docs/teacher_service.md); ``overlap``:
    :meth:`submit` sends the request from a background thread (the trainer goes on with the student's forward);
    the other keyword arguments are :class:`~opdistill.teachers.http.HttpClient`'s."""

    def __init__(self, url: str, *, payload: str = "fp32", overlap: bool = False, token_file: str | None = None,
                 timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 0.5, key: str = "teacher.url",
                 hidden_payload: str = "fp32"):
        if payload not in ("json",) + LOGPROB_CODECS:
            raise ValueError(f"payload: expected one of json/fp32/fp16/int8, got {payload!r}")
        if hidden_payload not in HIDDEN_DTYPES:
            raise ValueError(f"hidden_payload: expected one of {list(HIDDEN_DTYPES)}, got {hidden_payload!r}")
        self.payload, self.background, self.key, self.hidden_payload = payload, overlap, key, hidden_payload
        self._head = None
        accept = MEDIA_JSON if payload == "json" else f"{MEDIA_BINARY};logprobs={payload}"
        self.http = HttpClient(url, token_file=token_file, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
                               key=key, headers={"Accept": accept})
        self.url = self.http.url
        self.info: dict | None = None

    def fetch_info(self) -> dict:
        resp = self.http.request("GET", "/info", "server info")
        try:
            info = resp.json()
        except (ValueError, RecursionError):
            info = None
        if not isinstance(info, dict):
            raise TeacherServiceError(f"{self.http.where()}: GET /info answered something that is not a JSON object; "
                                      f"is this an opdistill serve-teacher server?")
        why = info_problem(info)
        if why:
            raise TeacherServiceError(f"{self.http.where()}: GET /info answered an invalid field: {why}")
        self.info = info
        return self.info

    @property
    def head(self):
        """The server teacher's output head (``GET /v1/lm_head``), fetched once: its SHA-256 checked against the
        payload's metadata and the server's ``/info``; a soft-capped head is refused (the hidden-state path does
        not implement soft-capping)."""
        if self._head is None:
            info = self.info or self.fetch_info()
            resp = self.http.request("GET", "/v1/lm_head", "the teacher's lm_head")
            try:
                head, digest = decode_head(resp.content)
            except (ValueError, KeyError) as e:
                raise TeacherServiceError(f"{self.http.where()}: GET /v1/lm_head answered no usable head ({e})") from None
            want = info.get("lm_head_sha256")
            if digest != want:
                raise TeacherServiceError(f"{self.http.where()}: the lm_head it sent (SHA-256 {digest[:12]}) is not the "
                                          f"one its /info names ({str(want)[:12]}): the server changed its teacher")
            why = head_problem(head, info)
            if why:
                raise TeacherServiceError(f"{self.http.where()}: GET /v1/lm_head answered a head that does not match "
                                          f"its /info: {why}; the answer is refused")
            if head.softcap is not None:
                raise TeacherServiceError(f"{self.http.where()}: the server's teacher soft-caps its logits (c * tanh(z / "
                                          f"c)), which the hidden-state payload does not implement; use loss_mode topk")
            self.head_sha256 = digest
            self._head = head
        return self._head

    def fetch_tokenizer(self):
        """The server teacher's tokenizer (``GET /v1/tokenizer``: its ``save_pretrained`` files), for a student with
        another tokenizer (``xtok.mode``, opdistill/teachers/xtok.py); never remote code."""
        import tempfile
        from pathlib import Path

        from transformers import AutoTokenizer

        resp = self.http.request("GET", "/v1/tokenizer", "the teacher's tokenizer")
        try:
            files = resp.json()
        except (ValueError, RecursionError):
            files = None
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()) or not files:
            raise TeacherServiceError(f"{self.http.where()}: GET /v1/tokenizer answered no tokenizer files; is this "
                                      f"an opdistill serve-teacher server of this version?")
        width = (self.info or self.fetch_info()).get("teacher_vocab_size")
        why = tokenizer_files_problem(files, width)
        if why:
            raise TeacherServiceError(f"{self.http.where()}: GET /v1/tokenizer answered {why}; the tokenizer is "
                                      f"refused")
        with tempfile.TemporaryDirectory() as d:
            for name, text in files.items():
                (Path(d) / name).write_text(text, encoding="utf-8")
            try:
                tok = AutoTokenizer.from_pretrained(d, trust_remote_code=False)
            except (OSError, ValueError) as e:
                raise TeacherServiceError(f"{self.http.where()}: GET /v1/tokenizer answered files no tokenizer loads "
                                          f"from ({e})") from None
        if width is not None and len(tok) > width:
            raise TeacherServiceError(f"{self.http.where()}: GET /v1/tokenizer answered a tokenizer of {len(tok)} "
                                      f"tokens, above the teacher's output width {width} (teacher_vocab_size in its "
                                      f"/info): ids above it cannot be scored; the tokenizer is refused")
        return tok

    def check_student(self, tokenizer, student=None, *, k: int | None = None, hidden: bool = False) -> dict:
        """Refuse (with a diff) a server whose tokenizer differs from the student's (the teacher cache's rules:
        vocabulary, special tokens and chat template fingerprint, size), whose vocabulary width differs from the
        student's lm_head, or whose largest K is below ``k``. Returns the server's /info."""
        info = self.info or self.fetch_info()
        current = tokenizer_fingerprint(tokenizer)
        diff = [f"{f}: student {_short(f, current[f])!r}, server {_short(f, info.get(f))!r}"
                for f in TOKENIZER_FIELDS if info.get(f) != current[f]]
        if student is not None:
            width = int(student.get_output_embeddings().weight.shape[0])
            if info.get("teacher_vocab_size") != width:
                diff.append(f"vocabulary width: student lm_head {width}, server teacher "
                            f"{info.get('teacher_vocab_size')!r}")
        if diff:
            raise TeacherServiceError(f"{self.http.where()}: the server's teacher cannot be distilled into this "
                                      f"student: {'; '.join(diff)} (the same rules as a teacher cache's provenance)")
        if k is not None and info.get("max_k") is not None and k > info["max_k"]:
            raise TeacherServiceError(f"{self.http.where()}: loss.topk={k} is above the server's max K {info['max_k']}; "
                                      f"lower loss.topk or start the server with a larger --max-k")
        if hidden:
            why = engine_refusal(info, k=None, temperature=1.0, num_requested=None,
                                 attention_mask=torch.ones(1, 1, dtype=torch.long), hidden=True)
            if why:
                raise TeacherServiceError(f"{self.http.where()}: loss_mode full cannot be served by this server: {why}")
        return info

    def score_positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor, *,
                        k: int | None, temperature: float = 1.0, requested_ids: torch.Tensor | None = None,
                        what: str = "", hidden: str | None = None) -> ScoreResult:
        """The raw answer at the scored positions (``requested_ids`` ``[P, J]``; ``hidden``: also the teacher's
        hidden states as fp32 or bf16; ``opdistill.teachers.wire``)."""
        body = {"input_ids": input_ids.tolist(), "attention_mask": attention_mask.tolist(),
                "response_mask": response_mask.tolist(), "k": k, "temperature": temperature}
        if hidden is not None:
            body["hidden"] = hidden
        if requested_ids is not None:
            body["requested_ids"] = requested_ids.tolist()
        B, S = input_ids.shape
        what = what or f"{B} rows x {S} positions"
        if self.info is not None:  # what the server's engine cannot answer: refused here, before sending
            why = engine_refusal(self.info, k=k, temperature=temperature, attention_mask=attention_mask,
                                 num_requested=None if requested_ids is None else int(requested_ids.shape[1]),
                                 hidden=hidden is not None)
            if why:
                raise TeacherServiceError(f"{self.http.where()}: POST /v1/score ({what}) cannot be served by this "
                                          f"server ({self.info.get('engine', 'hf')} engine): {why}")
        resp = self.http.request("POST", "/v1/score", what, content=json.dumps(body, separators=(",", ":")).encode(),
                                 headers={"Content-Type": MEDIA_JSON})
        try:
            r = decode_result(resp.content, resp.headers.get("content-type", MEDIA_JSON))
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
            raise TeacherServiceError(f"{self.http.where()}: POST /v1/score ({what}) answered a malformed payload "
                                      f"({' '.join(str(e).split())[:300]})") from None
        self._check_identity(r, what)
        P = int(Rows(input_ids, attention_mask, response_mask).scored().sum())
        if r.next_logprobs.shape != (P,) or (k and (r.topk_ids is None or r.topk_ids.shape[0] != P)):
            got = r.next_logprobs if r.topk_ids is None or r.next_logprobs.shape != (P,) else r.topk_ids
            raise TeacherServiceError(f"{self.http.where()}: POST /v1/score ({what}) answered scores for "
                                      f"{got.shape[0] if got.ndim else 0} positions, expected {P}")
        if k and r.topk_ids.shape[1] != k:
            raise TeacherServiceError(f"{self.http.where()}: POST /v1/score ({what}) answered K={r.topk_ids.shape[1]} "
                                      f"top-k ids per position (field topk_ids), asked K={k}")
        if r.temperature != float(temperature):
            raise TeacherServiceError(f"{self.http.where()}: POST /v1/score ({what}) scored at temperature "
                                      f"{r.temperature}, asked {temperature}")
        if hidden is not None and (r.hidden is None or r.hidden.shape[0] != P):
            raise TeacherServiceError(f"{self.http.where()}: POST /v1/score ({what}) answered no hidden states for "
                                      f"the {P} scored positions")
        if hidden is not None:  # the width and dtype /info and the request state, on every answer
            width = (self.info or {}).get("hidden_size")
            if width is not None and r.hidden.shape[1] != width:
                raise TeacherServiceError(f"{self.http.where()}: POST /v1/score ({what}) answered hidden states of "
                                          f"width {r.hidden.shape[1]} (field hidden), its /info states hidden_size "
                                          f"{width}")
            if self.payload != "json" and r.hidden_dtype != hidden:
                raise TeacherServiceError(f"{self.http.where()}: POST /v1/score ({what}) answered hidden states as "
                                          f"{r.hidden_dtype} (field hidden_dtype), asked {hidden}")
        if r.hidden is not None and not np.isfinite(r.hidden).all():
            p = int(np.argwhere(~np.isfinite(r.hidden))[0, 0])
            raise TeacherServiceError(f"{self.http.where()}: POST /v1/score ({what}) answered a non-finite hidden "
                                      f"state at scored position {p} (NaN or inf): the server's teacher diverged or "
                                      f"its weights are corrupt")
        self._check_answer(r, what, positions=P, k=k,
                           num_requested=None if requested_ids is None else int(requested_ids.shape[1]))
        return r

    def _check_identity(self, r: ScoreResult, what: str) -> None:
        """Refuse (:class:`~opdistill.teachers.http.TeacherChanged`) an answer whose teacher identity or ``model``
        differs from the server's ``/info`` this client accepted, or that lacks the identity that /info promised on
        every answer (``answer_identity``); an answer of an older server (no such promise, no identity) passes."""
        info = self.info
        if info is None:
            return
        promised = info.get("answer_identity") or []
        said = r.teacher
        if said is None:
            diff = ["its teacher identity: none, though its /info at start promised it on every answer"] \
                if promised else []
        else:
            fields = list(dict.fromkeys([*ANSWER_IDENTITY_FIELDS, *promised, *said]))
            diff = [f"{f}: accepted {_short(f, info.get(f))!r}, answered {_short(f, said.get(f))!r}"
                    for f in fields if (f in said or f in promised) and said.get(f) != info.get(f)]
        if r.model and isinstance(info.get("model"), str) and r.model != info["model"]:
            diff.append(f"model: accepted {info['model']!r:.80}, answered {r.model!r:.80}")
        if diff:
            reason = (f"POST /v1/score ({what}) was answered by another teacher than the one accepted at start "
                      f"({'; '.join(diff[:3])})")
            raise TeacherChanged(f"{self.http.where()}: {reason}; the answer is refused: serve the run's teacher "
                                 f"there again, or drop it from the config, then continue the run with --resume",
                                 reason=reason)

    def _check_answer(self, r: ScoreResult, what: str, **request) -> None:
        """Refuse an answer that breaks a teacher cache's rules (``opdistill.teachers.answers``), in one line."""
        vocab = (self.info or {}).get("teacher_vocab_size")
        why = answer_problem(r, vocab_size=vocab if isinstance(vocab, int) else None, **request)
        if why:
            raise TeacherServiceError(f"{self.http.where()}: POST /v1/score ({what}) answered invalid scores: {why}; "
                                      f"the server is broken or is not an opdistill teacher server (the rules of a "
                                      f"teacher cache file)")

    def score(self, rows: Rows, request: ScoreRequest) -> TeacherScores:
        """What :class:`~opdistill.teachers.local.LocalTeacher` returns (equal for the fp32 and JSON payloads)."""
        B, S = rows.num_rows, rows.width
        limit = (self.info or {}).get("max_request_tokens")
        if limit and B * S > limit and B > 1:  # above the server's per-request limit: rows in several requests
            step = max(1, limit // S)
            parts = [self.score(rows.select(idx), request.select(idx, f"{request.what or 'rows'} [rows {r0}:"
                                                                     f"{min(r0 + step, B)}]"))
                     for r0 in range(0, B, step) for idx in [torch.arange(r0, min(r0 + step, B))]]
            return TeacherScores.join(parts, torch.arange(B))
        keep = rows.scored()
        req = None if request.requested_ids is None else request.requested_ids[keep]
        head = self.head if request.hidden else None  # fetched once, before the first hidden-state request
        r = self.score_positions(rows.input_ids, rows.attention_mask, rows.response_mask, k=request.k,
                                 temperature=request.temperature, requested_ids=req,
                                 what=request.what or rows.describe(),
                                 hidden=self.hidden_payload if request.hidden else None)
        return from_wire(r, keep, k=request.k, sampled=request.sampled, head=head)
