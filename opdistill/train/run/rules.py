"""Every refusal the config alone decides: one table (:data:`RULES`), run in order by ``load_config`` after the schema
(types, bounds, unknown keys) and so by every command, ``opdistill check`` and ``train --dry-run`` included; and the
refusals of the process layout (:func:`check_layout`: the world size torchrun gives, or ``opdistill check --nproc``).

A rule is a function of the whole config that raises :class:`ConfigError` with one line naming the dotted key, what
it expects and what it got. What a teacher can answer is not written here per ``teacher.api`` / ``teacher.engine``
value: it is each teacher class's own declaration (``Teacher.cannot``), and
:func:`opdistill.teachers.build.teacher_sources` says which class a config's settings choose. Refusals that need
the machine, the model folders or the data (tokenizers, positions, rows) run before any weight loads
(opdistill/train/disk/preflight.py), those that need loaded weights after.
"""
from __future__ import annotations

import re
from typing import Any

from opdistill.errors import ConfigError, quote
from opdistill.teachers.build import teacher_sources

__all__ = ["RULES", "FLOAT32_MAX", "check_backend", "check_config", "check_layout", "check_urls",
           "lora_targets", "no_credentials", "redact_url"]

FLOAT32_MAX = 3.4028234663852886e38


def _need(cond: bool, key: str, expected: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"{key}: expected {expected}, got {quote(value)}")

def _model(cfg) -> None:
    """``model.teacher: self`` is the student's own starting weights: not a cut of another model."""
    s = cfg.model
    if s.teacher == "self" and s.student_from_teacher_layers is not None:
        raise ConfigError(f"model.student_from_teacher_layers: expected null with model.teacher 'self', got "
                          f"{s.student_from_teacher_layers}")
    return

def _data(cfg) -> None:
    """Where the rows and the held-out rows come from, and where the answer is."""
    s = cfg.data
    if s.task == "dataset" and not s.path:
        raise ConfigError(f"data.path: expected a file path when data.task is 'dataset', got {quote(s.path)}")
    for key in ("eval_path", "eval_split", "eval_fraction"):
        if getattr(s, key) is not None and s.task != "dataset":
            raise ConfigError(f"data.{key}: set only with data.task dataset (generated tasks hold out their own "
                              f"problems), got {quote(getattr(s, key))} with data.task {quote(s.task)}")
    if s.final_assistant == "answer" and s.answer_field is not None:
        raise ConfigError(f"data.answer_field: expected null with data.final_assistant 'answer' (the answer is "
                          f"the final assistant turn of data.prompt_field), got {quote(s.answer_field)}")
    if s.eval_fraction is not None and (s.eval_path is not None or s.eval_split is not None):
        raise ConfigError(f"data.eval_fraction: expected null when data.eval_path or data.eval_split gives the "
                          f"held-out rows, got {quote(s.eval_fraction)}")
    return

def _rollout(cfg) -> None:
    s = cfg.rollout
    if s.min_new_tokens > s.max_new_tokens:
        raise ConfigError(f"rollout.min_new_tokens: expected an integer in [0, rollout.max_new_tokens="
                          f"{s.max_new_tokens}], got {s.min_new_tokens}")
    return

def _optim(cfg) -> None:
    s = cfg.optim
    if s.lr > FLOAT32_MAX:  # was a RuntimeError ("cannot be converted ... without overflow") in the first step
        raise ConfigError(f"optim.lr: expected a number > 0 that float32 weights can hold (at most {FLOAT32_MAX:.4g}),"
                          f" got {quote(s.lr)}")
    return

def _context(cfg) -> None:
    """``teacher.context``: its examples' source and its template (opdistill/data/context.py)."""
    s = cfg.teacher.context
    if s is None:
        return
    from opdistill.data.context import check_template

    if s.examples_path is not None and s.examples:
        raise ConfigError(f"teacher.context.examples: expected 0 with teacher.context.examples_path (every row "
                          f"of the file is an example), got {s.examples}")
    check_template(s.template, s.hint_field)
    return

def _urls(cfg) -> None:
    """``teacher.url`` and each named teacher's: http(s)://host:port, each server of a pool once, no credentials
    in it (they would be written into config.yaml and every message naming the server: teacher.token_file)."""
    for url, key in [(cfg.teacher.url, "teacher.url")] + [(t.url, f"teachers: url of teacher {quote(t.name)}")
                                                          for t in cfg.teachers or []]:
        no_credentials(url, key)
        check_urls(url, key)

def _method(cfg) -> None:
    """A teacher where the method needs one, the loss's K, the policy-gradient modes off-policy, the run folder."""
    method, lc = cfg.train.method, cfg.loss
    _need(bool(cfg.run_dir.strip()), "run_dir", "a folder path (an empty one would be the current folder)",
          cfg.run_dir)
    _need(bool(cfg.model.student), "model.student", "a model folder", cfg.model.student)
    if method == "rl":
        _need(cfg.rollout.n >= 2, "rollout.n", "an int >= 2 for method rl (group-normalized advantages)",
              cfg.rollout.n)
    else:
        _need(bool(cfg.model.teacher) or cfg.teacher.url is not None or cfg.teachers is not None, "model.teacher",
              f"a model folder (or teacher.url) for method {method}", cfg.model.teacher)
        _need(lc.loss_mode != "topk" or lc.topk is not None, "loss.topk",
              "an int >= 1 with loss.loss_mode topk (the K of the teacher's top-k, e.g. 8)", lc.topk)
    if method == "off_policy":
        # teacher-written samples: the sampler log-probs are the teacher's, so ratios against them mean nothing
        _need(not lc.use_policy_gradient and not lc.use_task_rewards, "loss.use_policy_gradient",
              "false (and loss.use_task_rewards false) for method off_policy", lc.use_policy_gradient)


def _context_rules(cfg) -> None:
    """``teacher.context`` against the method and the data, ``eval.prompts: teacher`` (SPEC 6.7)."""
    method = cfg.train.method
    ctx = cfg.teacher.context
    if ctx is not None:
        _need(method != "rl", "teacher.context", "null with train.method rl (no teacher scores)", ctx.model_dump())
        _need(cfg.data.teacher_cache is None, "teacher.context", "null with data.teacher_cache (the cache holds "
              "scores made under the student's prompts)", ctx.model_dump())
        _need(ctx.hint_field is None or cfg.data.task in ("dataset", "reasoning_gym"), "teacher.context.hint_field",
              f"null with data.task {cfg.data.task} (a hint is a dataset column or a reasoning-gym metadata key)",
              ctx.hint_field)
    if cfg.eval.prompts == "teacher":
        _need(ctx is not None, "eval.prompts", "student without teacher.context (teacher: the held-out problems "
              "under the teacher's context)", cfg.eval.prompts)
        from opdistill.data.context import reads_rows

        _need(not reads_rows(ctx.template), "eval.prompts",
              "student when teacher.context.template reads {answer} or {hint} (the held-out answers never enter a "
              "prompt)", cfg.eval.prompts)


def _sources(cfg) -> None:
    """Where the rows and the scores come from against the method; a verifier for rewards."""
    method, lc = cfg.train.method, cfg.loss
    if cfg.teacher.url is not None:
        _need(method == "on_policy", "teacher.url", "set only with train.method on_policy (off_policy samples are "
              "written by an in-process teacher; rl has no teacher)", cfg.teacher.url)
    if cfg.data.teacher_cache is not None:
        _need(method == "off_policy", "data.teacher_cache",
              "set only with train.method off_policy (on-policy samples cannot come from a cache)",
              cfg.data.teacher_cache)
    if method == "rl" or lc.use_task_rewards:
        _need(cfg.data.task != "dataset" or cfg.data.answer_field is not None
              or cfg.data.final_assistant == "answer", "data.answer_field",
              "a column name (or data.final_assistant: answer): rewards need a verifier (method rl or "
              "loss.use_task_rewards)", cfg.data.answer_field)


def _engines(cfg) -> None:
    """What the vLLM engines cannot load or sample."""
    method, rc = cfg.train.method, cfg.rollout
    rc = cfg.rollout
    if rc.engine == "vllm" or cfg.teacher.engine == "vllm":
        _need(not cfg.model.student_from_teacher_layers, "model.student_from_teacher_layers",
              "unset with a vllm engine (vLLM loads models from folders)", cfg.model.student_from_teacher_layers)
        _need(cfg.model.dtype != "float64", "model.dtype", "float32, bfloat16 or float16 with a vllm engine",
              cfg.model.dtype)
    if rc.engine == "vllm":
        _need(method != "off_policy", "rollout.engine", "hf with method off_policy (the teacher writes the samples)",
              rc.engine)
        _need(rc.min_new_tokens == 0, "rollout.min_new_tokens", "0 with rollout.engine vllm", rc.min_new_tokens)


def _full(cfg) -> None:
    """``loss.loss_mode: full`` needs the teacher's hidden states: every teacher the config chooses sends them."""
    method, lc = cfg.train.method, cfg.loss
    if lc.loss_mode == "full" and method != "rl":  # the teacher's hidden states and lm_head (SPEC 6.4)
        why = "topk or sampled with {} (loss_mode full reads the teacher's hidden states, which {})"
        for src in teacher_sources(cfg):
            _need("hidden" not in src.cls.cannot, "loss.loss_mode", why.format(src.setting, src.cls.cannot.get(
                "hidden")), lc.loss_mode)


def _union(cfg) -> None:
    """``loss.support: union`` asks the teacher for its log-probs at the student's top-k ids."""
    method, lc, rc = cfg.train.method, cfg.loss, cfg.rollout
    if lc.loss_mode == "topk" and lc.support == "union" and method != "rl":
        # the student's top-k ids come from its own sampler; the teacher scores them as requested ids
        why = "tail, truncated or renormalized with {} (support union asks the teacher for its log-probs at the " \
              "student's top-k ids, {})"
        _need(method == "on_policy", "loss.support", why.format(
            f"train.method {method}", "which only on-policy rollouts carry"), lc.support)
        _need(rc.engine == "hf", "loss.support", why.format(
            "rollout.engine vllm", "which the vLLM rollout engine does not return"), lc.support)
        for src in teacher_sources(cfg):
            _need("requested" not in src.cls.cannot, "loss.support", why.format(src.setting, src.cls.cannot.get(
                "requested")), lc.support)


def _xtok(cfg) -> None:
    """``xtok.mode``: what a cross-tokenizer teacher can map, and what it reads of the teacher it wraps."""
    method, lc = cfg.train.method, cfg.loss
    if cfg.xtok.mode != "off" and method != "rl":
        why = "{} with xtok.mode " + cfg.xtok.mode + " (a teacher with another tokenizer {})"
        _need(lc.loss_mode != "full", "loss.loss_mode", why.format(
            "topk or sampled", "has no hidden states over the student's vocabulary"), lc.loss_mode)
        _need(not (lc.loss_mode == "topk" and lc.support == "union"), "loss.support", why.format(
            "tail, truncated or renormalized", "cannot score the student's own top-k ids"), lc.support)
        _need(cfg.xtok.mode != "sampled" or lc.loss_mode == "sampled", "loss.loss_mode", why.format(
            "sampled", "gives only the log-prob of the student's token in mode sampled"), lc.loss_mode)
        for src in teacher_sources(cfg):  # what a cross-tokenizer teacher reads of the teacher it wraps
            _need("mapped" not in src.cls.cannot, src.key, why.format(
                "null" if src.default is None else src.default, src.cls.cannot.get("mapped")), src.value)


def _teacher_engine(cfg) -> None:
    """``teacher.engine: vllm``: an engine of a teacher folder, scoring on-policy rows."""
    method = cfg.train.method
    if cfg.teacher.engine == "vllm":
        _need(cfg.teacher.url is None, "teacher.engine", "hf with teacher.url (the server scores)",
              cfg.teacher.engine)
        _need(cfg.model.teacher != "self", "teacher.engine", "hf with model.teacher self (the student's own "
              "starting weights are scored in process; serve its folder to score them with vLLM)",
              cfg.teacher.engine)
        _need(method != "rl", "teacher.engine", "hf with method rl (no teacher)", cfg.teacher.engine)
        _need(cfg.data.teacher_cache is None, "teacher.engine", "hf with data.teacher_cache", cfg.teacher.engine)


def _correction(cfg) -> None:
    """The off-policy correction (SPEC 6.2, 6.5): stated where the samples are stale, consistent with itself."""
    method, rc = cfg.train.method, cfg.rollout
    if rc.tis_cap is not None:
        _need(method != "off_policy", "rollout.tis_cap", "null with method off_policy (teacher-written samples)",
              rc.tis_cap)
    S = cfg.train.max_staleness
    if S:
        # step t reads the weights after step t-1-S (0 before that): S >= steps reads version 0 alone, while the
        # pipeline would keep a copy of every step's weights in memory and checkpoints for nothing
        _need(S < max(cfg.train.steps, 1), "train.max_staleness", f"at most train.steps - 1 = "
              f"{max(cfg.train.steps - 1, 0)} (with S >= train.steps every step reads the starting weights)", S)
        with_s = f" with train.max_staleness {S}"
        _need(method != "off_policy", "train.method", "on_policy or rl (off_policy samples are the teacher's)"
              + with_s, method)
        _need(cfg.data.teacher_cache is None, "data.teacher_cache", "null (a cache has no rollouts to run ahead)"
              + with_s, cfg.data.teacher_cache)
    if rc.correction is not None:
        _need(method != "off_policy", "rollout.correction", "null with method off_policy (teacher-written samples)",
              rc.correction)
        _need(rc.correction != "tis" or rc.tis_cap is not None, "rollout.tis_cap", "a cap >= 1 with "
              "rollout.correction tis", rc.tis_cap)
        _need(rc.correction == "tis" or rc.tis_cap is None, "rollout.tis_cap", f"null with rollout.correction "
              f"{rc.correction} (the cap is tis's)", rc.tis_cap)
        _need(rc.correction != "icepop" or rc.icepop_band is not None, "rollout.icepop_band", "[lo, hi] with "
              "rollout.correction icepop (tokens whose pi_train/pi_sampler lies outside are masked)", rc.icepop_band)
    if rc.correction_level != "token":
        _need(rc.correction in ("tis", "icepop") or (rc.correction is None and rc.tis_cap is not None),
              "rollout.correction_level", "token unless rollout.correction is tis or icepop (the level of their "
              "ratio)", rc.correction_level)
    if rc.icepop_band is not None:
        band = rc.icepop_band
        _need(rc.correction == "icepop", "rollout.icepop_band", "null unless rollout.correction is icepop", band)
        _need(len(band) == 2 and 0 < band[0] < 1 < band[1] < float("inf"), "rollout.icepop_band",
              "[lo, hi] with 0 < lo < 1 < hi", band)
    if S:
        _need(rc.correction is not None, "rollout.correction", f"none, tis (with rollout.tis_cap) or icepop (with "
              f"rollout.icepop_band), said explicitly with train.max_staleness {S}: the rollouts come from a policy "
              f"{S} updates old", rc.correction)


def _decode(cfg) -> None:
    """``distributed.decode: sharded``: decoding from the FSDP2 shards."""
    if cfg.distributed.decode == "sharded":
        no, dc, S = "distributed.decode", cfg.distributed, cfg.train.max_staleness
        _need(dc.strategy == "fsdp2", no, "replica with distributed.strategy ddp (DDP keeps the whole student on "
              "every rank; nothing is sharded to decode from)", dc.decode)
        _need(dc.tp_size == 1, no, "replica with distributed.tp_size > 1 (the vocab-parallel lm_head gives each "
              "rank a slice of the logits; decoding needs them whole)", dc.decode)
        _need(not S, no, f"replica with train.max_staleness {S} (the pipelined step decodes in its own thread "
              "from whole weight versions)", dc.decode)
        _need(cfg.rollout.engine == "hf", no, "replica with rollout.engine vllm (the engine holds its own "
              "weights)", dc.decode)


def _teacher_sharded(cfg) -> None:
    """``model.teacher_sharded``: an in-process teacher folder that only scores."""
    method = cfg.train.method
    if cfg.model.teacher_sharded:  # an in-process teacher that only scores (opdistill/train/sharded_teacher.py)
        no = "model.teacher_sharded"
        _need(cfg.teacher.url is None, no, "false with teacher.url (the server holds the teacher)", True)
        _need(cfg.teacher.engine == "hf", no, "false with teacher.engine vllm (the engine holds the teacher)", True)
        _need(cfg.data.teacher_cache is None, no, "false with data.teacher_cache (the cache replaces the teacher)",
              True)
        _need(cfg.teachers is None, no, "false with teachers (named teachers are replicated on every rank; only "
              "model.teacher can be sharded)", True)
        _need(cfg.model.teacher not in (None, "self"), no, "false without a teacher model folder (model.teacher "
              f"is {quote(cfg.model.teacher)})", True)
        _need(method != "off_policy", no, "false with train.method off_policy (the teacher decodes the samples, and "
              "a sharded teacher must run the same forwards on every rank)", True)


def _reward(cfg) -> None:
    """Each reward function named as the loader reads it (opdistill/data/rewards.py imports them, before any model
    loads), one weight per function."""
    s = cfg.reward
    for i, spec in enumerate(s.functions):
        if spec != "task":
            _function_spec(spec, f"reward.functions.{i}", "'task', 'module:function' or 'file.py:function'")
    if s.weights is not None and s.functions:  # without functions: one per reward run_training is handed (Rewards)
        _need(len(s.weights) == len(s.functions), "reward.weights",
              f"{len(s.functions)} number{'s' * (len(s.functions) != 1)}, one per entry of reward.functions",
              s.weights)


def _function_spec(spec: str, key: str, expected: str) -> None:
    """``module:function`` or ``file.py:function``, as opdistill/data/rewards.py's loader reads it."""
    where, sep, attr = spec.rpartition(":")
    _need(sep and where and attr.isidentifier(), key, expected, spec)


def _env(cfg) -> None:
    """``env.tools`` named as the loader reads them."""
    for i, spec in enumerate(cfg.env.tools):
        _function_spec(spec, f"env.tools.{i}", "'module:function' or 'file.py:function'")


def _task_rewards(cfg) -> None:
    """Task rewards are group-normalized."""
    lc = cfg.loss
    if lc.use_task_rewards:
        _need(cfg.rollout.n >= 2, "rollout.n", "an int >= 2 when loss.use_task_rewards is on", cfg.rollout.n)


def _tensor_parallel(cfg) -> None:
    """``distributed.tp_size > 1`` (the vocab-parallel lm_head): what it is not wired with."""
    tp = cfg.distributed.tp_size
    if tp > 1 and cfg.train.fused_lm_head:
        raise ConfigError("train.fused_lm_head: not supported with distributed.tp_size > 1 (the vocab-parallel "
                          "lm_head already keeps only [tokens, V/tp] logits); set train.fused_lm_head=false")
    if tp > 1 and cfg.distributed.strategy != "fsdp2":
        raise ConfigError(f"distributed.tp_size={tp}: needs distributed.strategy=fsdp2 (DDP over a "
                          f"tensor-parallel student is not wired in this version), got {cfg.distributed.strategy}")
    if tp > 1 and cfg.model.lora is not None:
        raise ConfigError("model.lora: not supported with distributed.tp_size > 1 (the adapters would sit on a "
                          "vocabulary-sharded lm_head); set distributed.tp_size=1")


def _lora(cfg) -> None:
    """``model.lora``: the lm_head is never adapted (the teacher signal and the fused path read its weight)."""
    if cfg.model.lora is not None:
        lora_targets(cfg.model.lora)


def _teachers(cfg) -> None:
    """``teachers`` + ``routing``: one clear line for a config that cannot route every prompt to one teacher."""
    ts, rt = cfg.teachers, cfg.routing
    if ts is None:
        if rt is not None:
            raise ConfigError("routing: expected null without teachers (routing picks one of the named teachers), "
                              f"got {quote(rt.model_dump())}")
        return
    if not ts:
        raise ConfigError("teachers: expected a list of at least one {name, path | url} teacher, got []")
    for key, value, why in (("model.teacher", cfg.model.teacher, "each of teachers has its own path or url"),
                            ("teacher.url", cfg.teacher.url, "each of teachers has its own path or url"),
                            ("model.student_from_teacher_layers", cfg.model.student_from_teacher_layers,
                             "the student is not cut from one of several teachers"),
                            ("data.teacher_cache", cfg.data.teacher_cache, "a cache holds one teacher's scores")):
        if value is not None:
            raise ConfigError(f"{key}: expected null when teachers is set ({why}), got {quote(value)}")
    if cfg.teacher.engine != "hf":
        raise ConfigError(f"teacher.engine: expected hf when teachers is set (named teachers score with hf in "
                          f"process or over their url), got {quote(cfg.teacher.engine)}")
    if cfg.train.device != "cpu":
        raise ConfigError(f"train.device: expected cpu when teachers is set (named in-process teachers are not "
                          f"placed on a GPU in this version), got {quote(cfg.train.device)}")
    if cfg.train.method != "on_policy":
        raise ConfigError(f"teachers: set only with train.method on_policy (off_policy samples are written by one "
                          f"teacher; rl has no teacher), got train.method {quote(cfg.train.method)}")
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
    if cfg.data.task != "dataset":  # generated tasks: the values are known now
        if rt.field != "task":
            raise ConfigError(f"routing.field: expected 'task' with data.task {quote(cfg.data.task)} (a column "
                              f"name needs data.task dataset), got {quote(rt.field)}")
        tasks = cfg.data.task_args.get("tasks") if cfg.data.task == "mix" else {cfg.data.task: None}
        tasks = list(tasks) if isinstance(tasks, dict) else []
        for value in rt.table:
            if value not in tasks:
                raise ConfigError(f"routing.table.{value}: no prompt has task {quote(value)} (the tasks of "
                                  f"data.task {quote(cfg.data.task)}: {tasks})")
        for value in tasks:
            if value not in rt.table and rt.default is None:
                raise ConfigError(f"routing.table: task {quote(value)} has no teacher; add it to routing.table or "
                                  f"set routing.default")
    return


def lora_targets(lora) -> None:
    """``model.lora.target_modules`` (a ``LoraConfig``'s) never names the lm_head."""
    if not isinstance(lora.target_modules, str) and any(t.split(".")[-1] == "lm_head" for t in lora.target_modules):
        raise ConfigError(f"model.lora.target_modules: lm_head is frozen in opdistill (the teacher signal and the "
                          f"fused path read its weight); remove it, got {list(lora.target_modules)}")


RULES = (_model, _data, _rollout, _optim, _context, _urls, _method, _context_rules, _sources, _engines, _full, _union,
         _xtok, _teacher_engine, _correction, _decode, _teacher_sharded, _reward, _task_rewards, _teachers,
         _tensor_parallel, _lora, _env)


def check_config(cfg) -> None:
    """Every rule of :data:`RULES` on ``cfg`` (a ``TrainerConfig``), in order: the first refusal raises."""
    for rule in RULES:
        rule(cfg)


def check_layout(cfg, world: int) -> int:
    """The data-parallel size of ``world`` processes (torchrun's, or ``opdistill check --nproc``), refusing what the
    config cannot run as that many: a ``distributed.tp_size`` that does not divide it, a step's prompts or the
    held-out problems that do not share out over the data-parallel ranks, the fused lm_head under FSDP2."""
    if world > 1:
        check_backend(cfg)
    tp = cfg.distributed.tp_size
    if world % tp:
        raise ConfigError(f"distributed.tp_size: expected a divisor of the world size {world} (the ranks form a "
                          f"(data-parallel, tensor-parallel) mesh of {world} / tp_size x tp_size), got {tp}")
    dp = world // tp
    if world > 1:
        pps = cfg.data.prompts_per_step
        if pps % dp:
            raise ConfigError(f"data.prompts_per_step: expected a multiple of the data-parallel size {dp} (each "
                              f"rank samples an equal share of the step's prompts), got {pps}")
        if 0 < cfg.eval.num_prompts < dp:
            raise ConfigError(f"eval.num_prompts: expected 0 or at least the data-parallel size {dp} (every rank "
                              f"evaluates a share), got {cfg.eval.num_prompts}")
        if cfg.distributed.strategy == "fsdp2" and cfg.train.fused_lm_head:
            raise ConfigError("train.fused_lm_head: not supported with distributed.strategy=fsdp2 (the fused loss "
                              "reads the whole lm_head); use distributed.strategy=ddp or train.fused_lm_head=false")
    return dp


def check_backend(cfg) -> None:
    """The process group's backend against ``train.device`` (``auto``: nccl on CUDA, gloo on CPU); torchrun only."""
    device = cfg.train.device
    backend = cfg.distributed.backend
    if backend == "auto":
        return
    if (backend == "nccl") != (device == "cuda"):
        raise ConfigError(f"distributed.backend: {backend} does not fit train.device={device} (nccl is for "
                          f"CUDA, gloo for CPU); use distributed.backend=auto (docs/distributed.md)")


def redact_url(url: str) -> str:
    """``url`` with its ``user:password@`` part, if any, replaced by ``***@`` (what a message may show)."""
    return re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s]*@", r"\1***@", url)


def no_credentials(url, key: str) -> None:
    """Refuse a ``user:password@`` (or ``user@``) part in a server URL, without echoing it."""
    for u in [url] if isinstance(url, str) else url or []:
        if isinstance(u, str) and re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s]*@", u):
            raise ConfigError(f"{key}: credentials in a URL ({redact_url(u)}) are refused: they would be written "
                              f"into the run's config.yaml and every message naming the server; give the server's "
                              f"bearer token in teacher.token_file (docs/teacher_service.md)")


def check_urls(url, key: str) -> None:
    """``url``: one http(s)://host:port (a host, and a port in [1, 65535]), or a list of at least
    one, each once (a pool of servers; aliases of one server are refused when the pool is built: that needs name
    resolution)."""
    from urllib.parse import urlsplit

    if url is None:
        return
    urls = [url] if isinstance(url, str) else url
    if not urls:
        raise ConfigError(f"{key}: expected http://host:port or a list of them, got []")
    for u in urls:
        if not isinstance(u, str) or not re.match(r"^https?://[^\s/]+", u):
            raise ConfigError(f"{key}: expected http://host:port or https://host:port, got {quote(u)}")
        try:  # a port out of range, an unclosed [IPv6 address]: urlsplit raises ValueError
            parts = urlsplit(u)
            parts.port  # noqa: B018 -- parsed (and range-checked) here
        except ValueError as e:
            raise ConfigError(f"{key}: {quote(u)} is not a valid URL ({e}); expected http://host:port") from None
        if not parts.hostname:
            raise ConfigError(f"{key}: {quote(u)} names no host; expected http://host:port")
        if parts.port == 0:
            raise ConfigError(f"{key}: {quote(u)}: port 0 is not a server's port; expected one in [1, 65535]")
    twice = sorted({u.rstrip("/") for u in urls if sum(v.rstrip("/") == u.rstrip("/") for v in urls) > 1})
    if twice:
        raise ConfigError(f"{key}: lists {quote(twice[0])} twice; each server of a pool once")
