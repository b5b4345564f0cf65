"""Typed trainer configuration: one dataclass per concern, loaded from YAML with dotted overrides.

Every field is checked at construction; an unknown key, a wrong type or a bad value raises :class:`ConfigError`
(a ``ValueError``) whose message starts with the dotted key, e.g. ``rollout.temperature: expected a number > 0,
got -1``. The ``loss`` section is the core :class:`opdistill.DistillationConfig` and is validated by it.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from opdistill import DistillationConfig

__all__ = ["ConfigError", "ModelConfig", "DataConfig", "RolloutConfig", "OptimConfig", "TrainConfig", "EvalConfig",
           "CheckpointConfig", "LogConfig", "TrainerConfig", "load_config", "apply_overrides", "config_to_dict"]

METHODS = ("on_policy", "off_policy", "rl")


class ConfigError(ValueError):
    """A configuration key is unknown, has the wrong type, or a bad value. The message names the dotted key."""


def _check(cond: bool, key: str, expected: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"{key}: expected {expected}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    student: str = ""  # folder (or hub name) of the student; "builtin:demo-student" for the packaged demo model
    teacher: Optional[str] = None  # folder of the teacher; None only for method "rl"
    student_from_teacher_layers: Optional[int] = None  # build the student from the teacher's first N layers
    dtype: str = "float32"
    trust_remote_code: bool = False

    def __post_init__(self):
        _check(self.dtype in ("float32", "bfloat16", "float16", "float64"), "model.dtype",
               "one of float32/bfloat16/float16/float64", self.dtype)
        _check(self.student_from_teacher_layers is None or self.student_from_teacher_layers >= 1,
               "model.student_from_teacher_layers", "an int >= 1 or null", self.student_from_teacher_layers)


@dataclass(frozen=True)
class DataConfig:
    task: str = "carry_add"  # carry_add | gsm_symbolic | dataset
    task_args: dict = field(default_factory=dict)  # keyword arguments of the task generator
    path: Optional[str] = None  # local jsonl/parquet/csv for task "dataset"
    prompt_field: str = "prompt"
    answer_field: Optional[str] = None
    use_chat_template: bool = True
    prompts_per_step: int = 16
    eval_seed: int = 0  # the held-out set and the evaluation's sampling stream (independent of train.seed)
    teacher_cache: Optional[str] = None  # off_policy only: train on the rows of an `opdistill score` cache, in order

    def __post_init__(self):
        _check(self.task in ("carry_add", "gsm_symbolic", "dataset"), "data.task",
               "one of carry_add/gsm_symbolic/dataset", self.task)
        _check(self.task != "dataset" or bool(self.path), "data.path", "a file path when data.task is 'dataset'",
               self.path)
        _check(self.prompts_per_step >= 1, "data.prompts_per_step", "an int >= 1", self.prompts_per_step)


@dataclass(frozen=True)
class RolloutConfig:
    n: int = 4  # samples per prompt (a GRPO group)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    batch_size: Optional[int] = None  # prompts per generate() call; None = all at once

    def __post_init__(self):
        _check(self.n >= 1, "rollout.n", "an int >= 1", self.n)
        _check(self.temperature > 0 and math.isfinite(self.temperature), "rollout.temperature", "a number > 0",
               self.temperature)
        _check(0 < self.top_p <= 1, "rollout.top_p", "a number in (0, 1]", self.top_p)
        _check(self.top_k >= 0, "rollout.top_k", "an int >= 0 (0 = off)", self.top_k)
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", "an int >= 1", self.max_new_tokens)
        _check(self.batch_size is None or self.batch_size >= 1, "rollout.batch_size", "an int >= 1 or null",
               self.batch_size)


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    warmup_steps: int = 0
    schedule: str = "cosine"  # cosine | constant (after warmup)
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    grad_clip: Optional[float] = 1.0

    def __post_init__(self):
        _check(self.lr > 0 and math.isfinite(self.lr), "optim.lr", "a number > 0", self.lr)
        _check(self.weight_decay >= 0, "optim.weight_decay", "a number >= 0", self.weight_decay)
        _check(0 <= self.beta1 < 1, "optim.beta1", "a number in [0, 1)", self.beta1)
        _check(0 <= self.beta2 < 1, "optim.beta2", "a number in [0, 1)", self.beta2)
        _check(self.warmup_steps >= 0, "optim.warmup_steps", "an int >= 0", self.warmup_steps)
        _check(self.schedule in ("cosine", "constant"), "optim.schedule", "cosine or constant", self.schedule)
        _check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "a number in [0, 1]", self.min_lr_ratio)
        _check(self.grad_clip is None or self.grad_clip > 0, "optim.grad_clip", "a number > 0 or null",
               self.grad_clip)


@dataclass(frozen=True)
class TrainConfig:
    method: str = "on_policy"  # on_policy | off_policy (teacher-written samples) | rl (verifier reward only)
    steps: int = 100
    max_time_s: Optional[float] = None  # wall-clock budget of the training phases (eval excluded)
    micro_batch_tokens: int = 4096  # token budget of a micro-batch (rows x padded length)
    bf16: bool = False  # autocast the student forward in bfloat16
    fused_lm_head: bool = False  # fused lm_head + loss (opdistill.fused): no [tokens, vocab] logits buffer
    seed: int = 0
    threads: Optional[int] = None  # torch.set_num_threads; None = leave torch's default
    max_nonfinite_steps: int = 3  # this many steps in a row with a NaN/inf loss or gradient norm stop the run

    def __post_init__(self):
        _check(self.method in METHODS, "train.method", "one of " + "/".join(METHODS), self.method)
        _check(self.steps >= 0, "train.steps", "an int >= 0", self.steps)
        _check(self.max_time_s is None or self.max_time_s > 0, "train.max_time_s", "a number > 0 or null",
               self.max_time_s)
        _check(self.micro_batch_tokens >= 1, "train.micro_batch_tokens", "an int >= 1", self.micro_batch_tokens)
        _check(self.threads is None or self.threads >= 1, "train.threads", "an int >= 1 or null", self.threads)
        _check(self.max_nonfinite_steps >= 1, "train.max_nonfinite_steps", "an int >= 1", self.max_nonfinite_steps)


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0  # evaluate every N steps (0 = only before and after training)
    num_prompts: int = 200
    greedy: bool = True
    sampled: bool = True
    topk: int = 8  # for the overlap / mass diagnostics
    batch_size: int = 256
    max_new_tokens: Optional[int] = None  # default: rollout.max_new_tokens

    def __post_init__(self):
        _check(self.every >= 0, "eval.every", "an int >= 0", self.every)
        _check(self.num_prompts >= 0, "eval.num_prompts", "an int >= 0", self.num_prompts)
        _check(self.topk >= 1, "eval.topk", "an int >= 1", self.topk)
        _check(self.batch_size >= 1, "eval.batch_size", "an int >= 1", self.batch_size)


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # save every N steps (0 = only at the end)
    keep_last: int = 2
    save_final: bool = True

    def __post_init__(self):
        _check(self.every >= 0, "checkpoint.every", "an int >= 0", self.every)
        _check(self.keep_last >= 1, "checkpoint.keep_last", "an int >= 1", self.keep_last)


@dataclass(frozen=True)
class LogConfig:
    tensorboard: bool = True
    progress: bool = True


@dataclass(frozen=True)
class TrainerConfig:
    run_dir: str = "runs/run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: DistillationConfig = field(default_factory=DistillationConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self):
        _check(bool(self.model.student), "model.student", "a model folder", self.model.student)
        if self.train.method == "rl":
            _check(self.rollout.n >= 2, "rollout.n", "an int >= 2 for method rl (group-normalized advantages)",
                   self.rollout.n)
        else:
            _check(bool(self.model.teacher), "model.teacher", f"a model folder for method {self.train.method}",
                   self.model.teacher)
        if self.train.method == "off_policy":
            # teacher-written samples: the sampler log-probs are the teacher's, so ratios against them mean nothing
            _check(not self.loss.use_policy_gradient and not self.loss.use_task_rewards, "loss.use_policy_gradient",
                   "false (and loss.use_task_rewards false) for method off_policy", self.loss.use_policy_gradient)
        if self.data.teacher_cache is not None:
            _check(self.train.method == "off_policy", "data.teacher_cache",
                   "set only with train.method off_policy (on-policy samples cannot come from a cache)",
                   self.data.teacher_cache)
            _check(self.loss.loss_mode in ("topk", "sampled"), "loss.loss_mode",
                   "topk or sampled when training from data.teacher_cache", self.loss.loss_mode)
        if self.train.method == "rl" or self.loss.use_task_rewards:
            _check(self.data.task != "dataset" or self.data.answer_field is not None, "data.answer_field",
                   "a column name: rewards need a verifier (method rl or loss.use_task_rewards)",
                   self.data.answer_field)
        if self.loss.use_task_rewards:
            _check(self.rollout.n >= 2, "rollout.n", "an int >= 2 when loss.use_task_rewards is on", self.rollout.n)


_SECTIONS = {f.name: f for f in dataclasses.fields(TrainerConfig)}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key)
    if tp is bool:
        _check(isinstance(value, bool), key, "true or false", value)
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key, "an integer", value)
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), key, "a number", value)
        return float(value)
    if tp is str:
        _check(isinstance(value, str), key, "a string", value)
        return value
    if tp is dict or origin is dict:
        _check(isinstance(value, dict), key, "a mapping", value)
        return dict(value)
    return value


def _build(cls, data: Any, prefix: str):
    _check(isinstance(data, dict), prefix or "config", "a mapping", data)
    if cls is DistillationConfig:
        try:
            return DistillationConfig.from_dict(dict(data))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{prefix}: {e}") from e
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"{where}{unknown[0]}: unknown key (known keys{' of ' + prefix if prefix else ''}: {names})")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, key)
        else:
            kwargs[name] = _coerce(value, tp, key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{prefix}: {e}") from e


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a nested dict; returns a new dict."""
    import copy

    out = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected dotted.key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {p!r} is not a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    return out


def load_config(path: str | Path | None = None, overrides: list[str] = (), base: dict | None = None) -> TrainerConfig:
    """TrainerConfig from a YAML file (or ``base`` dict) plus dotted overrides. Unknown keys are errors."""
    data = dict(base or {})
    if path is not None:
        with open(path) as f:
            loaded = yaml.safe_load(f) or {}
        _check(isinstance(loaded, dict), str(path), "a YAML mapping at the top level", type(loaded).__name__)
        data = _merge(data, loaded)
    data = apply_overrides(data, list(overrides))
    return _build(TrainerConfig, data, "")


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
