"""Each token id of a tokenizer as the bytes of text it stands for: :func:`token_bytes` -> :class:`TokenBytes`.

Cross-tokenizer distillation compares two tokenizations of one response by their bytes (SPEC 6.6), so each side
must say which bytes each of its ids writes. A fast (``tokenizers``) tokenizer says it through its decoder:

- **byte-level** (a ``ByteLevel`` decoder: GPT-2, Llama 3, Qwen, SmolLM2, our demo BPE): each character of the token
  string is one byte through GPT-2's byte-to-unicode table;
- **SentencePiece style** (``Replace("▁", " ")`` with ``ByteFallback``, or ``Metaspace``: Llama 2, Mistral, Gemma):
  ``▁`` is a space, ``<0xNN>`` is byte NN (byte fallback), anything else its UTF-8;
- **plain** (a ``Fuse`` decoder or none, over a pre-tokenizer that keeps every character: our character-level demo
  tokenizer): the token string's UTF-8.

Anything else (WordPiece's ``##``, a pre-tokenizer that drops whitespace, a slow tokenizer) cannot say which bytes
an id writes: :func:`token_bytes` refuses it in one line naming the tokenizer and its decoder
(:class:`TokenizerBytesError`).

Special tokens (``<s>``, ``</s>``, ``<|im_end|>``) write no text. Each gets a *sentinel*: ``0xFF``, its content,
``0xFF`` (0xFF never occurs in UTF-8 text, so no text writes it and no sentinel is a prefix of another), the two
end-of-sequence tokens one shared sentinel whatever their content. So a special token is matched across tokenizers
by its content, end to end, through the same byte comparison as text.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import sys
import time
from dataclasses import dataclass, field

from opdistill.errors import ConfigError, IncompatibleModelsError, ModelError, first_line

__all__ = ["TokenBytes", "TokenizerBytesError", "token_bytes", "byte_level_table", "check_chat_templates",
           "render_chat", "template_error", "sentinel",
           "EOS_SENTINEL"]


class TokenizerBytesError(ConfigError):
    """A tokenizer whose ids cannot be mapped to the bytes they write (no byte-level decode)."""


def byte_level_table() -> dict[str, int]:
    """GPT-2's byte-to-unicode table inverted: the character a byte-level token string uses -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_DROPS_TEXT = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer", "CharDelimiterSplit", "Punctuation"}


def _types(node) -> list[str]:
    """The component types of a tokenizers.json decoder / pre-tokenizer node (a Sequence: its members')."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        key = "decoders" if "decoders" in node else "pretokenizers"
        return [t for member in node.get(key, []) for t in _types(member)]
    return [node.get("type")]


EOS_SENTINEL = b"\xff</eos>\xff"


def sentinel(content: str, eos: bool = False) -> bytes:
    """The bytes a special token stands for (module notes)."""
    return EOS_SENTINEL if eos else b"\xff" + content.encode("utf-8") + b"\xff"


@dataclass
class TokenBytes:
    """``table[id]``: the bytes token ``id`` writes (a special token: its sentinel; None: an id that writes nothing
    known); ``specials``: special token content -> id; ``eos_id``: the end-of-sequence id (None: none); ``name``:
    the tokenizer, for messages."""

    name: str
    table: list
    specials: dict
    eos_id: int | None
    kind: str
    _trie: dict | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.table)

    def __post_init__(self):
        self._special_ids = set(self.specials.values()) | ({self.eos_id} if self.eos_id is not None else set())

    def is_special(self, i: int) -> bool:
        return i in self._special_ids

    def longest_prefix(self, data: bytes) -> int:
        """The id of the longest token whose bytes are a prefix of ``data`` (-1: none). Tokens with the same bytes:
        the lowest id."""
        if self._trie is None:
            trie: dict = {}
            for i, b in enumerate(self.table):
                if not b:
                    continue
                node = trie
                for x in b:
                    node = node.setdefault(x, {})
                node.setdefault(-1, i)
            self._trie = trie
        node, best = self._trie, -1
        for x in data:
            node = node.get(x)
            if node is None:
                break
            best = node.get(-1, best)
        return best


_READ: dict[str, TokenBytes] = {}  # by content (a few entries): the preflight's reading and the teacher's share it


def token_bytes(tokenizer, name: str = "tokenizer") -> TokenBytes:
    """The bytes each id of ``tokenizer`` writes (module notes), or TokenizerBytesError naming ``name``. Read once
    per tokenizer content (its tokenizer.json, special tokens, end-of-sequence id and length): the preflight check
    and the teacher that maps use one reading though each loads its own tokenizer object."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TokenizerBytesError(f"{name}: {type(tokenizer).__name__} is not a fast tokenizer, so the bytes each "
                                  f"of its tokens writes cannot be read; cross-tokenizer distillation needs a "
                                  f"tokenizer.json")
    text = backend.to_str()
    special_ids = {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    key = hashlib.sha256(f"{text}\0{sorted(special_ids.items())}\0{tokenizer.eos_token_id}\0{len(tokenizer)}"
                         .encode()).hexdigest()
    read = _READ.get(key)
    if read is None:
        read = _read(tokenizer, name, json.loads(text), special_ids)
        if len(_READ) >= 8:
            _READ.clear()
        _READ[key] = read
    return read if read.name == name else dataclasses.replace(read, name=name)


def _read(tokenizer, name: str, spec: dict, special_ids: dict) -> TokenBytes:
    decoders = _types(spec.get("decoder"))
    pre = _types(spec.get("pre_tokenizer"))
    if "ByteLevel" in decoders:
        kind = "byte-level"
    elif "ByteFallback" in decoders or "Metaspace" in decoders or "Replace" in decoders:
        kind = "sentencepiece"
    elif set(decoders) <= {"Fuse"} and not set(pre) & _DROPS_TEXT:
        kind = "plain"
    else:
        raise TokenizerBytesError(
            f"{name}: cannot map its tokens to bytes (decoder {'+'.join(decoders) or 'none'}, pre-tokenizer "
            f"{'+'.join(pre) or 'none'}): cross-tokenizer distillation needs a byte-level, SentencePiece-style or "
            f"character-preserving tokenizer")
    vocab = tokenizer.get_vocab()
    size = max(max(vocab.values()) + 1, len(tokenizer))
    table: list = [None] * size
    byte_of = byte_level_table() if kind == "byte-level" else None
    for text, i in vocab.items():
        if i in special_ids:
            continue
        if kind == "byte-level":
            try:
                table[i] = bytes(byte_of[ch] for ch in text)
            except KeyError:  # an added (non-special) token stored as plain text
                table[i] = text.encode("utf-8")
        elif kind == "sentencepiece":
            m = _BYTE_FALLBACK.match(text)
            table[i] = bytes([int(m.group(1), 16)]) if m else text.replace("▁", " ").encode("utf-8")
        else:
            table[i] = text.encode("utf-8")
        if table[i] == b"":
            table[i] = None
    eos = tokenizer.eos_token_id
    for i, content in special_ids.items():
        if i < size:
            table[i] = sentinel(content, eos=i == eos)
    specials = {content: i for i, content in special_ids.items()}
    return TokenBytes(name=name, table=table, specials=specials, eos_id=eos, kind=kind)


_PROBE = [{"role": "user", "content": "What is 12 + 30?"}]
_PROBE_ANSWER = "  12 + 30 = 42.\nSo the answer is 42  "


def template_error(tokenizer, e: Exception) -> ModelError:
    """A chat template that raised (its ``raise_exception``, a jinja error, a type error in its code), as one line
    naming the tokenizer."""
    return ModelError(f"the chat template of {_name(tokenizer)} failed: {type(e).__name__}: {first_line(e)}")


TEMPLATE_SECONDS = 10.0  # the longest a chat template may take to render one conversation
TEMPLATE_MAX_CHARS = 4 << 20  # the most text it may write for one


class _TemplateOverrun(Exception):
    pass


def render_chat(tokenizer, messages: list, *, add_generation_prompt: bool, tools: list | None = None) -> str:
    """The text ``tokenizer``'s chat template writes for ``messages``, bounded: a template (the model folder's code,
    run in transformers' jinja sandbox) that raises, runs past :data:`TEMPLATE_SECONDS` (a loop) or writes more than
    :data:`TEMPLATE_MAX_CHARS` is a one-line :class:`ModelError`, stopped where it is. The bounds are checked by a
    trace function on the template's own compiled code only (jinja's ``<template>`` frames: every line, every piece
    of text it yields), so the rest of the program runs untraced. ``tools``: the tools' JSON schemas, which the
    template lists for the model (``apply_chat_template(tools=...)``; an episode's prompt, SPEC 6.8)."""
    deadline, written = time.monotonic() + TEMPLATE_SECONDS, [0]

    def in_template(frame, event, arg):
        if event == "return" and isinstance(arg, str):  # a piece of output (a generator's yield)
            written[0] += len(arg)
            if written[0] > TEMPLATE_MAX_CHARS:
                raise _TemplateOverrun(f"wrote more than {TEMPLATE_MAX_CHARS} characters")
        if time.monotonic() > deadline:
            raise _TemplateOverrun(f"ran longer than {TEMPLATE_SECONDS:g} s")
        return in_template

    def on_call(frame, event, arg):
        if frame.f_code.co_filename == "<template>":
            return in_template(frame, event, arg)
        return None  # no line events elsewhere

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **({"tools": tools} if tools else {}))
    except _TemplateOverrun as e:
        raise ModelError(f"the chat template of {_name(tokenizer)} {e} rendering a conversation of {len(messages)} "
                         f"message(s); a chat template is a few lines of formatting (a loop in it?)") from None
    except Exception as e:  # noqa: BLE001 -- the template is the model folder's code: its failure in one line
        raise template_error(tokenizer, e) from None
    finally:
        sys.settrace(previous)
    if not isinstance(text, str) or len(text) > TEMPLATE_MAX_CHARS:
        raise ModelError(f"the chat template of {_name(tokenizer)} wrote "
                         f"{len(text) if isinstance(text, str) else type(text).__name__} characters for a conversation "
                         f"of {len(messages)} message(s), more than {TEMPLATE_MAX_CHARS}")
    return text


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def check_chat_templates(student_tok, teacher_tok, *, key: str = "model.teacher") -> None:
    """Refuse a pair whose chat templates write the assistant's response differently (one strips its whitespace,
    inserts a reasoning block, ...): the text the student writes after its generation prompt must be what the
    teacher's template puts after its own. Checked on a probe conversation; the message shows the difference."""
    seen = {}
    for side, tok in (("student", student_tok), ("teacher", teacher_tok)):
        if not getattr(tok, "chat_template", None):
            seen[side] = _PROBE_ANSWER
            continue
        prompt = render_chat(tok, _PROBE, add_generation_prompt=True)
        full = render_chat(tok, _PROBE + [{"role": "assistant", "content": _PROBE_ANSWER}], add_generation_prompt=False)
        if not full.startswith(prompt):
            seen[side] = f"<the conversation does not start with the generation prompt {prompt!r}>"
            continue
        after = full[len(prompt):]
        seen[side] = after[:len(_PROBE_ANSWER)] if after.startswith(_PROBE_ANSWER) else after
    if seen["student"] != _PROBE_ANSWER or seen["teacher"] != _PROBE_ANSWER:
        diff = " | ".join(line for line in difflib.unified_diff(
            [_PROBE_ANSWER], [seen["teacher"] if seen["teacher"] != _PROBE_ANSWER else seen["student"]],
            "response", "as rendered", lineterm="", n=0) if line[:1] in "+-" and not line.startswith(("---", "+++")))
        which = "teacher" if seen["teacher"] != _PROBE_ANSWER else "student"
        raise IncompatibleModelsError(f"{key}: the {which}'s chat template changes the assistant's response text, so "
                                      f"the response cannot be re-tokenized for the other side as written: {diff}")
