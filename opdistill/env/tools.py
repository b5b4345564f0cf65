"""Tools the student calls in an episode (SPEC 6.8): Python functions the user writes, called by name.

    env:
      tools: [my_tools:lookup, tools/calc.py:add]   # module:function or file.py:function, as reward.functions

A call is what the student writes between the call markers (``<tool_call>`` ... ``</tool_call>`` by default, the
format Hermes, Qwen and SmolLM3 templates use): a JSON object ``{"name": ..., "arguments": {...}}``. Model-written
text is never executed, evaluated or imported: it is parsed as JSON, ``name`` picks one of the listed functions, and
each argument is validated against that function's signature (every parameter without a default given, no unknown
name, each annotated value checked by pydantic in strict mode: JSON ``"7"`` is not an ``int``). Then the function runs
in a thread with a deadline (``env.tool_timeout_s``).

Every outcome becomes an observation the student reads in its next turn, and none stops training:

- ``ok``: the result as text (a ``str`` as it is; numbers, booleans, None, lists and dicts as JSON), cut to
  ``env.max_result_chars`` (then ``cut`` is counted too);
- ``bad_call``: no JSON object, an unknown tool, bad arguments, an unclosed call (``env/bad_calls``);
- ``error``: the tool raised, ran past its deadline, or returned something that is not text (bytes, an object).

A tool that runs past its deadline is left running in its daemon thread (Python cannot stop a thread); its result,
if it ever comes, is dropped. Tools must be safe to call from several threads if that matters to them.
"""
from __future__ import annotations

import inspect
import json
import math
import threading
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from opdistill.errors import ConfigError, first_line, quote

__all__ = ["CallFormat", "Observation", "Tools"]


@dataclass(frozen=True)
class CallFormat:
    """The markers around a call in the student's text."""

    open: str = "<tool_call>"
    close: str = "</tool_call>"

    def __post_init__(self):
        for name in ("open", "close"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                raise ConfigError(f"env.call_{name}: expected a non-empty marker string, got {quote(v)}")

    def calls(self, text: str) -> list[str | None]:
        """The bodies of the calls in ``text``, in order; None for a call opened and never closed."""
        out, at = [], 0
        while (i := text.find(self.open, at)) >= 0:
            j = text.find(self.close, i + len(self.open))
            if j < 0:
                out.append(None)
                break
            out.append(text[i + len(self.open):j])
            at = j + len(self.close)
        return out


@dataclass(frozen=True)
class Observation:
    """What one call gave: ``name`` (the tool, or "" when the call names none), ``text`` (what the student reads),
    ``kind``: ``ok``, ``bad_call`` or ``error``, and ``cut``: whether the result was cut to the limit."""

    name: str
    text: str
    kind: str
    cut: bool = False


class _Tool:
    def __init__(self, name: str, fn: Callable, key: str):
        from pydantic import ConfigDict, TypeAdapter

        self.name, self.fn = name, fn
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: {name} has no signature to check its arguments against (a builtin?); wrap it "
                              "in a Python function") from None
        self.params, self.adapters, props, required = {}, {}, {}, []
        for p in sig.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY):
                raise ConfigError(f"{key}: {name}'s parameter {p.name!r} cannot be given by name; a tool is called "
                                  "with the JSON object's arguments as keywords")
            if p.kind is p.VAR_KEYWORD:
                raise ConfigError(f"{key}: {name} takes **{p.name}; a tool names every argument it accepts, so a "
                                  "call's arguments can be checked")
            self.params[p.name] = p
            schema = {}
            if p.annotation is not p.empty:
                try:
                    self.adapters[p.name] = TypeAdapter(p.annotation, config=ConfigDict(strict=True))
                    schema = self.adapters[p.name].json_schema()
                except Exception as e:  # noqa: BLE001 -- pydantic's refusal of an annotation, in one line
                    raise ConfigError(f"{key}: {name}'s parameter {p.name!r} has an annotation that cannot be "
                                      f"checked against JSON ({type(e).__name__}: {first_line(e)})") from None
            props[p.name] = schema
            if p.default is p.empty:
                required.append(p.name)
        doc = inspect.getdoc(fn) or ""
        self.schema = {"type": "function", "function": {
            "name": name, "description": doc.split("\n\n")[0].strip(),
            "parameters": {"type": "object", "properties": props, "required": required}}}

    def arguments(self, args: dict) -> dict:
        """``args`` checked against the signature (ValueError with the reason)."""
        unknown = sorted(set(args) - set(self.params))
        if unknown:
            raise ValueError(f"unknown argument(s) {unknown} (it takes {sorted(self.params)})")
        missing = [n for n, p in self.params.items() if p.default is p.empty and n not in args]
        if missing:
            raise ValueError(f"missing argument(s) {missing}")
        for n, v in args.items():
            if n in self.adapters:
                try:
                    self.adapters[n].validate_python(v)
                except Exception as e:  # noqa: BLE001 -- pydantic's ValidationError, summarised
                    errors = getattr(e, "errors", lambda: [])()
                    why = errors[0]["msg"] if errors else first_line(e)
                    raise ValueError(f"argument {n!r}: {why} (got {json.dumps(v)[:60]})") from None
        return args


def _as_text(value) -> str:
    """A tool's result as the text the student reads (TypeError for a value that is not text)."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, (bool, int, float, list, dict)):
        try:
            return json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"returned {type(value).__name__}, not text (a str, a number, a bool, None, or JSON lists/dicts)")


class Tools:
    """The tools of an environment, by name: ``functions`` is ``{name: callable}`` or a list of callables (each named
    by its ``__name__``); :meth:`from_specs` loads ``module:function`` entries. ``call(body)`` is one call's
    :class:`Observation` (module notes)."""

    def __init__(self, functions: Mapping[str, Callable] | Sequence[Callable], *, timeout_s: float = 10.0,
                 max_result_chars: int = 2000, key: str = "env.tools"):
        if isinstance(functions, Mapping):
            named = list(functions.items())
        else:
            named = [(getattr(fn, "__name__", ""), fn) for fn in functions]
        if not named:
            raise ConfigError(f"{key}: an environment needs at least one tool")
        seen = {}
        for name, fn in named:
            if not callable(fn):
                raise ConfigError(f"{key}: {quote(name)} is not callable ({type(fn).__name__})")
            if not isinstance(name, str) or not name.isidentifier():
                raise ConfigError(f"{key}: a tool's name must be an identifier, got {quote(name)} (name a lambda "
                                  "with a dict {name: function})")
            if name in seen:
                raise ConfigError(f"{key}: two tools are named {name!r}")
            seen[name] = _Tool(name, fn, key)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
                math.isfinite(timeout_s) and timeout_s > 0):
            raise ConfigError(f"env.tool_timeout_s: expected a finite number > 0, got {quote(timeout_s)}")
        if isinstance(max_result_chars, bool) or not isinstance(max_result_chars, int) or max_result_chars < 1:
            raise ConfigError(f"env.max_result_chars: expected an int >= 1, got {quote(max_result_chars)}")
        self.tools, self.timeout_s, self.max_result_chars = seen, float(timeout_s), max_result_chars

    @classmethod
    def from_specs(cls, specs: Sequence[str], **kw) -> "Tools":
        """The tools ``module:function`` / ``file.py:function`` name (refusals: one line naming the entry)."""
        from opdistill.data.rewards import load_function  # the one loader of the user's functions

        named, first = {}, {}
        for i, spec in enumerate(specs):
            name = spec.rsplit(":", 1)[-1]
            if name in first:
                raise ConfigError(f"env.tools.{i}: a second tool named {name!r} (env.tools.{first[name]} is the "
                                  "first); the model calls a tool by its function's name")
            first[name], named[name] = i, load_function(spec, f"env.tools.{i}")
        return cls(named, **kw)

    @property
    def names(self) -> list[str]:
        return list(self.tools)

    @property
    def schemas(self) -> list[dict]:
        """The tools' JSON schemas, as ``apply_chat_template(tools=...)`` takes them."""
        return [t.schema for t in self.tools.values()]

    def call(self, body: str | None) -> Observation:
        """Parse one call's body, check it, run the tool with its deadline: the observation (never raises for what
        the model wrote or the tool did)."""
        if body is None:
            return Observation("", "error: the tool call was not closed", "bad_call")
        try:
            call = json.loads(body)
        except ValueError as e:
            return Observation("", f"error: the tool call is not JSON ({first_line(e)})", "bad_call")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return Observation("", 'error: a tool call is a JSON object {"name": ..., "arguments": {...}}',
                               "bad_call")
        name, args = call["name"], call.get("arguments", {})
        tool = self.tools.get(name)
        if tool is None:
            return Observation(name, f"error: unknown tool {json.dumps(name)[:60]} (tools: {', '.join(self.tools)})",
                               "bad_call")
        if not isinstance(args, dict) or set(call) - {"name", "arguments"}:
            return Observation(name, f'error: {name}: a call has "name" and "arguments" (a JSON object) only',
                               "bad_call")
        try:
            tool.arguments(args)
        except ValueError as e:
            return Observation(name, f"error: {name}: {e}", "bad_call")
        return self._run(tool, args)

    def _run(self, tool: _Tool, args: dict) -> Observation:
        box: dict = {}

        def run():
            try:
                box["value"] = tool.fn(**args)
            except BaseException as e:  # noqa: BLE001 -- the user's tool may raise anything; the student reads it
                box["error"] = e

        worker = threading.Thread(target=run, daemon=True, name=f"opdistill-tool-{tool.name}")
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            return Observation(tool.name, f"error: {tool.name} did not answer within {self.timeout_s:g} s", "error")
        if "error" in box:
            e = box["error"]
            return Observation(tool.name, f"error: {tool.name} raised {type(e).__name__}: {first_line(e)}"[:500],
                               "error")
        try:
            text = _as_text(box.get("value"))
        except TypeError as e:
            return Observation(tool.name, f"error: {tool.name} {e}", "error")
        if len(text) > self.max_result_chars:
            return Observation(tool.name, text[:self.max_result_chars] + " [cut]", "ok", cut=True)
        return Observation(tool.name, text, "ok")
