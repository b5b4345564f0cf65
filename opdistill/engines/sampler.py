"""Our own decode loop around a causal LM's forward: KV cache, finished rows dropped, keyed Gumbel-max sampling.

Design notes
- One prefill per chunk of prompts (left-padded, ``attention_mask`` + ``position_ids`` as transformers ``generate``
  builds them), run once per *prompt*; the cache rows are then repeated for the ``n`` samples of each prompt. Then
  one token per step through the model's own forward with a ``DynamicCache``. A row that has emitted EOS is dropped
  from the batch (its cache rows are sliced away), so the forward runs only over unfinished rows.
- Randomness is keyed, never drawn from a shared stream. Every row owns a ``torch.Generator`` seeded by a hash of
  ``(seed, step, prompt key, sample index)``; at each decode position it draws V uniforms ``u`` and the token is
  ``argmax(logits / T - log(-log u))`` (Gumbel-max: an exact draw from ``softmax(logits / T)``). A row's draws depend
  on nothing else in the batch, so the same keys give the same samples at any batch size, chunking, row order or
  (later) world size -- up to floating-point ties: the model's logits themselves can differ in the last bits with
  the batch shape, which changes a sample only where two perturbed scores are that close (docs/sampler.md).
- Generators live on the model's device. CPU generators (mt19937) use the low 32 bits of the seed, CUDA ones
  (Philox) all 64; the same keys give the same samples on one device type, not across CPU and CUDA.
- ``greedy`` is ``argmax(logits)``, token for token what ``generate(do_sample=False)`` returns.
- Truncated sampling (``top_k`` / ``top_p``) applies exactly the rules of transformers' ``TopKLogitsWarper`` and
  ``TopPLogitsWarper`` (in that order, after temperature). ``min_new_tokens`` masks EOS before that many tokens.
- Sampler log-probs (``want_logprobs``) are ``log_softmax(logits / T)`` of the *full* temperature-scaled model
  distribution in fp32 at the sampled token: neither the EOS mask of ``min_new_tokens`` nor a truncation is applied
  to them, so they equal what a fresh forward of prompt + response gives (the old-policy log-probs the losses use).
  Only the log-sum-exp is computed, and only when asked.
- ``want_topk`` K: the K most likely ids of the model's distribution at each generated token (the logits' top-K,
  which no temperature changes; ties in the order ``torch.topk`` gives): what a union-support loss asks the
  teacher to score, read off the logits the decoding computes anyway.
"""
from __future__ import annotations

import hashlib
import inspect
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from opdistill.parallel.rows import VocabRows

__all__ = ["Lockstep", "Samples", "lockstep", "sample", "truncate_logits", "row_key"]


@dataclass
class Samples:
    """Rows in prompt-major order: row ``i * n + j`` is sample ``j`` of ``prompts[i]``."""

    tokens: list[list[int]]  # generated tokens per row, cut after the first EOS (EOS included)
    prompt_index: list[int]  # position in ``prompts`` of the prompt each row answers
    sample_index: list[int]  # j: which sample of its prompt
    logprobs: list[list[float]] | None  # sampler log-prob of each generated token (want_logprobs)
    texts: list[str] | None  # decoded responses, special tokens removed (tokenizer given)
    topk_ids: list[list[list[int]]] | None = None  # the top-K ids of the distribution of each generated token


def row_key(seed: int, step: int, prompt_key: int, sample_index: int, turn: int = 0) -> int:
    """The 64-bit generator seed of one sample: a hash of its four keys (stable across processes and versions), and
    of the episode's turn after the first (SPEC 6.8: turn 0 is the single-turn key, so one-turn episodes draw what
    single responses draw)."""
    msg = f"opdistill.sampler:{int(seed)}:{int(step)}:{int(prompt_key)}:{int(sample_index)}"
    msg = (msg if not turn else f"{msg}:turn{int(turn)}").encode()
    return int.from_bytes(hashlib.blake2b(msg, digest_size=8).digest(), "little")


def truncate_logits(scores: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``scores`` [rows, V] (already divided by the temperature) with the tokens outside top-k, then outside top-p,
    set to -inf: the exact rules of transformers' ``TopKLogitsWarper`` and ``TopPLogitsWarper`` (one token kept)."""
    if top_k > 0:
        k = min(top_k, scores.size(-1))
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], -math.inf)
    if top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), -math.inf)
    return scores


def _check(n, temperature, greedy, max_new_tokens, min_new_tokens, top_k, top_p, prompts, prompt_keys, batch_size):
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected an int >= 1 samples per prompt, got {n!r}")
    if not greedy and not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature: expected a finite number > 0 for sampling, got {temperature!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if not isinstance(min_new_tokens, int) or not 0 <= min_new_tokens <= max_new_tokens:
        raise ValueError(f"min_new_tokens: expected an int in [0, max_new_tokens={max_new_tokens}], "
                         f"got {min_new_tokens!r}")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k: expected an int >= 0 (0 = off), got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p: expected a number in (0, 1], got {top_p!r}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError(f"prompts: every prompt needs at least one token; prompt {[len(p) for p in prompts].index(0)} "
                         "is empty")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError("batch_size: expected an int >= 1 prompts decoded together (or None = all), "
                         f"got {batch_size!r}")
    if prompt_keys is not None and len(prompt_keys) != len(prompts):
        raise ValueError(f"prompt_keys: expected one key per prompt ({len(prompts)}), got {len(prompt_keys)}")


def _forward_names(model) -> tuple[str, bool]:
    """(name of the cache argument, whether ``logits_to_keep`` is accepted) for this model's forward: ``cache`` in
    transformers >= 5.x (``past_key_values`` is deprecated there), ``past_key_values`` before."""
    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


_NOISE_BLOCK_ELEMS = 1 << 16  # per row: positions drawn ahead = this // V (at least 1); a function of V only


def _lean_decoder(model):
    """A ``_LeanDecoder`` for ``model`` when it is a plain Qwen2 / Llama causal LM this loop can step itself (exact
    module types, full attention, no hooks, plain local parameters), else None (the model's own forward is used)."""
    try:
        from transformers.models.llama import modeling_llama as llama
        from transformers.models.qwen2 import modeling_qwen2 as qwen2
    except ImportError:  # pragma: no cover - an older transformers
        return None
    families = {qwen2.Qwen2ForCausalLM: (qwen2.Qwen2DecoderLayer, qwen2.Qwen2Attention, qwen2.Qwen2MLP,
                                         qwen2.Qwen2RMSNorm, qwen2.Qwen2RotaryEmbedding),
                llama.LlamaForCausalLM: (llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP,
                                         llama.LlamaRMSNorm, llama.LlamaRotaryEmbedding)}
    fam = families.get(type(model))
    if fam is None:
        return None
    Layer, Attn, Mlp, Norm, Rope = fam
    cfg, base = model.config, getattr(model, "model", None)
    if getattr(cfg, "_attn_implementation", None) not in ("sdpa", "eager"):
        return None
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return None
    if (type(base) not in (qwen2.Qwen2Model, llama.LlamaModel) or type(base.embed_tokens) is not torch.nn.Embedding
            or type(base.norm) is not Norm or type(base.rotary_emb) is not Rope
            or type(model.lm_head) is not torch.nn.Linear or len(base.layers) != cfg.num_hidden_layers):
        return None
    lin = torch.nn.Linear
    for layer in base.layers:
        a, m = layer.self_attn, layer.mlp
        if (type(layer) is not Layer or type(a) is not Attn or type(m) is not Mlp
                or type(layer.input_layernorm) is not Norm or type(layer.post_attention_layernorm) is not Norm
                or any(type(x) is not lin for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj,
                                                    m.down_proj))
                or getattr(a, "sliding_window", None) is not None):
            return None
    from torch.nn.modules import module as _m

    if _m._global_forward_hooks or _m._global_forward_pre_hooks:
        return None
    for mod in model.modules():  # a hook (FSDP, PEFT, a user's probe), a forward replaced on the instance (accelerate's
        # device_map / offload hooks), or a sharded/subclassed parameter: the model's own forward
        if mod._forward_hooks or mod._forward_pre_hooks or "forward" in mod.__dict__ or hasattr(mod, "_hf_hook"):
            return None
        for p in mod._parameters.values():
            if p is not None and (type(p) is not torch.nn.Parameter or type(p.data) is not torch.Tensor):
                return None
    return _LeanDecoder(model)


_FUSE_BYTES = 256 << 20  # the lean decoder fuses q/k/v and gate/up weights while the copies stay under this size


class _LeanDecoder:
    """One decode token for a Qwen2 / Llama causal LM with the model's own weights, without the per-call work of the
    HF forward (mask building, cache objects, output dataclasses, kwargs plumbing): the computation of the model's
    forward at ``q_len = 1`` (RMSNorm, q/k/v projections, rotary embedding from the model's own rotary module, SDPA
    over a preallocated KV cache with the padding mask, o_proj, MLP, final norm, lm_head), equal to it up to
    floating-point rounding (tests/test_sampler.py). Built only by ``_lean_decoder``.

    Fewer ops per token: the q/k/v and the gate/up projections run as one GEMM each on concatenated weights (copies
    made per ``sample`` call, only while they total under ``_FUSE_BYTES``; separate GEMMs otherwise), and the rotary
    embedding is applied to q and k together as ``x * cos + roll(x, D/2) * sin'`` with ``sin' = [-sin_1, sin_2]``,
    which is ``rotate_half(x) * sin`` element for element (a sign moved between the factors of a product).
    """

    def __init__(self, model):
        base = model.model
        self.embed, self.rope = base.embed_tokens, base.rotary_emb
        self.norm = (base.norm.weight, base.norm.variance_epsilon)
        self.lm_head = (model.lm_head.weight, model.lm_head.bias)
        linears = [[x.self_attn.q_proj, x.self_attn.k_proj, x.self_attn.v_proj, x.mlp.gate_proj, x.mlp.up_proj]
                   for x in base.layers]
        fuse = sum(m.weight.numel() * m.weight.element_size() for ls in linears for m in ls) <= _FUSE_BYTES
        self.layers = []
        for layer, (qp, kp, vp, gp, up) in zip(base.layers, linears):
            a, m, n1, n2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
            H, Hkv, D = qp.weight.shape[0] // a.head_dim, kp.weight.shape[0] // a.head_dim, a.head_dim
            if fuse:
                qkv = [_cat_linear((qp, kp, vp))]
                gate_up = [_cat_linear((gp, up))]
            else:
                qkv = [(x.weight, x.bias) for x in (qp, kp, vp)]
                gate_up = [(x.weight, x.bias) for x in (gp, up)]
            self.layers.append(((n1.weight, n1.variance_epsilon), qkv, (a.o_proj.weight, a.o_proj.bias),
                                (n2.weight, n2.variance_epsilon), gate_up, (m.down_proj.weight, m.down_proj.bias),
                                m.act_fn, H, Hkv, D, a.scaling))
        # cos/sin of every position at once when the rotary embedding does not depend on the sequence seen so far
        self.static_rope = not any(w in str(getattr(self.rope, "rope_type", "")) for w in ("dynamic", "longrope"))
        self.cos = self.sin = None  # [positions, D] tables (static rotary)
        self.row_cos = self.row_sin = None  # [rows, steps, 1, D]: each row's table entries for its next positions
        self.prompt_columns = 0
        # plain modules called as their functional forms (no module-call overhead per token): same computation
        emb = self.embed
        self.embed_weight = emb.weight if emb.max_norm is None else None  # max_norm renormalizes: the module's call
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask: torch.Tensor | None = None  # [rows, 1, 1, columns] bool: True = attend; None: every column

    @staticmethod
    def _rms(x: torch.Tensor, norm) -> torch.Tensor:
        """Qwen2RMSNorm / LlamaRMSNorm: ``weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)``, ``h = x`` in fp32, with
        torch's fused ``rms_norm`` for the normalisation (same formula; equal up to rounding)."""
        weight, eps = norm
        if x.dtype == torch.float32 and weight.dtype == torch.float32:  # weight applied last either way
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
        return weight * torch.nn.functional.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=eps).to(x.dtype)

    @staticmethod
    def _rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin') with sin' = [-sin[:D/2], sin[D/2:]] so that rotate_half(x) * sin = roll(x, D/2) * sin'."""
        half = sin.shape[-1] // 2
        return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)

    def start(self, cache, rows: torch.Tensor, attn: torch.Tensor, columns: int, max_position: int,
              last_pos: torch.Tensor | None = None) -> None:
        """Copy the prefill ``cache`` (one row per prompt) into preallocated buffers of ``columns`` positions, one row
        per sample (``rows`` = the prompt row of each); ``attn`` [samples, prompt columns] = the prefill mask;
        positions up to ``max_position`` will be fed. ``last_pos`` [samples]: each row's last prompt position; given,
        the rotary entries of the positions ``last_pos + 1 ..`` that :meth:`step` feeds at columns ``P ..`` are
        gathered once here (``step`` then takes a view per token instead of two gathers)."""
        P = attn.shape[1]
        self.prompt_columns = P
        self.keys, self.values = [], []
        for layer in cache.layers:
            for src, dst in ((layer.keys, self.keys), (layer.values, self.values)):
                buf = src.new_zeros(len(rows), src.shape[1], columns, src.shape[3])
                buf[:, :, :P] = src[rows]
                dst.append(buf)
        if bool(attn.all()):  # no padding: every column is attended, SDPA needs no mask (the same result)
            self.mask = None
        else:
            mask = torch.ones(len(rows), columns, dtype=torch.bool, device=attn.device)
            mask[:, :P] = attn.bool()
            self.mask = mask[:, None, None, :]
        if self.static_rope:
            w = self.embed.weight
            cos, sin = self.rope(w.new_zeros(1, 1, w.shape[1]), torch.arange(max_position + 1, device=w.device)[None])
            self.cos, self.sin = self._rope_tables(cos[0], sin[0])  # [positions, D]
            self.row_cos = self.row_sin = None
            if last_pos is not None:
                at = (last_pos[:, None] + torch.arange(1, columns - P + 1, device=last_pos.device)).clamp_max(
                    max_position)  # [rows, steps]; positions past max_position are never fed
                self.row_cos, self.row_sin = self.cos[at][:, :, None], self.sin[at][:, :, None]

    def select(self, sel: torch.Tensor) -> None:
        """Keep the rows ``sel`` (finished rows dropped)."""
        self.keys = [k.index_select(0, sel) for k in self.keys]
        self.values = [v.index_select(0, sel) for v in self.values]
        if self.mask is not None:
            self.mask = self.mask.index_select(0, sel)
        if self.row_cos is not None:
            self.row_cos, self.row_sin = self.row_cos.index_select(0, sel), self.row_sin.index_select(0, sel)

    def step(self, tok: torch.Tensor, pos: torch.Tensor, col: int) -> torch.Tensor:
        """Logits [rows, V] of the next token after feeding ``tok`` [rows] at position ``pos`` [rows], cache column
        ``col``."""
        F = torch.nn.functional
        x = self.embed(tok) if self.embed_weight is None else F.embedding(tok, self.embed_weight)  # [R, hidden]
        if self.row_cos is not None:  # this column's entries, gathered at start (pos = last_pos + col - P + 1)
            j = col - self.prompt_columns
            cos, sin = self.row_cos[:, j], self.row_sin[:, j]  # [R, 1, D]
        else:
            if self.static_rope:
                cos, sin = self.cos[pos], self.sin[pos]  # [R, D]
            else:
                cos, sin = self.rope(x[:, None], pos[:, None])
                cos, sin = self._rope_tables(cos[:, 0], sin[:, 0])
            cos, sin = cos[:, None], sin[:, None]  # [R, 1, D]: one row of every head
        R = x.shape[0]
        mask = None if self.mask is None else self.mask[..., : col + 1]
        for i, (n1, qkv, op, n2, gate_up, dp, act, H, Hkv, D, scale) in enumerate(self.layers):
            h = self._rms(x, n1)
            if len(qkv) == 1:
                y = F.linear(h, *qkv[0])
                qk, v = y[:, : (H + Hkv) * D].view(R, H + Hkv, D), y[:, (H + Hkv) * D :]
            else:
                qk = torch.cat([F.linear(h, *qkv[0]).view(R, H, D), F.linear(h, *qkv[1]).view(R, Hkv, D)], dim=1)
                v = F.linear(h, *qkv[2])
            qk = qk * cos + torch.roll(qk, D // 2, -1) * sin  # q*cos + rotate_half(q)*sin, and the same for k
            K, V = self.keys[i], self.values[i]
            K[:, :, col] = qk[:, H:]
            V[:, :, col] = v.view(R, Hkv, D)
            o = F.scaled_dot_product_attention(qk[:, :H].view(R, Hkv, H // Hkv, D), K[:, :, : col + 1],
                                               V[:, :, : col + 1], attn_mask=mask, scale=scale)
            x = x + F.linear(o.reshape(R, -1), *op)
            h = self._rms(x, n2)
            if len(gate_up) == 1:
                g, u = F.linear(h, *gate_up[0]).chunk(2, dim=-1)
            else:
                g, u = F.linear(h, *gate_up[0]), F.linear(h, *gate_up[1])
            x = x + F.linear(act(g) * u, *dp)
        return F.linear(self._rms(x, self.norm), *self.lm_head)


class Lockstep:
    """Decoding with a model whose parameters are sharded over a group (FSDP2: every forward gathers each layer's
    shards, a collective): every rank of the group must run the same number of forwards, though each decodes its own
    rows and stops at its own EOS. So the ranks agree on the number of prompt chunks, and after every token on
    whether any of them still decodes; a rank with nothing left runs a one-token forward for each token the others
    still decode (its gathers answer theirs).

    ``rows`` (``lockstep`` finds them): the model's body and its input embedding and lm_head as
    :class:`~opdistill.parallel.VocabRows`, when the root holds nothing else: a forward then looks the ids up and
    computes the logits from each rank's vocabulary rows (collectives on the ranks' inputs, parallel/rows.py) and
    runs the body, whose units gather themselves, so the vocabulary-sized root weights are never gathered whole
    (docs/distributed.md).
    None: the model's own forward (the root gathered once, kept until :meth:`release`)."""

    def __init__(self, group, rows: "tuple | None" = None):
        self.group, self.rows = group, rows  # group None: no other rank (only :meth:`logits` is used)

    def _max(self, value: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t)

    def pad(self, starts: list) -> list:
        """``starts`` (this rank's chunks) with None appended up to the most chunks any rank has: a None is a chunk
        another rank runs, for which this one runs a forward of its own (one all-reduce)."""
        return list(starts) + [None] * (self._max(len(starts)) - len(starts))

    def any(self, alive: bool) -> bool:
        """Whether any rank still decodes after this token."""
        return bool(self._max(int(alive)))

    def logits(self, model, input_ids: torch.Tensor, *, last: bool = True, **kwargs) -> torch.Tensor:
        """The logits of a forward of ``model``: the last position's ``[rows, V]`` (``last``), else every
        position's ``[rows, S, V]``; the same collectives on every rank."""
        if self.rows is None:
            out = model(input_ids=input_ids, **kwargs).logits
        else:
            body, embed, head = self.rows
            kwargs.pop("logits_to_keep", None)
            hidden = body(inputs_embeds=embed.lookup(input_ids), **kwargs).last_hidden_state
            out = head.logits(hidden[:, -1:] if last else hidden)
        return out[:, -1, :] if last else out

    def forward(self, model, pad_id: int = 0, device=None) -> None:
        """One one-token forward (its gathers answer another rank's forward of real rows)."""
        self.logits(model, torch.full((1, 1), pad_id, dtype=torch.long, device=device), use_cache=False)

    def idle(self, model, pad_id: int, device) -> None:
        """One-token forwards while the other ranks decode, until none does."""
        while True:
            self.forward(model, pad_id, device)
            if not self.any(False):
                return

    @staticmethod
    def release(model) -> None:
        """Back to the shards (FSDP2 keeps the root's weights gathered after a forward)."""
        if hasattr(model, "reshard"):
            model.reshard()


# logits = lm_head(body(embedding(ids))), the embedding plain or (Gemma 3's) scaled by a constant
_BY_ROWS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM")
_SCALED_EMBEDDINGS = ("Gemma3TextScaledWordEmbedding",)  # embedding(ids) * embed_scale (a buffer), nothing else


def _vocab_rows(model, mesh) -> "tuple | None":
    """(body, input embedding rows, lm_head rows) for :class:`Lockstep` when ``model`` is an FSDP2 causal LM of a
    family whose logits are ``lm_head(body(...))`` (_BY_ROWS; its embedding plain, or scaled by a constant as
    Gemma 3's: the rows looked up are multiplied by it) and whose root unit holds only its input embedding
    and lm_head (``fully_shard`` on every other module that holds parameters: opdistill/train/run/distributed.py), both
    sharded on their vocabulary rows; else None."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    body = getattr(model, getattr(model, "base_model_prefix", ""), None)
    # the class FSDP2 wrapped (it makes FSDP<cls>(FSDPModule, cls)): exactly transformers' own, not a subclass
    # (a remote-code class may change the forward that turns the body's output into logits)
    wrapped = [c for c in type(model).__bases__ if c is not FSDPModule] or [type(model)]
    family = wrapped[0].__name__ in _BY_ROWS and wrapped[0].__module__.startswith("transformers.models.")
    scaled = type(embed).__name__ in _SCALED_EMBEDDINGS and type(embed).__module__.startswith("transformers.models.")
    if (not family or not isinstance(model, FSDPModule) or body is None
            or not (type(embed) is torch.nn.Embedding or scaled) or embed.max_norm is not None
            or type(head) is not torch.nn.Linear or head.bias is not None
            or any(getattr(model.config, k, None) not in (None, 1.0)
                   for k in ("logit_scale", "final_logit_softcapping"))):
        return None
    vocab = {id(embed.weight), id(head.weight)}
    for w in (embed.weight, head.weight):
        if not isinstance(w, DTensor) or w.device_mesh != mesh or tuple(w.placements) != (Shard(0),):
            return None

    def root_params(module):  # the parameters no inner FSDP2 unit holds
        for child in module.children():
            if not isinstance(child, FSDPModule):
                yield from root_params(child)
        yield from module.parameters(recurse=False)

    if any(id(p) not in vocab for p in root_params(model)):
        return None
    # FSDP2 takes the first unit to run forward as the root; the body's units run first here, so the root is
    # initialized now (a private call: torch has no public one)
    model._get_fsdp_state()._lazy_init()
    group = mesh.get_group()
    rows = VocabRows(embed.weight.to_local(), group, scale=embed.embed_scale if scaled else None)
    return body, rows, rows if head.weight is embed.weight and not scaled else VocabRows(head.weight.to_local(), group)


def lockstep(model) -> "Lockstep | None":
    """A :class:`Lockstep` for a model whose parameters are DTensors over a 1-D mesh of several ranks (the FSDP2
    student of ``distributed.decode: sharded``), else None."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor) and p.device_mesh.size() > 1:
            if p.device_mesh.ndim != 1:
                raise ValueError("sample: a model sharded over a mesh of more than one dimension cannot decode "
                                 "(use a plain replica: distributed.decode replica)")
            return Lockstep(p.device_mesh.get_group(), _vocab_rows(model, p.device_mesh))
    return None


def _cat_linear(mods) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of one linear computing ``mods`` side by side (a missing bias is zeros: ``+ 0`` is exact)."""
    weight = torch.cat([m.weight for m in mods], dim=0)
    if all(m.bias is None for m in mods):
        return weight, None
    return weight, torch.cat([m.weight.new_zeros(m.weight.shape[0]) if m.bias is None else m.bias for m in mods])


@torch.no_grad()
def sample(model, prompts: Sequence[Sequence[int]], *, eos_id: int | None, pad_id: int, n: int = 1,
           temperature: float = 1.0, greedy: bool = False, top_k: int = 0, top_p: float = 1.0,
           max_new_tokens: int = 64, min_new_tokens: int = 0, seed: int = 0, step: int = 0,
           prompt_keys: Sequence[int] | None = None, batch_size: int | None = None, want_logprobs: bool = False,
           tokenizer=None, forward_hook=None,
           lean_decode: bool = True, want_topk: int = 0, sample_indices: Sequence[int] | None = None,
           turn: int = 0) -> Samples:
    """Draw ``n`` responses per prompt (``greedy``: one argmax response each) with the keyed decode loop.

    ``prompt_keys[i]`` is the key of ``prompts[i]`` (default: ``i``); with ``seed`` and ``step`` it fixes every
    sample's randomness. ``batch_size`` is the number of prompts prefilled and decoded together (default: all).
    ``tokenizer``: decode the texts too. ``forward_hook(rows)`` (tests) is called before every forward.
    ``want_topk`` K > 0: also the top-K ids of each generated token's distribution (module notes).
    ``sample_indices[i]`` (with ``n`` 1) keys ``prompts[i]`` as that sample of its prompt key, and ``turn`` as that
    turn of an episode (opdistill/engines/episodes.py continues each sample's episode on its own key).
    """
    from transformers import DynamicCache

    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module  # a DDP-style wrapper: generation needs no gradient hooks, run the model itself
    _check(n, temperature, greedy, max_new_tokens, min_new_tokens, top_k, top_p, prompts, prompt_keys, batch_size)
    if greedy:
        n, temperature, top_k, top_p = 1, 1.0, 0, 1.0
    keys = list(range(len(prompts))) if prompt_keys is None else [int(k) for k in prompt_keys]
    if sample_indices is not None and (n != 1 or len(sample_indices) != len(prompts)):
        raise ValueError(f"sample_indices: expected one per prompt with n=1, got {len(sample_indices)} for "
                         f"{len(prompts)} prompts with n={n}")
    device = model.device
    cache_arg, has_keep = _forward_names(model)
    extra = {"logits_to_keep": 1} if has_keep else {}
    batch_size = batch_size or max(len(prompts), 1)
    tokens: list[list[int]] = [[] for _ in range(len(prompts) * n)]
    logprobs: list[list[float]] | None = [[] for _ in tokens] if want_logprobs else None
    if isinstance(want_topk, bool) or not isinstance(want_topk, int) or want_topk < 0:
        raise ValueError(f"want_topk must be an int >= 0, got {want_topk!r}")
    topk_ids: list[list[list[int]]] | None = [[] for _ in tokens] if want_topk else None
    lean = _lean_decoder(model) if lean_decode else None
    lock = lockstep(model)  # a sharded model: every forward in step with the other ranks
    forward = lock if lock is not None else Lockstep(None)  # its logits: the model's own forward without a group
    starts = list(range(0, len(prompts), batch_size))
    if lock is not None:
        starts = lock.pad(starts)  # chunks another rank has: forwards in step
    was_training = model.training
    model.eval()
    try:
        for start in starts:
            if start is None:  # no prompt left here: the others' prefill, then their tokens
                lock.idle(model, pad_id, device)
                continue
            chunk = prompts[start : start + batch_size]
            B, P = len(chunk), max(len(p) for p in chunk)
            ids = torch.full((B, P), pad_id, dtype=torch.long)
            attn = torch.zeros(B, P, dtype=torch.long)
            for i, p in enumerate(chunk):  # left padding: every row continues from the last column
                ids[i, P - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
                attn[i, P - len(p):] = 1
            ids, attn = ids.to(device), attn.to(device)
            pos = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 0)  # as generate() builds them
            cache = DynamicCache(config=model.config)
            if forward_hook is not None:
                forward_hook(B)
            logits = forward.logits(model, ids, attention_mask=attn, position_ids=pos, use_cache=True,
                                    **{cache_arg: cache}, **extra)
            # the n samples of a prompt share its prefill: repeat the cache rows (prompt-major order)
            rows = torch.arange(B, device=device).repeat_interleave(n)
            if n > 1:
                logits, attn = logits[rows], attn[rows]
            last_pos = pos[rows, -1]
            if lean is not None:
                lean.start(cache, rows, attn, P + max_new_tokens, int(last_pos.max()) + max_new_tokens, last_pos)
                del cache
            elif n > 1:
                cache.batch_select_indices(rows)
            out_rows = [(start + i) * n + j for i in range(B) for j in range(n)]  # row in `tokens` of each live row
            gens = None
            if not greedy:
                gens = [torch.Generator(device=device).manual_seed(row_key(
                    seed, step, keys[start + i], j if sample_indices is None else sample_indices[start + i], turn))
                        for i in range(B) for j in range(n)]
            block = max(1, _NOISE_BLOCK_ELEMS // logits.shape[-1])  # positions of noise drawn at once
            noise = None  # [rows, block, V]: log(-log u) of the next `block` positions of every live row
            for t in range(max_new_tokens):
                scaled = logits.float()
                if temperature != 1.0:
                    scaled = scaled / temperature
                if want_logprobs:
                    lse = torch.logsumexp(scaled, dim=-1)
                choose = scaled
                if eos_id is not None and t < min_new_tokens:
                    choose = choose.clone()
                    choose[:, eos_id] = -math.inf
                if greedy:
                    tok = choose.argmax(dim=-1)
                else:
                    choose = truncate_logits(choose, top_k, top_p)
                    if t % block == 0:  # each row's next `block` x V uniforms, in its generator's order
                        u = choose.new_empty(len(gens), min(block, max_new_tokens - t), choose.shape[-1])
                        for r, g in enumerate(gens):
                            u[r].uniform_(generator=g)
                        noise = torch.log(-torch.log(u))
                    tok = (choose - noise[:, t % block]).argmax(dim=-1)
                tok_list = tok.tolist()
                lp_list = (scaled.gather(-1, tok[:, None])[:, 0] - lse).tolist() if want_logprobs else None
                top_list = (torch.topk(scaled, min(want_topk, scaled.shape[-1]), dim=-1).indices.tolist()
                            if want_topk else None)
                for r, o in enumerate(out_rows):
                    tokens[o].append(tok_list[r])
                    if lp_list is not None:
                        logprobs[o].append(lp_list[r])
                    if top_list is not None:
                        topk_ids[o].append(top_list[r])
                last = t + 1 == max_new_tokens
                keep = [] if last else [r for r, x in enumerate(tok_list) if x != eos_id]
                if lock is not None:  # every rank says whether it decodes on, after every token
                    if not keep:
                        if lock.any(False):  # the others still decode: forwards in step until they end
                            lock.idle(model, pad_id, device)
                        break
                    lock.any(True)
                elif not keep:
                    break
                if len(keep) < len(tok_list):  # drop finished rows from the batch and the cache
                    sel = torch.tensor(keep, device=device)
                    if lean is not None:
                        lean.select(sel)
                    else:
                        cache.batch_select_indices(sel)
                        attn = attn[sel]
                    last_pos, tok = last_pos[sel], tok[sel]
                    out_rows = [out_rows[r] for r in keep]
                    if gens is not None:
                        gens = [gens[r] for r in keep]
                        noise = noise[sel]
                last_pos = last_pos + 1
                if forward_hook is not None:
                    forward_hook(len(keep))
                if lean is not None:
                    logits = lean.step(tok, last_pos, P + t)
                else:
                    attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)
                    logits = forward.logits(model, tok[:, None], attention_mask=attn,
                                            position_ids=last_pos[:, None], use_cache=True, **{cache_arg: cache},
                                            **extra)
    finally:
        model.train(was_training)
        if lock is not None:
            lock.release(model)
    texts = None if tokenizer is None else [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    return Samples(tokens, [r // n for r in range(len(tokens))], [r % n for r in range(len(tokens))], logprobs,
                   texts, topk_ids)
