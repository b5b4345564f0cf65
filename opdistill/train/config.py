"""Typed trainer configuration: one pydantic model per concern, loaded from YAML with dotted overrides.

Every field is checked at load: types are strict (``2.5`` is not an int, ``"yes"`` is not a bool), every number is
finite and inside its bounds, unknown keys are refused, and rules that tie sections together (a teacher for
distillation, K for top-k, what the hidden-state payload of ``full`` mode cannot come from) run right after. A failure raises :class:`ConfigError` (a
``ValueError``) with one line that names the dotted key, what it expects and what it got, e.g.
``optim.lr: expected a number > 0, got 'abc'``. The ``loss`` section is the core
:class:`opdistill.DistillationConfig`: its fields are type-checked the same way (from the dataclass's own
annotations, so the schema has one home) and its own rules then run in its ``__post_init__``.

Checks that need the model folders' metadata (K against the vocabulary, prompt length against the model's positions,
tokenizers) or the process layout live in :mod:`opdistill.train.preflight` and run before any model loads.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from opdistill import DistillationConfig
from opdistill.errors import ConfigError, quote
from opdistill.yaml12 import MAX_CONFIG_BYTES, load_yaml

__all__ = ["ConfigError", "LoraConfig", "ModelConfig", "DataConfig", "RolloutConfig", "OptimConfig", "TrainConfig",
           "EvalConfig", "CheckpointConfig", "LogConfig", "DistributedConfig", "TeacherConfig", "ContextConfig",
           "NamedTeacher",
           "RoutingConfig", "TrainerConfig",
           "load_config", "apply_overrides", "config_to_dict"]

Method = Literal["on_policy", "off_policy", "rl"]
FLOAT32_MAX = 3.4028234663852886e38
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

    @model_validator(mode="after")
    def _self_teacher(self):
        if self.teacher == "self" and self.student_from_teacher_layers is not None:
            raise ConfigError(f"model.student_from_teacher_layers: expected null with model.teacher 'self', got "
                              f"{self.student_from_teacher_layers}")
        return self


class DataConfig(_Section):
    task: Literal["carry_add", "gsm_symbolic", "reasoning_gym", "dataset", "mix"] = "carry_add"  # mix: task_args.tasks
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

    @model_validator(mode="after")
    def _rules(self):
        if self.task == "dataset" and not self.path:
            raise ConfigError(f"data.path: expected a file path when data.task is 'dataset', got {quote(self.path)}")
        for key in ("eval_path", "eval_split", "eval_fraction"):
            if getattr(self, key) is not None and self.task != "dataset":
                raise ConfigError(f"data.{key}: set only with data.task dataset (generated tasks hold out their own "
                                  f"problems), got {quote(getattr(self, key))} with data.task {quote(self.task)}")
        if self.final_assistant == "answer" and self.answer_field is not None:
            raise ConfigError(f"data.answer_field: expected null with data.final_assistant 'answer' (the answer is "
                              f"the final assistant turn of data.prompt_field), got {quote(self.answer_field)}")
        if self.eval_fraction is not None and (self.eval_path is not None or self.eval_split is not None):
            raise ConfigError(f"data.eval_fraction: expected null when data.eval_path or data.eval_split gives the "
                              f"held-out rows, got {quote(self.eval_fraction)}")
        return self


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

    @model_validator(mode="after")
    def _min_within_max(self):
        if self.min_new_tokens > self.max_new_tokens:
            raise ConfigError(f"rollout.min_new_tokens: expected an integer in [0, rollout.max_new_tokens="
                              f"{self.max_new_tokens}], got {self.min_new_tokens}")
        return self


class OptimConfig(_Section):
    lr: float = Field(1e-3, gt=0)  # at most FLOAT32_MAX: torch casts it to the weights' float32 (_lr_fits)
    weight_decay: float = Field(0.0, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "constant"] = "cosine"  # after warmup
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # cosine floor as a fraction of lr
    grad_clip: Optional[float] = Field(1.0, gt=0)
    # AdamW kernel (opdistill/train/optim.py): auto = fused where torch has it for the device, else foreach
    implementation: Literal["auto", "fused", "foreach", "single"] = "auto"

    @model_validator(mode="after")
    def _lr_fits(self):
        if self.lr > FLOAT32_MAX:  # was a RuntimeError ("cannot be converted ... without overflow") in the first step
            raise ConfigError(f"optim.lr: expected a number > 0 that float32 weights can hold (at most {FLOAT32_MAX:.4g}),"
                              f" got {quote(self.lr)}")
        return self


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
    # --- device placement (opdistill/train/placement.py; docs/distributed.md) ---
    device: Literal["cpu", "cuda"] = "cpu"  # cuda: the models on cuda:LOCAL_RANK, nccl under torchrun
    # --- the pipelined step (opdistill/train/pipeline.py; docs/trainer.md) ---
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
    """``log.wandb``: Weights & Biases logging (the ``wandb`` extra; opdistill/train/wandb_log.py)."""

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
    tp_size: int = Field(1, ge=1)  # tensor (vocab) parallel size of the student's lm_head (train/tensor_parallel.py)
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

    @model_validator(mode="after")
    def _rules(self):
        from opdistill.data.context import check_template

        if self.examples_path is not None and self.examples:
            raise ConfigError(f"teacher.context.examples: expected 0 with teacher.context.examples_path (every row "
                              f"of the file is an example), got {self.examples}")
        check_template(self.template, self.hint_field)
        return self


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

    @model_validator(mode="after")
    def _url(self):
        _check_urls(self.url, "teacher.url")
        return self


def _check_urls(url, key: str) -> None:
    """``url``: one http(s)://host:port, or a list of at least one, each once (a pool of servers)."""
    if url is None:
        return
    urls = [url] if isinstance(url, str) else url
    if not urls:
        raise ConfigError(f"{key}: expected http://host:port or a list of them, got []")
    for u in urls:
        if not re.match(r"^https?://[^\s/]+", u):
            raise ConfigError(f"{key}: expected http://host:port or https://host:port, got {quote(u)}")
    twice = sorted({u.rstrip("/") for u in urls if sum(v.rstrip("/") == u.rstrip("/") for v in urls) > 1})
    if twice:
        raise ConfigError(f"{key}: lists {quote(twice[0])} twice; each server of a pool once")


class NamedTeacher(TeacherConfig):
    """One entry of ``teachers``: a name and either ``path`` (a model folder or builtin, scored in process, like
    model.teacher) or ``url`` with the client keys of the ``teacher`` section (token_file, timeouts, payload, api,
    overlap). docs/teacher_service.md "Several teachers"."""

    name: str = ""  # letters, digits, '_', '-', '.': it names the metrics teacher/<name>/...
    path: Optional[str] = None  # in process: a model folder (or builtin:demo-teacher); or give url

    @model_validator(mode="after")
    def _url(self):
        _check_urls(self.url, f"teachers: url of teacher {quote(self.name)}")
        return self


class XtokConfig(_Section):
    """``xtok``: distillation from a teacher whose tokenizer differs from the student's (SPEC 6.6,
    opdistill/teachers/xtok.py; docs/cross_tokenizer.md). ``off``: such a teacher is refused at load."""

    # bpm: the teacher's next-token distribution mapped onto student tokens by byte prefix (top-K + residual bucket,
    # any top-k or sampled-token loss); sampled: the teacher's log-prob of the student's sampled token only where
    # both tokenizations have a boundary at its start and end (a sampled-token loss), the rest masked
    mode: Literal["off", "bpm", "sampled"] = "off"
    teacher_topk: int = Field(256, ge=1)  # the teacher's top-K_T per position (capped at its vocabulary)


class RoutingConfig(_Section):
    """``routing``: which teacher scores a prompt, from a field of its data (docs/teacher_service.md)."""

    field: str = "task"  # generated tasks: "task" (a data.task mix's task name); data.task dataset: a column name
    table: dict[str, Optional[str]] = {}  # field value -> teacher name
    default: Optional[str] = None  # the teacher of values the table does not list; null: every value must be listed


class TrainerConfig(_Section):
    run_dir: str = "runs/run"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
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

    @model_validator(mode="after")
    def _rules(self):
        method, lc = self.train.method, self.loss

        def need(cond: bool, key: str, expected: str, value: Any) -> None:
            if not cond:
                raise ConfigError(f"{key}: expected {expected}, got {quote(value)}")

        need(bool(self.run_dir.strip()), "run_dir", "a folder path (an empty one would be the current folder)",
             self.run_dir)
        need(bool(self.model.student), "model.student", "a model folder", self.model.student)
        if method == "rl":
            need(self.rollout.n >= 2, "rollout.n", "an int >= 2 for method rl (group-normalized advantages)",
                 self.rollout.n)
        else:
            need(bool(self.model.teacher) or self.teacher.url is not None or self.teachers is not None, "model.teacher",
                 f"a model folder (or teacher.url) for method {method}", self.model.teacher)
            need(lc.loss_mode != "topk" or lc.topk is not None, "loss.topk",
                 "an int >= 1 with loss.loss_mode topk (the K of the teacher's top-k, e.g. 8)", lc.topk)
        if method == "off_policy":
            # teacher-written samples: the sampler log-probs are the teacher's, so ratios against them mean nothing
            need(not lc.use_policy_gradient and not lc.use_task_rewards, "loss.use_policy_gradient",
                 "false (and loss.use_task_rewards false) for method off_policy", lc.use_policy_gradient)
        ctx = self.teacher.context
        if ctx is not None:
            need(method != "rl", "teacher.context", "null with train.method rl (no teacher scores)", ctx.model_dump())
            need(self.data.teacher_cache is None, "teacher.context", "null with data.teacher_cache (the cache holds "
                 "scores made under the student's prompts)", ctx.model_dump())
            need(ctx.hint_field is None or self.data.task in ("dataset", "reasoning_gym"), "teacher.context.hint_field",
                 f"null with data.task {self.data.task} (a hint is a dataset column or a reasoning-gym metadata key)",
                 ctx.hint_field)
        if self.eval.prompts == "teacher":
            need(ctx is not None, "eval.prompts", "student without teacher.context (teacher: the held-out problems "
                 "under the teacher's context)", self.eval.prompts)
            from opdistill.data.context import reads_rows

            need(not reads_rows(ctx.template), "eval.prompts",
                 "student when teacher.context.template reads {answer} or {hint} (the held-out answers never enter a "
                 "prompt)", self.eval.prompts)
        if self.teacher.url is not None:
            need(method == "on_policy", "teacher.url", "set only with train.method on_policy (off_policy samples are "
                 "written by an in-process teacher; rl has no teacher)", self.teacher.url)
        if self.data.teacher_cache is not None:
            need(method == "off_policy", "data.teacher_cache",
                 "set only with train.method off_policy (on-policy samples cannot come from a cache)",
                 self.data.teacher_cache)
        if method == "rl" or lc.use_task_rewards:
            need(self.data.task != "dataset" or self.data.answer_field is not None
                 or self.data.final_assistant == "answer", "data.answer_field",
                 "a column name (or data.final_assistant: answer): rewards need a verifier (method rl or "
                 "loss.use_task_rewards)", self.data.answer_field)
        rc = self.rollout
        if rc.engine == "vllm" or self.teacher.engine == "vllm":
            need(not self.model.student_from_teacher_layers, "model.student_from_teacher_layers",
                 "unset with a vllm engine (vLLM loads models from folders)", self.model.student_from_teacher_layers)
            need(self.model.dtype != "float64", "model.dtype", "float32, bfloat16 or float16 with a vllm engine",
                 self.model.dtype)
        if rc.engine == "vllm":
            need(method != "off_policy", "rollout.engine", "hf with method off_policy (the teacher writes the samples)",
                 rc.engine)
            need(rc.min_new_tokens == 0, "rollout.min_new_tokens", "0 with rollout.engine vllm", rc.min_new_tokens)
        if lc.loss_mode == "full" and method != "rl":  # the teacher's hidden states and lm_head (SPEC 6.4)
            why = "topk or sampled with {} (loss_mode full reads the teacher's hidden states, which {})"
            need(self.teacher.engine == "hf", "loss.loss_mode",
                 why.format("teacher.engine vllm", "vLLM's prompt log-probs do not carry"), lc.loss_mode)
            need(self.teacher.api == "opdistill", "loss.loss_mode",
                 why.format("teacher.api vllm", "a stock vllm serve endpoint does not return"), lc.loss_mode)
            need(self.data.teacher_cache is None, "loss.loss_mode",
                 why.format("data.teacher_cache", "a teacher cache does not hold"), lc.loss_mode)
            for i, t in enumerate(self.teachers or []):
                need(t.api == "opdistill", "loss.loss_mode",
                     why.format(f"teachers.{i}.api vllm", "a stock vllm serve endpoint does not return"), lc.loss_mode)
        if lc.loss_mode == "topk" and lc.support == "union" and method != "rl":
            # the student's top-k ids come from its own sampler; the teacher scores them as requested ids
            why = "tail, truncated or renormalized with {} (support union asks the teacher for its log-probs at the " \
                  "student's top-k ids, {})"
            need(method == "on_policy", "loss.support", why.format(
                f"train.method {method}", "which only on-policy rollouts carry"), lc.support)
            need(rc.engine == "hf", "loss.support", why.format(
                "rollout.engine vllm", "which the vLLM rollout engine does not return"), lc.support)
            need(self.teacher.engine == "hf", "loss.support", why.format(
                "teacher.engine vllm", "which vLLM's prompt log-probs cannot answer"), lc.support)
            need(self.teacher.api == "opdistill", "loss.support", why.format(
                "teacher.api vllm", "which a stock vllm serve endpoint cannot answer"), lc.support)
            for i, t in enumerate(self.teachers or []):
                need(t.api == "opdistill", "loss.support", why.format(
                    f"teachers.{i}.api vllm", "which a stock vllm serve endpoint cannot answer"), lc.support)
        if self.xtok.mode != "off" and method != "rl":
            why = "{} with xtok.mode " + self.xtok.mode + " (a teacher with another tokenizer {})"
            need(lc.loss_mode != "full", "loss.loss_mode", why.format(
                "topk or sampled", "has no hidden states over the student's vocabulary"), lc.loss_mode)
            need(not (lc.loss_mode == "topk" and lc.support == "union"), "loss.support", why.format(
                "tail, truncated or renormalized", "cannot score the student's own top-k ids"), lc.support)
            need(self.xtok.mode != "sampled" or lc.loss_mode == "sampled", "loss.loss_mode", why.format(
                "sampled", "gives only the log-prob of the student's token in mode sampled"), lc.loss_mode)
            need(self.data.teacher_cache is None, "data.teacher_cache", why.format(
                "null", "reads each prompt's text, which a cache's rows do not keep"), self.data.teacher_cache)
            need(self.teacher.engine == "hf", "teacher.engine", why.format(
                "hf", "is scored through opdistill's own teachers"), self.teacher.engine)
            need(self.teacher.api == "opdistill", "teacher.api", why.format(
                "opdistill", "needs its top-k and sampled log-probs together"), self.teacher.api)
            for i, t in enumerate(self.teachers or []):
                need(t.api == "opdistill", f"teachers.{i}.api", why.format(
                    "opdistill", "needs its top-k and sampled log-probs together"), t.api)
        if self.teacher.engine == "vllm":
            need(self.teacher.url is None, "teacher.engine", "hf with teacher.url (the server scores)",
                 self.teacher.engine)
            need(self.model.teacher != "self", "teacher.engine", "hf with model.teacher self (the student's own "
                 "starting weights are scored in process; serve its folder to score them with vLLM)",
                 self.teacher.engine)
            need(method != "rl", "teacher.engine", "hf with method rl (no teacher)", self.teacher.engine)
            need(self.data.teacher_cache is None, "teacher.engine", "hf with data.teacher_cache", self.teacher.engine)
        if rc.tis_cap is not None:
            need(method != "off_policy", "rollout.tis_cap", "null with method off_policy (teacher-written samples)",
                 rc.tis_cap)
        S = self.train.max_staleness
        if S:
            with_s = f" with train.max_staleness {S}"
            need(method != "off_policy", "train.method", "on_policy or rl (off_policy samples are the teacher's)"
                 + with_s, method)
            need(self.data.teacher_cache is None, "data.teacher_cache", "null (a cache has no rollouts to run ahead)"
                 + with_s, self.data.teacher_cache)
        if rc.correction is not None:
            need(method != "off_policy", "rollout.correction", "null with method off_policy (teacher-written samples)",
                 rc.correction)
            need(rc.correction != "tis" or rc.tis_cap is not None, "rollout.tis_cap", "a cap >= 1 with "
                 "rollout.correction tis", rc.tis_cap)
            need(rc.correction == "tis" or rc.tis_cap is None, "rollout.tis_cap", f"null with rollout.correction "
                 f"{rc.correction} (the cap is tis's)", rc.tis_cap)
            need(rc.correction != "icepop" or rc.icepop_band is not None, "rollout.icepop_band", "[lo, hi] with "
                 "rollout.correction icepop (tokens whose pi_train/pi_sampler lies outside are masked)", rc.icepop_band)
        if rc.correction_level != "token":
            need(rc.correction in ("tis", "icepop") or (rc.correction is None and rc.tis_cap is not None),
                 "rollout.correction_level", "token unless rollout.correction is tis or icepop (the level of their "
                 "ratio)", rc.correction_level)
        if rc.icepop_band is not None:
            band = rc.icepop_band
            need(rc.correction == "icepop", "rollout.icepop_band", "null unless rollout.correction is icepop", band)
            need(len(band) == 2 and 0 < band[0] < 1 < band[1] < float("inf"), "rollout.icepop_band",
                 "[lo, hi] with 0 < lo < 1 < hi", band)
        if S:
            need(rc.correction is not None, "rollout.correction", f"none, tis (with rollout.tis_cap) or icepop (with "
                 f"rollout.icepop_band), said explicitly with train.max_staleness {S}: the rollouts come from a policy "
                 f"{S} updates old", rc.correction)
        if self.distributed.decode == "sharded":
            no, dc = "distributed.decode", self.distributed
            need(dc.strategy == "fsdp2", no, "replica with distributed.strategy ddp (DDP keeps the whole student on "
                 "every rank; nothing is sharded to decode from)", dc.decode)
            need(dc.tp_size == 1, no, "replica with distributed.tp_size > 1 (the vocab-parallel lm_head gives each "
                 "rank a slice of the logits; decoding needs them whole)", dc.decode)
            need(not S, no, f"replica with train.max_staleness {S} (the pipelined step decodes in its own thread "
                 "from whole weight versions)", dc.decode)
            need(self.rollout.engine == "hf", no, "replica with rollout.engine vllm (the engine holds its own "
                 "weights)", dc.decode)
        if self.model.teacher_sharded:  # an in-process teacher that only scores (opdistill/train/sharded_teacher.py)
            no = "model.teacher_sharded"
            need(self.teacher.url is None, no, "false with teacher.url (the server holds the teacher)", True)
            need(self.teacher.engine == "hf", no, "false with teacher.engine vllm (the engine holds the teacher)", True)
            need(self.data.teacher_cache is None, no, "false with data.teacher_cache (the cache replaces the teacher)",
                 True)
            need(self.teachers is None, no, "false with teachers (named teachers are replicated on every rank; only "
                 "model.teacher can be sharded)", True)
            need(self.model.teacher not in (None, "self"), no, "false without a teacher model folder (model.teacher "
                 f"is {quote(self.model.teacher)})", True)
            need(method != "off_policy", no, "false with train.method off_policy (the teacher decodes the samples, and "
                 "a sharded teacher must run the same forwards on every rank)", True)
        if lc.use_task_rewards:
            need(self.rollout.n >= 2, "rollout.n", "an int >= 2 when loss.use_task_rewards is on", self.rollout.n)
        return self

    @model_validator(mode="after")
    def _teachers(self):
        """``teachers`` + ``routing``: one clear line for a config that cannot route every prompt to one teacher."""
        ts, rt = self.teachers, self.routing
        if ts is None:
            if rt is not None:
                raise ConfigError("routing: expected null without teachers (routing picks one of the named teachers), "
                                  f"got {quote(rt.model_dump())}")
            return self
        if not ts:
            raise ConfigError("teachers: expected a list of at least one {name, path | url} teacher, got []")
        for key, value, why in (("model.teacher", self.model.teacher, "each of teachers has its own path or url"),
                                ("teacher.url", self.teacher.url, "each of teachers has its own path or url"),
                                ("model.student_from_teacher_layers", self.model.student_from_teacher_layers,
                                 "the student is not cut from one of several teachers"),
                                ("data.teacher_cache", self.data.teacher_cache, "a cache holds one teacher's scores")):
            if value is not None:
                raise ConfigError(f"{key}: expected null when teachers is set ({why}), got {quote(value)}")
        if self.teacher.engine != "hf":
            raise ConfigError(f"teacher.engine: expected hf when teachers is set (named teachers score with hf in "
                              f"process or over their url), got {quote(self.teacher.engine)}")
        if self.train.device != "cpu":
            raise ConfigError(f"train.device: expected cpu when teachers is set (named in-process teachers are not "
                              f"placed on a GPU in this version), got {quote(self.train.device)}")
        if self.train.method != "on_policy":
            raise ConfigError(f"teachers: set only with train.method on_policy (off_policy samples are written by one "
                              f"teacher; rl has no teacher), got train.method {quote(self.train.method)}")
        names = []
        for i, t in enumerate(ts):
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", t.name):
                raise ConfigError(f"teachers.{i}.name: expected letters, digits, '_', '-' or '.' (it names the metrics "
                                  f"teacher/<name>/...), got {quote(t.name)}")
            if t.name in names:
                raise ConfigError(f"teachers.{i}.name: duplicate teacher name {quote(t.name)} (names must be unique)")
            names.append(t.name)
            if (t.path is None) == (t.url is None):
                raise ConfigError(f"teachers.{i}: expected exactly one of path (a model folder, scored in process) or "
                                  f"url (a teacher server) for teacher {quote(t.name)}, got "
                                  f"{'both' if t.path is not None else 'neither'}")
            if t.path == "self":
                raise ConfigError(f"teachers.{i}.path: expected a model folder, got 'self' (the LoRA self-teacher is "
                                  f"model.teacher: self, a single teacher)")
            if t.context is not None:
                raise ConfigError(f"teachers.{i}.context: expected null (one teacher.context serves every named "
                                  f"teacher), got {quote(t.context.model_dump())}")
            if t.engine != "hf":
                raise ConfigError(f"teachers.{i}.engine: expected hf (named teachers score with hf in process or over "
                                  f"their url), got {quote(t.engine)}")
        if rt is None:
            raise ConfigError(f"routing: expected a routing section with teachers (routing.table: {{value: teacher "
                              f"name}}, routing.field, routing.default), got null (teachers: {names})")
        for value, name in rt.table.items():
            if not name:
                raise ConfigError(f"routing.table.{value}: expected a teacher name (one of {names}), got {quote(name)}")
            if name not in names:
                raise ConfigError(f"routing.table.{value}: unknown teacher {quote(name)} (teachers: {names})")
        if rt.default is not None and rt.default not in names:
            raise ConfigError(f"routing.default: unknown teacher {quote(rt.default)} (teachers: {names})")
        if not rt.table and rt.default is None:
            raise ConfigError("routing.table: expected at least one value: teacher entry (or routing.default), got "
                              "nothing: no prompt would have a teacher")
        used = set(rt.table.values()) | {rt.default}
        for name in names:
            if name not in used:
                raise ConfigError(f"teachers: teacher {quote(name)} gets no prompts (neither routing.table nor "
                                  f"routing.default names it); route to it or remove it")
        if self.data.task != "dataset":  # generated tasks: the values are known now
            if rt.field != "task":
                raise ConfigError(f"routing.field: expected 'task' with data.task {quote(self.data.task)} (a column "
                                  f"name needs data.task dataset), got {quote(rt.field)}")
            tasks = self.data.task_args.get("tasks") if self.data.task == "mix" else {self.data.task: None}
            tasks = list(tasks) if isinstance(tasks, dict) else []
            for value in rt.table:
                if value not in tasks:
                    raise ConfigError(f"routing.table.{value}: no prompt has task {quote(value)} (the tasks of "
                                      f"data.task {quote(self.data.task)}: {tasks})")
            for value in tasks:
                if value not in rt.table and rt.default is None:
                    raise ConfigError(f"routing.table: task {quote(value)} has no teacher; add it to routing.table or "
                                      f"set routing.default")
        return self


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
        return TrainerConfig.model_validate(data)
    except ValidationError as e:
        raise _one_line(e, TrainerConfig) from None


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
