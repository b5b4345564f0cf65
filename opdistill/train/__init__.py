"""The trainer: config, one optimizer step, evaluation, checkpoints, the loop."""
from opdistill.train.run.config import ConfigError, TrainerConfig, load_config
from opdistill.train.loop import run_training

__all__ = ["ConfigError", "TrainerConfig", "load_config", "run_training"]
