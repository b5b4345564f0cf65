"""Tasks: problem generators with verifiers.

A task turns a seeded ``random.Random`` into a :class:`Problem` (the prompt text, the reference answer, and a worked
solution for supervised warm-up or SFT) and scores a completion with a 0/1 verifier. Generation is a pure function of
the rng, so a run's data position is just "which step", which is what makes ``--resume`` exact.

``carry_add`` is the demo task. The answer is a worked, column-by-column addition with the carries written out,
least significant column first, and then the sum::

    4721+3896=  ->  1+6+0=7,2+9+0=11,7+8+1=16,4+3+1=8>8617

It is long (about 8 tokens per column), every column depends on the carry the previous one wrote, and one wrong
column sends the rest of the answer down a prefix a correct teacher never writes: the setting where training on the
student's own samples (on-policy) is supposed to matter.
"""
from __future__ import annotations

import abc
import inspect
import random
import re
from dataclasses import dataclass

from opdistill.errors import ConfigError

__all__ = ["Problem", "Task", "CarryAdditionTask", "GsmSymbolicTask", "make_task", "CARRY_ADD_CHARS"]

CARRY_ADD_CHARS = "0123456789+=,>"


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    solution: str | None = None


class Task(abc.ABC):
    """A source of problems with a verifier: ``sample`` draws one, ``score`` returns the 0/1 reward of a completion."""

    name = "task"

    @abc.abstractmethod
    def sample(self, rng: random.Random) -> Problem: ...

    @abc.abstractmethod
    def score(self, problem: Problem, completion: str) -> float: ...


class CarryAdditionTask(Task):
    """Add two ``digits``-digit numbers (digits drawn from [min_digits, max_digits]) with written-out carries."""

    name = "carry_add"

    def __init__(self, min_digits: int = 3, max_digits: int = 5):
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"carry_add: expected 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        self.min_digits, self.max_digits = min_digits, max_digits

    @staticmethod
    def worked_solution(a: int, b: int) -> str:
        da, db = str(a)[::-1], str(b)[::-1]
        cols, carry = [], 0
        for i in range(max(len(da), len(db))):
            x = int(da[i]) if i < len(da) else 0
            y = int(db[i]) if i < len(db) else 0
            s = x + y + carry
            cols.append(f"{x}+{y}+{carry}={s}")
            carry = s // 10
        return ",".join(cols) + f">{a + b}"

    def sample(self, rng: random.Random) -> Problem:
        d = rng.randint(self.min_digits, self.max_digits)
        a = rng.randint(10 ** (d - 1), 10**d - 1)
        b = rng.randint(10 ** (d - 1), 10**d - 1)
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b), solution=self.worked_solution(a, b))

    def score(self, problem: Problem, completion: str) -> float:
        # Only the final sum counts: the text after the last '>'; the worked columns are not graded.
        tail = completion.rsplit(">", 1)
        return float(len(tail) == 2 and tail[1].strip() == problem.answer)


class GsmSymbolicTask(Task):
    """reasoning-gym's ``gsm_symbolic`` word problems; the last number in the completion is the answer."""

    name = "gsm_symbolic"
    instruction = "\nSolve step by step and end with 'The answer is N.'"

    def __init__(self, size: int = 2000, seed: int = 0):
        import reasoning_gym

        self.data = reasoning_gym.create_dataset("gsm_symbolic", seed=seed, size=size)
        self.size = size

    def sample(self, rng: random.Random) -> Problem:
        e = self.data[rng.randrange(self.size)]
        return Problem(prompt=e["question"] + self.instruction, answer=str(e["answer"]).strip(), solution=None)

    def score(self, problem: Problem, completion: str) -> float:
        nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", completion)
        if not nums:
            return 0.0
        try:
            return float(abs(float(nums[-1].replace(",", "")) - float(problem.answer.replace(",", ""))) < 1e-6)
        except ValueError:
            return 0.0


def make_task(name: str, **kwargs) -> Task:
    """The task ``name`` built with ``kwargs`` (``data.task_args``); a bad argument is a ConfigError naming the key."""
    tasks = {"carry_add": CarryAdditionTask, "gsm_symbolic": GsmSymbolicTask}
    if name not in tasks:
        raise ConfigError(f"data.task: expected one of {sorted(tasks)}, got {name!r}")
    params = [p for p in inspect.signature(tasks[name]).parameters]
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise ConfigError(f"data.task_args: {name} takes {params}, got unknown {unknown}")
    try:
        return tasks[name](**kwargs)
    except (ValueError, TypeError, AssertionError) as e:  # reasoning_gym checks its arguments with assert
        raise ConfigError(f"data.task_args: {e}") from None
