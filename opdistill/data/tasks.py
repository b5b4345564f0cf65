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
import dataclasses
import inspect
import random
import re
from dataclasses import dataclass

from opdistill.errors import ConfigError, DataError

__all__ = ["Problem", "Task", "CarryAdditionTask", "GsmSymbolicTask", "ReasoningGymTask", "MixedTask", "make_task",
           "CARRY_ADD_CHARS", "LookupAdditionTask", "lookup_value"]

CARRY_ADD_CHARS = "0123456789+=,>"


@dataclass(frozen=True)
class Problem:
    """``prompt`` is a plain string, or a chat-format list of ``{"role", "content"}`` messages (system prompts
    included) rendered with the tokenizer's chat template; ``index`` is the row of the task's dataset it came from
    (reasoning-gym tasks score with it), None for generated problems; ``task``: the name of the task it belongs to
    in a mix of tasks (``data.task: mix``), or a dataset row's routing column (the field a multi-teacher run routes
    on: docs/teacher_service.md), None otherwise."""

    prompt: str | list
    answer: str
    solution: str | None = None
    index: int | None = None
    task: str | None = None
    hint: str | None = None  # a field the teacher's own prompt may show (teacher.context.hint_field, SPEC 6.7)


class Task(abc.ABC):
    """A source of problems with a verifier: ``sample`` draws one, ``score`` returns the 0/1 reward of a completion."""

    name = "task"

    @abc.abstractmethod
    def sample(self, rng: random.Random) -> Problem: ...

    @abc.abstractmethod
    def score(self, problem: Problem, completion: str) -> float: ...

    def held_out(self, n: int, seed: int) -> list[Problem] | None:
        """The task's own held-out problems (disjoint from the training ones), at most ``n``, in an order keyed by
        ``seed``; None when the task has no separate held-out set (PromptSource then draws from ``sample``)."""
        return None

    def held_out_all(self) -> list[Problem] | None:
        """Every problem of the task's own held-out set (what no teacher prompt may show), or None when the task
        has none (its held-out problems are draws: the evaluated ones are known to the caller)."""
        return None

    def worked(self, problem: Problem) -> str:
        """The response a worked example of ``problem`` shows (``teacher.context.examples``): its worked solution,
        else its answer, written as the task's verifier reads it."""
        return problem.solution or problem.answer


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


def lookup_value(k: int) -> int:
    """The hidden table of ``lookup_add``: a fixed 3-digit value per key 0..999 (a hash: no model can derive it, a
    model that never calls the tool can only guess it)."""
    import hashlib

    digest = hashlib.blake2b(f"opdistill.lookup:{int(k)}".encode(), digest_size=8).digest()
    return 100 + int.from_bytes(digest, "little") % 900


class LookupAdditionTask(Task):
    """``f(k)+b=``: add ``b`` to the value a tool holds for key ``k`` (the demo environment of SPEC 6.8: the value
    is in no prompt, so only an episode that calls ``f``, ``opdistill.env.demo:f``, can answer). The worked episode
    (:meth:`script`): a call, then the worked addition of the result and ``b`` (carry_add's columns).

    ``answer``: how the last turn gives the sum. ``worked`` (the demo models'): carry_add's columns, the sum after
    the last ``>``. ``number`` (a chat model's): the last number in the turn, as gsm_symbolic reads it (worked
    examples show ``The answer is N.``)."""

    name = "lookup_add"

    def __init__(self, min_digits: int = 3, max_digits: int = 3, answer: str = "worked"):
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"lookup_add: expected 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        if answer not in ("worked", "number"):
            raise ValueError(f"lookup_add: expected answer 'worked' or 'number', got {answer!r}")
        self.min_digits, self.max_digits, self.answer = min_digits, max_digits, answer

    def sample(self, rng: random.Random) -> Problem:
        k = rng.randint(0, 999)
        d = rng.randint(self.min_digits, self.max_digits)
        b = rng.randint(10 ** (d - 1), 10**d - 1)
        v = lookup_value(k)
        return Problem(prompt=f"f({k})+{b}=", answer=str(v + b),
                       solution=CarryAdditionTask.worked_solution(v, b))

    @staticmethod
    def script(problem: Problem) -> list[str]:
        """The worked episode's student turns: the call (compact JSON between ``[`` and ``]``), then the solution."""
        k = int(problem.prompt[2:problem.prompt.index(")")])
        return ['[{"name":"f","arguments":{"k":%d}}]' % k, problem.solution]

    def worked(self, problem: Problem) -> str:
        return problem.solution if self.answer == "worked" else GsmSymbolicTask.worked(self, problem)

    def score(self, problem: Problem, completion: str) -> float:
        if self.answer == "worked":  # the final sum after the last '>' of the last turn
            return CarryAdditionTask.score(self, problem, completion)
        return GsmSymbolicTask.score(self, problem, completion)  # the last number


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

    def worked(self, problem: Problem) -> str:
        return f"The answer is {problem.answer}."

    def score(self, problem: Problem, completion: str) -> float:
        nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", completion)
        if not nums:
            return 0.0
        try:
            return float(abs(float(nums[-1].replace(",", "")) - float(problem.answer.replace(",", ""))) < 1e-6)
        except ValueError:
            return 0.0


class ReasoningGymTask(Task):
    """Any reasoning-gym task by name, scored by its own verifier (``score_answer``).

    ``data.task_args: {name: leg_counting, size: 1000, seed: 0, eval_size: 200, ...}``: the other keys go to the
    task's config (``reasoning_gym.create_dataset(name, seed=, size=, **config)``). The prompt is chat-format: the
    reasoning-gym default system prompt (think, then answer inside ``<answer></answer>``) and the question; the answer
    is extracted with reasoning-gym's ``extract_answer`` (None scores 0) and scored by the dataset's ``score_answer``
    (a float in [0, 1]; some tasks give partial credit). Training draws from ``size`` problems built with ``seed``;
    the held-out set is ``eval_size`` problems built with another seed, minus any whose question is also a training
    question, so no held-out problem is trained on. ``hint_field``: a key of each entry's metadata that the problem
    carries as its ``hint`` (``teacher.context.hint_field``)."""

    name = "reasoning_gym"

    def __init__(self, name: str, size: int = 1000, seed: int = 0, eval_size: int = 200, system_prompt: str | None =
                 "default", hint_field: str | None = None, **config):
        import reasoning_gym
        from reasoning_gym.utils import SYSTEM_PROMPTS

        if system_prompt is not None and system_prompt not in SYSTEM_PROMPTS:
            raise ConfigError(f"data.task_args.system_prompt: expected one of {sorted(SYSTEM_PROMPTS)} or null, got "
                              f"{system_prompt!r}")
        if size < 1 or eval_size < 0:
            raise ConfigError(f"data.task_args: expected size >= 1 and eval_size >= 0, got {size}, {eval_size}")
        try:
            self.data = reasoning_gym.create_dataset(name, seed=seed, size=size, **config)
            self.eval_data = reasoning_gym.create_dataset(name, seed=seed + 1_000_003, size=eval_size, **config) \
                if eval_size else None
        except ValueError as e:  # 'Dataset 'x' not registered', or the task config's own checks
            raise ConfigError(f"data.task_args: reasoning_gym {name!r}: {e}") from None
        except TypeError as e:  # an unknown config key
            raise ConfigError(f"data.task_args: reasoning_gym {name!r} does not take these arguments ({e})") from None
        self.task_name, self.size = name, size
        self.system = SYSTEM_PROMPTS[system_prompt] if system_prompt is not None else None
        train_q = {self.data[i]["question"] for i in range(size)}
        self.eval_index = [i for i in range(eval_size) if self.eval_data[i]["question"] not in train_q]
        self.hint_field = hint_field
        keys = list(self.data[0].get("metadata") or {})
        if hint_field is not None and hint_field not in keys:
            raise ConfigError(f"teacher.context.hint_field: {hint_field!r} is not a metadata key of reasoning_gym "
                              f"{name!r} (keys: {keys})")

    def _problem(self, entry: dict, index: int) -> Problem:
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": entry["question"]}]
        hint = None
        if self.hint_field is not None:
            hint = (entry.get("metadata") or {}).get(self.hint_field)
            if hint is None:
                raise DataError(f"teacher.context.hint_field: reasoning_gym {self.task_name!r} problem "
                                f"{entry['question'][:60]!r} has no metadata {self.hint_field!r}")
            hint = str(hint)
        return Problem(prompt=msgs, answer=str(entry["answer"]), solution=None, index=index, hint=hint)

    def worked(self, problem: Problem) -> str:
        # the answer as the system prompt asks for it (every reasoning-gym system prompt: inside <answer> tags)
        return f"<answer>{problem.answer}</answer>" if self.system and "<answer>" in self.system else problem.answer

    def sample(self, rng: random.Random) -> Problem:
        i = rng.randrange(self.size)
        return self._problem(self.data[i], i)

    def held_out_all(self) -> list[Problem]:
        return [self._problem(self.eval_data[i], -1 - i) for i in self.eval_index]

    def held_out(self, n: int, seed: int) -> list[Problem]:
        order = list(self.eval_index)
        random.Random(f"eval/{seed}").shuffle(order)
        return [self._problem(self.eval_data[i], -1 - i) for i in order[:n]]  # negative index: the eval dataset

    def score(self, problem: Problem, completion: str) -> float:
        from reasoning_gym.utils import extract_answer

        i = problem.index
        entry = self.data[i] if i >= 0 else self.eval_data[-1 - i]
        answer = extract_answer(completion)
        if answer is None:
            return 0.0
        return float(self.data.score_answer(answer=answer, entry=entry))


class MixedTask(Task):
    """Several generated tasks in one prompt stream (``data.task: mix``), each prompt tagged with its task's name
    (``Problem.task``): what a multi-teacher run routes on (docs/teacher_service.md).

    ``data.task_args: {tasks: {NAME: {task: carry_add, <its task_args>}, ...}, weights: {NAME: w, ...}}``: each
    prompt first draws a task (``weights``, default equal), then a problem of that task, from the same seeded rng, so
    the stream stays a pure function of (seed, step). A completion is scored by its own task's verifier. The held-out
    set takes the tasks in turn (round robin over their own held-out problems, or draws keyed by the seed)."""

    name = "mix"

    def __init__(self, tasks: dict, weights: dict | None = None):
        if not isinstance(tasks, dict) or not tasks:
            raise ConfigError(f"data.task_args.tasks: expected a mapping of task names to task specs "
                              f"({{NAME: {{task: carry_add, ...}}}}), got {tasks!r}")
        self.tasks: dict[str, Task] = {}
        for name, spec in tasks.items():
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ConfigError(f"data.task_args.tasks: expected task names of letters, digits, '_', '-' or '.', "
                                  f"got {name!r}")
            if not isinstance(spec, dict) or not isinstance(spec.get("task"), str):
                raise ConfigError(f"data.task_args.tasks.{name}: expected a mapping with a task key (e.g. "
                                  f"{{task: carry_add, min_digits: 1}}), got {spec!r}")
            args = {k: v for k, v in spec.items() if k != "task"}
            if spec["task"] == "mix":
                raise ConfigError(f"data.task_args.tasks.{name}.task: a mix cannot hold another mix")
            try:
                self.tasks[name] = make_task(spec["task"], **args)
            except ConfigError as e:
                raise ConfigError(f"data.task_args.tasks.{name}: {str(e).split(': ', 1)[-1]}") from None
        weights = dict(weights or {})
        unknown = sorted(set(weights) - set(self.tasks))
        if unknown:
            raise ConfigError(f"data.task_args.weights: unknown tasks {unknown} (tasks: {list(self.tasks)})")
        self.names = list(self.tasks)
        self.weights = [weights.get(n, 1.0) for n in self.names]
        if any(isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0 for w in self.weights) \
                or not sum(self.weights) > 0:
            raise ConfigError(f"data.task_args.weights: expected numbers >= 0, not all 0, got {weights!r}")

    def sample(self, rng: random.Random) -> Problem:
        name = rng.choices(self.names, weights=self.weights)[0]
        return dataclasses.replace(self.tasks[name].sample(rng), task=name)

    def held_out(self, n: int, seed: int) -> list[Problem]:
        per = {}
        for name, t in self.tasks.items():
            own = t.held_out(n, seed)
            if own is None:
                rng = random.Random(f"eval/{seed}/{name}")
                own = [t.sample(rng) for _ in range(n)]
            per[name] = [dataclasses.replace(p, task=name) for p in own]
        out = [p for i in range(n) for name in self.names for p in per[name][i:i + 1]]
        return out[:n]

    def score(self, problem: Problem, completion: str) -> float:
        return self.tasks[problem.task].score(problem, completion)

    def held_out_all(self) -> list[Problem] | None:
        own = [p for t in self.tasks.values() for p in (t.held_out_all() or [])]
        return own or None

    def worked(self, problem: Problem) -> str:
        return self.tasks[problem.task].worked(problem)


def make_task(name: str, /, **kwargs) -> Task:
    """The task ``name`` built with ``kwargs`` (``data.task_args``); a bad argument is a ConfigError naming the key."""
    tasks = {"carry_add": CarryAdditionTask, "gsm_symbolic": GsmSymbolicTask, "reasoning_gym": ReasoningGymTask,
             "mix": MixedTask, "lookup_add": LookupAdditionTask}
    if name == "reasoning_gym" and "name" not in kwargs:
        raise ConfigError("data.task_args.name: expected a reasoning-gym task name (e.g. leg_counting), got nothing")
    if name == "reasoning_gym":  # the task's own config keys pass through
        return ReasoningGymTask(**kwargs)
    if name == "mix":  # its own errors name their keys (data.task_args.tasks.NAME...)
        unknown = sorted(set(kwargs) - {"tasks", "weights"})
        if unknown:
            raise ConfigError(f"data.task_args: mix takes ['tasks', 'weights'], got unknown {unknown}")
        return MixedTask(kwargs.get("tasks"), kwargs.get("weights"))
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
