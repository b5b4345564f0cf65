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
"""
from __future__ import annotations

import hashlib
import inspect
import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Samples", "sample", "truncate_logits", "row_key"]


@dataclass
class Samples:
    """Rows in prompt-major order: row ``i * n + j`` is sample ``j`` of ``prompts[i]``."""

    tokens: list[list[int]]  # generated tokens per row, cut after the first EOS (EOS included)
    prompt_index: list[int]  # position in ``prompts`` of the prompt each row answers
    sample_index: list[int]  # j: which sample of its prompt
    logprobs: list[list[float]] | None  # sampler log-prob of each generated token (want_logprobs)
    texts: list[str] | None  # decoded responses, special tokens removed (tokenizer given)


def row_key(seed: int, step: int, prompt_key: int, sample_index: int) -> int:
    """The 64-bit generator seed of one sample: a hash of its four keys (stable across processes and versions)."""
    msg = f"opdistill.sampler:{int(seed)}:{int(step)}:{int(prompt_key)}:{int(sample_index)}".encode()
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


@torch.no_grad()
def sample(model, prompts: Sequence[Sequence[int]], *, eos_id: int | None, pad_id: int, n: int = 1,
           temperature: float = 1.0, greedy: bool = False, top_k: int = 0, top_p: float = 1.0,
           max_new_tokens: int = 64, min_new_tokens: int = 0, seed: int = 0, step: int = 0,
           prompt_keys: Sequence[int] | None = None, batch_size: int | None = None, want_logprobs: bool = False,
           tokenizer=None, forward_hook=None) -> Samples:
    """Draw ``n`` responses per prompt (``greedy``: one argmax response each) with the keyed decode loop.

    ``prompt_keys[i]`` is the key of ``prompts[i]`` (default: ``i``); with ``seed`` and ``step`` it fixes every
    sample's randomness. ``batch_size`` is the number of prompts prefilled and decoded together (default: all).
    ``tokenizer``: decode the texts too. ``forward_hook(rows)`` (tests) is called before every forward.
    """
    from transformers import DynamicCache

    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module  # a DDP-style wrapper: generation needs no gradient hooks, run the model itself
    _check(n, temperature, greedy, max_new_tokens, min_new_tokens, top_k, top_p, prompts, prompt_keys, batch_size)
    if greedy:
        n, temperature, top_k, top_p = 1, 1.0, 0, 1.0
    keys = list(range(len(prompts))) if prompt_keys is None else [int(k) for k in prompt_keys]
    device = model.device
    cache_arg, has_keep = _forward_names(model)
    extra = {"logits_to_keep": 1} if has_keep else {}
    batch_size = batch_size or max(len(prompts), 1)
    tokens: list[list[int]] = [[] for _ in range(len(prompts) * n)]
    logprobs: list[list[float]] | None = [[] for _ in tokens] if want_logprobs else None
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(prompts), batch_size):
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
            logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                           **{cache_arg: cache}, **extra).logits[:, -1, :]
            # the n samples of a prompt share its prefill: repeat the cache rows (prompt-major order)
            rows = torch.arange(B, device=device).repeat_interleave(n)
            if n > 1:
                cache.batch_select_indices(rows)
                logits, attn = logits[rows], attn[rows]
            last_pos = pos[rows, -1]
            out_rows = [(start + i) * n + j for i in range(B) for j in range(n)]  # row in `tokens` of each live row
            gens = None
            if not greedy:
                gens = [torch.Generator(device=device).manual_seed(row_key(seed, step, keys[start + i], j))
                        for i in range(B) for j in range(n)]
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
                    u = torch.empty_like(choose)
                    for r, g in enumerate(gens):
                        u[r].uniform_(generator=g)
                    tok = (choose - torch.log(-torch.log(u))).argmax(dim=-1)
                tok_list = tok.tolist()
                lp_list = (scaled.gather(-1, tok[:, None])[:, 0] - lse).tolist() if want_logprobs else None
                for r, o in enumerate(out_rows):
                    tokens[o].append(tok_list[r])
                    if lp_list is not None:
                        logprobs[o].append(lp_list[r])
                if t + 1 == max_new_tokens:
                    break
                keep = [r for r, x in enumerate(tok_list) if x != eos_id]
                if not keep:
                    break
                if len(keep) < len(tok_list):  # drop finished rows from the batch and the cache
                    sel = torch.tensor(keep, device=device)
                    cache.batch_select_indices(sel)
                    attn, last_pos, tok = attn[sel], last_pos[sel], tok[sel]
                    out_rows = [out_rows[r] for r in keep]
                    if gens is not None:
                        gens = [gens[r] for r in keep]
                attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)
                last_pos = last_pos + 1
                if forward_hook is not None:
                    forward_hook(len(keep))
                logits = model(input_ids=tok[:, None], attention_mask=attn, position_ids=last_pos[:, None],
                               use_cache=True, **{cache_arg: cache}, **extra).logits[:, -1, :]
    finally:
        model.train(was_training)
    texts = None if tokenizer is None else [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    return Samples(tokens, [r // n for r in range(len(tokens))], [r % n for r in range(len(tokens))], logprobs,
                   texts)
