"""Student rollouts with transformers ``generate`` (KV cache), and the padded training layout they produce.

Design notes
- Sampling is plain ancestral sampling at the configured temperature: top-p 1 and top-k off unless the user asks.
  Truncated sampling draws from a distribution other than the student's, which makes the data off-policy for every
  on-policy objective; it is allowed with a warning.
- A fresh ``GenerationConfig`` is built for every call so a model's own generation defaults (SmolLM2 ships
  temperature 0.2, top-p 0.9) never leak into training data.
- The sampler's log-probabilities of the sampled tokens are recorded during generation by a logits processor that
  holds only the previous step's ``[rows, V]`` log-softmax, never ``[rows, T, V]``. They are the log-probs of the
  temperature-scaled full distribution (equal to the sampler's when top-p/top-k are off).
- The result is re-laid out as right-padded ``[B, S]`` rows of prompt + response (cut after the first EOS), in the
  next-token convention the losses use: ``sampler_logprobs[t]`` is the log-prob of token ``t+1``.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

__all__ = ["RolloutBatch", "generate_rollouts", "make_batch"]


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [B, S] int64, right-padded prompt + response
    attention_mask: torch.Tensor  # [B, S] 0/1
    response_mask: torch.Tensor  # [B, S] 0/1: 1 on response tokens (the EOS included)
    sampler_logprobs: torch.Tensor  # [B, S] fp32: row t = sampler log-prob of token t+1 (0 where not a response token)
    prompt_index: list[int]  # which prompt of the call each row answers (rows of one prompt form a GRPO group)
    texts: list[str]  # decoded responses, special tokens removed

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]


class _RecordLogprobs:
    """LogitsProcessor that records log p(sampled token) one step late, holding one [rows, V] tensor at a time."""

    def __init__(self, temperature: float):
        self.temperature = temperature if temperature > 0 else 1.0
        self.prev = None  # [rows, V] log-softmax of the previous step
        self.taken: list[torch.Tensor] = []  # one [rows] tensor per generated token

    def __call__(self, input_ids, scores):
        if self.prev is not None:
            self.taken.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.prev = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, last_tokens):
        if self.prev is not None:
            self.taken.append(self.prev.gather(-1, last_tokens[:, None]).squeeze(-1))
            self.prev = None
        return torch.stack(self.taken, dim=1) if self.taken else None


def make_batch(prompts: list[list[int]], responses: list[list[int]], response_logprobs: list[list[float]] | None,
               prompt_index: list[int], texts: list[str], pad_id: int) -> RolloutBatch:
    """Right-padded [B, S] layout of prompt + response rows (the next-token convention for log-probs)."""
    B = len(prompts)
    S = max((len(p) + len(r) for p, r in zip(prompts, responses)), default=1)
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    attn = torch.zeros(B, S, dtype=torch.long)
    resp = torch.zeros(B, S, dtype=torch.long)
    lps = torch.zeros(B, S, dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r, dtype=torch.long)
        attn[i, :n] = 1
        resp[i, len(p):n] = 1
        if response_logprobs is not None and r:
            lps[i, len(p) - 1 : n - 1] = torch.tensor(response_logprobs[i], dtype=torch.float32)
    return RolloutBatch(ids, attn, resp, lps, prompt_index, texts)


@torch.no_grad()
def generate_rollouts(model, tokenizer, prompts: list[list[int]], *, n: int = 1, temperature: float = 1.0,
                      top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 64, greedy: bool = False,
                      batch_size: int | None = None) -> RolloutBatch:
    """Sample ``n`` responses per prompt (``greedy``: one argmax response each) and lay them out for training."""
    from transformers import GenerationConfig, LogitsProcessorList

    if n < 1:
        raise ValueError(f"n: expected >= 1 samples per prompt, got {n}")
    if not greedy and not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature: expected a finite value > 0 for sampling, got {temperature}")
    if not greedy and (top_p < 1.0 or top_k > 0):
        warnings.warn(
            f"rollout uses truncated sampling (top_p={top_p}, top_k={top_k}): samples no longer come from the "
            "student's distribution, so on-policy objectives become off-policy",
            stacklevel=2,
        )
    if greedy:
        n = 1
    pad_id = tokenizer.pad_token_id
    eos_id = tokenizer.eos_token_id
    batch_size = batch_size or len(prompts)
    was_training = model.training
    model.eval()
    rows_p, rows_r, rows_lp, rows_idx, rows_txt = [], [], [], [], []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            P = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), P), pad_id, dtype=torch.long)
            attn = torch.zeros(len(chunk), P, dtype=torch.long)
            for i, p in enumerate(chunk):  # left padding: generation continues every row from its last column
                ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
                attn[i, P - len(p):] = 1
            gen_cfg = GenerationConfig(
                do_sample=not greedy,
                temperature=temperature if not greedy else None,
                top_p=top_p if not greedy else None,
                top_k=top_k if not greedy else None,
                max_new_tokens=max_new_tokens,
                num_return_sequences=n,
                pad_token_id=pad_id,
                eos_token_id=eos_id,
                bos_token_id=tokenizer.bos_token_id,
            )
            rec = _RecordLogprobs(1.0 if greedy else temperature)
            out = model.generate(
                input_ids=ids.to(model.device),
                attention_mask=attn.to(model.device),
                generation_config=gen_cfg,
                logits_processor=LogitsProcessorList([rec]),
            )
            new = out[:, P:].cpu()  # [len(chunk)*n, T]
            lp = rec.finish(new[:, -1].to(model.device)) if new.shape[1] else None
            for r in range(new.shape[0]):
                toks = new[r].tolist()
                if eos_id in toks:
                    toks = toks[: toks.index(eos_id) + 1]
                rows_p.append(chunk[r // n])
                rows_r.append(toks)
                rows_lp.append(lp[r, : len(toks)].cpu().tolist() if lp is not None else [])
                rows_idx.append(start + r // n)
                rows_txt.append(tokenizer.decode(toks, skip_special_tokens=True))
    finally:
        model.train(was_training)
    return make_batch(rows_p, rows_r, rows_lp, rows_idx, rows_txt, pad_id)
