"""What identifies a teacher's scores: fingerprints of its weights and config and of the tokenizer.

The same fields travel in a teacher cache's provenance (``opdistill.teachers.cache``), a teacher server's ``/info``
(``opdistill.serve``) and a run's record of what it read: a hash over every weight tensor (name, dtype, shape, bytes),
a hash of the config without its volatile keys (load path, transformers version, dtype, KV-cache switch, private
keys), the dtype and the output vocabulary width; for the tokenizer, a hash of its vocabulary, special tokens and chat
template, and its size.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

import opdistill

__all__ = ["teacher_fingerprint", "teacher_fingerprint_from_folder", "tokenizer_fingerprint", "TEACHER_FIELDS",
           "TOKENIZER_FIELDS", "ANSWER_IDENTITY_FIELDS", "opdistill_version", "canonical_json", "hash_tensors"]

# Provenance fields compared with the current models (the others are recorded for the reader).
TEACHER_FIELDS = ("teacher_config_sha256", "teacher_weights_sha256", "teacher_dtype", "teacher_vocab_size")
TOKENIZER_FIELDS = ("tokenizer_sha256", "tokenizer_vocab_size")
# What every answer of a teacher server carries (its /info's values), checked by the client on every answer.
ANSWER_IDENTITY_FIELDS = ("teacher_weights_sha256", "teacher_config_sha256", "tokenizer_sha256")
# Config keys that do not change what a teacher computes: where it was loaded from, by which transformers, in which
# dtype (recorded separately as teacher_dtype), the KV-cache switch, and transformers' private ("_...") keys.
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "torch_dtype", "dtype", "use_cache"})


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def _tensor_bytes(t: torch.Tensor):
    """The raw bytes of ``t`` (any dtype, bf16 included) as a buffer, without a copy when already contiguous on CPU."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def hash_tensors(h, tensors) -> None:
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


def teacher_fingerprint(model, state: dict | None = None) -> dict:
    """What identifies a teacher's scores: SHA-256 of its config (``config.to_dict()`` as canonical JSON, minus the
    load path, transformers version, dtype and private keys), SHA-256 over its ``state_dict`` tensors (name, dtype,
    shape and bytes, in name order; one pass over the weights; ``state``: these tensors instead), its dtype and its
    output vocabulary width."""
    h = hashlib.sha256()
    hash_tensors(h, sorted((model.state_dict() if state is None else state).items()))
    return {
        "teacher_config_sha256": hashlib.sha256(canonical_json(_stable_config(model.config.to_dict()))).hexdigest(),
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
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError):  # unreadable: the caller loads the model instead
            return None
        if not isinstance(weight_map, dict):
            return None
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
        hash_tensors(h, [(name, t.to(ref.dtype))])
    params = [t for t in entries.values() if isinstance(t, torch.nn.Parameter)]
    return {
        "teacher_config_sha256": hashlib.sha256(canonical_json(_stable_config(model.config.to_dict()))).hexdigest(),
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
    return {"tokenizer_sha256": hashlib.sha256(canonical_json(spec)).hexdigest(),
            "tokenizer_vocab_size": len(tokenizer)}


def opdistill_version() -> str:
    version = getattr(opdistill, "__version__", None)
    if version:
        return str(version)
    try:
        from importlib.metadata import PackageNotFoundError, version as dist_version

        return dist_version("opdistill")
    except (ImportError, PackageNotFoundError):
        return "unknown"
