"""The teacher cache: a safetensors file of scored rows (``opdistill score``), and :class:`CachedTeacher`, the
teacher that answers from it.

- The file holds ``input_ids``/``attention_mask``/``response_mask`` (int32), ``topk_ids`` (int32) and
  ``topk_logprobs`` (fp16 or fp32), optionally ``sampled_logprobs``; enough to rerun off-policy KD without the teacher.
  Format v2 records its provenance in the safetensors metadata (JSON): the teacher's config and weights hashes, dtype
  and vocabulary width, the tokenizer fingerprint (vocabulary, special tokens, chat template), K, the log-prob dtype,
  the opdistill version, and a SHA-256 checksum over the provenance and every tensor. :func:`load_cache` verifies the
  checksum, refuses a cache scored with other models than the ones it is given (with a diff of every differing field)
  and validates every value (ids, masks, log-probs, shapes) before any training; every refusal is a
  :class:`TeacherCacheError` naming the file (docs/trainer.md, "Teacher cache").
- :class:`CachedTeacher` scores rows by looking them up in a loaded cache (by their tokens and response mask): a row
  the cache holds gets its stored scores (the row's width cut or padded to the request's), any other row goes to the
  wrapped teacher, or is refused when there is none. Off-policy KD from a cache (``data.teacher_cache``) reads its
  rows from the cache itself, so every lookup hits.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from opdistill.durable import replace_durably
from opdistill.errors import UserError
from opdistill.loss import TeacherScores, TeacherTopK
from opdistill.teachers.answers import LOGPROB_TOL  # a stored log-prob may exceed 0 by this much (one home)
from opdistill.teachers.base import Rows, ScoreRequest, Teacher, WrappedTeacher
from opdistill.teachers.fingerprint import (canonical_json, hash_tensors, opdistill_version, teacher_fingerprint,
                                            tokenizer_fingerprint)

__all__ = ["CACHE_FORMAT", "TeacherCacheError", "save_cache", "load_cache", "check_provenance", "CachedTeacher"]

CACHE_FORMAT = "opdistill-teacher-cache-v2"
_FORMAT_PREFIX = "opdistill-teacher-cache-"
_V1_FORMAT = _FORMAT_PREFIX + "v1"
_ROW_TENSORS = ("input_ids", "attention_mask", "response_mask")
_KNOWN_TENSORS = _ROW_TENSORS + ("topk_ids", "topk_logprobs", "sampled_logprobs")
_LOGPROB_DTYPES = {"float16": torch.float16, "float32": torch.float32}


class TeacherCacheError(UserError, ValueError):
    """A teacher cache that cannot be used: missing or unreadable, corrupt (checksum mismatch), in an old format,
    scored with other models than the current ones (the message lists every differing field, expected vs found), or
    holding an invalid value (the message names the tensor and the first bad position). The message is one line that
    names the file and the fix; the CLI prints it and exits 2."""

    kind = "teacher cache error"


def _checksum(tensors: dict, provenance: dict) -> str:
    """SHA-256 over the provenance (without the checksum itself) and every tensor (name, dtype, shape, bytes) in name
    order: a flipped bit anywhere in the header's provenance or in the payload changes it."""
    h = hashlib.sha256(canonical_json({k: v for k, v in provenance.items() if k != "checksum_sha256"}))
    hash_tensors(h, sorted(tensors.items()))
    return h.hexdigest()


def _position(flat_index: int, shape) -> str:
    idx = []
    for dim in reversed(shape):
        idx.append(flat_index % dim)
        flat_index //= dim
    return "[" + ", ".join(str(i) for i in reversed(idx)) + "]"


def _first_bad(path: Path, name: str, t: torch.Tensor, bad: torch.Tensor, rule: str) -> None:
    """Raise naming ``t``'s first position where ``bad`` holds (row-major order)."""
    if bool(bad.any()):
        i = int(bad.reshape(-1).to(torch.uint8).argmax())
        value = t.reshape(-1)[i].item()
        value = f"{value:.6g}" if isinstance(value, float) else value
        raise TeacherCacheError(f"{path}: tensor {name!r} holds {value} at {_position(i, list(t.shape))}; {rule}; "
                                f"re-score the cache with `opdistill score`")


def _check_cache(path: Path, t: dict, prov: dict) -> None:
    """Every structural and value check of a cache (run before writing and after reading)."""
    def fail(msg: str):
        raise TeacherCacheError(f"{path}: {msg}; re-score the cache with `opdistill score`")

    unknown = sorted(set(t) - set(_KNOWN_TENSORS))
    if unknown:
        fail(f"unexpected tensors {unknown} (a teacher cache holds {list(_KNOWN_TENSORS)})")
    for name in _ROW_TENSORS:
        if name not in t:
            fail(f"tensor {name!r} is missing")
    if ("topk_ids" in t) != ("topk_logprobs" in t):
        fail("tensors 'topk_ids' and 'topk_logprobs' must both be present or both absent")
    if "topk_ids" not in t and "sampled_logprobs" not in t:
        fail("holds no teacher scores (neither 'topk_ids'/'topk_logprobs' nor 'sampled_logprobs')")
    lp_dtype = _LOGPROB_DTYPES.get(prov.get("logprob_dtype"))
    if lp_dtype is None:
        fail(f"provenance 'logprob_dtype' is {prov.get('logprob_dtype')!r}, expected one of {list(_LOGPROB_DTYPES)}")
    vocab = prov.get("teacher_vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        fail(f"provenance 'teacher_vocab_size' is {vocab!r}, expected an int >= 1")
    k = prov.get("k")
    if ("topk_ids" in t) != (k is not None):
        fail(f"provenance 'k' is {k!r} but the cache {'holds' if 'topk_ids' in t else 'has no'} top-k tensors")

    ids = t["input_ids"]
    if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        fail(f"tensor 'input_ids' has shape {list(ids.shape)}, expected [rows >= 1, positions >= 1]")
    rows_shape = list(ids.shape)
    expected = {"input_ids": (torch.int32, rows_shape), "attention_mask": (torch.int32, rows_shape),
                "response_mask": (torch.int32, rows_shape), "sampled_logprobs": (lp_dtype, rows_shape)}
    if k is not None:
        expected["topk_ids"] = (torch.int32, rows_shape + [k])
        expected["topk_logprobs"] = (lp_dtype, rows_shape + [k])
    for name, tensor in t.items():
        dtype, shape = expected[name]
        if tensor.dtype != dtype or list(tensor.shape) != shape:
            fail(f"tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}, expected "
                 f"{str(dtype).removeprefix('torch.')} {shape}")

    for name in ("attention_mask", "response_mask"):
        _first_bad(path, name, t[name], (t[name] != 0) & (t[name] != 1), "masks hold only 0 and 1")
    _first_bad(path, "response_mask", t["response_mask"], (t["response_mask"] == 1) & (t["attention_mask"] == 0),
               "a response token must be attended (attention_mask 1 there)")
    for name in ("input_ids", "topk_ids"):
        if name in t:
            _first_bad(path, name, t[name], (t[name] < 0) | (t[name] >= vocab),
                       f"token ids must lie in [0, {vocab}) (the teacher's vocabulary)")
    for name in ("topk_logprobs", "sampled_logprobs"):
        if name in t:
            x = t[name]
            _first_bad(path, name, x, x.isnan() | (x == float("inf")),
                       "log-probs must be finite or -inf")
            _first_bad(path, name, x, x > LOGPROB_TOL, f"log-probs must be <= 0 (tolerance {LOGPROB_TOL})")


def save_cache(path: str | os.PathLike, *, input_ids, attention_mask, response_mask, scores: TeacherScores,
               teacher, tokenizer, logprob_dtype: torch.dtype = torch.float16) -> Path:
    """Write a teacher cache with its provenance (``teacher``: the model that scored it; ``tokenizer``: the one
    that made ``input_ids``), atomically (temp file, fsync, rename). Every value is checked first, so an invalid
    cache is never written (:class:`TeacherCacheError`)."""
    from safetensors.torch import save_file

    if logprob_dtype not in (torch.float16, torch.float32):
        raise ValueError(f"logprob_dtype: expected torch.float16 or torch.float32, got {logprob_dtype}")
    t = {
        "input_ids": input_ids.to(torch.int32).contiguous(),
        "attention_mask": attention_mask.to(torch.int32).contiguous(),
        "response_mask": response_mask.to(torch.int32).contiguous(),
    }
    if scores.topk is not None:
        t["topk_ids"] = scores.topk.ids.to(torch.int32).contiguous()
        # fp16 keeps ~3 significant digits; -inf (empty slot) survives, values below -65504 round to -inf.
        t["topk_logprobs"] = scores.topk.logprobs.to(logprob_dtype).contiguous()
    if scores.sampled_logprobs is not None:
        t["sampled_logprobs"] = scores.sampled_logprobs.to(logprob_dtype).contiguous()
    path = Path(path)
    prov = {
        **teacher_fingerprint(teacher),
        **tokenizer_fingerprint(tokenizer),
        "teacher_name": str(getattr(teacher.config, "_name_or_path", "") or ""),  # recorded, never compared
        "k": None if scores.topk is None else int(scores.topk.ids.shape[-1]),
        "logprob_dtype": str(logprob_dtype).removeprefix("torch."),
        "opdistill_version": opdistill_version(),
    }
    _check_cache(path, t, prov)
    prov["checksum_sha256"] = _checksum(t, prov)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()  # never write through a link left at the temporary name
    save_file(t, str(tmp), metadata={"format": CACHE_FORMAT, "provenance": json.dumps(prov, sort_keys=True)})
    return replace_durably(tmp, path)  # replaces a link at ``path`` itself, never its target


def _short(field: str, value):
    if field.endswith("_sha256") and isinstance(value, str):
        return value[:12]
    return value


def _compare(path: Path, prov: dict, current: dict) -> None:
    diff = [f"{field}: expected {_short(field, want)!r}, found {_short(field, prov.get(field))!r}"
            for field, want in current.items() if prov.get(field) != want]
    if diff:
        raise TeacherCacheError(f"{path}: the cache was scored with other models than the current ones: "
                                f"{'; '.join(diff)} (expected = current models, found = the cache); re-score it with "
                                f"`opdistill score` using the current teacher and tokenizer")


def load_cache(path: str | os.PathLike, *, teacher=None, tokenizer=None, expect_k: int | None = None) -> dict:
    """Read a teacher cache back, verified: int64 ids/masks, fp32 log-probs, ``scores`` as TeacherScores and the
    recorded ``provenance`` dict.

    Checked, in order (each refusal a :class:`TeacherCacheError` naming the file): the file reads as safetensors; it
    is a v2 cache (a v1 cache has no provenance: re-score it); the checksum over provenance and tensors matches;
    the provenance matches ``teacher`` (config, weights, dtype, vocabulary width), ``tokenizer`` (fingerprint, size)
    and ``expect_k`` when given -- every differing field is listed; every tensor has the expected dtype and shape, the
    masks hold 0/1 (a response token is attended), ids lie in [0, teacher vocab), log-probs are finite or -inf and
    <= 0 (tolerance :data:`LOGPROB_TOL`). A value error names the tensor and its first bad position."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise TeacherCacheError(f"{path}: no such teacher cache file (write one with `opdistill score`)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            t = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # noqa: BLE001 -- any parse failure of the file is one user-facing refusal
        reason = " ".join(str(e).split()) or type(e).__name__
        raise TeacherCacheError(f"{path}: not a readable safetensors file ({reason}); the file is corrupt or not a "
                                f"teacher cache: re-score it with `opdistill score`") from e
    fmt = meta.get("format")
    if fmt == _V1_FORMAT:
        raise TeacherCacheError(f"{path}: a v1 teacher cache, which records no provenance (teacher, tokenizer) and no "
                                f"checksum, so it cannot be checked against the current models; re-score it with "
                                f"`opdistill score` (writes {CACHE_FORMAT})")
    if fmt != CACHE_FORMAT:
        if isinstance(fmt, str) and fmt.startswith(_FORMAT_PREFIX):
            raise TeacherCacheError(f"{path}: teacher cache format {fmt!r} is not readable by opdistill "
                                    f"{opdistill_version()} (it reads {CACHE_FORMAT}); re-score it with "
                                    f"`opdistill score` or use the opdistill version that wrote it")
        raise TeacherCacheError(f"{path}: not an opdistill teacher cache (metadata format {fmt!r}); write one with "
                                f"`opdistill score`")
    try:
        prov = json.loads(meta["provenance"])
        if not isinstance(prov, dict) or not isinstance(prov.get("checksum_sha256"), str):
            raise ValueError("not a JSON object with a checksum_sha256 string")
    except (KeyError, ValueError, RecursionError) as e:
        raise TeacherCacheError(f"{path}: the cache's provenance metadata is missing or corrupt "
                                f"({str(e)[:200]}); re-score it with `opdistill score`") from None
    actual = _checksum(t, prov)
    if actual != prov["checksum_sha256"]:
        raise TeacherCacheError(f"{path}: checksum mismatch (SHA-256 of provenance and tensors is {actual[:12]}, the "
                                f"file records {prov['checksum_sha256'][:12]}): the file is corrupt; re-score it with "
                                f"`opdistill score` or restore an intact copy")
    current = {}
    if teacher is not None:
        current.update(teacher_fingerprint(teacher))
    if tokenizer is not None:
        current.update(tokenizer_fingerprint(tokenizer))
    if expect_k is not None:
        current["k"] = expect_k
    _compare(path, prov, current)
    _check_cache(path, t, prov)
    topk = TeacherTopK(t["topk_ids"].long(), t["topk_logprobs"].float(), validated=True) if "topk_ids" in t else None
    samp = t["sampled_logprobs"].float() if "sampled_logprobs" in t else None
    return {
        "input_ids": t["input_ids"].long(),
        "attention_mask": t["attention_mask"].long(),
        "response_mask": t["response_mask"].long(),
        "scores": TeacherScores(topk, samp),
        "provenance": prov,
    }


def check_provenance(path, cache: dict, *, teacher=None, tokenizer=None) -> None:
    """Refuse a loaded cache (:func:`load_cache`'s dict) scored with other models than ``teacher`` / ``tokenizer``,
    listing every differing field (what :func:`load_cache` checks when given them; for a cache read before the
    teacher was loaded)."""
    current = {}
    if teacher is not None:
        current.update(teacher_fingerprint(teacher))
    if tokenizer is not None:
        current.update(tokenizer_fingerprint(tokenizer))
    _compare(Path(path), cache["provenance"], current)


def _row_key(ids: torch.Tensor, attention: torch.Tensor, response: torch.Tensor) -> tuple:
    """What identifies a row: its attended tokens and which of them are response tokens (padding ignored)."""
    keep = attention.bool()
    return tuple(ids[keep].tolist()), tuple(response[keep].tolist())


class CachedTeacher(WrappedTeacher):
    """Scores from a loaded cache (:func:`load_cache`'s dict): each row is looked up by its tokens and response mask;
    rows the cache does not hold are scored by ``inner`` (a Teacher) or refused when ``inner`` is None. Only what the
    cache stored can be answered from it: top-k at its K, sampled-token log-probs, temperature 1."""

    cannot = {"hidden": "a teacher cache does not hold", "mapped": "reads each prompt's text, which a cache's rows do "
              "not keep"}

    def __init__(self, cache: dict, *, inner: Teacher | None = None, key: str = "data.teacher_cache"):
        super().__init__(inner)
        self.cache, self.key = cache, key
        ids, am, rm = cache["input_ids"], cache["attention_mask"], cache["response_mask"]
        self._index: dict[tuple, int] = {}
        for i in range(ids.shape[0]):
            self._index.setdefault(_row_key(ids[i], am[i], rm[i]), i)  # equal rows hold equal scores: the first
        self.hits = 0

    def _answerable(self, request: ScoreRequest) -> str | None:
        s = self.cache["scores"]
        if request.temperature != 1.0:
            return f"temperature {request.temperature:g} (the cache holds temperature-1 scores)"
        if request.requested_ids is not None:
            return "log-probs at requested ids (the cache holds the top-k and the sampled tokens' only)"
        if request.hidden:
            return "hidden states (loss_mode full; the cache holds top-k and sampled-token log-probs only)"
        if request.k is not None and (s.topk is None or s.topk.ids.shape[-1] != request.k):
            held = "no top-k" if s.topk is None else f"top-{s.topk.ids.shape[-1]}"
            return f"top-{request.k} (the cache holds {held})"
        if request.sampled and s.sampled_logprobs is None:
            return "sampled-token log-probs (the cache holds none)"
        return None

    def score(self, rows: Rows, request: ScoreRequest) -> TeacherScores:
        why = self._answerable(request)
        found = [self._index.get(_row_key(rows.input_ids[b], rows.attention_mask[b], rows.response_mask[b]))
                 for b in range(rows.num_rows)]
        missing = [b for b, i in enumerate(found) if i is None]
        if why is not None or missing:
            if self.inner is None:
                reason = why or f"row {missing[0]} of {request.what or rows.describe()} is not in the cache"
                raise TeacherCacheError(f"{self.key}: cannot answer {reason}; re-score the cache with `opdistill "
                                        f"score` or configure the teacher it stands for")
            if why is not None or len(missing) == rows.num_rows:
                return self.inner.score(rows, request)
        idx = torch.tensor([0 if i is None else i for i in found], dtype=torch.long)
        out = self._stored(idx, rows.width, request)
        self.hits += rows.num_rows - len(missing)
        if not missing:
            return out
        sel = torch.tensor(missing, dtype=torch.long)
        hit = torch.tensor([b for b in range(rows.num_rows) if b not in set(missing)], dtype=torch.long)
        fresh = self.inner.score(rows.select(sel), request.select(sel, request.what))
        return TeacherScores.join([out.micro(hit, rows.width), fresh], torch.cat([hit, sel]))

    def _stored(self, idx: torch.Tensor, width: int, request: ScoreRequest) -> TeacherScores:
        """The cache's scores of rows ``idx``, at the rows' width (cut, or padded with unscored positions)."""
        s = self.cache["scores"]
        S = self.cache["input_ids"].shape[1]

        def fit(x, fill):
            x = x[idx]
            if width <= S:
                return x[:, :width]
            pad = torch.full((x.shape[0], width - S) + tuple(x.shape[2:]), fill, dtype=x.dtype)
            return torch.cat([x, pad], dim=1)

        topk = None
        if request.k is not None:
            topk = TeacherTopK(fit(s.topk.ids, 0), fit(s.topk.logprobs, float("-inf")), validated=s.topk.validated)
        sampled = fit(s.sampled_logprobs, 0.0) if request.sampled else None
        return TeacherScores(topk, sampled)
