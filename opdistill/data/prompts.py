"""Prompt sources: a seeded stream of problems per optimizer step, from a task generator or a local dataset file.

``batch(step, n)`` is a pure function of (seed, step), so the data position saved in a checkpoint is the step itself
and a resumed run sees exactly the prompts the uninterrupted one would have seen. A held-out evaluation set is drawn
from a separate stream keyed by ``eval_seed`` (not the training seed, so runs with different seeds are measured on the
same problems). For generated tasks a training prompt can coincide with a held-out one by chance (the same problem
drawn twice), as with any generator; the sets are not filtered against each other.
"""
from __future__ import annotations

import collections
import csv
import dataclasses
import json
import os
import random
import warnings

from opdistill.data.tasks import Problem, Task
from opdistill.errors import ConfigError, DataError

__all__ = ["PromptSource", "DatasetTask", "render_prompt", "truncate_prompt", "warn_unknown_chars"]


def render_prompt(tokenizer, text: str, *, use_chat_template: bool = True) -> list[int]:
    """Token ids of a prompt, through the tokenizer's chat template (generation prompt added) when it has one."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if hasattr(ids, "keys"):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def _read_rows(path: str) -> list[tuple[str, dict]]:
    """(where, row) pairs of a local jsonl/json/csv/parquet file (or a hub dataset); ``where`` is 'FILE:LINE'."""
    ext = path.rsplit(".", 1)[-1].lower()
    if ext not in ("jsonl", "json", "csv", "parquet"):  # a hub dataset name, where a network exists
        try:
            import datasets

            rows = datasets.load_dataset(path, split="train")
        except Exception as e:  # noqa: BLE001 -- datasets raises many types (missing file, script, network, format)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise DataError(f"data.path: {path!r} is not a .jsonl/.json/.csv/.parquet file and does not load as a "
                            f"dataset ({type(e).__name__}: {first[:200]})") from None
        return [(f"{path} row {i + 1}", r) for i, r in enumerate(rows)]
    if not os.path.isfile(path):
        raise DataError(f"data.path: no such file '{path}'")
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
        pairs = [(f"{path} item {i + 1}", r) for i, r in enumerate(items)]
    else:  # JSON lines; blank lines are skipped
        pairs = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    pairs.append((f"{path}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
    for where, r in pairs:
        if not isinstance(r, dict):
            raise DataError(f"{where}: expected a JSON object with the prompt field, got {type(r).__name__}")
    return pairs


def _text(where: str, row: dict, field: str, key: str) -> str:
    value = row.get(field)
    if value is None:
        raise DataError(f"{where}: {field!r} is {'missing' if field not in row else 'null'} ({key}; every row needs it)")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: {field!r} is a {type(value).__name__}, expected a string ({key})")
    if not str(value).strip():
        raise DataError(f"{where}: {field!r} is empty ({key}; every row needs it)")
    return str(value)


class DatasetTask(Task):
    """Prompts from a local jsonl/json/csv/parquet file; optional substring verifier on ``answer_field``.

    Every row is read and checked at construction: an empty file, a malformed line, a missing, null or empty prompt
    (or answer, when ``answer_field`` is set) is a :class:`DataError` naming the file and the line. ``where[i]`` is
    row i's 'FILE:LINE', for later messages (over-long prompts, unknown characters)."""

    name = "dataset"

    def __init__(self, path: str, prompt_field: str = "prompt", answer_field: str | None = None):
        pairs = _read_rows(path)
        if not pairs:
            raise DataError(f"{path}: no rows (the file is empty)")
        columns = list(pairs[0][1])
        for field, key in ((prompt_field, "data.prompt_field"), (answer_field, "data.answer_field")):
            if field is not None and field not in columns:
                raise ConfigError(f"{key}: {field!r} is not a column of {path} (columns: {columns})")
        self.where = [w for w, _ in pairs]
        self.rows = [Problem(prompt=_text(w, r, prompt_field, "data.prompt_field"),
                             answer="" if answer_field is None else _text(w, r, answer_field, "data.answer_field"))
                     for w, r in pairs]
        self.path, self.has_answers = path, answer_field is not None

    def sample(self, rng: random.Random) -> Problem:
        return self.rows[rng.randrange(len(self.rows))]

    def score(self, problem: Problem, completion: str) -> float:
        if not self.has_answers:
            return float("nan")
        return float(problem.answer.strip() in completion)

    def fit_prompts(self, tokenizer, max_tokens: int, *, overlong: str = "error", use_chat_template: bool = True):
        """Refuse (``overlong="error"``, a DataError naming the first file:line) or cut the end of the text of
        (``"truncate"``, one warning with the count) every prompt whose rendered ids exceed ``max_tokens``; warn once
        with a count when characters map to the tokenizer's unknown token."""
        too_long = warn_unknown_chars(tokenizer, [p.prompt for p in self.rows], self.where, self.path,
                                      max_tokens=max_tokens, use_chat_template=use_chat_template)
        if not too_long:
            return
        i, n = too_long[0]
        if overlong == "error":
            raise DataError(f"{self.where[i]}: the prompt is {n} tokens, more than the {max_tokens} the model allows "
                            f"(its positions minus max_new_tokens); {len(too_long)} prompt(s) are too long: shorten "
                            "them or set data.overlong=truncate")
        for j, _ in too_long:
            cut = truncate_prompt(tokenizer, self.rows[j].prompt, max_tokens, use_chat_template=use_chat_template)
            if cut is None:
                raise DataError(f"{self.where[j]}: the chat template alone is longer than the {max_tokens} tokens "
                                "the model allows; lower rollout.max_new_tokens / eval.max_new_tokens")
            self.rows[j] = dataclasses.replace(self.rows[j], prompt=cut)
        warnings.warn(f"data: cut the end of {len(too_long)} prompt(s) of {self.path} to fit {max_tokens} tokens "
                      f"(data.overlong=truncate; first: {self.where[i]}, {n} tokens)", stacklevel=2)


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
        rng = random.Random(f"eval/{self.eval_seed}")
        return [self.task.sample(rng) for _ in range(n)]
