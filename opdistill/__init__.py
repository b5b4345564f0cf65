"""opdistill: exact, memory-lean on-policy distillation of language models."""
