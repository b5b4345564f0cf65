"""Fused linear losses: distill from hidden states and the lm_head weight, never holding more than one chunk of
logits (SPEC 5).  Same results as ``opdistill.ops`` (same named stages: each chunk of z = h W^T goes through the
vocab-sharded stages of ``opdistill.parallel.stages``), gradients for hidden, weight and bias."""

from ._chunks import default_chunk_size
from .hf import (LMHead, backbone_of, causal_lm_hidden, check_lm_head, head_transform, lm_head_of, no_cache_kwargs,
                 read_lm_head)
from .inputs import StudentHidden, TeacherHidden
from .jsd import fused_generalized_jsd, fused_jsd_loss
from .logprobs import fused_token_logprobs
from .topk import fused_topk_divergence, fused_topk_loss

__all__ = [
    "LMHead",
    "StudentHidden",
    "TeacherHidden",
    "backbone_of",
    "causal_lm_hidden",
    "check_lm_head",
    "default_chunk_size",
    "head_transform",
    "fused_generalized_jsd",
    "fused_jsd_loss",
    "fused_token_logprobs",
    "fused_topk_divergence",
    "fused_topk_loss",
    "lm_head_of",
    "no_cache_kwargs",
    "read_lm_head",
]
