"""An environment: tools, the limits of an episode, and how its turns are written in the student's tokens (SPEC 6.8).

An episode is the prompt, then turns: the student writes a turn (up to its end-of-sequence token); if the turn holds
tool calls (opdistill/env/tools.py) the environment answers each, and its answer joins the episode as the chat
template writes tool messages; the student writes its next turn after them. The episode ends when a turn holds no
call (the student's answer), at ``max_turns`` student turns, or when ``max_episode_tokens`` (the student's and the
environment's tokens after the prompt) would be passed: that episode is *truncated* (counted, ``env/truncated``).

The environment's tokens are the chat template's own: the text the template writes between the end of an assistant
turn and the next assistant turn, for the tool messages, read off two renderings of a fixed conversation (the
assistant turn closed at the model's end-of-sequence token, as the student closes its turns). A template that writes
no tool message (its text holds no result), or whose rendering of the conversation with tool messages does not
extend the one without, cannot carry an episode: refused when the environment is built, in one line.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from opdistill.data.prompts import render_prompt
from opdistill.env.tools import CallFormat, Observation, Tools
from opdistill.errors import ConfigError
from opdistill.xtok.tokens import render_chat

__all__ = ["Environment", "EnvTurn", "ToolMessages", "prompt_renderer"]

_PROBE = "opdistill-probe-7f3a"  # a result text no template writes by itself


@dataclass(frozen=True)
class EnvTurn:
    """The environment's answer to one student turn: the observations (one per call) and their tokens."""

    observations: tuple[Observation, ...]
    ids: list[int]


class ToolMessages:
    """How a tokenizer's chat template writes tool messages after an assistant turn (module notes): :meth:`text` of
    ``(tool name, result)`` pairs is the template's text from the end of the assistant turn (its EOS included) to the
    next generation prompt. Checked at construction, one ConfigError naming ``name`` (``key``: the config key) for a
    template that does not write an assistant turn's content, writes no tool messages, or does not grow turn by
    turn. The student's environment writes its tool messages with one; a cross-tokenizer teacher writes the same
    results through its own template with another (opdistill/teachers/xtok.py)."""

    _TURN = "opdistill-turn-5c1d"
    _BASE = ({"role": "user", "content": "opdistill-user-2b9e"}, {"role": "assistant", "content": _TURN})

    def __init__(self, tokenizer, name: str, key: str = "env.tools"):
        self.tokenizer = tokenizer
        before = render_chat(tokenizer, list(self._BASE), add_generation_prompt=False)
        end = before.find(self._TURN)
        if end < 0:
            raise ConfigError(f"{key}: the chat template of {name} does not write an assistant turn's content")
        end += len(self._TURN)
        if tokenizer.eos_token is not None and before[end:].startswith(tokenizer.eos_token):
            end += len(tokenizer.eos_token)
        after = render_chat(tokenizer, [*self._BASE, {"role": "tool", "name": "probe", "content": _PROBE}],
                            add_generation_prompt=True)
        if after[:end] != before[:end]:
            raise ConfigError(f"{key}: the chat template of {name} writes the conversation before a tool message "
                              "differently once one follows, so an episode cannot grow turn by turn")
        if _PROBE not in after[end:]:
            raise ConfigError(f"{key}: the chat template of {name} writes no tool messages (a tool result "
                              "disappears from its text); give it a template with a 'tool' role")
        self._end = end

    def text(self, results) -> str:
        """The template's text for tool messages holding ``results`` ((tool name, text) pairs), after an assistant
        turn closed at EOS, up to and including the next generation prompt."""
        tool_msgs = [{"role": "tool", "name": name, "content": text} for name, text in results]
        return render_chat(self.tokenizer, [*self._BASE, *tool_msgs], add_generation_prompt=True)[self._end:]

    def ids(self, results) -> list[int]:
        """:meth:`text` in the tokenizer's ids."""
        return list(self.tokenizer(self.text(results), add_special_tokens=False)["input_ids"])


def prompt_renderer(tokenizer, env: "Environment | None", *, use_chat_template: bool = True):
    """How a run renders a problem's prompt into token ids: through ``env`` (its tools listed) when the run has one,
    else :func:`~opdistill.data.prompts.render_prompt`."""
    if env is not None:
        return env.prompt
    return lambda prompt: render_prompt(tokenizer, prompt, use_chat_template=use_chat_template)


class Environment:
    """``tools`` and an episode's limits over ``tokenizer`` (the student's): :meth:`prompt` renders a problem's prompt
    with the tools listed, :meth:`respond` answers a student turn (None when the turn calls no tool)."""

    def __init__(self, tools: Tools, tokenizer, *, max_turns: int = 4, max_episode_tokens: int = 512,
                 call_format: CallFormat = CallFormat(), use_chat_template: bool = True, calls_in_prompt: bool = False):
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ConfigError(f"env.max_turns: expected an int >= 1, got {max_turns!r}")
        if isinstance(max_episode_tokens, bool) or not isinstance(max_episode_tokens, int) or max_episode_tokens < 1:
            raise ConfigError(f"env.max_episode_tokens: expected an int >= 1, got {max_episode_tokens!r}")
        # its own copy: the pipelined step runs episodes in its thread while an evaluation runs them in the trainer's,
        # and a fast tokenizer refuses two threads at once
        self.tools, self.tokenizer, self.format = tools, copy.deepcopy(tokenizer), call_format
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens
        template = getattr(tokenizer, "chat_template", None) if use_chat_template else None
        name = getattr(tokenizer, "name_or_path", "") or "the student's tokenizer"
        if not template:
            raise ConfigError("env.tools: an episode's tool results are written by the tokenizer's chat template "
                              "(its tool messages), and " + ("data.use_chat_template is false" if
                                                              not use_chat_template else f"{name} has none"))
        if not isinstance(template, str) or (call_format.open not in template and not calls_in_prompt):
            raise ConfigError(f"env.tools: the chat template of {name} has no tool-call format ({call_format.open!r} "
                              "appears nowhere in it); set env.call_open/env.call_close to the markers it uses, or "
                              "env.calls_in_prompt: true if your prompts teach the model the format")
        if tokenizer.eos_token is None:
            raise ConfigError("env.tools: the student's tokenizer has no end-of-sequence token to end a turn with")
        self.messages = ToolMessages(self.tokenizer, name)

    def prompt(self, prompt) -> list[int]:
        """A problem's prompt (a string or chat messages) as the student reads it: through the chat template with the
        tools' schemas listed."""
        return render_prompt(self.tokenizer, prompt, use_chat_template=True, tools=self.tools.schemas)

    def respond(self, turn_text: str) -> EnvTurn | None:
        """The answer to a student turn (its text, special tokens removed): None when it calls no tool, else each
        call's observation and their tokens as the template writes them."""
        bodies = self.format.calls(turn_text)
        if not bodies:
            return None
        obs = tuple(self.tools.call(b) for b in bodies)
        return EnvTurn(obs, self.messages.ids([(o.name, o.text) for o in obs]))
