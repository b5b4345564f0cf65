"""The run on disk: the checks before any weight loads, what a run reads (fingerprinted), the run folder's rules,
checkpoints, logging."""
