"""The demo environment (SPEC 6.8, docs/episodes.md): ``lookup_add``'s tool and the demo models' tokenizer for it.

``f(k)`` returns the hidden value of key ``k`` (``opdistill.data.lookup_value``): the prompt ``f(k)+b=`` does not
hold it, so a model that never calls the tool can only guess. The packaged tool-using teacher and student
(``builtin:demo-tool-teacher``, ``builtin:demo-tool-student``, built by scripts/make_demo_models.py) read
:data:`TOOL_CHARS` one character per token, through :data:`TOOL_TEMPLATE`: the prompt, each assistant turn closed by
EOS, each tool result followed by ``;``. A call is ``[{"name":"f","arguments":{"k":K}}]`` (``env.call_open: "["``,
``env.call_close: "]"``).
"""
from __future__ import annotations

from opdistill.data.tasks import CARRY_ADD_CHARS, lookup_value
from opdistill.env.environment import Environment
from opdistill.env.tools import CallFormat, Tools

__all__ = ["ENV_CONFIG", "TOOL_CHARS", "TOOL_TEMPLATE", "demo_environment", "f"]

TOOL_CHARS = CARRY_ADD_CHARS + ';()[]{}":' + "afegkmnrstu"
TOOL_TEMPLATE = (
    "{# tool calls: [{\"name\": ..., \"arguments\": {...}}] #}{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'assistant' %}{{ m.content }}{{ eos_token }}{% elif m.role == 'tool' %}{{ m.content }};"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}")


def f(k: int) -> int:
    """The value stored under key k (0 to 999)."""
    if not 0 <= k <= 999:
        raise ValueError(f"no key {k}: keys are 0 to 999")
    return lookup_value(k)


#: the demo environment's ``env`` config section (configs/demo_tools.yaml, ``opdistill demo --tools``)
ENV_CONFIG = {"tools": ["opdistill.env.demo:f"], "call_open": "[", "call_close": "]", "max_turns": 3,
              "max_episode_tokens": 96}


def demo_environment(tokenizer):
    """The environment :data:`ENV_CONFIG` describes, over ``tokenizer`` (the demo tool models')."""
    c = ENV_CONFIG
    return Environment(Tools([f]), tokenizer, call_format=CallFormat(c["call_open"], c["call_close"]),
                       max_turns=c["max_turns"], max_episode_tokens=c["max_episode_tokens"])
