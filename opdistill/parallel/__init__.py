"""Vocab-parallel (tensor-parallel) losses: the ``ops`` results, with the student logits sharded on the vocab dim.

Each op takes this rank's shard of the logits (or a DTensor sharded on its last dim) and the tensor-parallel
process group, returns the per-token values of the single-device op (identical on every rank of the group), and
back-propagates into the local shard with an analytic backward that saves no fp32 ``[tokens, V/tp]`` tensor.
A group of one rank issues no collective.  The math is the vocab-sharded stages of ``stages.py`` (which the fused ops
share); the collectives per call are in docs/parallel.md.
"""

from .jsd import VocabParallelGeneralizedJSD, vocab_parallel_generalized_jsd
from .rows import VocabRows
from .sampled import VocabParallelLogProbs, vocab_parallel_token_logprobs
from .shard import VocabShard, resolve_shard
from .topk import VocabParallelTopKLoss, vocab_parallel_topk_divergence

__all__ = [
    "VocabParallelGeneralizedJSD",
    "VocabParallelLogProbs",
    "VocabParallelTopKLoss",
    "VocabRows",
    "VocabShard",
    "resolve_shard",
    "vocab_parallel_generalized_jsd",
    "vocab_parallel_token_logprobs",
    "vocab_parallel_topk_divergence",
]
