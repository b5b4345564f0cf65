"""Every refusal a run can decide before it loads a weight, and the few that need the loaded weights.

:func:`opdistill.train.run.config.load_config` checks everything a config alone can tell. What is left needs the
machine, the process layout or the model folders; :func:`check_before_loading` runs all of it from the folders' metadata
(``config.json``, the tokenizers) before any model is loaded, so a run that cannot work stops in seconds, not after
minutes of loading:

- the machine: ``train.device: cuda`` without a GPU; a missing extra (vllm, peft, httpx);
- the process layout: vLLM engines under torchrun with a vocab-parallel student, or whose KV caches (one engine per
  rank) do not fit the node's memory;
- the folders: student and teacher tokenizers and output widths (:func:`opdistill.models.check_compatible`), a
  teacher head transform opdistill does not know, ``model.student_from_teacher_layers`` beyond the teacher's layers,
  ``distributed.tp_size`` above the vocabulary, a soft-capped student head with ``train.fused_lm_head``;
- the config against them (:func:`check_metadata`): fp16 training, ``loss.topk`` / ``eval.topk`` above the vocabulary,
  ``max_new_tokens`` against the positions, prompts that do not fit (a dataset's rows refused or cut by
  ``data.overlong``, a generated task's refused naming ``data.task_args``), unknown characters (one warning);
- the data: a dataset's routing values against ``routing``; a sharded teacher's held-out share per rank; the teacher
  cache file (format, checksum, values, K against ``loss.topk``).

After loading, before any evaluation: NaN/inf weights (:func:`check_finite_weights`) and the cache's provenance
against the loaded teacher (``opdistill.train.assemble``). Each failure is a :class:`ConfigError` (or a
:class:`DataError` for a dataset row, a :class:`ModelError` for a folder) whose one-line message names the key.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from opdistill.data import DatasetTask, PromptSource, Task
from opdistill.data.prompts import warn_unknown_chars
from opdistill.errors import ConfigError, IncompatibleModelsError, ModelError
from opdistill.models import (check_compatible, model_folder, model_positions, num_layers, output_width,
                              resolve_model_path)
from opdistill.train.run.config import TrainerConfig

__all__ = ["ModelInfo", "check_model_folders", "check_before_loading", "check_metadata", "check_finite_weights",
           "check_finite_model", "check_loaded", "check_against_models", "check_held_out", "check_routing",
           "check_context", "resolve_folder"]


@dataclass(frozen=True)
class ModelInfo:
    """What a run knows of one model before (or without) its weights: the config key that names it, its folder,
    its transformers config (or the loaded model, when a caller hands models in) and its tokenizer."""

    key: str
    path: str | None
    model: object  # a transformers config, or a loaded model
    tokenizer: object = None


def check_model_folders(cfg: TrainerConfig) -> None:
    """Before loading: each of ``model.student`` / ``model.teacher`` names a model folder (or a builtin, or a hub
    id); a ConfigError / ModelError names the key otherwise (``model.student: no such folder '...'``)."""
    for key, name in (("model.student", cfg.model.student), ("model.teacher", cfg.model.teacher)):
        if name and not (key == "model.teacher" and name == "self"):  # self: the LoRA student's base
            resolve_folder(name, key)


def resolve_folder(name: str, key: str) -> str:
    """``name`` (a folder, builtin or hub id) as a model folder; a one-line error naming ``key`` otherwise."""
    try:
        path = resolve_model_path(name)
    except (ValueError, FileNotFoundError) as e:  # an unknown builtin, a missing packaged model
        raise ConfigError(f"{key}: {str(e).removeprefix('model: ')}") from None
    return model_folder(path, key)


def check_finite_weights(cfg: TrainerConfig, student, teacher) -> None:
    """Refuse a loaded model holding a NaN/inf weight (a corrupt or diverged folder), naming the key and the tensor:
    otherwise the first evaluation or training step fails deep inside the loss, or every step is skipped as
    non-finite. One pass over the weights, right after loading."""
    for key, model in (("model.student", student), ("model.teacher", teacher)):
        if model is not None:
            check_finite_model(key, model, getattr(cfg.model, key.split('.')[1]))


def check_finite_model(key: str, model, path) -> None:
    """:func:`check_finite_weights` for one model loaded from ``path`` (a ``teachers`` entry's: ``key``
    teachers.N.path)."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:  # not read yet (a sharded teacher's: checked shard by shard when each rank reads its own)
            continue
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ModelError(f"{key}: weight {name} of {path!r} holds NaN/inf (a corrupt or diverged model folder); "
                             f"use an intact model folder")


def check_loaded(cfg: TrainerConfig, student, teacher, *, training: bool = True) -> None:
    """What only loaded weights tell: NaN/inf weights, and fp16 trainable parameters (a model handed in need not be
    in ``model.dtype``; ``training=False``: fp16 is fine for ``opdistill eval`` and ``score``)."""
    check_finite_weights(cfg, student, teacher)
    if training and cfg.train.steps > 0 and any(p.dtype == torch.float16 for p in student.parameters() if p.requires_grad):
        if cfg.model.dtype == "float16":
            raise ConfigError(_FP16)
        raise ConfigError(_FP16_HANDED_IN)


def check_against_models(cfg: TrainerConfig, tokenizer, student, teacher, task: Task, *,
                         training: bool = True, env=None) -> None:
    """:func:`check_metadata` on loaded models, after :func:`check_loaded`."""
    check_loaded(cfg, student, teacher, training=training)
    teachers = [] if teacher is None else [ModelInfo("model.teacher", None, teacher)]
    check_metadata(cfg, tokenizer, ModelInfo("model.student", None, student), teachers, task, training=training,
                   env=env)


def _room(cfg: TrainerConfig, env) -> tuple[str, int]:
    """(the key that sets it, the tokens) a row takes after its prompt: the longest decode (``rollout`` or ``eval``
    ``max_new_tokens``), or with an environment its episode, turns and tool messages (``env.max_episode_tokens``,
    SPEC 6.8; every turn is cut to what is left of it)."""
    if env is not None:
        return "env.max_episode_tokens", env.max_episode_tokens
    return max((("rollout.max_new_tokens", cfg.rollout.max_new_tokens),
                ("eval.max_new_tokens", cfg.eval.max_new_tokens or 0)), key=lambda kv: kv[1])


def _listed(tokenizer, env) -> int:
    """The tokens an environment's tool schemas add to a prompt (its template lists them; 0 without one)."""
    if env is None:
        return 0
    from opdistill.data import render_prompt

    return len(env.prompt("x")) - len(render_prompt(tokenizer, "x", use_chat_template=True))


_FP16 = ("model.dtype: float16 training is refused: the trainer has no loss scaling, so small gradients flush to zero "
         "and one overflow turns every weight into NaN; use bfloat16 or float32 (float16 is fine for eval and score)")
_FP16_HANDED_IN = ("models: the student handed in has float16 trainable parameters; the trainer has no loss scaling, "
                   "so small gradients flush to zero and one overflow turns every weight into NaN; load it in "
                   "bfloat16 or float32 (from_pretrained(..., dtype=...))")


def check_metadata(cfg: TrainerConfig, tokenizer, student: ModelInfo, teachers: list[ModelInfo], task: Task, *,
                   training: bool = True, env=None) -> None:
    """Refuse, naming the key, what the config asks and the models (their configs or the loaded models) cannot do;
    fit a dataset's prompts:

    - fp16 training (``model.dtype``): there is no loss scaling, so small gradients flush to 0 and one overflow makes
      every weight NaN;
    - ``loss.topk`` (distillation methods) and ``eval.topk`` above the vocabulary;
    - ``rollout.max_new_tokens`` / ``eval.max_new_tokens`` (with an environment ``env``: ``env.max_episode_tokens``
      and the tool schemas its prompts list) leaving no room for a prompt within the positions;
    - prompts longer than positions - max_new_tokens: a dataset's rows are refused or cut (``data.overlong``), a
      generated task's (its held-out set and first training batch) are refused naming ``data.task_args``;
    - characters the tokenizer maps to its unknown token: one warning with a count.
    """
    if training and cfg.train.steps > 0 and cfg.model.dtype == "float16":
        raise ConfigError(_FP16)
    vocab = output_width(student.model, scoring=False)
    if cfg.train.method != "rl" and cfg.loss.topk is not None and cfg.loss.topk > vocab:
        raise ConfigError(f"loss.topk: expected at most the vocabulary size {vocab}, got {cfg.loss.topk}")
    if cfg.eval.topk > vocab:
        raise ConfigError(f"eval.topk: expected at most the vocabulary size {vocab}, got {cfg.eval.topk}")

    positions = [n for n in (model_positions(m.model) for m in [student] + teachers) if n]
    if not positions:
        return
    positions = min(positions)
    new_key, new = _room(cfg, env)
    listed = _listed(tokenizer, env)
    budget = positions - new - listed  # the longest prompt that leaves room for max_new_tokens within the positions
    if budget < 1:
        tools = f", {listed} of them to list the tools," if listed else ""
        raise ConfigError(f"{new_key}: expected at most {positions - 1 - listed} (the model has {positions} positions"
                          f"{tools} and a prompt needs at least one), got {new}")
    if isinstance(task, DatasetTask):
        if not task.has_held_out and cfg.eval.num_prompts:
            fix = "set data.eval_path, data.eval_split or data.eval_fraction (docs/data.md)" \
                if isinstance(task.path, str) else "give DatasetTask.from_rows eval_rows or eval_fraction"
            warnings.warn(f"data: {task.path} has no held-out rows, so eval/* measures prompts drawn from the "
                          f"training rows; {fix}", stacklevel=2)
        task.fit_prompts(tokenizer, budget, overlong=cfg.data.overlong, use_chat_template=cfg.data.use_chat_template)
        return
    source = PromptSource(task, cfg.train.seed, cfg.data.eval_seed)
    problems = source.held_out(cfg.eval.num_prompts) + source.batch(1, cfg.data.prompts_per_step)
    too_long = warn_unknown_chars(tokenizer, [p.prompt for p in problems], [task.name] * len(problems),
                                  f"task {task.name}", max_tokens=budget, use_chat_template=cfg.data.use_chat_template)
    if too_long:
        raise ConfigError(f"data.task_args: {task.name} prompts reach {max(n for _, n in too_long)} tokens, more than "
                          f"the {budget} the model allows ({positions} positions - {new} for {new_key}"
                          f"{f' - {listed} for the tool schemas' if listed else ''}); use smaller task_args or a "
                          f"lower {new_key}")


# -- before any weight is loaded -----------------------------------------------------------------------------------
def check_environment(cfg: TrainerConfig, world: int) -> None:
    """What the machine and the process layout cannot run: vLLM engines under torchrun, a missing vllm / peft /
    httpx, ``train.device: cuda`` without a GPU (``placement.run_device``)."""
    import importlib.util

    from opdistill.engines.vllm import INSTALL_HINT, vllm_available
    from opdistill.train.run.placement import run_device

    engines = [k for k, v in (("rollout.engine", cfg.rollout.engine), ("teacher.engine", cfg.teacher.engine))
               if v == "vllm"]
    tp = cfg.distributed.tp_size
    if cfg.rollout.engine == "vllm" and world > 1 and tp > 1 and cfg.train.max_staleness > 0 and \
            cfg.train.device == "cuda":
        raise ConfigError(f"train.max_staleness: expected 0 with rollout.engine vllm over the tp ranks "
                          f"(distributed.tp_size {tp}) on CUDA: the pipeline's thread would run the engine's NCCL "
                          f"collectives while the trainer's run on another communicator, which NCCL does not order "
                          f"(tested on CPU/gloo only), got {cfg.train.max_staleness}")
    if cfg.teacher.engine == "vllm" and world > 1 and tp > 1:
        raise ConfigError(f"teacher.engine: vllm with distributed.tp_size {tp}: a data-parallel rank's teacher "
                          f"requests are made by its first tp rank alone, and a vLLM engine over the tp ranks needs "
                          f"every one of them in each request; serve the teacher (teacher.url) or use "
                          f"distributed.tp_size=1")
    if engines and world > 1:
        check_engines_fit(cfg, engines)
    if engines and not vllm_available():
        raise ConfigError(f"{engines[0]}: vllm, but the vllm package is not installed; {INSTALL_HINT}")
    if cfg.model.lora is not None and importlib.util.find_spec("peft") is None:
        raise ConfigError("model.lora: LoRA students need the peft package (the lora extra): pip install "
                          "'opdistill[lora]'")
    urls = [("teacher.url", cfg.teacher.url)] + [(f"teachers.{i}.url", t.url) for i, t in enumerate(cfg.teachers or [])]
    urls = [k for k, u in urls if u is not None]
    if urls and importlib.util.find_spec("httpx") is None:
        raise ConfigError(f"{urls[0]}: the teacher client needs the serve extra (httpx is missing): "
                          "pip install 'opdistill[serve]'")
    run_device(cfg)


def check_vllm_architecture(config, engine_key: str, model_key: str) -> None:
    """A model whose ``architectures`` vLLM does not implement is refused in one line before any weight is read
    (vLLM would fail while building its engine, after the trainer loaded the models)."""
    from opdistill.engines.vllm import supported_architectures

    archs = list(getattr(config, "architectures", None) or [])
    if archs and not set(archs) & supported_architectures():
        raise ConfigError(f"{engine_key}: vllm does not implement {model_key}'s architecture {archs[0]} (its "
                          f"config.json); use the hf engines for it")


def check_vllm_head_size(config, engine_key: str, model_key: str) -> None:
    """On CPU, a model whose attention head size vLLM's CPU backend has no kernel for is refused in one line before
    any weight is read (vLLM would fail at its first forward, after the trainer loaded the models)."""
    from opdistill.engines.vllm import cpu_head_sizes

    c = getattr(config, "config", config)  # a loaded model's, or the config itself
    c = c.get_text_config() if hasattr(c, "get_text_config") else c
    heads = getattr(c, "num_attention_heads", None)
    size = getattr(c, "head_dim", None) or (c.hidden_size // heads if heads else None)
    supported = cpu_head_sizes()
    if size is not None and supported and size not in supported:
        raise ConfigError(f"{engine_key}: vllm on CPU has no attention kernel for {model_key}'s head size {size} "
                          f"(it has {supported}); use the hf engines for it")


def check_vllm_tp(config, tp: int) -> None:
    """A vLLM student engine over the ``tp`` ranks of a data-parallel rank shards the attention heads over them:
    the heads must divide by tp, and the key/value heads divide by tp or tp by them (vLLM replicates them then);
    else refused in one line from the model's config, before any weight is read."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    inter = getattr(config, "intermediate_size", None)
    if heads is None:
        return
    what = (f"{heads} attention heads" if heads % tp else f"{kv} key/value heads" if kv % tp and tp % kv
            else f"MLP width {inter}" if inter and inter % tp else None)
    if what is not None:
        sizes = " and ".join(str(n) for n in dict.fromkeys(x for x in (heads, kv, inter) if x))
        raise ConfigError(f"distributed.tp_size: rollout.engine vllm shards the student's attention heads and MLP "
                          f"over the {tp} tp ranks, and its {what} do not divide by {tp}; use a tp_size that "
                          f"divides {sizes}, or the hf engines")


def check_engines_fit(cfg: TrainerConfig, engines: list[str], available: int | None = None) -> None:
    """Under torchrun every rank starts its own vLLM engine(s). On CPU each holds a KV cache of
    ``rollout.vllm_kv_cache_gb`` in host memory: the node's ranks' caches must fit its MemAvailable (``available``
    bytes, for tests), or the run is refused in one line before any model loads. (On a GPU each rank has its own
    device and ``rollout.vllm_gpu_memory_utilization`` of it per engine: vLLM refuses a share it cannot get.)"""
    from opdistill.train.run.placement import run_device

    if run_device(cfg).type == "cuda":
        share = cfg.rollout.vllm_gpu_memory_utilization * len(engines)
        if share > 0.9:
            raise ConfigError(f"rollout.vllm_gpu_memory_utilization: {len(engines)} engine(s) per rank x "
                              f"{cfg.rollout.vllm_gpu_memory_utilization} of its GPU leaves the trainer "
                              f"{max(0.0, 1 - share):.2f} of it; lower it")
        return
    local = _local_ranks()
    available = _mem_available() if available is None else available
    if available is None:
        return
    gb = max(1, round(cfg.rollout.vllm_kv_cache_gb))  # what VLLM_CPU_KVCACHE_SPACE gets (whole GiB)
    need_gib = local * len(engines) * gb
    if need_gib * (1 << 30) > available:
        raise ConfigError(f"rollout.vllm_kv_cache_gb: {local} rank(s) on this node x {len(engines)} vLLM engine(s) "
                          f"x {gb} GiB of KV cache = {need_gib} GiB, more than the {available / (1 << 30):.1f} GiB "
                          f"available; lower rollout.vllm_kv_cache_gb or start fewer ranks per node")


def check_before_loading(cfg: TrainerConfig, tokenizer, student: ModelInfo, teachers: list[ModelInfo], task: Task, *,
                         world: int, dp: int, held_out: int, env=None) -> None:
    """Every refusal the metadata decides (module docstring), before any weight is read. ``teachers``: the
    in-process teachers' infos (``model.teacher`` or the ``teachers`` entries with a path); ``world``/``dp``: the
    world and data-parallel sizes; ``held_out``: the held-out problems; ``env``: the run's environment or None."""
    check_environment(cfg, world)
    layers = cfg.model.student_from_teacher_layers
    if layers is not None:
        n = num_layers(student.model)
        if n is not None and not 1 <= layers <= n:
            raise ConfigError(f"model.student_from_teacher_layers: expected 1..{n} (the layers of this model), "
                              f"got {layers}")
    for t in teachers:
        try:
            check_compatible(tokenizer, t.tokenizer, student.model, t.model, cross_tokenizer=cfg.xtok.mode != "off",
                             key=t.key)
        except IncompatibleModelsError as e:
            raise IncompatibleModelsError(f"{t.key}: " + str(e).removeprefix("model.teacher: ")) from None
    if cfg.train.fused_lm_head and _softcap(student) is not None:
        raise ConfigError("train.fused_lm_head: the student soft-caps its logits (c * tanh(z / c)), which the "
                          "fused lm_head path does not implement; set train.fused_lm_head=false")
    if cfg.loss.loss_mode == "full" and cfg.train.method != "rl":  # the teacher's logits from its hidden states
        for t in teachers + ([student] if cfg.model.teacher == "self" else []):
            if _softcap(t) is not None:
                raise ConfigError(f"loss.loss_mode: full reads the teacher's logits from its hidden states and "
                                  f"lm_head, and {t.key} soft-caps its logits (c * tanh(z / c)), which that path does "
                                  f"not implement; use loss_mode topk with this teacher")
    tp = cfg.distributed.tp_size
    vocab = output_width(student.model, scoring=False)
    if tp > 1 and world > 1 and vocab < tp:
        raise ConfigError(f"distributed.tp_size={tp}: larger than the student's vocabulary ({vocab}); set "
                          f"distributed.tp_size to a divisor of the world size of at most {vocab}")
    cpu = cfg.train.device == "cpu"
    if cfg.rollout.engine == "vllm":
        check_vllm_architecture(student.model, "rollout.engine", "model.student")
        if cpu:
            check_vllm_head_size(student.model, "rollout.engine", "model.student")
    if cfg.teacher.engine == "vllm":
        for t in teachers:
            if t.key == "model.teacher":
                check_vllm_architecture(t.model, "teacher.engine", t.key)
                if cpu:
                    check_vllm_head_size(t.model, "teacher.engine", t.key)
    if tp > 1 and world > 1 and cfg.rollout.engine == "vllm":
        check_vllm_tp(student.model, tp)
    check_metadata(cfg, tokenizer, student, teachers, task, env=env)
    check_routing(cfg, task)
    check_held_out(cfg, held_out, world=world, dp=dp)
    if cfg.model.teacher_sharded and world > 1:
        for t in teachers:
            if t.key == "model.teacher" and t.path is not None:
                check_teacher_shards_fit(cfg, t.path, dp=dp)


def sharded_teacher_bytes(folder, dtype: str, dp: int) -> tuple[int, int]:
    """(bytes of one rank's shards, bytes of the largest unit a forward gathers whole: a decoder layer, or the root:
    embeddings, final norm, lm_head) of the teacher in ``folder`` at ``dtype`` sharded over ``dp`` ranks, from the
    safetensors headers alone (no weight read)."""
    import re

    from safetensors import safe_open

    from opdistill.models import parse_dtype, weight_files

    size = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    units: dict[str, int] = {}
    by_file: dict = {}
    for name, f in weight_files(folder).items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(str(f), "pt") as h:
            for name in names:
                shape = h.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= d
                m = re.search(r"\.layers\.(\d+)\.", name)
                key = f"layer {m.group(1)}" if m else "root"
                # a row more than the even share: torch.chunk's rounding up on dim 0
                units[key] = units.get(key, 0) + n * size
    shards = sum(-(-b // dp) for b in units.values())
    return shards, max(units.values(), default=0)


def _mem_available() -> int | None:
    """The node's MemAvailable in bytes (Linux), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def _local_ranks() -> int:
    """The ranks torchrun started on this node (LOCAL_WORLD_SIZE; 1 without torchrun)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _available_bytes(device_type: str) -> tuple[int | None, str]:
    """(bytes this rank may use, where they are) for a sharded teacher: a GPU's free memory, or on CPU the node's
    MemAvailable shared by its ranks; None where unknown."""
    if device_type == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return free, "free on this rank's GPU"
    avail = _mem_available()
    if avail is None:
        return None, ""
    return avail // _local_ranks(), f"available host memory / {_local_ranks()} rank(s) on this node"


def check_teacher_shards_fit(cfg: TrainerConfig, folder, *, dp: int, available: tuple | None = None) -> None:
    """Refuse, before any weight is read, a sharded teacher whose shards plus the largest unit a forward gathers
    do not fit what this rank has (``available``: (bytes, where), for tests; default: measured)."""
    from opdistill.train.run.placement import run_device

    shards, unit = sharded_teacher_bytes(folder, cfg.model.dtype, dp)
    avail, where = available if available is not None else _available_bytes(run_device(cfg).type)
    if avail is not None and shards + unit > avail:
        gib = 1 << 30
        raise ConfigError(f"model.teacher_sharded: the teacher's shards ({shards / gib:.2f} GiB per rank over {dp} "
                          f"ranks, {cfg.model.dtype}) plus the largest layer a forward gathers ({unit / gib:.2f} GiB) "
                          f"exceed the {avail / gib:.2f} GiB {where}; use more ranks, a smaller model.dtype, or a "
                          f"teacher server (teacher.url)")


def check_held_out(cfg: TrainerConfig, held_out: int, *, world: int, dp: int) -> None:
    """A sharded teacher scores in every rank's evaluation, and a sharded student decodes it, so every
    data-parallel rank needs at least one held-out problem (a rank without one would skip its forwards while the
    others wait on its gathers): refused in one line."""
    if world < 2 or not 0 < held_out < dp:
        return
    for key, on in (("model.teacher_sharded", cfg.model.teacher_sharded and cfg.eval.sampled),
                    ("distributed.decode sharded", cfg.distributed.decode == "sharded")):
        if on:
            raise ConfigError(f"eval.num_prompts: the held-out set has {held_out} problem(s), fewer than the "
                              f"{dp} data-parallel ranks; with {key} every rank evaluates at least one "
                              f"(add held-out rows, or set eval.num_prompts=0)")


def check_context(cfg: TrainerConfig, context, tokenizer, student: ModelInfo, teachers: list[ModelInfo],
                  source: PromptSource, held_out: list, env=None) -> None:
    """``teacher.context``: the teacher's own prompt of the first steps' problems (and of the held-out ones where
    the evaluation uses it), rendered through each in-process teacher's tokenizer (the student's for ``model.teacher:
    self`` and ``eval.prompts: teacher``), must leave room for ``max_new_tokens`` (an episode's
    ``env.max_episode_tokens``; the prompt lists its tools) within that model's positions;
    refused in one line before any weight is read. A longer row later is refused by the teacher that meets it
    (opdistill/teachers/context.py)."""
    from opdistill.data import render_prompt

    problems = [p for step in range(1, 5) for p in source.batch(step, cfg.data.prompts_per_step)]
    if not context.reads_rows:
        problems += list(held_out)
    models = list(teachers)
    if cfg.model.teacher == "self" or cfg.eval.prompts == "teacher":
        models.append(student)
    new_key, new = _room(cfg, env)
    tools = None if env is None else env.tools.schemas
    for m in models:
        positions = model_positions(m.model)
        tok = m.tokenizer or tokenizer
        if not positions or not problems:
            continue
        longest = max(len(render_prompt(tok, context(p), use_chat_template=cfg.data.use_chat_template, tools=tools))
                      for p in problems)
        if longest + new > positions:
            raise ConfigError(f"teacher.context: the teacher's prompt reaches {longest} tokens ({m.key}'s tokenizer), "
                              f"and with {new} for {new_key} that is more than its {positions} positions; use fewer "
                              f"teacher.context.examples, a shorter template or a lower {new_key}")


def _softcap(info: ModelInfo):
    """The soft-cap a model (or its config) applies to its logits, or None (an unknown head transform is refused)."""
    from opdistill.fused import head_transform

    config = info.model.config if hasattr(info.model, "get_output_embeddings") else info.model
    return head_transform(config)[1]


def check_routing(cfg: TrainerConfig, task: Task) -> None:
    """A dataset's routing values against ``routing`` (known once its rows are read; generated tasks are checked at
    load by the config)."""
    if cfg.teachers is None or not isinstance(task, DatasetTask):
        return
    rt = cfg.routing
    values = {p.task for p in task.rows + task.eval_rows}
    for v in rt.table:
        if v not in values:
            raise ConfigError(f"routing.table.{v}: no row of {cfg.data.path} has {rt.field} {v!r} (values: "
                              f"{sorted(values)[:10]})")
    missing = sorted(v for v in values if v not in rt.table)
    if missing and rt.default is None:
        raise ConfigError(f"routing.table: {rt.field} {missing[0]!r} of {cfg.data.path} has no teacher "
                          f"({len(missing)} value(s) unrouted); add it to routing.table or set routing.default")
