"""Where tokens come from: our own keyed, KV-cache decode loop (``sampler``)."""
from opdistill.engines.sampler import Samples, row_key, sample, truncate_logits

__all__ = ["Samples", "sample", "row_key", "truncate_logits"]
