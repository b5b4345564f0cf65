"""The teacher's own prompt per row: privileged context (SPEC 6.7, ``teacher.context``).

The student answers the row's prompt x; the teacher scores the same response under x' = T(row), built here from:

- **worked examples** before the row's question: ``examples`` problems drawn once from the task's training problems
  (``Task.sample`` with a generator keyed by ``examples_seed``; never a held-out question: those are skipped), or
  every row of ``examples_path`` (JSON lines, JSON, CSV or parquet; a file holding a held-out question is refused):
  ``{prompt, response}``, or ``{messages}``, a whole worked episode (SPEC 6.8: the user's question, then assistant
  turns and tool messages, ending on an assistant turn). In a chat prompt each example is a user turn and what
  answered it (``Task.worked``: the response an example shows); in a plain-text prompt they are written one after
  another, each followed by a blank line (an episode needs the chat template);
- a **system prompt** (``system``) that replaces the row's own;
- a **template** of the row's last user turn: ``{prompt}`` (the row's question, required), ``{answer}`` (its
  reference answer) and ``{hint}`` (its ``hint_field``: a dataset column, a reasoning-gym metadata key).

A row whose own question is one of the examples gets the spare example drawn in its place (an example read from a file
is left out instead), so no teacher prompt shows the answer of the question it scores (unless the template asks for
it). With no examples, no system prompt
and the template ``{prompt}``, x' = x (the identity: every loss equals the plain run's). The held-out split never
enters x': examples are training problems, and the evaluation gives a context that reads ``{answer}`` or ``{hint}``
no held-out row (``reads_rows``: opdistill/train reports no teacher metrics then).
"""
from __future__ import annotations

import json
import random
import re

from opdistill.data.prompts import _read_rows, prompt_text
from opdistill.data.tasks import Problem, Task
from opdistill.errors import ConfigError, DataError

__all__ = ["TeacherPrompt", "PLACEHOLDERS", "question_of", "check_template", "reads_rows"]

PLACEHOLDERS = ("prompt", "answer", "hint")
_DRAWS = 100  # draws per example asked before a task is declared too small for the examples


def question_of(prompt) -> str:
    """The question of a prompt: the string itself, or a chat prompt's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m["role"] == "user"]
    return users[-1] if users else prompt_text(prompt)


def reads_rows(template: str) -> bool:
    """Whether a template shows each row's own answer or hint (a held-out problem's must never be shown)."""
    return bool(re.search(r"\{(answer|hint)\}", template))


def check_template(template: str, hint_field: str | None, key: str = "teacher.context.template") -> None:
    """A ConfigError unless ``template`` names ``{prompt}`` and only the known placeholders, ``{hint}`` exactly when
    ``hint_field`` is set."""
    names = set(re.findall(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", template))
    unknown = sorted(names - set(PLACEHOLDERS))
    if unknown:
        raise ConfigError(f"{key}: unknown placeholder {{{unknown[0]}}} (known: "
                          f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)}), got {template!r}")
    if "prompt" not in names:
        raise ConfigError(f"{key}: expected the row's question as {{prompt}} (the teacher scores the response to "
                          f"it), got {template!r}")
    if ("hint" in names) != (hint_field is not None):
        raise ConfigError("teacher.context.hint_field: " + (
            "expected the field {hint} reads (a dataset column or a reasoning-gym metadata key), got null"
            if "hint" in names else f"set, but teacher.context.template has no {{hint}} to put it in, got "
                                    f"{hint_field!r}"))


class TeacherPrompt:
    """``T(problem) -> x'`` (module notes): a chat prompt (a list of messages) when the row's prompt is one or
    ``chat`` (the prompt goes through a chat template), else a string. Built once per run; the examples are drawn at
    construction (``held_out``: the problems whose questions no example may be)."""

    def __init__(self, task: Task, *, examples: int = 0, examples_path: str | None = None, examples_seed: int = 0,
                 system: str | None = None, template: str = "{prompt}", hint_field: str | None = None,
                 held_out: list[Problem] = (), chat: bool = True):
        check_template(template, hint_field)
        self.task, self.system, self.template, self.chat = task, system, template, chat
        self.reads_rows = reads_rows(template)  # the row's own answer or hint
        banned = {question_of(p.prompt) for p in held_out}
        # each example: (its question, the messages that answer it: one assistant turn, or an episode's turns)
        if examples_path is not None:
            self.examples = _read_examples(examples_path, banned)
            self.spare = None
            if not chat and any(len(turns) > 1 for _, turns in self.examples):
                raise ConfigError(f"teacher.context.examples_path: {examples_path} holds worked episodes (rows with "
                                  "messages), which need the chat template; set data.use_chat_template: true")
        else:
            drawn = _draw(task, examples + 1, examples_seed, banned) if examples else []
            self.examples, self.spare = drawn[:examples], (drawn[examples] if examples else None)

    def __call__(self, problem: Problem):
        question = question_of(problem.prompt)
        examples = self.examples
        if any(q == question for q, _ in examples):  # never the answer of the question the teacher scores
            examples = [e if e[0] != question else self.spare for e in examples if e[0] != question or self.spare]
        user = self._fill(question, problem)
        if isinstance(problem.prompt, str) and not self.chat:
            head = (self.system + "\n\n") if self.system else ""
            return head + "".join(f"{q}{turns[0]['content']}\n\n" for q, turns in examples) + user
        msgs = [{"role": "user", "content": problem.prompt}] if isinstance(problem.prompt, str) else \
            [dict(m) for m in problem.prompt]
        system = [m for m in msgs if m["role"] == "system"]
        if self.system is not None:
            system = [{"role": "system", "content": self.system}]
        rest = [m for m in msgs if m["role"] != "system"]
        last = max(i for i, m in enumerate(rest) if m["role"] == "user") if any(
            m["role"] == "user" for m in rest) else len(rest) - 1
        rest[last] = {"role": rest[last]["role"], "content": user}
        shots = [m for q, turns in examples for m in [{"role": "user", "content": q}, *map(dict, turns)]]
        return system + shots + rest

    def _fill(self, question: str, problem: Problem) -> str:
        values = {"prompt": question, "answer": problem.answer}
        if "{hint}" in self.template:
            if problem.hint is None:
                raise DataError(f"teacher.context.hint_field: a row of task {self.task.name} carries no hint "
                                f"(question {question[:60]!r})")
            values["hint"] = problem.hint
        # one pass over the template: a value holding "{answer}" is not filled again
        return re.sub(r"\{(prompt|answer|hint)\}", lambda m: str(values[m.group(1)]), self.template)


def _answer(response: str) -> tuple[dict]:
    """The messages of an example that one assistant turn answers."""
    return ({"role": "assistant", "content": response},)


def _draw(task: Task, n: int, seed: int, banned: set) -> list[tuple[str, tuple]]:
    """``n`` distinct (question, worked response) pairs of the task's training problems, none of them held out."""
    rng = random.Random(f"context/{seed}")
    out, seen = [], set()
    for _ in range(_DRAWS * n):
        p = task.sample(rng)
        q = question_of(p.prompt)
        if q in seen or q in banned:
            continue
        seen.add(q)
        out.append((q, _answer(task.worked(p))))
        if len(out) == n:
            return out
    raise ConfigError(f"teacher.context.examples: task {task.name} gave {len(out)} distinct training questions "
                      f"outside the held-out set in {_DRAWS * n} draws, fewer than the {n} needed ({n - 1} examples "
                      f"+ 1 spare); ask for fewer examples or give teacher.context.examples_path")


def _read_examples(path: str, banned: set) -> list[tuple[str, tuple]]:
    """The ``{prompt, response}`` or ``{messages}`` rows of a file (JSON lines, JSON, CSV or parquet:
    ``opdistill.data.prompts``' reader); one naming a held-out question is refused with its place."""
    out = []
    for where, row in _read_rows(path, key="teacher.context.examples_path"):
        if "messages" in row:
            question, turns = _episode(row["messages"], where)
        elif all(isinstance(row.get(k), str) and row[k].strip() for k in ("prompt", "response")):
            question, turns = row["prompt"], _answer(row["response"])
        else:
            raise DataError(f"{where}: expected non-empty string fields 'prompt' and 'response', or 'messages' (a "
                            f"worked example for teacher.context), got {json.dumps(row, default=str)[:80]}")
        if question in banned:
            raise DataError(f"{where}: this example's prompt is a held-out problem ({question[:60]!r}); the "
                            f"held-out split never enters the teacher's prompt: remove it")
        out.append((question, turns))
    if not out:
        raise DataError(f"{path}: no examples (teacher.context.examples_path holds no rows)")
    return out


_EPISODE_ROLES = ("assistant", "tool")


def _episode(messages, where: str) -> tuple[str, tuple]:
    """(the question, the turns after it) of a worked episode: a user message, then assistant turns and tool
    messages, the last an assistant turn, every content a non-empty string (one DataError naming what is wrong)."""
    def bad(what):
        return DataError(f"{where}: 'messages' {what} (a worked episode: a user message, then assistant turns and tool "
                         f"messages, ending on an assistant turn)")

    if not isinstance(messages, list) or len(messages) < 2:
        raise bad(f"must be a list of at least 2 messages, got {json.dumps(messages, default=str)[:80]}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and set(m) == {"role", "content"} and isinstance(m["content"], str)
                and m["content"].strip()):
            raise bad(f"entry {i} must be {{\"role\", \"content\"}} with non-empty string content, got "
                      f"{json.dumps(m, default=str)[:80]}")
        expected = ("user",) if i == 0 else _EPISODE_ROLES
        if m["role"] not in expected:
            raise bad(f"entry {i} has role {m['role']!r}, expected {' or '.join(map(repr, expected))}")
    if messages[-1]["role"] != "assistant":
        raise bad(f"ends on a {messages[-1]['role']!r} message")
    return messages[0]["content"], tuple(dict(m) for m in messages[1:])
