"""Typed trainer configuration: one pydantic model per concern, loaded from YAML with dotted overrides.

Every field is checked at load: types are strict (``2.5`` is not an int, ``"yes"`` is not a bool), every number is
finite and inside its bounds, unknown keys are refused; then every rule that the config alone decides runs, one
table of them (:mod:`opdistill.train.run.rules`: a teacher for distillation, K for top-k, what the chosen teacher
cannot answer, ...). A failure raises :class:`ConfigError` (a ``ValueError``) with one line that names the dotted
key, what it expects and what it got, e.g.
``optim.lr: expected a number > 0, got 'abc'``. The ``loss`` section is the core
:class:`opdistill.DistillationConfig`: its fields are type-checked the same way (from the dataclass's own
annotations, so the schema has one home) and its own rules then run in its ``__post_init__``.

Checks that need the model folders' metadata (K against the vocabulary, prompt length against the model's positions,
tokenizers) live in :mod:`opdistill.train.disk.preflight` and run before any model loads; those of the process layout
(the world size) are :func:`opdistill.train.run.rules.check_layout`.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from opdistill import DistillationConfig
from opdistill.errors import ConfigError, quote
from opdistill.train.run.rules import check_config
from opdistill.yaml12 import MAX_CONFIG_BYTES, load_yaml

__all__ = ["ConfigError", "LoraConfig", "ModelConfig", "DataConfig", "RewardConfig", "RolloutConfig", "OptimConfig",
           "TrainConfig",
           "EvalConfig", "CheckpointConfig", "LogConfig", "DistributedConfig", "TeacherConfig", "ContextConfig",
           "NamedTeacher",
           "RoutingConfig", "EnvConfig", "TrainerConfig",
           "load_config", "apply_overrides", "config_to_dict"]

Method = Literal["on_policy", "off_policy", "rl"]
SEED_MAX = 2**32 - 1  # train.seed * 1_000_003 + step must stay inside torch.manual_seed's 64-bit range


class _Section(BaseModel):
    # strict: no silent str -> int or 1 -> True; frozen: a config never changes under a running loop
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


class LoraConfig(_Section):
    """``model.lora``: LoRA adapters on the student (peft; the ``lora`` extra). lm_head is frozen, never adapted."""

    r: int = Field(8, ge=1)  # adapter rank
    alpha: float = Field(16.0, gt=0)  # scaling: alpha / r
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: Union[Literal["all-linear"], list[str]] = "all-linear"  # module names (q_proj, ...) or all-linear


class ModelConfig(_Section):
    student: str = ""  # folder (or hub name) of the student; "builtin:demo-student" for the packaged demo model
    # folder of the teacher; None only for method "rl"; "self": the student's own starting weights (a LoRA student's
    # base with the adapters off, no copy; else one frozen copy of the student folder): self-distillation
    teacher: Optional[str] = None
    student_from_teacher_layers: Optional[int] = Field(None, ge=1)  # the student = the teacher's first N layers
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"  # float16 training is refused
    trust_remote_code: bool = False
    # --- LoRA students and attention (docs/trainer.md "LoRA students") ---
    lora: Optional[LoraConfig] = None  # LoRA adapters on the student (only they train); null = full fine-tuning
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"] = "sdpa"
    # --- teacher placement under torchrun (docs/distributed.md "Teacher placement") ---
    teacher_sharded: bool = False  # FSDP2-shard the teacher over the data-parallel ranks (forward only); false: replicated

class DataConfig(_Section):
    task: Literal["carry_add", "lookup_add", "gsm_symbolic", "reasoning_gym", "dataset", "mix"] = "carry_add"  # mix: task_args.tasks
    task_args: dict = {}  # keyword arguments of the task generator (reasoning_gym: {name: TASK, size, seed, ...})
    path: Optional[str] = None  # task "dataset": a jsonl/json/csv/parquet file, a dataset folder or a hub name
    prompt_field: str = "prompt"
    answer_field: Optional[str] = None
    # a chat prompt (list of messages) ending with the assistant's turn: refuse it, or take that turn as the reference
    # answer and everything before it as the prompt (TRL's conversational datasets: data.prompt_field: messages)
    final_assistant: Literal["refuse", "answer"] = "refuse"
    use_chat_template: bool = True
    prompts_per_step: int = Field(16, ge=1)
    eval_seed: int = Field(0, ge=0, le=SEED_MAX)  # the held-out set and the evaluation's sampling stream
    teacher_cache: Optional[str] = None  # off_policy only: train on the rows of an `opdistill score` cache, in order
    overlong: Literal["error", "truncate"] = "error"  # a dataset prompt longer than the model allows
    # --- held-out rows, hub datasets and answer checking (docs/data.md) ---
    split: str = "train"  # the split of data.path read for training (hub names and dataset folders)
    subset: Optional[str] = None  # the hub dataset's configuration name (load_dataset(path, subset)), e.g. "main"
    eval_path: Optional[str] = None  # held-out rows from another file / dataset (split: eval_split, default split)
    eval_split: Optional[str] = None  # held-out rows from this split (of eval_path, else of path)
    eval_fraction: Optional[float] = Field(None, gt=0, lt=1)  # or: hold out this share of path's distinct prompts
    answer_match: Literal["math", "exact", "contains"] = "math"  # how answer_field is checked (opdistill/data/answers.py)

class RewardConfig(_Section):
    """``reward``: what a completion earns (opdistill/data/rewards.py; docs/trainer.md "Your own reward"): what RL,
    loss.use_task_rewards and loss.use_policy_gradient optimize and train/reward reports."""

    # 'task' (the task's verifier), 'module:function' or 'file.py:function'; empty: the task's verifier alone
    functions: list[str] = []
    weights: Optional[list[float]] = None  # one per function (a row's reward: the weighted sum); null: 1 each


class RolloutConfig(_Section):
    n: int = Field(4, ge=1)  # samples per prompt (a GRPO group)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0 = off
    max_new_tokens: int = Field(64, ge=1)
    min_new_tokens: int = Field(0, ge=0)  # EOS masked before this many response tokens
    batch_size: Optional[int] = Field(None, ge=1)  # prompts decoded together; None = all at once
    # -- inference engine, mismatch correction (docs/engines.md) --
    engine: Literal["hf", "vllm"] = "hf"  # who samples the student's rollouts (vllm: the [vllm] extra)
    tis_cap: Optional[float] = Field(None, ge=1)  # truncated importance sampling: weight min(pi_train/pi_sampler, cap)
    # the off-policy correction of the sampled tokens (SPEC 6.2, 6.5): null = tis when tis_cap is set, else none;
    # train.max_staleness > 0 needs it said: none | tis (tis_cap) | icepop (icepop_band: tokens outside it masked)
    correction: Optional[Literal["none", "tis", "icepop"]] = None
    icepop_band: Optional[list[float]] = None  # icepop: [lo, hi], keep tokens with lo <= pi_train/pi_sampler <= hi
    # the ratio tis / icepop weigh by: per token, or one per sequence broadcast over its tokens (SPEC 6.5): sequence
    # = the product of its tokens' ratios, geometric = their geometric mean
    correction_level: Literal["token", "sequence", "geometric"] = "token"
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, le=1)  # GPU share of each colocated vLLM engine
    vllm_sleep: bool = True  # GPU: put the engines to sleep between rollouts (training gets the memory back)
    vllm_max_model_len: Optional[int] = Field(None, ge=1)  # None: the model's max_position_embeddings
    vllm_kv_cache_gb: float = Field(1.0, gt=0)  # CPU: VLLM_CPU_KVCACHE_SPACE of each engine (GiB)

class OptimConfig(_Section):
    lr: float = Field(1e-3, gt=0)  # at most float32's largest: torch casts it to the weights' dtype (rules.py)
    weight_decay: float = Field(0.0, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "constant"] = "cosine"  # after warmup
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # cosine floor as a fraction of lr
    grad_clip: Optional[float] = Field(1.0, gt=0)
    # AdamW kernel (opdistill/train/run/optim.py): auto = fused where torch has it for the device, else foreach
    implementation: Literal["auto", "fused", "foreach", "single"] = "auto"

class TrainConfig(_Section):
    method: Method = "on_policy"  # on_policy | off_policy (teacher-written samples) | rl (verifier reward only)
    steps: int = Field(100, ge=0)
    max_time_s: Optional[float] = Field(None, gt=0)  # wall-clock budget of the training phases (eval excluded)
    micro_batch_tokens: int = Field(4096, ge=1)  # token budget of a micro-batch (rows x padded length)
    bf16: bool = False  # autocast the student forward in bfloat16
    fused_lm_head: bool = False  # fused lm_head + loss (opdistill.fused): no [tokens, vocab] logits buffer
    seed: int = Field(0, ge=0, le=SEED_MAX)
    threads: Optional[int] = Field(None, ge=1)  # torch.set_num_threads; None = leave torch's default
    max_nonfinite_steps: int = Field(3, ge=1)  # this many non-finite steps in a row stop the run
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~30% more compute
    # --- device placement (opdistill/train/run/placement.py; docs/distributed.md) ---
    device: Literal["cpu", "cuda"] = "cpu"  # cuda: the models on cuda:LOCAL_RANK, nccl under torchrun
    # --- the pipelined step (opdistill/train/steps/pipeline.py; docs/trainer.md) ---
    max_staleness: int = Field(0, ge=0)  # S: step t's rollouts come from the weights after step t-1-S (0: sequential)


class EvalConfig(_Section):
    every: int = Field(0, ge=0)  # evaluate every N steps (0 = only before and after training)
    at_start: bool = True  # evaluate at step 0 (false: e.g. many runs from one start, evaluated once with opdistill eval)
    num_prompts: int = Field(200, ge=0)
    greedy: bool = True
    sampled: bool = True
    topk: int = Field(8, ge=1)  # for the overlap / mass diagnostics
    batch_size: int = Field(256, ge=1)
    max_new_tokens: Optional[int] = Field(None, ge=1)  # default: rollout.max_new_tokens
    # confidence intervals (opdistill/runs/stats.py): samples per problem for the sampled metrics, and the
    # percentile-bootstrap resamples over problems (0 = point estimates only)
    num_samples: int = Field(1, ge=1)
    bootstrap_resamples: int = Field(1000, ge=0)
    # the prompts the student decodes from: student = each held-out problem's own; teacher = under teacher.context
    # (the few-shot student: what a self-teacher scores from; no teacher metrics then)
    prompts: Literal["student", "teacher"] = "student"


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0)  # save every N steps (0 = only at the end)
    keep_last: int = Field(2, ge=1)
    save_final: bool = True


class WandbConfig(_Section):
    """``log.wandb``: Weights & Biases logging (the ``wandb`` extra; opdistill/train/disk/wandb_log.py)."""

    project: str = "opdistill"
    name: Optional[str] = None  # the wandb run name; None = wandb's
    mode: Literal["online", "offline", "disabled"] = "online"  # offline: files under RUN_DIR/wandb, no network


class LogConfig(_Section):
    tensorboard: bool = True
    progress: bool = True
    wandb: Optional[WandbConfig] = None  # null = no wandb


class DistributedConfig(_Section):
    """torch.distributed (torchrun) settings; ignored by a plain one-process run (docs/distributed.md)."""

    strategy: Literal["fsdp2", "ddp"] = "fsdp2"  # how the student is wrapped for data parallelism
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    timeout_s: float = Field(1800.0, gt=0)  # collective timeout
    tp_size: int = Field(1, ge=1)  # tensor (vocab) parallel size of the student's lm_head (run/tensor_parallel.py)
    # what rollouts and evaluation decode with under fsdp2: replica = a whole plain copy of the student per rank
    # (refreshed from the shards before each use; fastest), sharded = the FSDP2 student itself, each layer gathered
    # for its forward and freed after, the ranks' forwards in step (no copy: docs/distributed.md)
    decode: Literal["replica", "sharded"] = "replica"


class ContextConfig(_Section):
    """``teacher.context``: the teacher scores the student's response under its own prompt, built from each row
    (privileged context, SPEC 6.7; opdistill/data/context.py, docs/self_distillation.md). All defaults: the row's
    own prompt (the identity)."""

    examples: int = Field(0, ge=0)  # worked examples before the question, drawn once from the training problems
    examples_path: Optional[str] = None  # or every {prompt, response} row of this JSON-lines file (examples: 0)
    examples_seed: int = Field(0, ge=0, le=SEED_MAX)  # which training problems the examples are
    system: Optional[str] = None  # the teacher's system prompt, in place of the row's own (null: the row's)
    template: str = "{prompt}"  # the teacher's last user turn: {prompt} (required), {answer}, {hint}
    hint_field: Optional[str] = None  # what {hint} reads: a dataset column, a reasoning-gym metadata key

class TeacherConfig(_Section):
    """Where the teacher's scores come from: in process (``engine: hf``, default), a vLLM engine in process
    (``engine: vllm``; docs/engines.md), or a remote server (``url``: ``opdistill serve-teacher`` or a stock
    ``vllm serve``; docs/teacher_service.md): with ``url`` set, on-policy steps are scored by the server and
    model.teacher is not loaded."""

    # -- teacher engine (docs/engines.md) --
    engine: Literal["hf", "vllm"] = "hf"  # who scores the teacher's top-k / sampled-token log-probs (at temperature 1)
    # -- teacher service (docs/teacher_service.md) --

    # http(s)://host:port of an `opdistill serve-teacher` server (TLS by the scheme), or a list of servers of one
    # teacher: a pool (teachers/pool.py: balanced, a failed server taken out and probed back in)
    url: Optional[Union[str, list[str]]] = None
    token_file: Optional[str] = None  # file holding the server's bearer token
    timeout_s: float = Field(120.0, gt=0)  # the deadline of each try of a request, the whole of it (teachers/http.py)
    retries: int = Field(3, ge=0)  # retries after a failed try (connection, timeout, 5xx), backoff doubling
    backoff_s: float = Field(0.5, ge=0)  # wait before the first retry
    payload: Literal["fp32", "fp16", "int8", "json"] = "fp32"  # fp32 and json are exact
    hidden_payload: Literal["fp32", "bf16"] = "fp32"  # loss_mode full: the hidden states on the wire (fp32: exact)
    api: Literal["opdistill", "vllm"] = "opdistill"  # vllm: a stock `vllm serve` endpoint (prompt_logprobs)
    model: Optional[str] = None  # api vllm: the served model name (default: the first of /v1/models)
    overlap: bool = True  # the url request runs in a background thread during the student's forward (same numbers)
    probe_s: float = Field(10.0, gt=0)  # a pool (url: a list): how often a down server is probed back in
    patience_s: float = Field(60.0, ge=0)  # a pool: how long a request waits while every server is down
    # -- privileged context (SPEC 6.7, docs/self_distillation.md) --
    context: Optional[ContextConfig] = None  # the teacher's own prompt per row; null: the student's prompt

class NamedTeacher(TeacherConfig):
    """One entry of ``teachers``: a name and either ``path`` (a model folder or builtin, scored in process, like
    model.teacher) or ``url`` with the client keys of the ``teacher`` section (token_file, timeouts, payload, api,
    overlap). docs/teacher_service.md "Several teachers"."""

    name: str = ""  # letters, digits, '_', '-', '.': it names the metrics teacher/<name>/...
    path: Optional[str] = None  # in process: a model folder (or builtin:demo-teacher); or give url

class XtokConfig(_Section):
    """``xtok``: distillation from a teacher whose tokenizer differs from the student's (SPEC 6.6,
    opdistill/teachers/xtok.py; docs/cross_tokenizer.md). ``off``: such a teacher is refused at load."""

    # bpm: the teacher's next-token distribution mapped onto student tokens by byte prefix (top-K + residual bucket,
    # any top-k or sampled-token loss); sampled: the teacher's log-prob of the student's sampled token only where
    # both tokenizations have a boundary at its start and end (a sampled-token loss), the rest masked
    mode: Literal["off", "bpm", "sampled"] = "off"
    teacher_topk: int = Field(256, ge=1)  # the teacher's top-K_T per position (capped at its vocabulary)


class EnvConfig(_Section):
    """``env``: multi-turn episodes in which the student calls tools (SPEC 6.8; opdistill/env, docs/episodes.md). No
    tools: every rollout is a single response, as before."""

    tools: list[str] = []  # 'module:function' or 'file.py:function', called by name from the student's tool calls
    max_turns: int = Field(4, ge=1)  # student turns per episode (the last one's tool calls are not run)
    max_episode_tokens: int = Field(512, ge=1)  # the student's and the environment's tokens after the prompt
    tool_timeout_s: float = Field(10.0, gt=0)  # a call still running after this is an error observation
    max_result_chars: int = Field(2000, ge=1)  # a longer result is cut (env/cut_results)
    call_open: str = "<tool_call>"  # the markers around a call's JSON {"name": ..., "arguments": {...}}
    call_close: str = "</tool_call>"
    calls_in_prompt: bool = False  # true: your prompts teach the call format, the chat template need not mention it


class RoutingConfig(_Section):
    """``routing``: which teacher scores a prompt, from a field of its data (docs/teacher_service.md)."""

    field: str = "task"  # generated tasks: "task" (a data.task mix's task name); data.task dataset: a column name
    table: dict[str, Optional[str]] = {}  # field value -> teacher name
    default: Optional[str] = None  # the teacher of values the table does not list; null: every value must be listed


class TrainerConfig(_Section):
    run_dir: str = "runs/run"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()  # your own reward functions (default: the task's verifier)
    rollout: RolloutConfig = RolloutConfig()
    teacher: TeacherConfig = TeacherConfig()  # engine, or a remote teacher server
    loss: DistillationConfig = Field(default_factory=DistillationConfig)  # built by load_config (see _loss)
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    distributed: DistributedConfig = DistributedConfig()
    # --- multi-teacher routing (docs/teacher_service.md "Several teachers"; rules in _teachers) ---
    teachers: Optional[list[NamedTeacher]] = None  # named teachers, in process (path) or servers (url)
    routing: Optional[RoutingConfig] = None  # which teacher scores which prompt (needed with teachers)
    xtok: XtokConfig = XtokConfig()  # teachers with another tokenizer (docs/cross_tokenizer.md)
    env: EnvConfig = EnvConfig()  # tools the student calls over several turns (docs/episodes.md)

# The loss section: the DistillationConfig dataclass's own fields and defaults, type-checked like the sections above.
_LOSS_HINTS = typing.get_type_hints(DistillationConfig)
_LossFields = create_model("loss", __base__=_Section, **{
    f.name: (_LOSS_HINTS[f.name], f.default if f.default is not dataclasses.MISSING else Field(
        default_factory=f.default_factory)) for f in dataclasses.fields(DistillationConfig)})


def _loss(data: Any) -> DistillationConfig:
    fields = _LossFields.model_validate(data)  # raises ValidationError with locs relative to "loss"
    try:
        return DistillationConfig(**dict(fields))
    except (ValueError, TypeError) as e:  # DistillationConfig's own rules: "topk must be ..." -> "loss.topk: must be"
        msg = str(e)
        name = msg.split(" ", 1)[0]
        raise ConfigError(f"loss.{name}: {msg.split(' ', 1)[1]}" if name in _LossFields.model_fields else
                          f"loss: {msg}") from None


def _expected(field) -> str:
    """What a field accepts, in words, from its annotation and bounds: 'a number in (0, 1]'."""
    ann, args = field.annotation, typing.get_args(field.annotation)
    nullable = type(None) in args
    if nullable:
        ann = next(a for a in args if a is not type(None))
    if typing.get_origin(ann) is Literal:
        text = "one of " + "/".join(map(str, typing.get_args(ann)))
    elif typing.get_origin(ann) in (list, dict):
        text = {list: "a list", dict: "a mapping"}[typing.get_origin(ann)]
    else:
        text = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
                dict: "a mapping"}.get(ann, str(ann))
    b = {k: getattr(m, k) for m in field.metadata for k in ("gt", "ge", "lt", "le") if hasattr(m, k)}
    lo, hi = b.get("ge", b.get("gt")), b.get("le", b.get("lt"))
    if lo is not None and hi is not None:
        text += f" in {'[' if 'ge' in b else '('}{lo}, {hi}{']' if 'le' in b else ')'}"
    elif lo is not None:
        text += f" {'>=' if 'ge' in b else '>'} {lo}"
    elif hi is not None:
        text += f" {'<=' if 'le' in b else '<'} {hi}"
    return text + (" or null" if nullable else "")


def _one_line(err: ValidationError, root: type[BaseModel], prefix: tuple = ()) -> ConfigError:
    """The first pydantic error as one line: 'dotted.key: expected WHAT, got VALUE' (or the rule that failed)."""
    e = err.errors()[0]
    loc = prefix + tuple(e["loc"])
    key = ".".join(map(str, loc)) or "config"
    cause = (e.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # a rule of a model_validator: already one line naming its key
        return ConfigError(str(cause))
    section, field = root, None  # walk the key path to the field (and the section holding it)
    path = loc[len(prefix):]
    for i, part in enumerate(path):
        if isinstance(part, int) and field is not None:  # an item of a list of sections (teachers.0.url)
            continue
        field = getattr(section, "model_fields", {}).get(part)
        if field is None:
            break
        if i < len(path) - 1:  # an Optional[Section] (model.lora), Optional[list[Section]] walks into the section
            args = typing.get_args(field.annotation)
            section = next((a for a in (field.annotation, *args, *(x for a in args for x in typing.get_args(a)))
                            if isinstance(a, type) and issubclass(a, BaseModel)), field.annotation)
    if e["type"] == "extra_forbidden":
        where = ".".join(map(str, loc[:-1]))
        return ConfigError(f"{key}: unknown key (known keys{' of ' + where if where else ''}: {list(section.model_fields)})")
    if len(loc) == len(prefix) or (field is not None and isinstance(field.annotation, type)
                                   and issubclass(field.annotation, BaseModel)):
        return ConfigError(f"{key}: expected a mapping of {key}.* keys, got {quote(e['input'])}")
    if cause is not None:
        return ConfigError(f"{key}: {cause}")
    expected = _expected(field) if field is not None else e["msg"].lower()
    if e["type"] == "finite_number":  # inf is "a number > 0": say what is wrong with it
        expected = expected.replace("a number", "a finite number", 1)
    return ConfigError(f"{key}: expected {expected}, got {quote(e['input'])}")


def config_to_dict(cfg: TrainerConfig) -> dict:
    return cfg.model_dump()


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML, by the rules of a config file: opdistill/yaml12.py) to
    a nested dict; returns a new dict."""
    out = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {quote(item)}: expected dotted.key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {quote(p)} is not a section")
        try:
            node[parts[-1]] = load_yaml(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            why = getattr(e, "problem", None)
            raise ConfigError(f"{key}: cannot read {quote(raw)} as a YAML value{f' ({why})' if why else ''}") from None
    return out


def load_config(path: str | Path | None = None, overrides: list[str] = (), base: dict | None = None) -> TrainerConfig:
    """TrainerConfig from a YAML file (or ``base`` dict) plus dotted overrides. Unknown keys are errors."""
    data = dict(base or {})
    if path is not None:
        try:
            loaded = load_yaml(_read_config_text(path)) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
            why = getattr(e, "problem", None) or getattr(e, "reason", None) or e
            raise ConfigError(f"{where}: not valid YAML ({' '.join(str(why).split())})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a YAML mapping at the top level, got {type(loaded).__name__}")
        data = _merge(data, loaded)
    data = apply_overrides(data, list(overrides))
    _no_nul(data)
    try:
        if "loss" in data:
            data["loss"] = _loss(data["loss"])
    except ValidationError as e:
        raise _one_line(e, _LossFields, ("loss",)) from None
    try:
        cfg = TrainerConfig.model_validate(data)
    except ValidationError as e:
        raise _one_line(e, TrainerConfig) from None
    check_config(cfg)  # every refusal the config alone decides (opdistill/train/run/rules.py)
    return cfg


def _read_config_text(path) -> str:
    """The config file's text: a regular file or a pipe (not a device: ``/dev/zero`` never ends), UTF-8, at most
    ``MAX_CONFIG_BYTES`` (read no further)."""
    import stat

    try:
        mode = os.stat(path).st_mode
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            raise ConfigError(f"{path}: a device, not a config file (a config is a YAML text file)")
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB; a config is a few KB of YAML (data "
                          f"belongs in data.path)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 text file ({e.reason} at byte {e.start}); a config is YAML "
                          f"text") from None


def _no_nul(data, key: str = "") -> None:
    """Refuse a NUL character in any string of the config: no path, name or URL holds one (the OS refuses it later,
    deep inside, as a ValueError)."""
    if isinstance(data, str):
        if "\x00" in data:
            raise ConfigError(f"{key or 'config'}: expected text without a NUL character, got {quote(data)}")
    elif isinstance(data, dict):
        for k, v in data.items():
            _no_nul(k, key)
            _no_nul(v, f"{key}.{k}" if key else str(k))
    elif isinstance(data, (list, tuple)):
        for i, v in enumerate(data):
            _no_nul(v, f"{key}.{i}")


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
