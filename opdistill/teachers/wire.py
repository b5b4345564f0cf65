"""The teacher service's wire format, shared by the server (``opdistill.serve``) and its client
(:class:`opdistill.teachers.remote.RemoteTeacher`): the answer (:class:`ScoreResult`), its JSON and binary codecs,
and what an engine can answer (:func:`engine_refusal`).

- What travels: the client sends the step's padded rows as they are (``input_ids``, ``attention_mask``,
  ``response_mask``, ``[B, S]``), so the server scores exactly the tensors the in-process teacher would score. The
  server answers only at the *scored positions*: row b, position t with ``response_mask[b, t + 1] == 1`` (the
  positions whose next token is a response token, the only ones the loss reads), in row-major order (``P`` of them).
  :func:`to_wire` and :func:`from_wire` move scores between the ``[B, S, ...]`` layout of
  :class:`~opdistill.loss.TeacherScores` (every other position: id 0 and log-prob -inf for top-k, 0 for the next
  token, -inf for requested ids) and the ``[P, ...]`` answer.
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
- Every answer's header also holds ``model`` and ``teacher`` (the teacher's identity: the ``answer_identity`` fields
  of the server's ``/info``), which the client checks against the ``/info`` it accepted. :func:`decode_result`
  checks every header field by type and range and every array by the dtypes its name and the codec allow (ids in an
  integer dtype, hidden states in the dtype their label states), raising ValueError naming the field.
- What the server's engine can answer is in its ``/info`` (``engine``, ``max_k``, ``max_requested_ids``,
  ``fixed_temperature``, ``padding``, ``max_model_len``: a ``--engine vllm`` server scores at temperature 1 only,
  no requested ids, right-padded rows only). :func:`engine_refusal` is the one rule: the server answers 422 with its
  line, and a client that has read ``/info`` raises it before sending.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from opdistill.errors import quote
from opdistill.loss import TeacherScores, TeacherTopK

__all__ = ["MEDIA_JSON", "MEDIA_BINARY", "LOGPROB_CODECS", "INT8_LEVELS", "HIDDEN_DTYPES", "ScoreResult",
           "parse_accept", "encode_result", "decode_result", "engine_refusal", "to_wire", "from_wire",
           "encode_head", "decode_head", "count_field"]

MEDIA_JSON = "application/json"
MEDIA_BINARY = "application/x-opdistill-v1"
MAGIC = b"OPDT"
LOGPROB_CODECS = ("fp32", "fp16", "int8")
INT8_LEVELS = 254  # q in 0..254 are values, 255 is -inf
FP16_REL_ERROR = 2.0 ** -11  # half an ulp; rounding down costs up to one ulp (2^-10)


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
    hidden: np.ndarray | None = None  # [P, H] float32: the teacher's final hidden states (bf16 values with "bf16")
    hidden_dtype: str = "fp32"  # how ``hidden`` travels in the binary payload: fp32 | bf16
    teacher: dict | None = None  # the answering teacher's identity (``ANSWER_IDENTITY_FIELDS`` of its /info)


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


def _json_number(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _from_json_floats(x, name: str) -> np.ndarray:
    """A JSON list (or list of lists) of numbers, null for -inf, as float32; anything else (a string, a bool, ragged
    rows) is refused: numpy would read "1.5" or true as numbers."""
    rows = x if isinstance(x, list) and x and isinstance(x[0], list) else None
    flat = [v for row in rows for v in (row if isinstance(row, list) else [row])] if rows is not None else x
    if not isinstance(flat, list) or not all(_json_number(v) for v in flat):
        raise ValueError(f"{name}: expected numbers or null")
    try:
        arr = np.array([[(-math.inf if v is None else v) for v in row] for row in x] if rows is not None
                       else [(-math.inf if v is None else v) for v in x], dtype=np.float64)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"{name}: expected numbers or null ({e})") from None
    return arr.astype(np.float32)


def _from_json_ints(x, name: str) -> np.ndarray:
    """A JSON list of lists of integers as int64; floats (2.7 would be truncated), bools, strings and integers
    beyond int64 are refused."""
    if not isinstance(x, list) or not all(isinstance(row, list) for row in x) or not all(
            isinstance(v, int) and not isinstance(v, bool) and -2 ** 63 <= v < 2 ** 63 for row in x for v in row):
        raise ValueError(f"{name}: expected lists of integers")
    try:
        return np.array(x, dtype=np.int64)
    except ValueError as e:  # ragged rows
        raise ValueError(f"{name}: expected rows of one length ({e})") from None


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


HIDDEN_DTYPES = ("fp32", "bf16")


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even, as torch) as little-endian uint16 bit patterns."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).view(torch.int16).numpy() \
        .astype("<u2")


def _from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(b).astype(np.int16)).view(torch.bfloat16).float().numpy()


def encode_result(r: ScoreResult, *, media: str, codec: str = "fp32", vocab_size: int) -> bytes:
    """The answer's body in ``media`` (JSON or binary with ``codec`` log-probs)."""
    head = {"model": r.model, "temperature": r.temperature, "num_positions": int(r.next_logprobs.shape[0]),
            "k": None if r.topk_ids is None else int(r.topk_ids.shape[1]),
            "num_requested": None if r.requested_logprobs is None else int(r.requested_logprobs.shape[1]),
            "hidden_size": None if r.hidden is None else int(r.hidden.shape[1])}
    if r.teacher is not None:
        head["teacher"] = dict(r.teacher)
    if media == MEDIA_JSON:
        body = dict(head)
        if r.hidden is not None:
            body["hidden"] = r.hidden.astype(np.float64).tolist()  # finite: exact float32 round trip
        body["next_logprobs"] = _json_floats(r.next_logprobs)
        if r.topk_ids is not None:
            body["topk_ids"] = r.topk_ids.tolist()
            body["topk_logprobs"] = _json_floats(r.topk_logprobs)
        if r.requested_logprobs is not None:
            body["requested_logprobs"] = _json_floats(r.requested_logprobs)
        return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()  # NaN is not JSON: refuse it
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
    if r.hidden is not None:  # bf16: the top 16 bits of each float32 (the values are bf16 already, or rounded here)
        head["hidden_dtype"] = r.hidden_dtype
        arrays.append(("hidden", r.hidden.astype("<f4") if r.hidden_dtype == "fp32" else _bf16_bits(r.hidden)))
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
_LOGPROB_ARRAYS = ("next_logprobs", "topk_logprobs", "requested_logprobs")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def count_field(d: dict, name: str):
    """``d[name]``: an integer >= 0 or None (absent), else ValueError naming the field."""
    v = d.get(name)
    if v is not None and not (_is_int(v) and v >= 0):
        raise ValueError(f"{name}: expected an integer >= 0 or null, got {quote(v, 60)}")
    return v


def _header_fields(d: dict) -> tuple[float, str, dict | None]:
    """The answer's temperature (a finite number > 0), model (a string) and teacher identity (an object of strings,
    or absent), every count field checked; ValueError naming the field."""
    t = d.get("temperature")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise ValueError(f"temperature: expected a finite number > 0, got {quote(t, 60)}")
    model = d.get("model", "")
    if not isinstance(model, str):
        raise ValueError(f"model: expected a string, got {quote(model, 60)}")
    teacher = d.get("teacher")
    if teacher is not None and not (isinstance(teacher, dict) and all(
            isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in teacher.items())):
        raise ValueError(f"teacher: expected an object of strings (the teacher's identity), got {quote(teacher, 60)}")
    for name in ("num_positions", "k", "num_requested", "hidden_size"):
        count_field(d, name)
    return float(t), model, teacher


def _array_dtypes(name: str, codec: str, hidden_dtype: str) -> set[str] | None:
    """The wire dtypes array ``name`` may travel in (None: not an array of the answer)."""
    if name == "topk_ids":
        return {"<u2", "<i4"}
    if name == "hidden":
        return {"<f4"} if hidden_dtype == "fp32" else {"<u2"}
    if name == "topk_log_tail":
        return {"<f2"}
    base, _, part = name.partition(".")
    if base not in _LOGPROB_ARRAYS:
        return None
    if part:  # int8: q, top, step
        if codec != "int8":
            return None
        return {"|u1"} if part == "q" else {"<f2"} if part in ("top", "step") else None
    if codec == "int8":
        return {"<f2"} if base == "next_logprobs" else None
    return {"<f4"} if codec == "fp32" else {"<f2"}


def decode_result(body: bytes, media: str) -> ScoreResult:
    """Parse an answer (either format) back to float32 / int64 arrays. Raises ValueError, naming the field, on
    anything malformed: every header field checked by type and range, every array by the dtype its name and the
    stated codec allow (ids integers, hidden states in the dtype their label states)."""
    if media.split(";")[0].strip().lower() == MEDIA_JSON:
        d = json.loads(body)
        if not isinstance(d, dict) or "next_logprobs" not in d:
            raise ValueError("the JSON answer has no 'next_logprobs'")
        temperature, model, teacher = _header_fields(d)
        ids = _from_json_ints(d["topk_ids"], "topk_ids") if d.get("topk_ids") is not None else None
        lp = _from_json_floats(d.get("topk_logprobs"), "topk_logprobs") if ids is not None else None
        if ids is not None and ids.size == 0:
            ids = ids.reshape(0, d.get("k") or 0)
            lp = lp.reshape(0, d.get("k") or 0)
        req = d.get("requested_logprobs")
        req = _from_json_floats(req, "requested_logprobs") if req is not None else None
        if req is not None and req.size == 0:
            req = req.reshape(0, d.get("num_requested") or 0)
        hid = d.get("hidden")
        if hid is not None:
            hid = _from_json_floats(hid, "hidden")
            if hid.ndim != 2 and hid.size:
                raise ValueError("hidden: expected one list of numbers per position")
            hid = hid.reshape(-1, d.get("hidden_size") or 0) if hid.size == 0 else hid
        return ScoreResult(ids, lp, _from_json_floats(d["next_logprobs"], "next_logprobs").reshape(-1), req,
                           temperature, model, hid, teacher=teacher)
    if body[:4] != MAGIC or len(body) < 8:
        raise ValueError("not an opdistill-v1 payload (bad magic)")
    (hlen,) = struct.unpack("<I", body[4:8])
    head = json.loads(body[8 : 8 + hlen])
    if not isinstance(head, dict) or not isinstance(head.get("arrays"), list):
        raise ValueError("the header is not an object with an 'arrays' list")
    temperature, model, teacher = _header_fields(head)
    codec = head.get("logprobs")
    if codec not in LOGPROB_CODECS:
        raise ValueError(f"logprobs: expected one of {list(LOGPROB_CODECS)}, got {quote(codec, 60)}")
    hid_dtype = head.get("hidden_dtype", "fp32")
    if hid_dtype not in HIDDEN_DTYPES:
        raise ValueError(f"hidden_dtype {hid_dtype!r} is not one of {list(HIDDEN_DTYPES)}")
    data = memoryview(body)[8 + hlen :]
    arrays = {}
    for e in head["arrays"]:
        if not isinstance(e, dict) or not isinstance(e.get("name"), str):
            raise ValueError(f"arrays: an entry is not an object with a name ({quote(e, 60)})")
        name = e["name"]
        shape, offset = e.get("shape"), e.get("offset")
        if not isinstance(shape, list) or len(shape) not in (1, 2) or not all(_is_int(n) and n >= 0 for n in shape):
            raise ValueError(f"array {name!r}: shape {quote(shape, 60)} is not one or two integers >= 0")
        if not _is_int(offset) or offset < 0:
            raise ValueError(f"array {name!r}: offset {quote(offset, 60)} is not an integer >= 0")
        if e.get("dtype") not in _WIRE_DTYPES:
            raise ValueError(f"array {name!r}: dtype {quote(e.get('dtype'), 60)} is not a wire dtype")
        allowed = _array_dtypes(name, codec, hid_dtype)
        if allowed is None:
            raise ValueError(f"array {name!r} is not part of a {codec} answer")
        if e["dtype"] not in allowed:
            raise ValueError(f"array {name!r}: dtype {e['dtype']!r}, but a {codec} answer"
                             f"{' with hidden_dtype ' + hid_dtype if name == 'hidden' else ''} sends it as "
                             f"{' or '.join(sorted(allowed))}")
        if name in arrays:
            raise ValueError(f"array {name!r} appears twice")
        dt = np.dtype(e["dtype"])
        n = math.prod(shape) * dt.itemsize
        if offset + n > len(data):
            raise ValueError(f"array {name!r} runs past the end of the payload")
        arrays[name] = np.frombuffer(data[offset : offset + n], dtype=dt).reshape(shape)

    def get_lp(name):
        if codec == "int8" and name not in arrays:
            if name + ".q" not in arrays:
                return None
            q, top, step = (arrays.get(name + p) for p in (".q", ".top", ".step"))
            if q.ndim != 2 or top is None or step is None or top.shape != (q.shape[0],) or step.shape != top.shape:
                raise ValueError(f"array {name!r}: int8 needs .q [P, K] with .top and .step of shape [P]")
            return _int8_decode(q, top, step)
        return arrays[name].astype(np.float32) if name in arrays else None

    if "next_logprobs" not in arrays:
        raise ValueError("the answer has no 'next_logprobs'")
    for name in ("topk_ids", "hidden"):
        if name in arrays and arrays[name].ndim != 2:
            raise ValueError(f"array {name!r}: shape {list(arrays[name].shape)}, expected [P, width]")
    ids = arrays["topk_ids"].astype(np.int64) if "topk_ids" in arrays else None
    topk_lp = get_lp("topk_logprobs")
    if topk_lp is not None and "topk_log_tail" in arrays:
        tail = arrays["topk_log_tail"]
        if topk_lp.ndim != 2 or tail.shape != (topk_lp.shape[0],):
            raise ValueError(f"array 'topk_log_tail': shape {list(tail.shape)}, expected [{topk_lp.shape[0]}]")
        topk_lp = _restore_mass(topk_lp, tail.astype(np.float64))
    hid = arrays.get("hidden")
    if hid is not None:
        hid = hid.astype(np.float32) if hid_dtype == "fp32" else _from_bf16_bits(hid)
    return ScoreResult(ids, topk_lp, get_lp("next_logprobs").reshape(-1), get_lp("requested_logprobs"),
                       temperature, model, hid, hid_dtype, teacher)


# ---------------------------------------------------------------------------------------------------------------------
# What a server's engine can answer (its /info), checked by the server (422) and by the client before it sends

def engine_refusal(info: dict, *, k: int | None, temperature: float, num_requested: int | None,
                   attention_mask: torch.Tensor, hidden: bool = False) -> str | None:
    """Why a server whose ``/info`` is ``info`` cannot serve this request (one line), or None. The engine's limits in
    /info: ``max_k``, ``max_requested_ids`` (0: none), ``fixed_temperature`` (null: any), ``padding`` ("any", or
    "right": attention 1 on a prefix of each row) and ``max_model_len`` (null: none). A server without these fields
    (an older one) is taken to accept anything."""
    engine = info.get("engine", "hf")
    use = "send it to a server started with --engine hf"
    if k is not None and info.get("max_k") is not None and k > info["max_k"]:
        return f"k: {k} is above this server's max K {info['max_k']} (its --max-k); ask for at most {info['max_k']}"
    if hidden and not info.get("hidden", False):
        return (f"hidden: the {engine} engine cannot return the teacher's hidden states (loss_mode full); {use}"
                if info.get("engine") else "hidden: this server does not return hidden states (an older opdistill "
                                            "serve-teacher?); upgrade it or use loss_mode topk")
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
# Between the [B, S, ...] layout of TeacherScores and the [P, ...] answer

def to_wire(scores: TeacherScores, keep: torch.Tensor, temperature: float, hidden_dtype: str = "fp32") -> ScoreResult:
    """The answer at the scored positions ``keep`` [B, S] (row-major) of ``scores`` (which holds the next-token
    log-probs: the answer always carries them)."""
    top = scores.topk
    req = scores.requested_logprobs
    hid = None if scores.hidden is None else scores.hidden[keep].float().numpy()
    return ScoreResult(None if top is None else top.ids[keep].numpy(),
                       None if top is None else top.logprobs[keep].numpy(), scores.sampled_logprobs[keep].numpy(),
                       None if req is None else req[keep].numpy(), float(temperature), hidden=hid,
                       hidden_dtype=hidden_dtype)


def from_wire(r: ScoreResult, keep: torch.Tensor, *, k: int | None, sampled: bool, head=None) -> TeacherScores:
    """``r`` back in the ``[B, S, ...]`` layout of ``keep`` [B, S]; unscored positions hold what the loss reads as
    nothing (module notes). Hidden states arrive in bfloat16 or float32 as they travelled (``head``: their head)."""
    B, S = keep.shape
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
    req = None
    if r.requested_logprobs is not None:
        req = torch.full((B, S, r.requested_logprobs.shape[1]), float("-inf"), dtype=torch.float32)
        req[keep] = torch.from_numpy(np.ascontiguousarray(r.requested_logprobs))
    hid = None
    if r.hidden is not None:
        dtype = torch.bfloat16 if r.hidden_dtype == "bf16" else torch.float32
        hid = torch.zeros(B, S, r.hidden.shape[1], dtype=dtype)
        hid[keep] = torch.from_numpy(np.ascontiguousarray(r.hidden)).to(dtype)
    return TeacherScores(topk, samp, req, hid, head if hid is not None else None)


# ---------------------------------------------------------------------------------------------------------------------
# The teacher's output head (GET /v1/lm_head): what turns the hidden-state payload into its logits

HEAD_FORMAT = "opdistill-lm-head-v1"


def head_sha256(weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """SHA-256 over the head's tensors (name, dtype, shape, bytes): what a run records and checks on resume."""
    import hashlib

    from opdistill.teachers.fingerprint import hash_tensors

    h = hashlib.sha256()
    hash_tensors(h, [("weight", weight)] + ([] if bias is None else [("bias", bias)]))
    return h.hexdigest()


def encode_head(head, model: str = "") -> bytes:
    """A safetensors file of the head's ``weight`` [V, H] (and ``bias``) with its logit scale, soft-cap and SHA-256
    in the metadata (data only: nothing is unpickled on either side)."""
    from safetensors.torch import save

    tensors = {"weight": head.weight.detach().contiguous()}
    if head.bias is not None:
        tensors["bias"] = head.bias.detach().contiguous()
    meta = {"format": HEAD_FORMAT, "logit_scale": repr(float(head.logit_scale)),
            "softcap": "" if head.softcap is None else repr(float(head.softcap)), "model": model,
            "lm_head_sha256": head_sha256(tensors["weight"], tensors.get("bias"))}
    return save(tensors, metadata=meta)


def decode_head(body: bytes):
    """``encode_head``'s bytes back to an ``opdistill.fused.LMHead``, its SHA-256 checked (ValueError if not)."""
    from safetensors.torch import load

    from opdistill.fused import LMHead

    if len(body) < 8:
        raise ValueError("not a safetensors payload (too short)")
    (n,) = struct.unpack("<Q", body[:8])
    if n > len(body) - 8:
        raise ValueError("not a safetensors payload (its header runs past the end)")
    meta = json.loads(body[8 : 8 + n]).get("__metadata__") or {}
    tensors = load(body)
    if meta.get("format") != HEAD_FORMAT or "weight" not in tensors:
        raise ValueError(f"not an lm_head payload (format {meta.get('format')!r})")
    digest = head_sha256(tensors["weight"], tensors.get("bias"))
    if digest != meta.get("lm_head_sha256"):
        raise ValueError(f"the head's SHA-256 is {digest[:12]}, its metadata says {str(meta.get('lm_head_sha256'))[:12]}")
    softcap = float(meta["softcap"]) if meta.get("softcap") else None
    return LMHead(tensors["weight"], tensors.get("bias"), float(meta["logit_scale"]), softcap,
                  meta.get("model") or "teacher"), digest
