"""The teacher server: an ASGI app (FastAPI) that scores rows with an in-process teacher, batching concurrent requests.

Design notes
- Engines (``--engine``): ``hf``, a transformers model (:class:`~opdistill.teachers.LocalTeacher`), or ``vllm``, a
  vLLM engine in this process (:class:`~opdistill.teachers.vllm.VllmTeacher`): the very Teacher classes the trainer
  scores with in process, so there is no second scorer. The vllm engine answers top-K and next-token log-probs at
  temperature 1 of right-padded rows only (prompt log-probs are raw logits, unpadded; vLLM returns its top-K and the
  actual token, nothing at other ids), K up to its ``max_logprobs`` (set to ``--max-k``) and rows up to its
  ``max_model_len``. ``/info`` states each engine's limits (``engine``, ``max_k``, ``max_requested_ids``,
  ``fixed_temperature``, ``padding``, ``max_model_len``: the teacher's ``limits``);
  :func:`opdistill.teachers.wire.engine_refusal` turns them into one-line refusals, here (422) and in the client
  (before it sends). Its ``/info`` fingerprint is the hf server's: hashed from the folder's safetensors tensor by
  tensor (:func:`opdistill.teachers.fingerprint.teacher_fingerprint_from_folder`), no HF model held next to the
  engine.
- ``GET /health`` (no token needed): ``{"status": "ok"}``. ``GET /info``: the model id, the teacher fingerprint and
  the tokenizer fingerprint (the same fields as a teacher cache's provenance, ``opdistill.teachers.fingerprint``),
  vocabulary width, max K, dtype, the limits and the payloads. ``POST /v1/score``: a JSON body ``{"input_ids":
  [B][S], "attention_mask": [B][S], "response_mask": [B][S], "k": K or null, "temperature": 1.0, "requested_ids":
  [P][J] (optional), "hidden": "fp32" | "bf16" | null}``; the answer (JSON or binary by the Accept header,
  ``opdistill.teachers.wire``) holds, at each scored position (``response_mask[b, t + 1] == 1``, row-major), the top-K
  ids and log-probs, the next token's log-prob and the log-probs at the requested ids, at the request's temperature
  (echoed), and with ``hidden`` the teacher's final hidden states (H numbers per position: the hidden-state payload of
  loss_mode full). Every answer carries the teacher's identity (``teacher``: the ``answer_identity`` fields of
  ``/info``) and ``model``, which the client checks on every answer. ``GET /v1/lm_head``: the teacher's output head
  (safetensors, with its logit scale, soft-cap and SHA-256, also in ``/info`` as ``lm_head_sha256``), which turns
  those hidden states into the teacher's logits.
- Exactness: the teacher scores the very tensors the client sent through ``Teacher.score``, so a request scored
  alone gets the in-process teacher's numbers bit for bit, requested ids and temperature included (one pass).
- Batching: requests wait on an asyncio queue; a worker takes the first and merges the waiting ones with the same
  K, temperature and requested-id width while the merged rows stay within ``max_batch_tokens`` (rows x padded
  length), pads them on the right to one length (attention 0, response 0), runs the forward in one worker thread
  and splits the answer back. A merged request's numbers equal the alone ones up to float rounding of the batched
  matmuls (tested to 1e-5).
- Safety: binds 127.0.0.1 by default and refuses to start on any other address without a bearer token; the token is
  compared in constant time; bodies above ``max_body_bytes`` and requests above ``max_request_tokens`` get 413; a
  malformed request gets 400/422 with a one-line message and the server keeps serving (every value of every row is
  checked: :func:`parse_request`); the body is parsed as JSON only (nothing is unpickled; weights load from
  safetensors only); ``trust_remote_code`` only when asked.
- Deadlines and bounds on the input (:func:`read_json_body`, :func:`header_deadline_protocol`): a connection's first
  request head must arrive within ``--header-timeout-s`` (the connection is closed otherwise) and be at most
  :data:`MAX_HEADER_BYTES`; the body must arrive within ``--body-timeout-s`` of the head (408); a body nested too deep
  for the JSON parser gets 400. The answer is checked by the rules the client applies (:func:`result_refusal`,
  ``opdistill.teachers.answers``) before it is sent: an answer the client would refuse is never sent (422 when the
  request's temperature made it so).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from opdistill.engines.vllm import INSTALL_HINT, vllm_available
from opdistill.errors import UserError
from opdistill.models import resolve_model_path
from opdistill.teachers import LocalTeacher, Rows, ScoreRequest, Teacher
from opdistill.teachers.build import server_teacher
from opdistill.teachers.answers import answer_problem
from opdistill.teachers.http import read_token_file
from opdistill.teachers.fingerprint import (ANSWER_IDENTITY_FIELDS, teacher_fingerprint,
                                            teacher_fingerprint_from_folder, tokenizer_fingerprint)
from opdistill.teachers.wire import (HIDDEN_DTYPES, MEDIA_BINARY, MEDIA_JSON, ScoreResult, encode_head, encode_result,
                                     engine_refusal, head_sha256, parse_accept, to_wire)

__all__ = ["TeacherService", "ServeError", "create_app", "score_rows", "LOOPBACK_HOSTS", "check_bind", "ENGINES"]

ENGINES = ("hf", "vllm")
VLLM_DTYPES = ("float32", "bfloat16", "float16")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
FLOAT32_MAX = 3.4028234663852886e38


class ServeError(UserError, ValueError):
    """The server cannot start as asked (an open bind without a token, an unreadable token file, a bad limit)."""

    kind = "serve error"


def check_bind(host: str, token: str | None) -> None:
    if host not in LOOPBACK_HOSTS and not token:
        raise ServeError(f"--host {host}: binding to a non-loopback address needs a bearer token; pass --token-file "
                         f"FILE (clients send it as 'Authorization: Bearer ...'), or bind 127.0.0.1")


class BadRequest(Exception):
    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status


def score_rows(teacher: Teacher, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor, *,
               k: int | None, temperature: float = 1.0, requested_ids: torch.Tensor | None = None,
               hidden: str | None = None) -> ScoreResult:
    """The answer at the scored positions (``response_mask[b, t + 1] == 1``, row-major): ``teacher`` (a
    :class:`~opdistill.teachers.LocalTeacher` or :class:`~opdistill.teachers.vllm.VllmTeacher`) scores the rows
    exactly as the trainer's in-process teacher does; ``requested_ids`` ``[P, J]`` (one row per scored position);
    ``hidden``: also the teacher's final hidden states, travelling as fp32 or bf16."""
    rows = Rows(input_ids, attention_mask, response_mask)
    keep = rows.scored()
    req = None
    if requested_ids is not None:
        req = torch.zeros(*keep.shape, requested_ids.shape[1], dtype=torch.long)
        req[keep] = requested_ids
    scores = teacher.score(rows, ScoreRequest(k=k, sampled=True, requested_ids=req, temperature=temperature,
                                              hidden=hidden is not None))
    return to_wire(scores, keep, temperature, hidden or "fp32")


@dataclass
class _Job:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    k: int | None
    temperature: float
    requested_ids: torch.Tensor | None
    future: asyncio.Future = field(repr=False)
    hidden: str | None = None  # the hidden-state payload's dtype (fp32 | bf16), or None

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())

    def group(self):
        return (self.k, self.temperature, None if self.requested_ids is None else self.requested_ids.shape[1],
                self.hidden)


class TeacherService:
    """A loaded teacher (a :class:`~opdistill.teachers.LocalTeacher`: engine hf; or a
    :class:`~opdistill.teachers.vllm.VllmTeacher`: engine vllm) and what ``/info`` says about it: the teacher cache's
    provenance fields, the engine and its limits (what :func:`~opdistill.teachers.wire.engine_refusal` checks).
    ``fingerprint``: the teacher's (:func:`~opdistill.teachers.fingerprint.teacher_fingerprint`), required when the
    teacher holds no HF model (a vLLM engine)."""

    def __init__(self, teacher: Teacher, tokenizer, *, model_id: str, max_k: int = 64, max_requested_ids: int = 256,
                 fingerprint: dict | None = None):
        self.teacher = teacher
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.engine = teacher.engine_name
        if fingerprint is None:
            if not isinstance(teacher, LocalTeacher):
                raise ValueError(f"TeacherService: a {self.engine} engine needs the teacher's fingerprint "
                                 f"(fingerprint=...)")
            fingerprint = teacher_fingerprint(teacher.model)
        self.vocab_size = int(fingerprint["teacher_vocab_size"])
        limits = teacher.limits
        self.max_k = min(max_k, self.vocab_size, limits.get("max_k") or max_k)
        if limits["max_requested_ids"] is not None:
            max_requested_ids = min(max_requested_ids, limits["max_requested_ids"])
        self.max_requested_ids = max_requested_ids
        # the hidden-state payload (loss_mode full): an engine that holds the model's head says so; every engine
        # answers the same /info fields (hidden: false, nulls, where it cannot send hidden states)
        self.head = teacher.head
        head_info = ({"hidden": False, "hidden_size": None, "lm_head_sha256": None} if self.head is None else
                     {"hidden": True, "hidden_size": int(self.head.weight.shape[1]),
                      "lm_head_sha256": head_sha256(self.head.weight, self.head.bias)})
        self.info = {"model": model_id, **fingerprint, **tokenizer_fingerprint(tokenizer), "engine": self.engine,
                     **head_info, "vocab_size": self.vocab_size, "max_k": self.max_k,
                     "max_requested_ids": max_requested_ids,
                     "fixed_temperature": limits["fixed_temperature"], "padding": limits["padding"],
                     "max_model_len": limits["max_model_len"], "dtype": fingerprint["teacher_dtype"],
                     "answer_identity": list(ANSWER_IDENTITY_FIELDS)}
        # every answer carries these (ScoreResult.teacher): a client checks each against the /info it accepted
        self.identity = {f: self.info[f] for f in ANSWER_IDENTITY_FIELDS}


def _int_matrix(body: dict, name: str, shape=None) -> torch.Tensor:
    """``body[name]`` as a ``[rows, width]`` int64 tensor, every value of every row checked (``torch.tensor`` would
    truncate 2.7 to 2 and read true as 1)."""
    x = body.get(name)
    if not isinstance(x, list) or not x or not all(isinstance(r, list) for r in x):
        raise BadRequest(400, f"{name}: expected a non-empty list of lists of integers")
    width = len(x[0])
    if any(len(r) != width for r in x):
        raise BadRequest(400, f"{name}: rows of different lengths (pad the rows to one length, attention_mask 0 "
                              f"on the padding)")
    if width == 0:
        raise BadRequest(400, f"{name}: rows are empty")
    bad = _first_non_int(x)
    if bad is not None:
        (b, t), v = bad
        raise BadRequest(400, f"{name}: expected integers only, got {_short_json(v)} at row {b}, position {t}")
    t = torch.tensor(x, dtype=torch.long)
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise BadRequest(400, f"{name}: shape {list(t.shape)}, expected {list(shape)}")
    return t


_INT64 = (-2 ** 63, 2 ** 63)


def _first_non_int(rows: list):
    """((row, position), value) of the first value of ``rows`` that is not an int64 integer (bools, floats, strings,
    lists, integers beyond int64 are not), or None."""
    lo, hi = _INT64
    for b, row in enumerate(rows):
        for t, v in enumerate(row):
            if type(v) is not int or not lo <= v < hi:
                return (b, t), v
    return None


def _short_json(v) -> str:
    text = json.dumps(v) if not isinstance(v, (list, dict)) else type(v).__name__
    return text if len(text) <= 40 else text[:40] + "..."


def parse_request(body: dict, svc: TeacherService, max_request_tokens: int) -> dict:
    if not isinstance(body, dict):
        raise BadRequest(400, "the body must be a JSON object")
    unknown = sorted(set(body) - {"input_ids", "attention_mask", "response_mask", "k", "temperature",
                                  "requested_ids", "hidden"})
    if unknown:
        raise BadRequest(400, f"unknown fields {unknown}")
    ids = _int_matrix(body, "input_ids")
    if ids.numel() > max_request_tokens:
        raise BadRequest(413, f"input_ids: {ids.shape[0]} rows x {ids.shape[1]} positions = {ids.numel()} tokens, "
                              f"above this server's limit of {max_request_tokens} per request; send fewer rows")
    am = _int_matrix(body, "attention_mask", ids.shape)
    rm = _int_matrix(body, "response_mask", ids.shape)
    V = svc.vocab_size
    if bool(((ids < 0) | (ids >= V)).any()):
        raise BadRequest(422, f"input_ids: ids must lie in [0, {V}) (the teacher's vocabulary)")
    for name, m in (("attention_mask", am), ("response_mask", rm)):
        if bool(((m != 0) & (m != 1)).any()):
            raise BadRequest(422, f"{name}: expected only 0 and 1")
    if bool(((rm == 1) & (am == 0)).any()):
        raise BadRequest(422, "response_mask: a response token must be attended (attention_mask 1 there)")
    k = body.get("k")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= svc.max_k):
        raise BadRequest(422, f"k: expected an integer in [1, {svc.max_k}] or null, got {k!r}")
    temperature = body.get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(
            float(temperature) if -FLOAT32_MAX <= temperature <= FLOAT32_MAX else math.inf) or temperature <= 0:
        raise BadRequest(422, f"temperature: expected a finite number > 0, got {_short_json(temperature)}")
    if not FLOAT32_TINY <= temperature <= FLOAT32_MAX:  # the logits are divided in float32: 1e-300 is 0 there
        raise BadRequest(422, f"temperature: expected a number in [{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}] (a float32 "
                              f"the logits can be divided by), got {temperature!r}")
    P = int(Rows(ids, am, rm).scored().sum())
    req = None
    if body.get("requested_ids") is not None:
        if P == 0:
            raise BadRequest(422, "requested_ids: the request has no scored positions")
        req = _int_matrix(body, "requested_ids")
        if req.shape[0] != P:
            raise BadRequest(422, f"requested_ids: {req.shape[0]} rows, expected one per scored position ({P}: "
                                  f"positions t with response_mask[b, t + 1] == 1, row-major)")
        if bool(((req < 0) | (req >= V)).any()):
            raise BadRequest(422, f"requested_ids: ids must lie in [0, {V})")
    hidden = body.get("hidden")
    if hidden is not None and hidden not in HIDDEN_DTYPES:
        raise BadRequest(422, f"hidden: expected one of {list(HIDDEN_DTYPES)} or null, got {hidden!r}")
    why = engine_refusal(svc.info, k=k, temperature=float(temperature), attention_mask=am, hidden=hidden is not None,
                         num_requested=None if req is None else int(req.shape[1]))
    if why:  # what this engine cannot answer (its limits in /info; the client checks the same before sending)
        raise BadRequest(422, why)
    return dict(input_ids=ids, attention_mask=am, response_mask=rm, k=k, temperature=float(temperature),
                requested_ids=req, hidden=hidden)


def _pad(t: torch.Tensor, S: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, S - t.shape[1])) if t.shape[1] < S else t


def run_jobs(svc: TeacherService, jobs: list[_Job]) -> list[ScoreResult]:
    """Score merged jobs in one forward (right-padded to one length) and split the answer back per job."""
    if len(jobs) == 1:
        j = jobs[0]
        return [score_rows(svc.teacher, j.input_ids, j.attention_mask, j.response_mask, k=j.k,
                           temperature=j.temperature, requested_ids=j.requested_ids, hidden=j.hidden)]
    S = max(j.input_ids.shape[1] for j in jobs)
    cat = lambda name: torch.cat([_pad(getattr(j, name), S) for j in jobs])  # noqa: E731
    req = torch.cat([j.requested_ids for j in jobs]) if jobs[0].requested_ids is not None else None
    r = score_rows(svc.teacher, cat("input_ids"), cat("attention_mask"), cat("response_mask"), k=jobs[0].k,
                   temperature=jobs[0].temperature, requested_ids=req, hidden=jobs[0].hidden)
    out, p0 = [], 0
    for j in jobs:
        p1 = p0 + int(Rows(j.input_ids, j.attention_mask, j.response_mask).scored().sum())
        sl = slice(p0, p1)
        out.append(ScoreResult(None if r.topk_ids is None else r.topk_ids[sl],
                               None if r.topk_logprobs is None else r.topk_logprobs[sl], r.next_logprobs[sl],
                               None if r.requested_logprobs is None else r.requested_logprobs[sl], r.temperature,
                               hidden=None if r.hidden is None else r.hidden[sl], hidden_dtype=r.hidden_dtype))
        p0 = p1
    return out


async def read_json_body(request: Request, *, max_body_bytes: int, timeout_s: float):
    """The request's body parsed as JSON: at most ``max_body_bytes`` (413), all of it within ``timeout_s`` of the
    headers (408: a client that trickles its body holds no worker for longer), and nesting no deeper than Python's
    parser takes (400, not a 500 from a RecursionError)."""
    try:
        declared = int(request.headers.get("content-length", "0") or 0)
    except ValueError:
        raise BadRequest(400, "Content-Length: not an integer") from None
    if declared > max_body_bytes:
        raise BadRequest(413, f"body of {declared} bytes is above this server's limit of {max_body_bytes}; send "
                              f"fewer rows")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise BadRequest(413, f"body above this server's limit of {max_body_bytes} bytes; send fewer rows")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        raw = await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise BadRequest(408, f"the body did not arrive within {timeout_s:g} s of the headers (this server's "
                              f"--body-timeout-s); send it whole, or send fewer rows") from None
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicate_fields)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(400, f"the body is not valid JSON ({e})") from None
    except RecursionError:
        raise BadRequest(400, "the body is not valid JSON here (nested too deeply); a request is a flat object of "
                              "lists of lists") from None


def _no_duplicate_fields(pairs: list) -> dict:
    """A JSON object that names a field twice is refused (json keeps the last one without a word)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the field {_short_json(k)} appears twice")
        out[k] = v
    return out


def result_refusal(result: ScoreResult, parsed: dict, vocab_size: int) -> tuple[int, str] | None:
    """(status, detail) when the scores break the rules the client checks (``opdistill.teachers.answers``: the
    rules of a teacher cache file), else None: 422 when the request's temperature made them so (1e-30 turns the
    logits into inf), 500 otherwise (a broken teacher)."""
    rows = Rows(parsed["input_ids"], parsed["attention_mask"], parsed["response_mask"])
    req = parsed["requested_ids"]
    why = answer_problem(result, positions=int(rows.scored().sum()), k=parsed["k"], vocab_size=vocab_size,
                         num_requested=None if req is None else int(req.shape[1]))
    hidden = getattr(result, "hidden", None)
    if why is None and hidden is not None and not np.isfinite(hidden).all():  # the client refuses them too
        why = f"hidden holds NaN or inf at scored position {int(np.argwhere(~np.isfinite(hidden))[0, 0])}"
    if why is None:
        return None
    if parsed["temperature"] != 1.0:
        return 422, (f"temperature: the teacher's scores at temperature {parsed['temperature']!r} are not valid "
                     f"({why}); ask for a temperature its logits can be divided by")
    return 500, f"scoring produced invalid scores ({why}); the teacher is broken"


def tokenizer_payload(tokenizer) -> dict:
    """``{file name: text}`` of a tokenizer's ``save_pretrained`` files (JSON and templates; no pickle)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tokenizer.save_pretrained(d)
        return {p.name: p.read_text(encoding="utf-8") for p in sorted(Path(d).iterdir())
                if p.is_file() and p.suffix in (".json", ".jinja", ".txt")}


def create_app(svc: TeacherService, *, token: str | None = None, max_batch_tokens: int = 65536,
               max_request_tokens: int = 262144, max_body_bytes: int = 64 * 2 ** 20, body_timeout_s: float = 60.0):
    """The FastAPI app serving ``svc`` (see the module notes)."""
    state: dict = {"requests": 0, "batches": 0}
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opdistill-teacher")

    async def worker(queue: asyncio.Queue):
        loop = asyncio.get_running_loop()
        pending: list[_Job] = []
        while True:
            first = pending.pop(0) if pending else await queue.get()
            jobs = [first]
            while not queue.empty():
                pending.append(queue.get_nowait())
            rest = []
            for j in pending:
                S = max(max(x.input_ids.shape[1] for x in jobs), j.input_ids.shape[1])
                rows = sum(x.input_ids.shape[0] for x in jobs) + j.input_ids.shape[0]
                if j.group() == first.group() and rows * S <= max_batch_tokens:
                    jobs.append(j)
                else:
                    rest.append(j)
            pending = rest
            jobs = [j for j in jobs if not j.future.cancelled()]
            if not jobs:
                continue
            try:
                results = await loop.run_in_executor(executor, run_jobs, svc, jobs)
                state["batches"] += 1
                for j, r in zip(jobs, results):
                    if not j.future.done():
                        j.future.set_result(r)
            except Exception as e:  # noqa: BLE001 -- a failed forward answers its requests with 500, keeps serving
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(e)

    @asynccontextmanager
    async def lifespan(app):
        queue: asyncio.Queue = asyncio.Queue()
        app.state.queue = queue
        task = asyncio.create_task(worker(queue))
        try:
            yield
        finally:
            task.cancel()
            executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="opdistill teacher", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def unauthorized(request: Request):
        if token is None:
            return None
        got = request.headers.get("authorization", "")
        scheme, _, value = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
            return JSONResponse({"detail": "missing or wrong bearer token (Authorization: Bearer ...)"},
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return None

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/info")
    async def info(request: Request):
        if (r := unauthorized(request)) is not None:
            return r
        return {**svc.info, "max_batch_tokens": max_batch_tokens, "max_request_tokens": max_request_tokens,
                "max_body_bytes": max_body_bytes, "payloads": [MEDIA_JSON, MEDIA_BINARY + ";logprobs=fp32|fp16|int8"],
                "requests": state["requests"], "batches": state["batches"]}

    @app.get("/v1/lm_head")
    async def lm_head(request: Request):
        """The teacher's output head (safetensors: weight, bias; logit scale, soft-cap and SHA-256 in the metadata),
        which turns the hidden-state payload into the teacher's logits: a trainer fetches it once."""
        if (r := unauthorized(request)) is not None:
            return r
        if svc.head is None:
            return JSONResponse({"detail": f"the {svc.engine} engine holds no lm_head to send (the hidden-state "
                                           f"payload needs --engine hf)"}, status_code=404)
        return Response(encode_head(svc.head, svc.model_id), media_type="application/octet-stream")

    @app.get("/v1/tokenizer")
    async def tokenizer_files(request: Request):
        """The teacher's tokenizer as its files (``{file name: text}``, what ``save_pretrained`` writes): a trainer
        whose student has another tokenizer (``xtok.mode``, SPEC 6.6) tokenizes each response the teacher's way
        with it and maps the answer onto its student's tokens."""
        if (r := unauthorized(request)) is not None:
            return r
        return tokenizer_payload(svc.tokenizer)

    @app.post("/v1/score")
    async def score(request: Request):
        if (r := unauthorized(request)) is not None:
            return r
        try:
            media, codec = parse_accept(request.headers.get("accept"))
        except ValueError as e:
            return JSONResponse({"detail": str(e)}, status_code=406)
        try:
            body = await read_json_body(request, max_body_bytes=max_body_bytes, timeout_s=body_timeout_s)
        except BadRequest as e:
            return JSONResponse({"detail": str(e)}, status_code=e.status)
        try:
            parsed = parse_request(body, svc, max_request_tokens)
        except BadRequest as e:
            return JSONResponse({"detail": str(e)}, status_code=e.status)
        fut = asyncio.get_running_loop().create_future()
        state["requests"] += 1
        await request.app.state.queue.put(_Job(**parsed, future=fut))
        try:
            result = await fut
        except Exception as e:  # noqa: BLE001
            return JSONResponse({"detail": f"scoring failed: {type(e).__name__}: {' '.join(str(e).split())}"},
                                status_code=500)
        result.model, result.teacher = svc.model_id, svc.identity
        refused = result_refusal(result, parsed, svc.vocab_size)
        if refused is not None:  # never send what the client would refuse (a NaN is not even JSON)
            return JSONResponse({"detail": refused[1]}, status_code=refused[0])
        payload = encode_result(result, media=media, codec=codec, vocab_size=svc.vocab_size)
        return Response(payload, media_type=media if media == MEDIA_JSON else f"{MEDIA_BINARY};logprobs={codec}")

    return app


MAX_HEADER_BYTES = 16 * 1024  # the request line and headers together (h11's bound; a larger head gets 400)


def header_deadline_protocol(timeout_s: float):
    """uvicorn's h11 protocol with a deadline on a connection's first request head: a client that has not sent its
    whole request line and headers within ``timeout_s`` of connecting is disconnected (uvicorn bounds the wait for
    later requests on a kept-alive connection itself, with ``timeout_keep_alive``, but not this one: slowly
    trickled headers would hold a connection open forever)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineH11(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(timeout_s, self._head_too_slow)

        def handle_events(self):
            super().handle_events()
            if self.cycle is not None:  # a whole request head arrived
                self._cancel_head_timer()

        def connection_lost(self, exc):
            self._cancel_head_timer()
            super().connection_lost(exc)

        def _cancel_head_timer(self):
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
                self._head_timer = None

        def _head_too_slow(self):
            self._head_timer = None
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineH11


def default_threads(host: str) -> int:
    """Torch threads of a server not told (``--threads``): bound to this machine only (a loopback host), half its
    cores, since the trainer that asks it runs here too (both at every core: each step about twice as slow, measured
    in issue 35); bound to the network, every core (a machine of its own)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // 2) if host in LOOPBACK_HOSTS else cores


def serve(model: str, *, engine: str = "hf", host: str = "127.0.0.1", port: int = 8000, token_file: str | None = None,
          max_batch_tokens: int = 65536, max_request_tokens: int = 262144, max_k: int = 64, dtype: str = "float32",
          trust_remote_code: bool = False, threads: int | None = None, max_model_len: int | None = None,
          gpu_memory_utilization: float = 0.9, log_level: str = "warning", header_timeout_s: float = 10.0,
          body_timeout_s: float = 60.0) -> None:
    """Load the teacher (``engine`` hf: a transformers model; vllm: a vLLM engine in this process) and serve it until
    interrupted (``opdistill serve-teacher``). Call it under ``if __name__ == "__main__":`` (vLLM may spawn)."""
    import uvicorn

    from opdistill.models import load_model, load_tokenizer

    token = None
    if token_file is not None:
        try:
            token = read_token_file(token_file)
        except ValueError as e:
            raise ServeError(f"--token-file {token_file}: {e}") from None
    check_bind(host, token)
    for name, v in (("--max-batch-tokens", max_batch_tokens), ("--max-request-tokens", max_request_tokens),
                    ("--max-k", max_k)):
        if v < 1:
            raise ServeError(f"{name}: expected an integer >= 1, got {v}")
    for name, v in (("--header-timeout-s", header_timeout_s), ("--body-timeout-s", body_timeout_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ServeError(f"{name}: expected a finite number of seconds > 0, got {v}")
    check_engine(engine, dtype=dtype, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization)
    torch.set_num_threads(threads or default_threads(host))
    try:
        path = resolve_model_path(model)
    except (ValueError, FileNotFoundError) as e:  # an unknown builtin, a missing packaged model
        raise ServeError(f"--model: {str(e).removeprefix('model: ')}") from None
    check_port(host, port)  # before the model loads: a port in use was a uvicorn error after it
    tok = load_tokenizer(path, trust_remote_code=trust_remote_code, key="--model")
    if engine == "vllm":
        fingerprint = teacher_fingerprint_from_folder(path, dtype=dtype, trust_remote_code=trust_remote_code)
        if fingerprint is None:  # a folder the streaming hash cannot reproduce: load the model once, then free it
            fingerprint = teacher_fingerprint(load_model(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                         key="--model"))
        most = min(max_k, fingerprint["teacher_vocab_size"])
    else:
        fingerprint, most = None, max_k
    teacher = server_teacher(path, engine=engine, dtype=dtype, trust_remote_code=trust_remote_code,
                             max_logprobs=most, max_model_len=max_model_len,
                             gpu_memory_utilization=gpu_memory_utilization)
    try:
        svc = TeacherService(teacher, tok, model_id=model, max_k=max_k, fingerprint=fingerprint)
        app = create_app(svc, token=token, max_batch_tokens=max_batch_tokens, max_request_tokens=max_request_tokens,
                         body_timeout_s=body_timeout_s)
        print(f"opdistill serve-teacher: {model} ({engine} engine) on http://{host}:{port} (vocab {svc.vocab_size}, "
              f"max K {svc.max_k}, {'token required' if token else 'no token'})", flush=True)
        uvicorn.run(app, host=host, port=port, log_level=log_level, http=header_deadline_protocol(header_timeout_s),
                    h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    finally:
        teacher.close()


def check_port(host: str, port: int) -> None:
    """Refuse a port outside [1, 65535] or one this host cannot bind now (in use, privileged), before anything loads
    (a free port can still be taken before uvicorn binds it: then uvicorn's own error stops the server)."""
    import socket

    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ServeError(f"--port: expected a port number in [1, 65535], got {port!r}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ServeError(f"--host {host}: not an address this machine can bind ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(addr)
        except OSError as e:
            raise ServeError(f"--port {port}: cannot bind {host}:{port} ({e.strerror}); choose another --port, or stop "
                             f"what holds it") from None


def check_engine(engine: str, *, dtype: str, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.9) -> None:
    """Refuse what ``--engine`` cannot run before anything is loaded (one line naming the flag and the fix)."""
    if engine not in ENGINES:
        raise ServeError(f"--engine {engine}: expected one of {list(ENGINES)}")
    if engine == "hf":
        for name, v in (("--max-model-len", max_model_len),):
            if v is not None:
                raise ServeError(f"{name}: only the vllm engine takes it; drop it or pass --engine vllm")
        return
    if not vllm_available():
        raise ServeError(f"--engine vllm: the vllm package is not installed; {INSTALL_HINT}")
    if dtype not in VLLM_DTYPES:
        raise ServeError(f"--dtype {dtype}: the vllm engine runs {', '.join(VLLM_DTYPES)}; pass one of those or "
                         f"--engine hf")
    if max_model_len is not None and max_model_len < 2:
        raise ServeError(f"--max-model-len: expected an integer >= 2, got {max_model_len}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ServeError(f"--gpu-memory-utilization: expected a number in (0, 1], got {gpu_memory_utilization}")
