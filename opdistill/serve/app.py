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
  loss_mode full). ``GET /v1/lm_head``: the teacher's output head (safetensors, with its logit scale, soft-cap and
  SHA-256, also in ``/info`` as ``lm_head_sha256``), which turns those hidden states into the teacher's logits.
- Exactness: the teacher scores the very tensors the client sent through ``Teacher.score``, so a request scored
  alone gets the in-process teacher's numbers bit for bit, requested ids and temperature included (one pass).
- Batching: requests wait on an asyncio queue; a worker takes the first and merges the waiting ones with the same
  K, temperature and requested-id width while the merged rows stay within ``max_batch_tokens`` (rows x padded
  length), pads them on the right to one length (attention 0, response 0), runs the forward in one worker thread
  and splits the answer back. A merged request's numbers equal the alone ones up to float rounding of the batched
  matmuls (tested to 1e-5).
- Safety: binds 127.0.0.1 by default and refuses to start on any other address without a bearer token; the token is
  compared in constant time; bodies above ``max_body_bytes`` and requests above ``max_request_tokens`` get 413; a
  malformed request gets 400/422 with a one-line message and the server keeps serving; the body is parsed as JSON
  only (nothing is unpickled; weights load from safetensors only); ``trust_remote_code`` only when asked.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from opdistill.engines.vllm import INSTALL_HINT, VllmEngine, vllm_available
from opdistill.errors import UserError
from opdistill.models import resolve_model_path
from opdistill.teachers import LocalTeacher, Rows, ScoreRequest, Teacher
from opdistill.teachers.fingerprint import teacher_fingerprint, teacher_fingerprint_from_folder, tokenizer_fingerprint
from opdistill.teachers.wire import (HIDDEN_DTYPES, MEDIA_BINARY, MEDIA_JSON, ScoreResult, encode_head, encode_result,
                                     engine_refusal, head_sha256, parse_accept, to_wire)

__all__ = ["TeacherService", "ServeError", "create_app", "score_rows", "LOOPBACK_HOSTS", "check_bind", "ENGINES"]

ENGINES = ("hf", "vllm")
VLLM_DTYPES = ("float32", "bfloat16", "float16")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


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
        # the hidden-state payload (loss_mode full): an engine that holds the model's head says so
        self.head = teacher.head if isinstance(teacher, LocalTeacher) else None
        head_info = {} if self.head is None else {"hidden": True, "hidden_size": int(self.head.weight.shape[1]),
                                                  "lm_head_sha256": head_sha256(self.head.weight, self.head.bias)}
        self.info = {"model": model_id, **fingerprint, **tokenizer_fingerprint(tokenizer), "engine": self.engine,
                     **head_info, "vocab_size": self.vocab_size, "max_k": self.max_k,
                     "max_requested_ids": max_requested_ids,
                     "fixed_temperature": limits["fixed_temperature"], "padding": limits["padding"],
                     "max_model_len": limits["max_model_len"], "dtype": fingerprint["teacher_dtype"]}


def _int_matrix(body: dict, name: str, shape=None) -> torch.Tensor:
    x = body.get(name)
    if not isinstance(x, list) or not x or not all(isinstance(r, list) for r in x):
        raise BadRequest(400, f"{name}: expected a non-empty list of lists of integers")
    width = len(x[0])
    if any(len(r) != width for r in x):
        raise BadRequest(400, f"{name}: rows of different lengths (pad the rows to one length, attention_mask 0 "
                              f"on the padding)")
    if width == 0:
        raise BadRequest(400, f"{name}: rows are empty")
    try:
        t = torch.tensor(x, dtype=torch.long)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        raise BadRequest(400, f"{name}: expected integers only") from None
    if any(isinstance(v, bool) or not isinstance(v, int) for v in x[0]):  # torch accepts floats/bools: refuse them
        raise BadRequest(400, f"{name}: expected integers only")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise BadRequest(400, f"{name}: shape {list(t.shape)}, expected {list(shape)}")
    return t


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
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature <= 0:
        raise BadRequest(422, f"temperature: expected a finite number > 0, got {temperature!r}")
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


def create_app(svc: TeacherService, *, token: str | None = None, max_batch_tokens: int = 65536,
               max_request_tokens: int = 262144, max_body_bytes: int = 64 * 2 ** 20):
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

    @app.post("/v1/score")
    async def score(request: Request):
        if (r := unauthorized(request)) is not None:
            return r
        try:
            media, codec = parse_accept(request.headers.get("accept"))
        except ValueError as e:
            return JSONResponse({"detail": str(e)}, status_code=406)
        try:
            declared = int(request.headers.get("content-length", "0") or 0)
        except ValueError:
            return JSONResponse({"detail": "Content-Length: not an integer"}, status_code=400)
        if declared > max_body_bytes:
            return JSONResponse({"detail": f"body of {declared} bytes is above this server's limit of "
                                           f"{max_body_bytes}; send fewer rows"}, status_code=413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                return JSONResponse({"detail": f"body above this server's limit of {max_body_bytes} bytes; send "
                                               f"fewer rows"}, status_code=413)
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            return JSONResponse({"detail": f"the body is not valid JSON ({e})"}, status_code=400)
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
        result.model = svc.model_id
        payload = encode_result(result, media=media, codec=codec, vocab_size=svc.vocab_size)
        return Response(payload, media_type=media if media == MEDIA_JSON else f"{MEDIA_BINARY};logprobs={codec}")

    return app


def serve(model: str, *, engine: str = "hf", host: str = "127.0.0.1", port: int = 8000, token_file: str | None = None,
          max_batch_tokens: int = 65536, max_request_tokens: int = 262144, max_k: int = 64, dtype: str = "float32",
          trust_remote_code: bool = False, threads: int | None = None, max_model_len: int | None = None,
          gpu_memory_utilization: float = 0.9, log_level: str = "warning") -> None:
    """Load the teacher (``engine`` hf: a transformers model; vllm: a vLLM engine in this process) and serve it until
    interrupted (``opdistill serve-teacher``). Call it under ``if __name__ == "__main__":`` (vLLM may spawn)."""
    import uvicorn

    from opdistill.models import load_model, load_tokenizer

    token = None
    if token_file is not None:
        try:
            with open(token_file) as f:
                token = f.read().strip()
        except OSError as e:
            raise ServeError(f"--token-file {token_file}: cannot read it ({e.strerror})") from None
        if not token:
            raise ServeError(f"--token-file {token_file}: the file is empty")
    check_bind(host, token)
    for name, v in (("--max-batch-tokens", max_batch_tokens), ("--max-request-tokens", max_request_tokens),
                    ("--max-k", max_k)):
        if v < 1:
            raise ServeError(f"{name}: expected an integer >= 1, got {v}")
    check_engine(engine, dtype=dtype, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization)
    if threads:
        torch.set_num_threads(threads)
    path = resolve_model_path(model)
    tok = load_tokenizer(path, trust_remote_code=trust_remote_code, key="--model")
    if engine == "vllm":
        fingerprint = teacher_fingerprint_from_folder(path, dtype=dtype, trust_remote_code=trust_remote_code)
        if fingerprint is None:  # a folder the streaming hash cannot reproduce: load the model once, then free it
            fingerprint = teacher_fingerprint(load_model(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                         key="--model"))
        # sleep off: a server scores request after request (sleep mode would offload the weights after each)
        most = min(max_k, fingerprint["teacher_vocab_size"])
        from opdistill.teachers.vllm import VllmTeacher

        teacher = VllmTeacher(VllmEngine(path, role="teacher", dtype=dtype, max_logprobs=most,
                                         max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                                         sleep=False, trust_remote_code=trust_remote_code))
    else:
        fingerprint = None
        model_ = load_model(path, dtype=dtype, trust_remote_code=trust_remote_code, key="--model")
        teacher = LocalTeacher(model_.requires_grad_(False), key="--model")
    try:
        svc = TeacherService(teacher, tok, model_id=model, max_k=max_k, fingerprint=fingerprint)
        app = create_app(svc, token=token, max_batch_tokens=max_batch_tokens, max_request_tokens=max_request_tokens)
        print(f"opdistill serve-teacher: {model} ({engine} engine) on http://{host}:{port} (vocab {svc.vocab_size}, "
              f"max K {svc.max_k}, {'token required' if token else 'no token'})", flush=True)
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        teacher.close()


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
