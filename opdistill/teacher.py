"""In-process teacher scoring (no grad) and its disk cache.

Design notes
- The teacher runs its backbone once per row chunk; the lm_head is applied chunk by chunk over token positions and
  each chunk's logits are reduced to what the loss needs (top-k ids + log-probs, and/or the log-prob of the sampled
  token) before the next chunk is computed. So no ``[batch, seq, vocab]`` buffer is ever kept, only one
  ``[chunk_tokens, vocab]`` block at a time.
- The teacher is always scored at temperature 1 (the SPEC's convention for teacher top-k, as a vLLM/SGLang server
  returns them). Row t holds the teacher distribution of token t+1, the same next-token layout as the student.
- The cache is one safetensors file: ``input_ids``/``attention_mask``/``response_mask`` (int32), ``topk_ids``
  (int32) and ``topk_logprobs`` (fp16 or fp32), optionally ``sampled_logprobs``; enough to rerun off-policy KD
  without the teacher. Format v2 records its provenance in the safetensors metadata (JSON): the teacher's config and
  weights hashes, dtype and vocabulary width, the tokenizer fingerprint (vocabulary, special tokens, chat template),
  K, the log-prob dtype, the opdistill version, and a SHA-256 checksum over the provenance and every tensor.
  :func:`load_cache` verifies the checksum, refuses a cache scored with other models than the ones it is given (with
  a diff of every differing field) and validates every value (ids, masks, log-probs, shapes) before any training;
  every refusal is a :class:`TeacherCacheError` naming the file (docs/trainer.md, "Teacher cache").
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

import opdistill
from opdistill.errors import UserError
from opdistill.ops.checks import check_mask
from opdistill import TeacherTopK
from opdistill.fused import backbone_of, no_cache_kwargs, read_lm_head

__all__ = ["TeacherScores", "TeacherCacheError", "score_teacher", "save_cache", "load_cache", "teacher_fingerprint",
           "teacher_fingerprint_from_folder", "tokenizer_fingerprint", "CACHE_FORMAT"]


@dataclass
class TeacherScores:
    topk: TeacherTopK | None  # ids [B, S, K] int64, logprobs [B, S, K] fp32
    sampled_logprobs: torch.Tensor | None  # [B, S] fp32, teacher log-prob of token t+1


@torch.no_grad()
def score_teacher(teacher, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, k: int | None = None,
                  sampled_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None, row_chunk: int = 64,
                  token_chunk: int = 2048) -> TeacherScores:
    """Teacher top-k (``k``) and/or sampled-token (``sampled_ids`` [B, S], usually the next-token targets) log-probs.

    The logits are the model's own, transform included (``opdistill.fused.read_lm_head``: Cohere/Granite/Falcon-H1
    logit multipliers, Gemma 2 soft-capping); a head the reader does not know is refused.

    ``positions`` [B, S] (bool or 0/1; usually the next-token response mask ``shift_for_next_token(...)[1]``): apply
    the lm_head only there. The backbone still runs over every position (attention needs them), but the
    ``[tokens, vocab]`` head GEMM, log-sum-exp and top-k cover only the rows the loss reads, and the results there are
    the full-layout scorer's exactly. Positions outside it are not computed: top-k rows there are empty slots (id 0,
    log-prob -inf: zero mass, what the loss turns masked rows into anyway) and sampled log-probs 0.
    Without ``positions`` every position is scored. Results are written into the ``[B, S, ...]`` outputs through
    contiguous views of the flattened layout (or, with ``positions``, one copy of the scored rows), never by per-chunk
    advanced indexing of the whole layout.

    Slot order: for ``k < V`` the slots hold the top-k in descending log-prob order (``topk``). For ``k = V`` (the
    whole vocabulary) slot ``j`` holds token ``j`` (ids ``0..V-1`` in vocabulary order; no ``topk``, which would be a
    full sort of every row): the same (id, log-prob) pairs bit for bit, in another order. Nothing reads the slot
    order (the losses, the overlap diagnostics, the cache and the server treat the K slots as a set)."""
    if k is None and sampled_ids is None:
        raise ValueError("score_teacher: ask for top-k (k=...) or sampled-token scores (sampled_ids=...), or both")
    B, S = input_ids.shape
    head = read_lm_head(teacher)
    V = head.weight.shape[0]
    if k is not None and not 1 <= k <= V:
        raise ValueError(f"k: expected 1 <= k <= vocab size {V}, got {k}")
    sel = None
    if positions is not None:
        if tuple(positions.shape) != (B, S):
            raise ValueError(f"positions: expected shape {(B, S)} (the shape of input_ids), got {tuple(positions.shape)}")
        sel = check_mask(positions, "positions").reshape(-1).cpu()
    backbone = backbone_of(teacher)
    no_cache = no_cache_kwargs(teacher)  # one forward: a KV cache would only be built and thrown away
    dev = teacher.device
    # Rows scored: every position of the flattened layout, or only those of ``positions`` (in layout order).
    n = B * S if sel is None else int(sel.sum())
    whole = k is not None and k == V  # every id: slot j = token j, no top-k (a full sort of each row)
    out_ids = torch.zeros(n, k, dtype=torch.long) if k and not whole else None
    out_lp = torch.zeros(n, k, dtype=torch.float32) if k else None
    out_samp = torch.zeros(n, dtype=torch.float32) if sampled_ids is not None else None
    flat_targets = sampled_ids.reshape(-1) if sampled_ids is not None else None
    was_training = teacher.training
    # eval() walks every module: skip it (and the restore) when nothing is in training mode (a frozen teacher)
    switch = any(m.training for m in teacher.modules())
    if switch:
        teacher.eval()
    try:
        done = 0  # rows of out_* written so far
        for r0 in range(0, B, row_chunk):
            ids = input_ids[r0 : r0 + row_chunk].to(dev)
            am = attention_mask[r0 : r0 + row_chunk].to(dev)
            b = ids.shape[0]
            lo, hi = r0 * S, (r0 + b) * S  # this row chunk in the flattened layout
            if sel is not None and not bool(sel[lo:hi].any()):
                continue
            hidden = backbone(input_ids=ids, attention_mask=am, **no_cache).last_hidden_state  # [b, S, H]
            flat = hidden.reshape(b * S, -1)
            if sel is None:
                tgt_rows = flat_targets[lo:hi] if flat_targets is not None else None
            else:
                keep = sel[lo:hi]
                flat = flat[keep.to(flat.device)]  # [n_chunk, H]: only the positions scored
                tgt_rows = flat_targets[lo:hi][keep] if flat_targets is not None else None
            for t0 in range(0, flat.shape[0], token_chunk):
                z = head.logits(flat[t0 : t0 + token_chunk])  # [c, V] fp32: the only vocab-wide buffer
                c = z.shape[0]
                lse = torch.logsumexp(z, dim=-1, keepdim=True)
                at = slice(done + t0, done + t0 + c)
                if whole:
                    out_lp[at] = (z - lse).cpu()
                elif k:
                    v, i = z.topk(k, dim=-1)
                    out_ids[at] = i.cpu()
                    out_lp[at] = (v - lse).cpu()
                if out_samp is not None:
                    tgt = tgt_rows[t0 : t0 + c].to(dev)
                    out_samp[at] = (z.gather(-1, tgt[:, None]) - lse).squeeze(-1).cpu()
            done += flat.shape[0]
    finally:
        if switch:
            teacher.train(was_training)
    vocab = torch.arange(V) if whole else None
    if sel is None:  # the flattened layout itself: views, no copy
        top_ids = (vocab.expand(B * S, V).contiguous() if whole else out_ids).view(B, S, k) if k else None
        top_lp = out_lp.view(B, S, k) if k else None
        samp = out_samp.view(B, S) if out_samp is not None else None
    else:
        top_ids = top_lp = samp = None
        if k:
            top_lp = torch.full((B * S, k), float("-inf"), dtype=torch.float32)
            top_lp[sel] = out_lp
            if whole:  # unscored rows: empty slots with id 0, as for k < V
                top_ids = torch.where(sel[:, None], vocab, 0)
            else:
                top_ids = torch.zeros(B * S, k, dtype=torch.long)
                top_ids[sel] = out_ids
            top_ids, top_lp = top_ids.view(B, S, k), top_lp.view(B, S, k)
        if out_samp is not None:
            samp = torch.zeros(B * S, dtype=torch.float32)
            samp[sel] = out_samp
            samp = samp.view(B, S)
    return TeacherScores(TeacherTopK(top_ids, top_lp, validated=True) if k else None, samp)  # our own scores


# ---------------------------------------------------------------------------------------------------------------------
# The teacher cache (format v2: provenance + checksum in the safetensors metadata, every value validated at load)

CACHE_FORMAT = "opdistill-teacher-cache-v2"
_FORMAT_PREFIX = "opdistill-teacher-cache-"
_V1_FORMAT = _FORMAT_PREFIX + "v1"
# A stored log-prob may exceed 0 by this much: fp32 log-softmax of a near-certain token, then fp16 rounding.
LOGPROB_TOL = 1e-3
_ROW_TENSORS = ("input_ids", "attention_mask", "response_mask")
_KNOWN_TENSORS = _ROW_TENSORS + ("topk_ids", "topk_logprobs", "sampled_logprobs")
_LOGPROB_DTYPES = {"float16": torch.float16, "float32": torch.float32}
# Provenance fields compared with the current models at load (the others are recorded for the reader).
_TEACHER_FIELDS = ("teacher_config_sha256", "teacher_weights_sha256", "teacher_dtype", "teacher_vocab_size")
_TOKENIZER_FIELDS = ("tokenizer_sha256", "tokenizer_vocab_size")
# Config keys that do not change what a teacher computes: where it was loaded from, by which transformers, in which
# dtype (recorded separately as teacher_dtype), the KV-cache switch, and transformers' private ("_...") keys.
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "torch_dtype", "dtype", "use_cache"})


class TeacherCacheError(UserError, ValueError):
    """A teacher cache that cannot be used: missing or unreadable, corrupt (checksum mismatch), in an old format,
    scored with other models than the current ones (the message lists every differing field, expected vs found), or
    holding an invalid value (the message names the tensor and the first bad position). The message is one line that
    names the file and the fix; the CLI prints it and exits 2."""

    kind = "teacher cache error"


def _canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def _tensor_bytes(t: torch.Tensor):
    """The raw bytes of ``t`` (any dtype, bf16 included) as a buffer, without a copy when already contiguous on CPU."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _hash_tensors(h, tensors) -> None:
    for name, t in tensors:
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}\n".encode())
        h.update(_tensor_bytes(t))


def _stable_config(d):
    if isinstance(d, dict):
        return {k: _stable_config(v) for k, v in d.items()
                if not str(k).startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    if isinstance(d, (list, tuple)):
        return [_stable_config(v) for v in d]
    return d


def teacher_fingerprint(model) -> dict:
    """What identifies a teacher's scores: SHA-256 of its config (``config.to_dict()`` as canonical JSON, minus the
    load path, transformers version, dtype and private keys), SHA-256 over its ``state_dict`` tensors (name, dtype,
    shape and bytes, in name order; one pass over the weights), its dtype and its output vocabulary width."""
    h = hashlib.sha256()
    _hash_tensors(h, sorted(model.state_dict().items()))
    return {
        "teacher_config_sha256": hashlib.sha256(_canonical_json(_stable_config(model.config.to_dict()))).hexdigest(),
        "teacher_weights_sha256": h.hexdigest(),
        "teacher_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "teacher_vocab_size": int(model.get_output_embeddings().weight.shape[0]),
    }


def teacher_fingerprint_from_folder(path, *, dtype: str = "float32", trust_remote_code: bool = False) -> dict | None:
    """``teacher_fingerprint(load_model(path, dtype=dtype))`` without holding the model: the model is built on the meta
    device (its ``state_dict`` names, dtypes and shapes) and each tensor is read from the folder's safetensors files
    one at a time, cast to its dtype and hashed (peak memory: one tensor). Tied weights are read from the tensor they
    share. Returns None where that cannot reproduce the loaded model (a ``state_dict`` entry absent from the files, a
    shape that differs, no safetensors files): the caller then loads the model (used where another engine, e.g.
    ``serve-teacher --engine vllm``, holds the weights)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from opdistill.models import parse_dtype

    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (folder / "model.safetensors").exists():
        weight_map = None
    else:
        return None
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=parse_dtype(dtype), trust_remote_code=trust_remote_code)
    entries = model.state_dict(keep_vars=True)
    files: dict[str, object] = {}

    def open_file(name: str):
        fname = weight_map.get(name) if weight_map is not None else "model.safetensors"
        if fname is None:
            return None
        if fname not in files:
            files[fname] = safe_open(str(folder / fname), framework="pt")
        f = files[fname]
        return f if name in f.keys() else None

    h = hashlib.sha256()
    for name in sorted(entries):
        ref = entries[name]
        source = next((n for n in [name] + [m for m, t in entries.items() if t is ref and m != name]
                       if open_file(n) is not None), None)
        if source is None:
            return None
        t = open_file(source).get_tensor(source)
        if list(t.shape) != list(ref.shape):
            return None
        _hash_tensors(h, [(name, t.to(ref.dtype))])
    params = [t for t in entries.values() if isinstance(t, torch.nn.Parameter)]
    return {
        "teacher_config_sha256": hashlib.sha256(_canonical_json(_stable_config(model.config.to_dict()))).hexdigest(),
        "teacher_weights_sha256": h.hexdigest(),
        "teacher_dtype": str(params[0].dtype).removeprefix("torch."),
        "teacher_vocab_size": int(model.get_output_embeddings().weight.shape[0]),
    }


def tokenizer_fingerprint(tokenizer) -> dict:
    """SHA-256 of the tokenizer's vocabulary (token -> id, added tokens included), special tokens (string and id)
    and chat template, plus its size."""
    specials = {name: [None if getattr(tokenizer, name, None) is None else str(getattr(tokenizer, name)),
                       getattr(tokenizer, name + "_id", None)]
                for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    extra = getattr(tokenizer, "additional_special_tokens", None) or []
    specials["additional_special_tokens"] = [str(t) for t in extra]
    spec = {"vocab": tokenizer.get_vocab(), "special_tokens": specials,
            "chat_template": getattr(tokenizer, "chat_template", None)}
    return {"tokenizer_sha256": hashlib.sha256(_canonical_json(spec)).hexdigest(),
            "tokenizer_vocab_size": len(tokenizer)}


def _opdistill_version() -> str:
    version = getattr(opdistill, "__version__", None)
    if version:
        return str(version)
    try:
        from importlib.metadata import PackageNotFoundError, version as dist_version

        return dist_version("opdistill")
    except (ImportError, PackageNotFoundError):
        return "unknown"


def _checksum(tensors: dict, provenance: dict) -> str:
    """SHA-256 over the provenance (without the checksum itself) and every tensor (name, dtype, shape, bytes) in name
    order: a flipped bit anywhere in the header's provenance or in the payload changes it."""
    h = hashlib.sha256(_canonical_json({k: v for k, v in provenance.items() if k != "checksum_sha256"}))
    _hash_tensors(h, sorted(tensors.items()))
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
        "opdistill_version": _opdistill_version(),
    }
    _check_cache(path, t, prov)
    prov["checksum_sha256"] = _checksum(t, prov)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()  # never write through a link left at the temporary name
    save_file(t, str(tmp), metadata={"format": CACHE_FORMAT, "provenance": json.dumps(prov, sort_keys=True)})
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)  # replaces a link at ``path`` itself, never its target
    return path


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
                                    f"{_opdistill_version()} (it reads {CACHE_FORMAT}); re-score it with "
                                    f"`opdistill score` or use the opdistill version that wrote it")
        raise TeacherCacheError(f"{path}: not an opdistill teacher cache (metadata format {fmt!r}); write one with "
                                f"`opdistill score`")
    try:
        prov = json.loads(meta["provenance"])
        if not isinstance(prov, dict) or not isinstance(prov.get("checksum_sha256"), str):
            raise ValueError("not a JSON object with a checksum_sha256 string")
    except (KeyError, ValueError) as e:
        raise TeacherCacheError(f"{path}: the cache's provenance metadata is missing or corrupt ({e}); re-score it "
                                f"with `opdistill score`") from e
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
