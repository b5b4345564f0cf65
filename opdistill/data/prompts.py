"""Prompt sources: a seeded stream of problems per optimizer step, from a task generator or a dataset.

``batch(step, n)`` is a pure function of (seed, step), so the data position saved in a checkpoint is the step itself
and a resumed run sees exactly the prompts the uninterrupted one would have seen. The held-out evaluation set is the
task's own held-out problems when it has them (a dataset's ``eval_path`` / ``eval_split`` / ``eval_fraction`` rows, a
reasoning-gym task's eval problems: never trained on), in an order keyed by ``eval_seed``; otherwise it is drawn from
a separate stream keyed by ``eval_seed`` (not the training seed, so runs with different seeds are measured on the same
problems), and for generated tasks a training prompt can then coincide with a held-out one by chance. docs/data.md.

Dataset rows (local jsonl/json/csv/parquet, a local dataset folder, or a hub name through
``datasets.load_dataset(name, subset, split=)``) hold a plain-string prompt or a chat-format list of
``{"role", "content"}`` messages (TRL's conversational format, system prompts included). A chat prompt that ends
with the assistant's turn is refused, unless ``data.final_assistant: answer``: that last turn is then the reference
answer (what the verifier checks) and the turns before it the prompt, as TRL's conversational datasets are written.
"""
from __future__ import annotations

import collections
import collections.abc
import csv
import dataclasses
import hashlib
import json
import math
import os
import random
import warnings

from opdistill.data.answers import match_answer
from opdistill.data.tasks import Problem, Task
from opdistill.errors import ConfigError, DataError
from opdistill.xtok.tokens import render_chat

__all__ = ["PromptSource", "DatasetTask", "InMemoryRows", "render_prompt", "render_prompts", "prompt_text",
           "split_held_out", "truncate_prompt",
           "warn_unknown_chars"]


def prompt_text(prompt) -> str:
    """The text of a prompt: the string itself, or a chat prompt's message contents, concatenated."""
    return prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)


def render_prompt(tokenizer, text, *, use_chat_template: bool = True, tools: list | None = None) -> list[int]:
    """Token ids of a prompt (a string, or a list of ``{"role", "content"}`` messages), through the tokenizer's chat
    template (generation prompt added) when it has one. A chat prompt needs the template: without it (or with
    ``use_chat_template`` off) it is a ConfigError. ``tools``: JSON schemas the template lists (an episode's tools)."""
    messages = not isinstance(text, str)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if messages and not (use_chat_template and has_template):
        raise ConfigError("data.use_chat_template: chat-format prompts (lists of messages) are rendered with the "
                          "tokenizer's chat template, " + ("which this tokenizer does not have; use plain-string "
                          "prompts" if not has_template else "so it must be true"))
    if use_chat_template and has_template:
        # the template's text, bounded (a template that loops or writes gigabytes is one line), then its ids: what
        # apply_chat_template(tokenize=True) returns (it tokenizes its text without adding special tokens)
        chat = render_chat(tokenizer, list(text) if messages else [{"role": "user", "content": text}],
                           add_generation_prompt=True, tools=tools)
        return list(tokenizer(chat, add_special_tokens=False)["input_ids"])
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def render_prompts(tokenizer, prompts, *, use_chat_template: bool = True,
                   tools: list | None = None) -> list[list[int]]:
    """:func:`render_prompt` of each of ``prompts``, each distinct prompt object rendered once (the ``rollout.n``
    rows of one problem share theirs); ``tools``: the schemas every prompt lists (an episode's tools)."""
    rendered: dict[int, list[int]] = {}
    out = []
    for x in prompts:
        ids = rendered.get(id(x))
        if ids is None:
            ids = rendered[id(x)] = render_prompt(tokenizer, x, use_chat_template=use_chat_template, tools=tools)
        out.append(ids)
    return out


def _load_hub(path: str, split: str, subset: str | None, key: str) -> list[tuple[str, dict]]:
    """Rows of ``datasets.load_dataset(path, subset, split=split)`` (a hub name, or a local dataset folder; a
    ``save_to_disk`` folder through ``load_from_disk``); offline
    (``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1``) it reads the local cache only. A failure is one DataError."""
    import datasets

    offline = any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
                  for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))
    saved = os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                        for f in ("dataset_dict.json", "state.json"))
    try:
        if saved:  # a folder written by Dataset(Dict).save_to_disk
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise KeyError(f"no split {split!r} (splits: {list(ds)})")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(path, subset, split=split)
    except Exception as e:  # noqa: BLE001 -- datasets/hub raise many types (ConnectionError, FileNotFoundError, ...)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        why = ("offline (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set) and it is not in the local cache: load it once "
               "with a network, or use a local file" if offline else
               "not a local file or dataset folder, and the hub could not provide it (no network? a wrong name, "
               "subset or split?)")
        raise DataError(f"{key}: cannot load dataset '{path}'" + (f" subset '{subset}'" if subset else "")
                        + f" split '{split}': {why} ({type(e).__name__}: {first})") from None
    return [(f"{path}[{split}] row {i + 1}", dict(r)) for i, r in enumerate(ds)]


class InMemoryRows:
    """Rows a Python caller hands in (:meth:`DatasetTask.from_rows`): any sequence of mappings (a list of dicts, a
    ``datasets.Dataset``); ``name`` stands for the file in messages (``rows[3]: ...``)."""

    def __init__(self, rows, name: str = "rows"):
        self.rows, self.name = rows, name

    def __str__(self) -> str:
        return self.name

    def pairs(self) -> list[tuple[str, dict]]:
        out = []
        for i, r in enumerate(self.rows):
            if not isinstance(r, collections.abc.Mapping):
                raise DataError(f"{self.name}[{i}]: expected a mapping with the prompt field, got {type(r).__name__}")
            out.append((f"{self.name}[{i}]", dict(r)))
        return out


def _read_rows(path, *, split: str = "train", subset: str | None = None,
               key: str = "data.path") -> list[tuple[str, dict]]:
    """(where, row) pairs of a local jsonl/json/csv/parquet file, a local dataset folder or a hub dataset (its
    ``split``), or of :class:`InMemoryRows`; ``where`` is 'FILE:LINE'."""
    if isinstance(path, InMemoryRows):
        return path.pairs()
    ext = path.rsplit(".", 1)[-1].lower()
    if os.path.isdir(path) or ext not in ("jsonl", "json", "csv", "parquet"):
        return _load_hub(path, split, subset, key)
    if not os.path.isfile(path):
        raise DataError(f"{key}: no such file '{path}'")
    if ext == "parquet":
        import pyarrow.parquet as pq

        try:
            return [(f"{path} row {i + 1}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
        except Exception as e:  # pyarrow's errors for a corrupt file are many types
            raise DataError(f"{path}: not a readable parquet file ({e})") from None
    try:
        with open(path, newline="" if ext == "csv" else None, encoding="utf-8") as f:
            if ext == "csv":
                reader = csv.DictReader(f)
                rows = []
                for r in reader:
                    if None in r:  # DictReader files surplus fields under the key None
                        raise DataError(f"{path}:{reader.line_num}: more fields than the header's {reader.fieldnames}")
                    rows.append((f"{path}:{reader.line_num}", r))
                return rows
            text = f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except csv.Error as e:
        raise DataError(f"{path}: not readable as CSV ({e})") from None
    if ext == "json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise DataError(f"{path}: not valid JSON here (nested too deeply)") from None
        pairs = [(f"{path} item {i + 1}", r) for i, r in enumerate(items)]
    else:  # JSON lines; blank lines are skipped
        pairs = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    pairs.append((f"{path}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
                except RecursionError:
                    raise DataError(f"{path}:{n}: not valid JSON here (nested too deeply)") from None
    for where, r in pairs:
        if not isinstance(r, dict):
            raise DataError(f"{where}: expected a JSON object with the prompt field, got {type(r).__name__}")
    return pairs


def _messages(where: str, value: list, field: str, key: str, *, final_assistant: str = "refuse") -> list[dict]:
    """A chat-format prompt checked: a non-empty list of {role, content} string pairs, not ending with the
    assistant (the model writes that turn). ``final_assistant="answer"``: the list must end with the assistant's
    turn, which the caller splits off as the reference answer (:func:`_split_final_assistant`)."""
    if not value:
        raise DataError(f"{where}: {field!r} is an empty list of messages ({key}; every row needs a prompt)")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {field!r} message {j} is not a {{'role': str, 'content': str}} mapping "
                            f"(got {m!r:.80})")
        out.append({"role": m["role"], "content": m["content"]})
    if final_assistant == "answer":
        if out[-1]["role"] != "assistant" or len(out) < 2:
            raise DataError(f"{where}: {field!r} does not end with an assistant message after the prompt "
                            f"(data.final_assistant: answer takes the reference answer from that last turn)")
        if not out[-1]["content"].strip():
            raise DataError(f"{where}: {field!r} ends with an empty assistant message (data.final_assistant: "
                            f"answer; every row needs an answer)")
        if out[-2]["role"] == "assistant":
            raise DataError(f"{where}: {field!r} ends with two assistant messages; the prompt before the answer "
                            f"must end with the turn the model answers")
    elif out[-1]["role"] == "assistant":
        raise DataError(f"{where}: {field!r} ends with an assistant message; a prompt ends with the turn the model "
                        f"answers (set data.final_assistant: answer to take that turn as the reference answer, as "
                        f"in TRL's conversational datasets; or drop it, or put it in data.answer_field)")
    return out


def _text(where: str, row: dict, field: str, key: str, *, chat: bool = False, final_assistant: str = "refuse"):
    value = row.get(field)
    if chat and isinstance(value, (list, tuple)):
        return _messages(where, list(value), field, key, final_assistant=final_assistant)
    if final_assistant == "answer" and value is not None:
        raise DataError(f"{where}: {field!r} is a {type(value).__name__}, expected a list of {{role, content}} "
                        f"messages ending with the assistant's answer (data.final_assistant: answer)")
    if value is None:
        raise DataError(f"{where}: {field!r} is {'missing' if field not in row else 'null'} ({key}; every row needs it)")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        expected = "a string or a list of {role, content} messages" if chat else "a string"
        raise DataError(f"{where}: {field!r} is a {type(value).__name__}, expected {expected} ({key})")
    if not str(value).strip():
        raise DataError(f"{where}: {field!r} is empty ({key}; every row needs it)")
    return str(value)


def _key(prompt) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def split_held_out(prompts: list, fraction: float) -> set[str]:
    """The held-out share of ``prompts`` for ``data.eval_fraction``: the distinct prompts sorted by the SHA-256 of
    their text (a chat prompt: its messages as sorted-key JSON), the first ``ceil(fraction * distinct)`` of them
    (at least one, and at least one left for training). Returns their keys. Every row whose prompt is among them is
    held out, so a prompt that appears twice is never on both sides; the split depends on the prompts only (not on
    the row order, a seed or the file name), so it is the same on every run and machine."""
    distinct = sorted({_key(p) for p in prompts}, key=lambda k: hashlib.sha256(k.encode()).hexdigest())
    if len(distinct) < 2:
        raise DataError(f"data.eval_fraction: the dataset has {len(distinct)} distinct prompt(s); a split needs two "
                        f"or more (or give data.eval_path)")
    n = min(len(distinct) - 1, max(1, math.ceil(fraction * len(distinct))))
    return set(distinct[:n])


class DatasetTask(Task):
    """Prompts from a dataset (local jsonl/json/csv/parquet file, local dataset folder or hub name); optional
    verifier on ``answer_field`` (``answer_match``: math, exact or contains; opdistill/data/answers.py).

    Held-out rows, never trained on: ``eval_path`` (another file or dataset; ``eval_split`` its split, default
    ``split``), or ``eval_split`` alone (another split of ``path``), or ``eval_fraction`` (a deterministic share of
    ``path``'s distinct prompts: :func:`split_held_out`). With none of them there is no held-out set and
    PromptSource draws evaluation prompts from the training rows (a warning says so in the trainer).

    Every row is read and checked at construction: an empty file, a malformed line, a missing, null or empty prompt
    (or answer, when ``answer_field`` is set) is a :class:`DataError` naming the file and the line. ``where[i]`` is
    row i's 'FILE:LINE' (``eval_where`` for the held-out rows), for later messages (over-long prompts, unknown
    characters). A prompt cell holding a list is a chat prompt (``[{"role", "content"}, ...]``).
    ``task_field``: a column whose value (a non-empty string) every row carries as ``Problem.task`` (``routing.field``
    of a multi-teacher run: docs/teacher_service.md)."""

    name = "dataset"

    def __init__(self, path: str, prompt_field: str = "prompt", answer_field: str | None = None, *,
                 split: str = "train", subset: str | None = None, eval_path: str | None = None,
                 eval_split: str | None = None, eval_fraction: float | None = None, answer_match: str = "math",
                 task_field: str | None = None, final_assistant: str = "refuse", hint_field: str | None = None):
        if sum(x is not None for x in (eval_path, eval_fraction)) > 1 or (eval_fraction is not None and eval_split):
            raise ConfigError("data.eval_fraction: expected one held-out source: data.eval_path (with an optional "
                              "data.eval_split), data.eval_split alone, or data.eval_fraction")
        self.task_field, self.final_assistant, self.hint_field = task_field, final_assistant, hint_field
        self.where, self.rows = self._load(path, prompt_field, answer_field, split, subset, "data.path")
        self.eval_where, self.eval_rows = [], []
        if eval_path is not None or eval_split is not None:
            self.eval_where, self.eval_rows = self._load(
                eval_path or path, prompt_field, answer_field, eval_split or split, subset,
                "data.eval_path" if eval_path is not None else "data.eval_split")
            train = {_key(p.prompt) for p in self.rows}
            shared = sum(_key(p.prompt) in train for p in self.eval_rows)
            if shared:
                warnings.warn(f"data: {shared} of the {len(self.eval_rows)} held-out prompts of "
                              f"{eval_path or path} also appear in the training rows of {path}; they are measured "
                              f"after being trained on", stacklevel=2)
        elif eval_fraction is not None:
            held = split_held_out([p.prompt for p in self.rows], eval_fraction)
            side = [_key(p.prompt) in held for p in self.rows]
            self.eval_where = [w for w, h in zip(self.where, side) if h]
            self.eval_rows = [p for p, h in zip(self.rows, side) if h]
            self.where = [w for w, h in zip(self.where, side) if not h]
            self.rows = [p for p, h in zip(self.rows, side) if not h]
        self.path, self.answer_match = path, answer_match
        self.has_answers = answer_field is not None or final_assistant == "answer"
        self.has_held_out = bool(self.eval_rows)

    @classmethod
    def from_rows(cls, rows, prompt_field: str = "prompt", answer_field: str | None = None, *, eval_rows=None,
                  **kwargs) -> "DatasetTask":
        """A dataset task of rows in memory (a list of dicts, a ``datasets.Dataset``; ``eval_rows``: held-out rows),
        checked as a file's rows are, messages naming ``rows[i]`` / ``eval_rows[i]``: the Python API's own dataset
        (``run_training(cfg, task=...)``). ``kwargs``: the other arguments of :class:`DatasetTask`."""
        return cls(InMemoryRows(rows), prompt_field, answer_field,
                   eval_path=None if eval_rows is None else InMemoryRows(eval_rows, "eval_rows"), **kwargs)

    def _load(self, path, prompt_field, answer_field, split, subset, key):
        pairs = _read_rows(path, split=split, subset=subset, key=key)
        if not pairs:
            raise DataError(f"{path}: no rows" + (" (the file is empty)" if isinstance(path, str) else ""))
        columns = list(pairs[0][1])
        for field, fkey in ((prompt_field, "data.prompt_field"), (answer_field, "data.answer_field"),
                            (self.task_field, "routing.field"), (self.hint_field, "teacher.context.hint_field")):
            if field is not None and field not in columns:
                hint = ""
                if fkey == "data.prompt_field" and "messages" in columns:
                    hint = ("; chat rows in TRL's conversational format: data.prompt_field: messages, and "
                            "data.final_assistant: answer when they end with the assistant's answer")
                raise ConfigError(f"{fkey}: {field!r} is not a column of {path} (columns: {columns}){hint}")
        rows = []
        for w, r in pairs:
            prompt = _text(w, r, prompt_field, "data.prompt_field", chat=True, final_assistant=self.final_assistant)
            answer = "" if answer_field is None else _text(w, r, answer_field, "data.answer_field")
            if self.final_assistant == "answer":  # the last turn is the reference, everything before it the prompt
                prompt, answer = prompt[:-1], prompt[-1]["content"]
            rows.append(Problem(prompt=prompt, answer=answer, task=None if self.task_field is None else
                                _text(w, r, self.task_field, "routing.field"),
                                hint=None if self.hint_field is None else
                                _text(w, r, self.hint_field, "teacher.context.hint_field")))
        return [w for w, _ in pairs], rows

    def sample(self, rng: random.Random) -> Problem:
        return self.rows[rng.randrange(len(self.rows))]

    def held_out(self, n: int, seed: int) -> list[Problem] | None:
        """The held-out rows (none repeated), the first ``n`` of an order keyed by ``seed``; None without them."""
        if not self.eval_rows:
            return None
        order = list(range(len(self.eval_rows)))
        random.Random(f"eval/{seed}").shuffle(order)
        return [self.eval_rows[i] for i in order[:n]]

    def worked(self, problem: Problem) -> str:
        if not self.has_answers:
            raise ConfigError("teacher.context.examples: the dataset's rows have no answers to show as worked "
                              "examples (set data.answer_field or data.final_assistant: answer, or give "
                              "teacher.context.examples_path)")
        return problem.answer

    def held_out_all(self) -> list[Problem] | None:
        return list(self.eval_rows) or None

    def score(self, problem: Problem, completion: str) -> float:
        if not self.has_answers:
            return float("nan")
        return match_answer(problem.answer, completion, self.answer_match)

    def fit_prompts(self, tokenizer, max_tokens: int, *, overlong: str = "error", use_chat_template: bool = True):
        """Refuse (``overlong="error"``, a DataError naming the first file:line) or cut the end of the text of
        (``"truncate"``, one warning with the count; plain-string prompts only) every prompt, training or held-out,
        whose rendered ids exceed ``max_tokens``; warn once with a count when characters map to the tokenizer's
        unknown token."""
        for rows, where in ((self.rows, self.where), (self.eval_rows, self.eval_where)):
            if rows:
                self._fit(rows, where, tokenizer, max_tokens, overlong, use_chat_template)

    def _fit(self, rows, where, tokenizer, max_tokens, overlong, use_chat_template):
        too_long = warn_unknown_chars(tokenizer, [p.prompt for p in rows], where, self.path,
                                      max_tokens=max_tokens, use_chat_template=use_chat_template)
        if not too_long:
            return
        i, n = too_long[0]
        if overlong == "error":
            raise DataError(f"{where[i]}: the prompt is {n} tokens, more than the {max_tokens} the model allows "
                            f"(its positions minus max_new_tokens); {len(too_long)} prompt(s) are too long: shorten "
                            "them or set data.overlong=truncate")
        for j, _ in too_long:
            if not isinstance(rows[j].prompt, str):
                raise DataError(f"{where[j]}: the chat prompt is longer than the {max_tokens} tokens the model "
                                "allows, and data.overlong=truncate cuts plain-string prompts only: shorten it")
            cut = truncate_prompt(tokenizer, rows[j].prompt, max_tokens, use_chat_template=use_chat_template)
            if cut is None:
                raise DataError(f"{where[j]}: the chat template alone is longer than the {max_tokens} tokens "
                                "the model allows; lower rollout.max_new_tokens / eval.max_new_tokens")
            rows[j] = dataclasses.replace(rows[j], prompt=cut)
        warnings.warn(f"data: cut the end of {len(too_long)} prompt(s) of {self.path} to fit {max_tokens} tokens "
                      f"(data.overlong=truncate; first: {where[i]}, {n} tokens)", stacklevel=3)


def warn_unknown_chars(tokenizer, texts: list[str], where: list[str], source: str, *, max_tokens: int | None = None,
                       use_chat_template: bool = True) -> list[tuple[int, int]]:
    """Warn once, with a count, when characters of ``texts`` map to the tokenizer's unknown token; return
    ``(index, rendered length)`` of the prompts longer than ``max_tokens`` (none when it is None)."""
    unk, chars, prompts, first, too_long = tokenizer.unk_token_id, collections.Counter(), 0, None, []
    for i, text in enumerate(texts):
        if max_tokens is not None:
            n = len(render_prompt(tokenizer, text, use_chat_template=use_chat_template))
            if n > max_tokens:
                too_long.append((i, n))
        if unk is None:
            continue
        text = prompt_text(text)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast)
        spans = [s for t, s in zip(enc["input_ids"], enc.get("offset_mapping") or [(0, 0)] * len(enc["input_ids"]))
                 if t == unk]
        if spans:
            prompts += 1
            first = first or where[i]
            chars.update(text[a:b] or "?" for a, b in spans)
    if prompts:
        shown = ", ".join(repr(c) for c, _ in chars.most_common(5))
        warnings.warn(f"data: {sum(len(c) for c in chars.elements())} character(s) in {prompts} prompt(s) of {source} "
                      f"map to the tokenizer's unknown token {tokenizer.unk_token!r} (first at {first}; most common: "
                      f"{shown}): the model cannot tell them apart", stacklevel=2)
    return too_long


def truncate_prompt(tokenizer, text: str, max_tokens: int, *, use_chat_template: bool = True) -> str | None:
    """The longest start of ``text`` whose rendered prompt fits ``max_tokens`` ids (the chat template's generation
    prompt is kept whole); None when the template alone does not fit."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast)
    ids = enc["input_ids"]
    keep = max_tokens - (len(render_prompt(tokenizer, text, use_chat_template=use_chat_template)) - len(ids))
    while keep >= 1:  # re-tokenizing a cut text can merge differently: shrink until it fits
        cut = text[: enc["offset_mapping"][keep - 1][1]] if tokenizer.is_fast else tokenizer.decode(ids[:keep])
        if len(render_prompt(tokenizer, cut, use_chat_template=use_chat_template)) <= max_tokens:
            return cut
        keep -= 1
    return None


class PromptSource:
    def __init__(self, task: Task, seed: int, eval_seed: int = 0):
        self.task, self.seed, self.eval_seed = task, seed, eval_seed

    def batch(self, step: int, n: int) -> list[Problem]:
        rng = random.Random(f"train/{self.seed}/{step}")
        return [self.task.sample(rng) for _ in range(n)]

    def held_out(self, n: int) -> list[Problem]:
        """The task's own held-out problems when it has them (never trained on); else ``n`` draws keyed by
        ``eval_seed``."""
        own = self.task.held_out(n, self.eval_seed)
        if own is not None:
            return own
        rng = random.Random(f"eval/{self.eval_seed}")
        return [self.task.sample(rng) for _ in range(n)]
