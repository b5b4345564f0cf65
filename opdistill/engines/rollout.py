"""Student rollouts through our keyed decode loop (``opdistill.engines.sampler``), and the padded training layout.

Design notes
- Sampling is plain ancestral sampling at the configured temperature: top-p 1 and top-k off unless the user asks.
  Truncated sampling draws from a distribution other than the student's, which makes the data off-policy for every
  on-policy objective; it is allowed with a warning. So is ``min_new_tokens`` (EOS masked before that many tokens).
- Sampling is keyed by ``(seed, step, prompt_offset + i, j)`` per sample: the same samples at any batch size or
  chunking (and, with per-rank ``prompt_offset``, any world size). A model's own generation defaults (SmolLM2 ships
  temperature 0.2, top-p 0.9) are never read.
- The sampler's log-probabilities of the sampled tokens (``want_logprobs``) are the log-probs of the
  temperature-scaled full distribution in fp32 (equal to the sampler's when top-p/top-k/min_new_tokens are off).
- The result is re-laid out as right-padded ``[B, S]`` rows of prompt + response (cut after the first EOS), in the
  next-token convention the losses use: ``sampler_logprobs[t]`` is the log-prob of token ``t+1``.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from opdistill.engines.sampler import sample

__all__ = ["RolloutBatch", "generate_rollouts", "make_batch", "warn_off_policy"]


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [B, S] int64, right-padded prompt + response
    attention_mask: torch.Tensor  # [B, S] 0/1
    response_mask: torch.Tensor  # [B, S] 0/1: 1 on response tokens (the EOS included)
    sampler_logprobs: torch.Tensor  # [B, S] fp32: row t = sampler log-prob of token t+1 (0 where not a response token)
    prompt_index: list[int]  # which prompt of the call each row answers (rows of one prompt form a GRPO group)
    texts: list[str] | None  # decoded responses, special tokens removed (None when not asked for)
    sampler_topk: torch.Tensor | None = None  # [B, S, K] int64: row t = the top-K ids of token t+1's distribution
    episode_sums: torch.Tensor | None = None  # [B, len(EPISODE_SUMS)] float64: an episode's counts (engines/episodes)
    episode_results: list | None = None  # per row, per environment answer in it, its (tool name, text) pairs

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def with_prompts(self, prompts: list[list[int]], pad_id: int) -> "RolloutBatch":
        """The same responses (log-probs, top-K ids, texts and an episode's counts with them) after other prompts:
        row r after ``prompts[prompt_index[r]]`` (the student's prompt before what a teacher wrote under its own, SPEC
        6.7). A response is everything from its first token to the row's end: an episode's environment tokens
        (SPEC 6.8) move with it, out of the mask."""
        responses, owners, lps, tops = [], [], [], []
        lengths = self.attention_mask.sum(-1).tolist()
        for r in range(self.num_rows):
            where = self.response_mask[r].nonzero().flatten()
            start = int(where[0]) if where.numel() else lengths[r]
            end = lengths[r]
            responses.append(self.input_ids[r, start:end].tolist())
            owners.append(self.response_mask[r, start:end].tolist())
            lps.append(self.sampler_logprobs[r, start - 1:end - 1].tolist())
            if self.sampler_topk is not None:
                tops.append(self.sampler_topk[r, start - 1:end - 1].tolist())
        out = make_batch([prompts[i] for i in self.prompt_index], responses, lps, self.prompt_index, self.texts,
                         pad_id, tops if self.sampler_topk is not None else None, owners=owners)
        out.episode_sums, out.episode_results = self.episode_sums, self.episode_results
        return out


def make_batch(prompts: list[list[int]], responses: list[list[int]], response_logprobs: list[list[float]] | None,
               prompt_index: list[int], texts: list[str] | None, pad_id: int,
               response_topk: list[list[list[int]]] | None = None,
               owners: list[list[int]] | None = None) -> RolloutBatch:
    """Right-padded [B, S] layout of prompt + response rows (the next-token convention for log-probs and the
    sampler's top-K ids: row t describes token t + 1; id 0 where no response token follows). ``owners`` (an
    episode's, SPEC 6.8): per response token 1 where the student wrote it, 0 for an environment's token, which stays
    in the row as context and out of ``response_mask``; None: every response token is the student's."""
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
        resp[i, len(p):n] = 1 if owners is None else torch.tensor(owners[i], dtype=torch.long)
        if response_logprobs is not None and r:
            lps[i, len(p) - 1 : n - 1] = torch.tensor(response_logprobs[i], dtype=torch.float32)
    top = None
    if response_topk is not None:
        K = max((len(row[0]) for row in response_topk if row), default=1)
        top = torch.zeros(B, S, K, dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            if r:
                top[i, len(p) - 1 : len(p) + len(r) - 1] = torch.tensor(response_topk[i], dtype=torch.long)
    return RolloutBatch(ids, attn, resp, lps, prompt_index, texts, top)


def warn_off_policy(*, greedy: bool, top_p: float, top_k: int, min_new_tokens: int) -> None:
    """Warn (at the rollout function's caller) when the sampling settings make the samples off-policy: truncated
    sampling, or EOS masked before ``min_new_tokens`` (module notes)."""
    if not greedy and (top_p < 1.0 or top_k > 0):
        warnings.warn(
            f"rollout uses truncated sampling (top_p={top_p}, top_k={top_k}): samples no longer come from the "
            "student's distribution, so on-policy objectives become off-policy",
            stacklevel=3,
        )
    if not greedy and min_new_tokens > 0:
        warnings.warn(
            f"rollout masks EOS before min_new_tokens={min_new_tokens} tokens: those samples no longer come from the "
            "student's distribution, so on-policy objectives become slightly off-policy (the sampler log-probs stay "
            "the unmasked student's)",
            stacklevel=3,
        )


def generate_rollouts(model, tokenizer, prompts: list[list[int]], *, n: int = 1, temperature: float = 1.0,
                      top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 64, min_new_tokens: int = 0,
                      greedy: bool = False, batch_size: int | None = None, seed: int | None = None, step: int = 0,
                      prompt_offset: int = 0, want_logprobs: bool = True, want_texts: bool = True,
                      want_topk: int = 0) -> RolloutBatch:
    """Sample ``n`` responses per prompt (``greedy``: one argmax response each) and lay them out for training.

    Sampling is keyed (``opdistill.engines.sampler``): sample ``j`` of ``prompts[i]`` is fixed by ``(seed, step,
    prompt_offset + i, j)``, whatever the batch size or the process that draws it. ``seed=None`` draws a seed from
    torch's global generator (so ``torch.manual_seed`` still makes a call reproducible). ``want_logprobs=False``
    leaves ``sampler_logprobs`` zero; ``want_texts=False`` leaves ``texts`` None; ``want_topk`` K > 0 fills
    ``sampler_topk`` with the top-K ids of each response token's distribution.
    """
    warn_off_policy(greedy=greedy, top_p=top_p, top_k=top_k, min_new_tokens=min_new_tokens)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    pad_id = tokenizer.pad_token_id
    out = sample(model, prompts, eos_id=tokenizer.eos_token_id, pad_id=pad_id, n=n, temperature=temperature,
                 greedy=greedy, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens,
                 min_new_tokens=min_new_tokens, seed=seed, step=step,
                 prompt_keys=range(prompt_offset, prompt_offset + len(prompts)), batch_size=batch_size,
                 want_logprobs=want_logprobs, tokenizer=tokenizer if want_texts else None, want_topk=want_topk)
    return make_batch([prompts[i] for i in out.prompt_index], out.tokens, out.logprobs, out.prompt_index,
                      out.texts, pad_id, out.topk_ids)
