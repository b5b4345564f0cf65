"""A remote teacher: the wire format of ``opdistill serve-teacher`` (payload codecs) and its HTTP client.

Design notes
- What travels: the client sends the step's padded rows as they are (``input_ids``, ``attention_mask``,
  ``response_mask``, ``[B, S]``), so the server scores exactly the tensors the in-process teacher would score. The
  server answers only at the *scored positions*: row b, position t with ``response_mask[b, t + 1] == 1`` (the
  positions whose next token is a response token, the only ones the loss reads), in row-major order (``P`` of them).
  The client puts them back into ``[B, S, ...]`` tensors; every other position holds id 0 and log-prob -inf (top-k)
  or 0 (next-token log-prob), the values the loss sanitises masked positions to, so nothing there changes a loss.
- Per scored position the answer holds the teacher's top-K ids and log-probs, the log-prob of the next token, and,
  when the client names ids per position (``requested_ids`` ``[P, J]``, e.g. the student's own top-k), the
  teacher's log-probs at those ids. Log-probs are at the request's temperature (echoed back).
- Payloads (content negotiation on ``Accept``): ``application/json`` (debugging; exact: float32 values written as
  the shortest decimal that reads back to the same float, -inf as ``null``) or ``application/x-opdistill-v1``:
  ``b"OPDT"``, a little-endian uint32 header length, a UTF-8 JSON header (the fields of the answer and one entry per
  array: name, dtype, shape, byte offset), then the raw little-endian arrays. Ids are uint16 when the vocabulary
  fits in 16 bits, else int32. Log-probs (``;logprobs=fp32|fp16|int8`` in the Accept header) are float32 (exact),
  float16 or 8-bit, both rounded toward -inf, so a decoded log-prob never exceeds the teacher's (a top-k mass never
  grows: the loss's mass check cannot trip on rounding). float16: relative error < 2^-10 per value, -inf kept.
  8-bit: per position, ``top`` (the largest finite value, float16) and a float16 step ``s >= (top - smallest finite
  value) / 254``; value = top - q * s for q in 0..254 and q = 255 for -inf, so every finite value is decoded below
  the sent one by < s + 2^-10 |top| (the header states the largest such bound in the payload as
  ``int8_max_abs_error``). With int8 the next-token log-prob (one value per position) travels as float16.
  Both compressed payloads also send, per position, the log of the teacher's tail mass (1 - top-k mass, float16);
  the client shifts each decoded top-k row by one constant so that its mass is exactly the sent one. The tail bucket
  of the tail losses is then the teacher's (its log to float16 precision) however small it is -- rounding the
  values alone moves a 1e-6 tail by orders of magnitude -- and a top-k mass is never above 1. The shift is below
  the row's largest rounding error, so a decoded top-k log-prob is within twice the bounds above.
- The client retries connection failures, timeouts and 5xx answers with exponential backoff and then raises
  :class:`TeacherServiceError` (a :class:`~opdistill.errors.UserError`: the CLI prints one line and exits 2) naming
  the server and the request. A 4xx answer is not retried: its message comes back in the error.
- What the server's engine can answer is in its ``/info`` (``engine``, ``max_k``, ``max_requested_ids``,
  ``fixed_temperature``, ``padding``, ``max_model_len``: a ``--engine vllm`` server scores at temperature 1 only,
  no requested ids, right-padded rows only). :func:`engine_refusal` is the one rule: the server answers 422 with its
  line, and a client that has read ``/info`` raises it before sending.
- At start the client checks ``/info`` against the student's tokenizer (the fingerprint of the teacher cache's
  provenance: vocabulary, special tokens, chat template) and lm_head width, and refuses with a diff.
"""
from __future__ import annotations

import json
import math
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from opdistill import TeacherTopK
from opdistill.errors import UserError
from opdistill.teacher import TeacherScores, tokenizer_fingerprint

__all__ = ["MEDIA_JSON", "MEDIA_BINARY", "LOGPROB_CODECS", "TeacherServiceError", "RemoteTeacher",
           "VLLMPromptLogprobsTeacher", "ScoreResult", "engine_refusal",
           "scored_positions", "encode_result", "decode_result", "parse_accept", "INT8_LEVELS"]

MEDIA_JSON = "application/json"
MEDIA_BINARY = "application/x-opdistill-v1"
MAGIC = b"OPDT"
LOGPROB_CODECS = ("fp32", "fp16", "int8")
INT8_LEVELS = 254  # q in 0..254 are values, 255 is -inf
FP16_REL_ERROR = 2.0 ** -11  # half an ulp; rounding down costs up to one ulp (2^-10)


class TeacherServiceError(UserError, RuntimeError):
    """The teacher service cannot be used: unreachable after the retries, an answer refused (4xx, with the server's
    message), a malformed answer, or a server whose teacher/tokenizer does not match the student (with a diff).
    The message is one line naming the server and the request; the CLI prints it and exits 2."""

    kind = "teacher service error"


# ---------------------------------------------------------------------------------------------------------------------
# The answer and its codecs (shared by the server and the client)

@dataclass
class ScoreResult:
    """Scores at the P scored positions (row-major order of ``response_mask[b, t + 1] == 1``)."""

    topk_ids: np.ndarray | None  # [P, K] int64
    topk_logprobs: np.ndarray | None  # [P, K] float32
    next_logprobs: np.ndarray  # [P] float32: the log-prob of the next token (the sampled token)
    requested_logprobs: np.ndarray | None  # [P, J] float32
    temperature: float
    model: str = ""


def scored_positions(response_mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, S]``: position t of row b is scored when ``response_mask[b, t + 1] == 1``."""
    keep = torch.zeros(response_mask.shape, dtype=torch.bool)
    keep[:, :-1] = response_mask[:, 1:].bool()
    return keep


def parse_accept(accept: str | None) -> tuple[str, str]:
    """(media type, log-prob codec) from an Accept header: ``application/x-opdistill-v1;logprobs=fp16`` ->
    (binary, fp16); JSON (or nothing, or ``*/*``) -> (json, fp32). Raises ValueError on an unknown codec or media
    type."""
    if not accept or accept.strip() in ("*/*", ""):
        return MEDIA_JSON, "fp32"
    for item in accept.split(","):
        parts = [p.strip() for p in item.split(";")]
        media = parts[0].lower()
        params = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        if media == MEDIA_BINARY:
            codec = params.get("logprobs", "fp32").strip().lower()
            if codec not in LOGPROB_CODECS:
                raise ValueError(f"Accept: logprobs={codec!r} is not one of {list(LOGPROB_CODECS)}")
            return MEDIA_BINARY, codec
        if media in (MEDIA_JSON, "application/*", "*/*"):
            return MEDIA_JSON, "fp32"
    raise ValueError(f"Accept: {accept!r} names no type this server writes ({MEDIA_JSON} or {MEDIA_BINARY})")


def _json_floats(a: np.ndarray):
    """float32 values as Python floats (exact round trip through JSON), -inf as None."""
    out = a.astype(np.float64)
    return [[None if v == -math.inf else v for v in row] for row in out.tolist()] if a.ndim == 2 else \
        [None if v == -math.inf else v for v in out.tolist()]


def _from_json_floats(x, name: str) -> np.ndarray:
    try:
        arr = np.array([[(-math.inf if v is None else v) for v in row] for row in x] if x and isinstance(x[0], list)
                       else [(-math.inf if v is None else v) for v in x], dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: expected numbers or null ({e})") from None
    return arr.astype(np.float32)


def _fp16_down(x: np.ndarray) -> np.ndarray:
    """float16 rounded toward -inf: a decoded log-prob never exceeds the sent one (so a top-k mass never grows past
    what the teacher gave, and the loss's mass check never trips on rounding); error < 2^-10 relative."""
    h = np.clip(x, -65504, None).astype(np.float16)  # finite values below -65504 (none in practice) stay finite
    h = np.where(np.isneginf(x), np.float16(-np.inf), h)
    up = h.astype(np.float32) > x
    return np.where(up, np.nextafter(h, np.float16(-np.inf)), h).astype(np.float16)


def _int8_encode(x: np.ndarray):
    """x [P, K] float32 (finite or -inf) -> (q uint8 [P, K], top float16 [P], step float16 [P], max abs error).

    top = the largest finite value of the position rounded down to float16; step >= (top - smallest finite value)
    / 254 rounded up to float16; q = ceil((top - x) / step) in [0, 254]; 255 = -inf. Every decoded value is <= the
    sent one and below it by < step + 2^-10 |top|."""
    finite = np.isfinite(x)
    big = np.where(finite, x, -np.inf).max(axis=1) if x.shape[1] else np.full(x.shape[0], -np.inf, np.float32)
    small = np.where(finite, x, np.inf).min(axis=1) if x.shape[1] else np.zeros(x.shape[0], np.float32)
    empty = ~np.isfinite(big)
    top = _fp16_down(np.where(empty, 0.0, big).astype(np.float32))
    t = top.astype(np.float64)
    span = np.where(empty, 0.0, np.maximum(t - small, 0.0))
    step = (span / INT8_LEVELS).astype(np.float16)
    # round the step UP to the next float16 so that q = (top - x) / step never exceeds INT8_LEVELS
    low = step.astype(np.float64) * INT8_LEVELS < span
    step = np.where(low, np.nextafter(step, np.float16(np.inf)), step).astype(np.float16)
    s = step.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s[:, None] > 0, np.ceil((t[:, None] - x.astype(np.float64)) / s[:, None]), 0.0)
    q = np.where(finite, np.clip(q, 0, INT8_LEVELS), 255).astype(np.uint8)
    bound = float((s + np.abs(t) * 2 * FP16_REL_ERROR).max()) if s.size else 0.0
    return q, top, step, bound


def _log_tail(x: np.ndarray) -> np.ndarray:
    """log(1 - sum(exp(x))) per row (float64 sum; -inf where the top-k holds all the mass)."""
    mass = np.exp(x.astype(np.float64)).sum(axis=1)
    with np.errstate(divide="ignore"):
        return np.log(np.clip(1.0 - mass, 0.0, 1.0))


def _restore_mass(x: np.ndarray, log_tail: np.ndarray) -> np.ndarray:
    """Shift each decoded row by log(c) so that its mass is the sent 1 - exp(log_tail): the tail bucket the loss
    computes from the top-k is then the teacher's to float16 precision of its log (rounding of the individual values
    would otherwise move a tiny tail mass by orders of magnitude), and the mass is never above 1."""
    x64 = x.astype(np.float64)
    mass = np.exp(x64).sum(axis=1)
    target = 1.0 - np.exp(log_tail)
    ok = (mass > 0) & (target > 0) & np.isfinite(log_tail)  # no tail sent (mass >= 1): leave the row as decoded
    with np.errstate(divide="ignore", invalid="ignore"):
        shift = np.where(ok, np.log(np.where(ok, target, 1.0) / np.where(ok, mass, 1.0)), 0.0)
    return (x64 + shift[:, None]).astype(np.float32)


def _int8_decode(q: np.ndarray, top: np.ndarray, step: np.ndarray) -> np.ndarray:
    x = top[:, None].astype(np.float32) - q.astype(np.float32) * step.astype(np.float32)[:, None]
    return np.where(q == 255, np.float32(-np.inf), x).astype(np.float32)


def encode_result(r: ScoreResult, *, media: str, codec: str = "fp32", vocab_size: int) -> bytes:
    """The answer's body in ``media`` (JSON or binary with ``codec`` log-probs)."""
    head = {"model": r.model, "temperature": r.temperature, "num_positions": int(r.next_logprobs.shape[0]),
            "k": None if r.topk_ids is None else int(r.topk_ids.shape[1]),
            "num_requested": None if r.requested_logprobs is None else int(r.requested_logprobs.shape[1])}
    if media == MEDIA_JSON:
        body = dict(head)
        body["next_logprobs"] = _json_floats(r.next_logprobs)
        if r.topk_ids is not None:
            body["topk_ids"] = r.topk_ids.tolist()
            body["topk_logprobs"] = _json_floats(r.topk_logprobs)
        if r.requested_logprobs is not None:
            body["requested_logprobs"] = _json_floats(r.requested_logprobs)
        return json.dumps(body, separators=(",", ":")).encode()
    arrays: list[tuple[str, np.ndarray]] = []
    id_dtype = "<u2" if vocab_size <= 2 ** 16 else "<i4"
    head["logprobs"] = codec
    bounds = [0.0]

    def add_logprobs(name: str, x: np.ndarray):
        x = x.reshape(x.shape[0], -1).astype(np.float32)
        if codec == "fp32":
            arrays.append((name, x.astype("<f4")))
        elif codec == "fp16":
            arrays.append((name, _fp16_down(x).astype("<f2")))
        else:
            q, top, step, bound = _int8_encode(x)
            bounds.append(bound)
            arrays.extend([(name + ".q", q), (name + ".top", top.astype("<f2")), (name + ".step", step.astype("<f2"))])

    if codec == "int8":  # one value per position: float16 (2 bytes) beats 8 bits + top + step (5 bytes)
        arrays.append(("next_logprobs", _fp16_down(r.next_logprobs.reshape(-1, 1)).astype("<f2")))
    else:
        add_logprobs("next_logprobs", r.next_logprobs[:, None])
    if r.topk_ids is not None:
        arrays.append(("topk_ids", r.topk_ids.astype(id_dtype)))
        add_logprobs("topk_logprobs", r.topk_logprobs)
        if codec != "fp32":  # the log of the tail mass (1 - top-k mass), so the client restores the exact mass
            arrays.append(("topk_log_tail", _log_tail(r.topk_logprobs).astype("<f2")))
    if r.requested_logprobs is not None:
        add_logprobs("requested_logprobs", r.requested_logprobs)
    if codec == "int8":
        head["int8_max_abs_error"] = max(bounds)
    entries, offset = [], 0
    for name, a in arrays:
        a = np.ascontiguousarray(a)
        entries.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset})
        offset += a.nbytes
    head["arrays"] = entries
    hb = json.dumps(head, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<I", len(hb)), hb] + [np.ascontiguousarray(a).tobytes() for _, a in arrays])


_WIRE_DTYPES = {"<u2", "<i4", "<f4", "<f2", "|u1"}


def decode_result(body: bytes, media: str) -> ScoreResult:
    """Parse an answer (either format) back to float32 / int64 arrays. Raises ValueError on anything malformed."""
    if media.split(";")[0].strip().lower() == MEDIA_JSON:
        d = json.loads(body)
        if not isinstance(d, dict) or "next_logprobs" not in d:
            raise ValueError("the JSON answer has no 'next_logprobs'")
        ids = np.array(d["topk_ids"], dtype=np.int64) if d.get("topk_ids") is not None else None
        lp = _from_json_floats(d["topk_logprobs"], "topk_logprobs") if ids is not None else None
        if ids is not None and ids.size == 0:
            ids = ids.reshape(0, d.get("k") or 0)
            lp = lp.reshape(0, d.get("k") or 0)
        req = d.get("requested_logprobs")
        req = _from_json_floats(req, "requested_logprobs") if req is not None else None
        if req is not None and req.size == 0:
            req = req.reshape(0, d.get("num_requested") or 0)
        return ScoreResult(ids, lp, _from_json_floats(d["next_logprobs"], "next_logprobs").reshape(-1), req,
                           float(d["temperature"]), str(d.get("model", "")))
    if body[:4] != MAGIC or len(body) < 8:
        raise ValueError("not an opdistill-v1 payload (bad magic)")
    (hlen,) = struct.unpack("<I", body[4:8])
    head = json.loads(body[8 : 8 + hlen])
    data = memoryview(body)[8 + hlen :]
    arrays = {}
    for e in head["arrays"]:
        if e["dtype"] not in _WIRE_DTYPES:
            raise ValueError(f"array {e['name']!r}: dtype {e['dtype']!r} is not a wire dtype")
        dt = np.dtype(e["dtype"])
        n = int(np.prod(e["shape"], dtype=np.int64)) * dt.itemsize
        if e["offset"] < 0 or e["offset"] + n > len(data):
            raise ValueError(f"array {e['name']!r} runs past the end of the payload")
        arrays[e["name"]] = np.frombuffer(data[e["offset"] : e["offset"] + n], dtype=dt).reshape(e["shape"])
    codec = head["logprobs"]

    def get_lp(name):
        if codec == "int8" and name not in arrays:
            if name + ".q" not in arrays:
                return None
            return _int8_decode(arrays[name + ".q"], arrays[name + ".top"], arrays[name + ".step"])
        return arrays[name].astype(np.float32) if name in arrays else None

    ids = arrays["topk_ids"].astype(np.int64) if "topk_ids" in arrays else None
    topk_lp = get_lp("topk_logprobs")
    if topk_lp is not None and "topk_log_tail" in arrays:
        topk_lp = _restore_mass(topk_lp, arrays["topk_log_tail"].astype(np.float64))
    return ScoreResult(ids, topk_lp, get_lp("next_logprobs").reshape(-1), get_lp("requested_logprobs"),
                       float(head["temperature"]), str(head.get("model", "")))


# ---------------------------------------------------------------------------------------------------------------------
# What a server's engine can answer (its /info), checked by the server (422) and by the client before it sends

def engine_refusal(info: dict, *, k: int | None, temperature: float, num_requested: int | None,
                   attention_mask: torch.Tensor) -> str | None:
    """Why a server whose ``/info`` is ``info`` cannot serve this request (one line), or None. The engine's limits in
    /info: ``max_k``, ``max_requested_ids`` (0: none), ``fixed_temperature`` (null: any), ``padding`` ("any", or
    "right": attention 1 on a prefix of each row) and ``max_model_len`` (null: none). A server without these fields
    (an older one) is taken to accept anything."""
    engine = info.get("engine", "hf")
    use = "send it to a server started with --engine hf"
    if k is not None and info.get("max_k") is not None and k > info["max_k"]:
        return f"k: {k} is above this server's max K {info['max_k']} (its --max-k); ask for at most {info['max_k']}"
    fixed = info.get("fixed_temperature")
    if fixed is not None and float(temperature) != float(fixed):
        return (f"temperature {temperature:g}: the {engine} engine scores at temperature {fixed:g} only (its prompt "
                f"log-probs are those of the raw logits); ask for temperature {fixed:g} or {use}")
    if num_requested is not None:
        most = info.get("max_requested_ids")
        if most == 0:
            return (f"requested_ids: the {engine} engine cannot score ids the client names (it returns only its top-K "
                    f"and the actual next token); {use}")
        if most is not None and num_requested > most:
            return f"requested_ids: {num_requested} ids per position, above the limit {most}"
    lengths = attention_mask.sum(-1)
    if info.get("padding") == "right":
        prefix = torch.arange(attention_mask.shape[1])[None] < lengths[:, None]
        bad = (prefix != attention_mask.bool()).any(-1).nonzero().flatten().tolist()
        if bad:
            return (f"attention_mask: the {engine} engine scores each row unpadded, so rows must be right-padded "
                    f"(attention_mask 1 on a prefix); row {bad[0]} is not")
    longest = info.get("max_model_len")
    if longest is not None and lengths.numel() and int(lengths.max()) > longest:
        b = int(lengths.argmax())
        return (f"input_ids: row {b} holds {int(lengths[b])} tokens, above the {engine} engine's max_model_len "
                f"{longest} (--max-model-len); send shorter rows")
    return None


# ---------------------------------------------------------------------------------------------------------------------
# The client

_TOKENIZER_FIELDS = ("tokenizer_sha256", "tokenizer_vocab_size")


def _short(field: str, value):
    return value[:12] if field.endswith("_sha256") and isinstance(value, str) else value


class RemoteTeacher:
    """A client of ``opdistill serve-teacher``: ``score`` returns the same :class:`TeacherScores` as
    :func:`opdistill.teacher.score_teacher` on the same rows (equal for the fp32 payload).

    ``url``: http(s)://host:port (TLS by the scheme); ``token_file``: a file holding the bearer token;
    ``timeout_s`` per request; ``retries`` after the first try, waiting ``backoff_s * 2**i`` before try i + 1;
    ``payload``: json | fp32 | fp16 | int8."""

    def __init__(self, url: str, *, token_file: str | None = None, timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 0.5, payload: str = "fp32", key: str = "teacher.url"):
        import httpx

        self.url = url.rstrip("/")
        self.key = key
        self.retries, self.backoff_s, self.payload = retries, backoff_s, payload
        if payload not in ("json",) + LOGPROB_CODECS:
            raise ValueError(f"payload: expected one of json/fp32/fp16/int8, got {payload!r}")
        headers = {"Accept": MEDIA_JSON if payload == "json" else f"{MEDIA_BINARY};logprobs={payload}"}
        if token_file is not None:
            try:
                token = Path(token_file).read_text().strip()
            except OSError as e:
                raise TeacherServiceError(f"teacher.token_file={token_file!r}: cannot read the token file "
                                          f"({e.strerror})") from None
            if not token:
                raise TeacherServiceError(f"teacher.token_file={token_file!r}: the token file is empty")
            headers["Authorization"] = f"Bearer {token}"
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)
        self.info: dict | None = None
        self.requests = 0
        self.bytes_received = 0

    def close(self) -> None:
        self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _request(self, method: str, path: str, what: str, **kw):
        import httpx

        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                resp = self._client.request(method, path, **kw)
            except httpx.TransportError as e:  # connect/read errors and timeouts: retried
                last = f"{type(e).__name__}: {' '.join(str(e).split()) or 'no answer'}"
                continue
            if resp.status_code >= 500:
                last = f"HTTP {resp.status_code}: {_detail(resp)}"
                continue
            if resp.status_code >= 400:
                raise TeacherServiceError(f"{self.key}={self.url}: {method} {path} ({what}) was refused: HTTP "
                                          f"{resp.status_code}: {_detail(resp)}")
            self.requests += 1
            self.bytes_received += len(resp.content)
            return resp
        raise TeacherServiceError(f"{self.key}={self.url}: {method} {path} ({what}) failed after {self.retries + 1} "
                                  f"tries ({last}); start the teacher server or fix {self.key}, then continue the "
                                  f"run with --resume")

    def fetch_info(self) -> dict:
        resp = self._request("GET", "/info", "server info")
        try:
            self.info = resp.json()
        except ValueError:
            raise TeacherServiceError(f"{self.key}={self.url}: GET /info answered something that is not JSON; is "
                                      f"this an opdistill serve-teacher server?") from None
        return self.info

    def check_student(self, tokenizer, student=None, *, k: int | None = None) -> dict:
        """Refuse (with a diff) a server whose tokenizer differs from the student's (the teacher cache's rules:
        vocabulary, special tokens and chat template fingerprint, size), whose vocabulary width differs from the
        student's lm_head, or whose largest K is below ``k``. Returns the server's /info."""
        info = self.info or self.fetch_info()
        current = tokenizer_fingerprint(tokenizer)
        diff = [f"{f}: student {_short(f, current[f])!r}, server {_short(f, info.get(f))!r}"
                for f in _TOKENIZER_FIELDS if info.get(f) != current[f]]
        if student is not None:
            width = int(student.get_output_embeddings().weight.shape[0])
            if info.get("teacher_vocab_size") != width:
                diff.append(f"vocabulary width: student lm_head {width}, server teacher {info.get('teacher_vocab_size')}")
        if diff:
            raise TeacherServiceError(f"{self.key}={self.url}: the server's teacher cannot be distilled into this "
                                      f"student: {'; '.join(diff)} (the same rules as a teacher cache's provenance)")
        if k is not None and info.get("max_k") is not None and k > info["max_k"]:
            raise TeacherServiceError(f"{self.key}={self.url}: loss.topk={k} is above the server's max K "
                                      f"{info['max_k']}; lower loss.topk or start the server with a larger --max-k")
        return info

    def score_positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor, *,
                        k: int | None, temperature: float = 1.0, requested_ids: torch.Tensor | None = None,
                        what: str = "") -> ScoreResult:
        """The raw answer at the scored positions (see the module notes)."""
        body = {"input_ids": input_ids.tolist(), "attention_mask": attention_mask.tolist(),
                "response_mask": response_mask.tolist(), "k": k, "temperature": temperature}
        if requested_ids is not None:
            body["requested_ids"] = requested_ids.tolist()
        B, S = input_ids.shape
        what = what or f"{B} rows x {S} positions"
        if self.info is not None:  # what the server's engine cannot answer: refused here, before sending
            why = engine_refusal(self.info, k=k, temperature=temperature, attention_mask=attention_mask,
                                 num_requested=None if requested_ids is None else int(requested_ids.shape[1]))
            if why:
                raise TeacherServiceError(f"{self.key}={self.url}: POST /v1/score ({what}) cannot be served by this "
                                          f"server ({self.info.get('engine', 'hf')} engine): {why}")
        resp = self._request("POST", "/v1/score", what, content=json.dumps(body, separators=(",", ":")).encode(),
                             headers={"Content-Type": MEDIA_JSON})
        try:
            r = decode_result(resp.content, resp.headers.get("content-type", MEDIA_JSON))
        except (ValueError, KeyError, TypeError) as e:
            raise TeacherServiceError(f"{self.key}={self.url}: POST /v1/score ({what}) answered a malformed payload "
                                      f"({e})") from None
        P = int(scored_positions(response_mask).sum())
        if r.next_logprobs.shape[0] != P or (k and (r.topk_ids is None or r.topk_ids.shape != (P, k))):
            raise TeacherServiceError(f"{self.key}={self.url}: POST /v1/score ({what}) answered scores for "
                                      f"{r.next_logprobs.shape[0]} positions, expected {P} (K={k})")
        if r.temperature != float(temperature):
            raise TeacherServiceError(f"{self.key}={self.url}: POST /v1/score ({what}) scored at temperature "
                                      f"{r.temperature}, asked {temperature}")
        return r

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor, *,
              k: int | None = None, sampled: bool = False, what: str = "") -> TeacherScores:
        """What :func:`~opdistill.teacher.score_teacher` returns for the loss: top-k ``[B, S, K]`` (id 0 / -inf
        where nothing is scored) and/or the next-token log-prob ``[B, S]`` (0 where nothing is scored)."""
        if k is None and not sampled:
            raise ValueError("RemoteTeacher.score: ask for top-k (k=...) or sampled-token scores (sampled=True)")
        B, S = input_ids.shape
        limit = (self.info or {}).get("max_request_tokens")
        if limit and B * S > limit and B > 1:  # above the server's per-request limit: rows in several requests
            rows = max(1, limit // S)
            parts = [self.score(input_ids[r0 : r0 + rows], attention_mask[r0 : r0 + rows],
                                response_mask[r0 : r0 + rows], k=k, sampled=sampled,
                                what=f"{what or 'rows'} [rows {r0}:{min(r0 + rows, B)}]") for r0 in range(0, B, rows)]
            return TeacherScores(
                TeacherTopK(torch.cat([p.topk.ids for p in parts]), torch.cat([p.topk.logprobs for p in parts]))
                if k else None, torch.cat([p.sampled_logprobs for p in parts]) if sampled else None)
        r = self.score_positions(input_ids, attention_mask, response_mask, k=k, what=what)
        keep = scored_positions(response_mask)
        topk = None
        if k:
            ids = torch.zeros(B, S, k, dtype=torch.long)
            lp = torch.full((B, S, k), float("-inf"), dtype=torch.float32)
            ids[keep] = torch.from_numpy(r.topk_ids)
            lp[keep] = torch.from_numpy(np.ascontiguousarray(r.topk_logprobs))
            topk = TeacherTopK(ids, lp)
        samp = None
        if sampled:
            samp = torch.zeros(B, S, dtype=torch.float32)
            samp[keep] = torch.from_numpy(np.ascontiguousarray(r.next_logprobs))
        return TeacherScores(topk, samp)


def _detail(resp) -> str:
    try:
        d = resp.json()
        if isinstance(d, dict) and isinstance(d.get("error"), dict):  # OpenAI-style {"error": {"message": ...}}
            d = d["error"]
        for field in ("detail", "message"):
            if isinstance(d, dict) and field in d:
                return " ".join(str(d[field]).split())[:500]
    except ValueError:
        pass
    return " ".join(resp.text.split())[:500] or "(empty body)"


# ---------------------------------------------------------------------------------------------------------------------
# A stock `vllm serve` endpoint (OpenAI completions with vLLM's prompt_logprobs extension)

class VLLMPromptLogprobsTeacher(RemoteTeacher):
    """A client of a stock ``vllm serve`` OpenAI endpoint: ``POST /v1/completions`` with the rows' token ids as
    prompts, ``max_tokens: 1`` and ``prompt_logprobs: K``; the answer's ``prompt_logprobs`` (per prompt position a
    ``{"<id>": {"logprob", "rank", "decoded_token"}}`` dict, position 0 null) gives the top-K (entries of rank 1..K)
    and the log-prob of each actual next token. Returns the same :class:`TeacherScores` as :meth:`RemoteTeacher.score`.

    What this mode cannot do (docs/teacher_service.md): no check of the server's tokenizer against the student's
    (vLLM's API does not expose a fingerprint; only the served model name is read from ``/v1/models``); no log-probs
    at ids the client names; temperature is vLLM's business (its prompt log-probs are those of the raw model logits
    in recent versions); K is capped by the server's ``--max-logprobs`` (20 by default); rows must be right-padded
    (attention 1 on a prefix); the JSON answer is ~20x the size of our binary fp32 payload."""

    def __init__(self, url: str, *, model: str | None = None, **kw):
        kw.pop("payload", None)
        super().__init__(url, payload="json", **kw)
        self.model = model

    def check_student(self, tokenizer, student=None, *, k: int | None = None) -> dict:
        resp = self._request("GET", "/v1/models", "served models")
        try:
            ids = [m["id"] for m in resp.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise TeacherServiceError(f"{self.key}={self.url}: GET /v1/models answered no model list; is this a "
                                      f"vllm serve endpoint?") from None
        if self.model is None:
            if not ids:
                raise TeacherServiceError(f"{self.key}={self.url}: GET /v1/models lists no model")
            self.model = ids[0]
        elif self.model not in ids:
            raise TeacherServiceError(f"{self.key}={self.url}: teacher.model={self.model!r} is not served (served: "
                                      f"{ids})")
        self.info = {"model": self.model, "served": ids}
        return self.info

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor, *,
              k: int | None = None, sampled: bool = False, what: str = "") -> TeacherScores:
        if k is None and not sampled:
            raise ValueError("score: ask for top-k (k=...) or sampled-token scores (sampled=True)")
        if self.model is None:
            self.check_student(None)
        B, S = input_ids.shape
        what = what or f"{B} rows x {S} positions"
        lengths = attention_mask.sum(1)
        prefix = torch.arange(S)[None] < lengths[:, None]
        if not torch.equal(prefix, attention_mask.bool()):
            raise TeacherServiceError(f"{self.key}={self.url}: POST /v1/completions ({what}): vLLM scores unpadded "
                                      f"prompts, so rows must be right-padded (attention_mask 1 on a prefix)")
        prompts = [input_ids[b, : int(lengths[b])].tolist() for b in range(B)]
        body = {"model": self.model, "prompt": prompts, "max_tokens": 1, "prompt_logprobs": k or 0,
                "temperature": 1.0}
        try:
            resp = self._request("POST", "/v1/completions", what, json=body)
        except TeacherServiceError as e:  # vLLM's 400 names the limit, not the key: add the fix
            if k and "was refused: HTTP 400" in str(e) and "prompt logprobs" in str(e):
                raise TeacherServiceError(f"{e}; lower loss.topk to at most the server's --max-logprobs, or restart "
                                          f"vllm serve with --max-logprobs >= {k}") from None
            raise
        keep = scored_positions(response_mask)
        ids = torch.zeros(B, S, k or 0, dtype=torch.long)
        lp = torch.full((B, S, k or 0), float("-inf"))
        samp = torch.zeros(B, S)
        try:
            choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
            if len(choices) != B:
                raise ValueError(f"{len(choices)} choices for {B} prompts")
            for b, choice in enumerate(choices):
                pl = choice["prompt_logprobs"]
                if len(pl) != len(prompts[b]):
                    raise ValueError(f"prompt {b}: {len(pl)} prompt_logprobs for {len(prompts[b])} tokens")
                for t in torch.nonzero(keep[b]).flatten().tolist():
                    entry = {int(i): v for i, v in pl[t + 1].items()}
                    samp[b, t] = float(entry[int(input_ids[b, t + 1])]["logprob"])
                    if k:
                        top = sorted((v["rank"], i, v["logprob"]) for i, v in entry.items()
                                     if v.get("rank") is not None and v["rank"] <= k)
                        if len(top) < k:
                            raise ValueError(f"prompt {b}, position {t + 1}: {len(top)} entries of rank <= {k}")
                        ids[b, t] = torch.tensor([i for _, i, _ in top[:k]])
                        lp[b, t] = torch.tensor([float(v) for _, _, v in top[:k]])
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise TeacherServiceError(f"{self.key}={self.url}: POST /v1/completions ({what}) answered no usable "
                                      f"prompt_logprobs ({type(e).__name__}: {e}); is this a vllm serve endpoint "
                                      f"(teacher.api=vllm) with --max-logprobs >= {k}?") from None
        return TeacherScores(TeacherTopK(ids, lp) if k else None, samp if sampled else None)
