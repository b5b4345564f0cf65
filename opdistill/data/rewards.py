"""Rewards: what a completion earns, from the task's verifier or from functions the user writes.

``reward.functions`` lists them (default: the task's verifier alone, which is what every run had before)::

    reward:
      functions: [task, my_rewards:brevity, rewards/format.py:has_answer]
      weights: [1.0, 0.1, 0.5]          # default: 1 each

An entry is ``task`` (the task's own 0/1 verifier), ``module:function`` (an importable module; the current
directory is searched too, as uvicorn does) or ``path/to/file.py:function``. In Python, ``run_training(cfg,
rewards=[fn, ...])`` takes the callables themselves. A function has TRL's ``reward_funcs`` signature: it is called
once per step on this process's rows, with keyword arguments, and returns one number per completion::

    def brevity(completions, **kwargs) -> list[float]: ...
    def exact(prompts, completions, answer, step) -> list[float]: ...

``prompts``: each row's prompt (a string, or a chat prompt's list of messages), ``completions``: the decoded
responses, ``answer``: each row's reference answer (``""`` when the data has none), ``step``: the optimizer step
(an int). A function names the keywords it reads, or takes ``**kwargs`` for all; ``completions`` is required.

Checked when a run starts, before any model loads (and by ``opdistill check``), each refusal one line naming the
entry: the module imports, the name is a
callable, every parameter without a default is one of the keywords above, none is positional-only. Checked at every
call: the result holds one finite real number per completion (a list, tuple or 1-D tensor/array; a bool counts as
0/1, as do numpy and torch scalars). A function that raises is called again one row at a time to name the row that
fails; the error (:class:`~opdistill.errors.RewardError`) names the function, the step and the row.

In Python a dict ``{name: function or spec}`` names them (two lambdas need names). A row's reward is
``sum_i weights[i] * r_i``; it is what RL (``train.method: rl``), ``loss.use_task_rewards`` and
``loss.use_policy_gradient`` read (group advantages, SPEC 6.3) and what ``train/reward`` reports. With reward
functions named each function's mean is also logged, as ``reward/<name>`` (name: the function's own). Evaluation
accuracy stays the task's verifier: a reward is what training optimizes, accuracy what it is measured by.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from opdistill.data.tasks import Problem, Task
from opdistill.errors import ConfigError, RewardError, first_line, quote

__all__ = ["KEYWORDS", "TASK", "RewardFunction", "Rewards", "load_function", "reward_name"]

TASK = "task"  # the task's own verifier
KEYWORDS = ("prompts", "completions", "answer", "step")  # what a reward function may read


def reward_name(spec) -> str:
    """The name a reward is logged under (``reward/<name>``): ``task``, the function's name after ``:`` of a spec, a
    callable's ``__name__``."""
    if isinstance(spec, str):
        return spec if spec == TASK else spec.rsplit(":", 1)[-1]
    return getattr(spec, "__name__", type(spec).__name__)


def load_function(spec: str, key: str) -> Callable:
    """The callable a ``module:function`` or ``file.py:function`` spec names (ConfigError naming ``key``)."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ConfigError(f"{key}: expected 'task', 'module:function' or 'file.py:function', got {quote(spec)}")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                rel = "" if path.is_absolute() else f" (a relative path is read from the current folder, {os.getcwd()})"
                raise ConfigError(f"{key}: no such file '{where}'{rel}")
            mod_spec = importlib.util.spec_from_file_location(f"opdistill_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:  # the current folder, as uvicorn does
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except BaseException as e:  # noqa: BLE001 -- the user's module may raise anything (SystemExit included)
        if isinstance(e, KeyboardInterrupt):
            raise
        hint = f"; the current folder {os.getcwd()} and sys.path are searched" \
            if isinstance(e, ModuleNotFoundError) and e.name == where.split(".")[0] else ""
        raise ConfigError(f"{key}: cannot import {quote(where)} ({type(e).__name__}: {first_line(e)}){hint}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise ConfigError(f"{key}: {quote(where)} has no attribute {quote(attr)} (its functions: {names})")
    if not callable(fn):
        raise ConfigError(f"{key}: expected a callable, got {where}:{attr} = {quote(fn)}")
    return fn


def _accepts(fn: Callable, key: str) -> frozenset | None:
    """The keywords ``fn`` reads (None: all, it takes ``**kwargs``); refuses a signature the call cannot satisfy."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: it must take the keywords as they come
        return None
    names, var_kw = set(), False
    for p in params:
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
        elif p.kind is p.VAR_POSITIONAL:
            continue
        elif p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            raise ConfigError(f"{key}: parameter {p.name!r} is positional-only; a reward function is called with "
                              f"keyword arguments ({', '.join(KEYWORDS)})")
        elif p.name in KEYWORDS:
            names.add(p.name)
        elif p.default is p.empty:
            raise ConfigError(f"{key}: parameter {p.name!r} has no default and is not one of the keywords a reward "
                              f"function is called with ({', '.join(KEYWORDS)})")
    if not var_kw and "completions" not in names:
        raise ConfigError(f"{key}: expected a function of the completions (a parameter named 'completions', or "
                          f"**kwargs), got the parameters {[p.name for p in params]}")
    return None if var_kw else frozenset(names)


@dataclass(frozen=True)
class RewardFunction:
    """One reward: its ``name`` (``reward/<name>``), where it was named (``key``), the callable (None: the task's
    verifier), its weight, and the keywords it reads (None: all)."""

    name: str
    key: str
    fn: Callable | None
    weight: float
    accepts: frozenset | None


class Rewards:
    """The rewards of a run: ``rewards(problems, completions, step) -> (reward per row [n] float64, each function's
    sum over the rows)``. ``functions``: specs (``task``, ``module:function``, ``file.py:function``) or callables;
    empty: the task's verifier alone. ``weights``: one per function (default 1). ``key``: where they were named, for
    messages (``reward.functions``; ``rewards`` for callables handed to ``run_training``)."""

    def __init__(self, task: Task, functions: Sequence | Mapping = (), weights: Sequence[float] | None = None, *,
                 key: str = "reward.functions"):
        self.task = task
        named = dict(functions) if isinstance(functions, Mapping) else None  # {name: function}: names chosen
        explicit, functions = bool(functions), list(named.values() if named else functions) or [TASK]
        weights = [1.0] * len(functions) if weights is None else list(weights)
        if len(weights) != len(functions):
            raise ConfigError(f"reward.weights: expected {len(functions)} number{'s' * (len(functions) != 1)}, one per "
                              f"reward function, got {len(weights)}")
        self.functions, seen = [], {}
        for i, (spec, w) in enumerate(zip(functions, weights)):
            name = list(named)[i] if named else reward_name(spec)
            where = f"{key}.{name}" if named else f"{key}.{i}"
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{key}: expected non-empty strings as the names of the rewards, got {quote(name)}")
            if name in seen:
                raise ConfigError(f"{where}: a second reward named {name!r} ({seen[name]} is the first): their "
                                  f"metrics reward/{name} would be one (name them: rewards={{'a': f, 'b': g}})")
            seen[name] = where
            if spec == TASK:
                if explicit and getattr(task, "has_answers", True) is False:
                    raise ConfigError(f"{where}: 'task': the dataset's rows have no answers for its verifier (set "
                                      f"data.answer_field, data.final_assistant: answer, or list only your own "
                                      f"functions)")
                self.functions.append(RewardFunction(name, where, None, float(w), None))
                continue
            fn = load_function(spec, where) if isinstance(spec, str) else spec
            if not callable(fn):
                raise ConfigError(f"{where}: expected a callable or a 'module:function' name, got {quote(fn)}")
            label = f"{where} ({spec})" if isinstance(spec, str) else where if named else f"{where} ({name})"
            self.functions.append(RewardFunction(name, label, fn, float(w), _accepts(fn, label)))
        self.names = tuple(f.name for f in self.functions)
        self.custom = explicit or self.functions[0].weight != 1.0  # per-function metrics

    def __call__(self, problems: Sequence[Problem], completions: Sequence[str], step: int):
        total = torch.zeros(len(completions), dtype=torch.float64)
        sums = []
        for f in self.functions:
            values = self._values(f, problems, completions, step)
            total += f.weight * values
            sums.append(float(values.sum()))
        return total, sums

    def _values(self, f: RewardFunction, problems, completions, step: int) -> torch.Tensor:
        if f.fn is None:  # the task's verifier: per row, with the problem (a reasoning-gym row reads its index)
            return torch.tensor([float(self.task.score(p, c)) for p, c in zip(problems, completions)],
                                dtype=torch.float64)
        try:
            got = f.fn(**self._kwargs(f, problems, completions, step))
        except Exception as e:  # noqa: BLE001 -- the user's code: find the row and say it in one line
            raise self._failure(f, problems, completions, step, e) from e
        return _check_values(f, got, completions, problems, step)

    @staticmethod
    def _kwargs(f: RewardFunction, problems, completions, step: int) -> dict:
        kw = {"prompts": [p.prompt for p in problems], "completions": list(completions),
              "answer": [p.answer for p in problems], "step": step}
        return kw if f.accepts is None else {k: v for k, v in kw.items() if k in f.accepts}

    def _failure(self, f: RewardFunction, problems, completions, step: int, error: Exception) -> RewardError:
        """The error of a call that raised, naming the first row that raises alone (the function is called again
        once per row until one does), or the whole batch when no row does."""
        for i, (p, c) in enumerate(zip(problems, completions)):
            try:
                f.fn(**self._kwargs(f, [p], [c], step))
            except Exception as e:  # noqa: BLE001
                return RewardError(f"{f.key} raised {type(e).__name__}: {first_line(e)} at step {step} on row {i} "
                                   f"(prompt {quote(p.prompt, 60)}, completion {quote(c, 60)})")
        return RewardError(f"{f.key} raised {type(error).__name__}: {first_line(error)} at step {step} on the "
                           f"batch of {len(completions)} rows (no row alone raises)")


def _check_values(f: RewardFunction, got, completions, problems, step: int) -> torch.Tensor:
    n = len(completions)
    if isinstance(got, torch.Tensor) or type(got).__module__ == "numpy":
        got = got.tolist() if getattr(got, "ndim", 1) == 1 else got
    if not isinstance(got, (list, tuple)):
        raise RewardError(f"{f.key} returned {quote(got, 60)} at step {step}: expected a list of {n} numbers, one "
                          f"per completion")
    got = list(got)
    if len(got) != n:
        raise RewardError(f"{f.key} returned {len(got)} values at step {step}: expected {n}, one per completion")
    for i, v in enumerate(got):
        if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:  # a numpy or torch scalar (np.bool_ included)
            v = got[i] = v.item()
        if not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
            raise RewardError(f"{f.key} returned {quote(v, 40)} at step {step} for row {i} (completion "
                              f"{quote(completions[i], 60)}): expected a finite number")
    return torch.tensor([float(v) for v in got], dtype=torch.float64)
