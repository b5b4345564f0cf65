"""In-process teacher scoring (no grad) and its disk cache.

Design notes
- The teacher runs its backbone once per row chunk; the lm_head is applied chunk by chunk over token positions and
  each chunk's logits are reduced to what the loss needs (top-k ids + log-probs, and/or the log-prob of the sampled
  token) before the next chunk is computed. So no ``[batch, seq, vocab]`` buffer is ever kept, only one
  ``[chunk_tokens, vocab]`` block at a time.
- The teacher is always scored at temperature 1 (the SPEC's convention for teacher top-k, as a vLLM/SGLang server
  returns them). Row t holds the teacher distribution of token t+1, the same next-token layout as the student.
- The cache is one safetensors file: ``input_ids``/``attention_mask``/``response_mask`` (int32), ``topk_ids``
  (int32) and ``topk_logprobs`` (fp16 or fp32), optionally ``sampled_logprobs``; enough to rerun off-policy KD
  without the teacher.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from opdistill import TeacherTopK
from opdistill.fused import backbone_of, read_lm_head

__all__ = ["TeacherScores", "score_teacher", "save_cache", "load_cache"]


@dataclass
class TeacherScores:
    topk: TeacherTopK | None  # ids [B, S, K] int64, logprobs [B, S, K] fp32
    sampled_logprobs: torch.Tensor | None  # [B, S] fp32, teacher log-prob of token t+1


@torch.no_grad()
def score_teacher(teacher, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, k: int | None = None,
                  sampled_ids: torch.Tensor | None = None, row_chunk: int = 64, token_chunk: int = 2048) -> TeacherScores:
    """Teacher top-k (``k``) and/or sampled-token (``sampled_ids`` [B, S], usually the next-token targets) log-probs.

    The logits are the model's own, transform included (``opdistill.fused.read_lm_head``: Cohere/Granite/Falcon-H1
    logit multipliers, Gemma 2 soft-capping); a head the reader does not know is refused."""
    if k is None and sampled_ids is None:
        raise ValueError("score_teacher: ask for top-k (k=...) or sampled-token scores (sampled_ids=...), or both")
    B, S = input_ids.shape
    head = read_lm_head(teacher)
    V = head.weight.shape[0]
    if k is not None and not 1 <= k <= V:
        raise ValueError(f"k: expected 1 <= k <= vocab size {V}, got {k}")
    backbone = backbone_of(teacher)
    dev = teacher.device
    top_ids = torch.zeros(B, S, k, dtype=torch.long) if k else None
    top_lp = torch.zeros(B, S, k, dtype=torch.float32) if k else None
    samp = torch.zeros(B, S, dtype=torch.float32) if sampled_ids is not None else None
    was_training = teacher.training
    teacher.eval()
    try:
        for r0 in range(0, B, row_chunk):
            ids = input_ids[r0 : r0 + row_chunk].to(dev)
            am = attention_mask[r0 : r0 + row_chunk].to(dev)
            hidden = backbone(input_ids=ids, attention_mask=am).last_hidden_state  # [b, S, H]
            b = hidden.shape[0]
            flat = hidden.reshape(b * S, -1)
            for t0 in range(0, b * S, token_chunk):
                z = head.logits(flat[t0 : t0 + token_chunk])  # [c, V] fp32: the only vocab-wide buffer
                lse = torch.logsumexp(z, dim=-1, keepdim=True)
                rows = torch.arange(t0, t0 + z.shape[0])
                bi, si = r0 + rows // S, rows % S
                if k:
                    v, i = z.topk(k, dim=-1)
                    top_ids[bi, si] = i.cpu()
                    top_lp[bi, si] = (v - lse).cpu()
                if samp is not None:
                    tgt = sampled_ids[bi, si].to(dev)
                    samp[bi, si] = (z.gather(-1, tgt[:, None]) - lse).squeeze(-1).cpu()
    finally:
        teacher.train(was_training)
    return TeacherScores(TeacherTopK(top_ids, top_lp) if k else None, samp)


def save_cache(path: str | os.PathLike, *, input_ids, attention_mask, response_mask, scores: TeacherScores,
               logprob_dtype: torch.dtype = torch.float16) -> Path:
    """Write a teacher cache (atomically: temp file + rename)."""
    from safetensors.torch import save_file

    if logprob_dtype not in (torch.float16, torch.float32):
        raise ValueError(f"logprob_dtype: expected torch.float16 or torch.float32, got {logprob_dtype}")
    t = {
        "input_ids": input_ids.to(torch.int32).contiguous(),
        "attention_mask": attention_mask.to(torch.int32).contiguous(),
        "response_mask": response_mask.to(torch.int32).contiguous(),
    }
    if scores.topk is not None:
        t["topk_ids"] = scores.topk.ids.to(torch.int32).contiguous()
        # fp16 keeps ~3 significant digits; -inf (empty slot) survives, very negative values saturate to -65504.
        t["topk_logprobs"] = scores.topk.logprobs.to(logprob_dtype).contiguous()
    if scores.sampled_logprobs is not None:
        t["sampled_logprobs"] = scores.sampled_logprobs.to(logprob_dtype).contiguous()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    save_file(t, str(tmp), metadata={"format": "opdistill-teacher-cache-v1"})
    os.replace(tmp, path)
    return path


def load_cache(path: str | os.PathLike) -> dict:
    """Read a teacher cache back: int64 ids/masks, fp32 log-probs, ``scores`` as TeacherScores."""
    from safetensors.torch import load_file

    t = load_file(str(path))
    for key in ("input_ids", "attention_mask", "response_mask"):
        if key not in t:
            raise ValueError(f"{path}: not an opdistill teacher cache (missing {key!r})")
    topk = None
    if "topk_ids" in t:
        topk = TeacherTopK(t["topk_ids"].long(), t["topk_logprobs"].float())
    samp = t["sampled_logprobs"].float() if "sampled_logprobs" in t else None
    return {
        "input_ids": t["input_ids"].long(),
        "attention_mask": t["attention_mask"].long(),
        "response_mask": t["response_mask"].long(),
        "scores": TeacherScores(topk, samp),
    }
