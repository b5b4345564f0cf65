"""Environments for multi-turn episodes (SPEC 6.8): the user's tools (``tools.py``) and how an episode's turns are
written (``environment.py``). The episodes themselves are sampled by ``opdistill.engines.episodes``."""
from opdistill.env.environment import Environment, EnvTurn, ToolMessages, prompt_renderer
from opdistill.env.tools import CallFormat, Observation, Tools

__all__ = ["CallFormat", "Environment", "EnvTurn", "Observation", "ToolMessages", "Tools", "prompt_renderer"]
