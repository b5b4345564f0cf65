"""Prompt sources: a seeded stream of problems per optimizer step, from a task generator or a local dataset file.

``batch(step, n)`` is a pure function of (seed, step), so the data position saved in a checkpoint is the step itself
and a resumed run sees exactly the prompts the uninterrupted one would have seen. A held-out evaluation set is drawn
from a separate stream keyed by ``eval_seed`` (not the training seed, so runs with different seeds are measured on the
same problems). For generated tasks a training prompt can coincide with a held-out one by chance (the same problem
drawn twice), as with any generator; the sets are not filtered against each other.
"""
from __future__ import annotations

import random

from opdistill.data.tasks import Problem, Task

__all__ = ["PromptSource", "DatasetTask", "render_prompt"]


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


class DatasetTask(Task):
    """Prompts from a local jsonl/parquet/csv file via `datasets`; optional exact-match verifier on ``answer_field``."""

    name = "dataset"

    def __init__(self, path: str, prompt_field: str = "prompt", answer_field: str | None = None, split: str = "train"):
        import datasets

        ext = path.rsplit(".", 1)[-1]
        kind = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}.get(ext)
        ds = datasets.load_dataset(kind, data_files=path, split=split) if kind else datasets.load_dataset(path, split=split)
        if prompt_field not in ds.column_names:
            raise ValueError(f"data.prompt_field: {prompt_field!r} is not a column of {path} (columns: {ds.column_names})")
        if answer_field is not None and answer_field not in ds.column_names:
            raise ValueError(f"data.answer_field: {answer_field!r} is not a column of {path} (columns: {ds.column_names})")
        self.rows = [
            Problem(prompt=str(r[prompt_field]), answer="" if answer_field is None else str(r[answer_field]))
            for r in ds
        ]
        self.has_answers = answer_field is not None

    def sample(self, rng: random.Random) -> Problem:
        return self.rows[rng.randrange(len(self.rows))]

    def score(self, problem: Problem, completion: str) -> float:
        if not self.has_answers:
            return float("nan")
        return float(problem.answer.strip() in completion)


class PromptSource:
    def __init__(self, task: Task, seed: int, eval_seed: int = 0):
        self.task, self.seed, self.eval_seed = task, seed, eval_seed

    def batch(self, step: int, n: int) -> list[Problem]:
        rng = random.Random(f"train/{self.seed}/{step}")
        return [self.task.sample(rng) for _ in range(n)]

    def held_out(self, n: int) -> list[Problem]:
        rng = random.Random(f"eval/{self.eval_seed}")
        return [self.task.sample(rng) for _ in range(n)]
