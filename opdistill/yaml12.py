"""YAML as the configs are read: the YAML 1.2 core schema, no duplicate keys, and bounded input.

PyYAML implements YAML 1.1, whose implicit types surprise: ``010`` is 8 (octal), ``1:30`` is 90 (base 60), ``no`` and
``off`` are false, ``1e-3`` is a string, ``2001-01-01`` a date. :class:`Yaml12Loader` resolves plain scalars by the
1.2 core schema instead (yaml.org/spec/1.2.2 10.3.2), in config files and in ``key=value`` overrides alike:

    null    ``null`` ``Null`` ``NULL`` ``~`` and the empty value
    bool    ``true`` ``True`` ``TRUE`` ``false`` ``False`` ``FALSE`` (``yes``/``no``/``on``/``off`` are strings)
    int     ``[-+]?[0-9]+`` in base 10 (``010`` is 10), ``0o[0-7]+``, ``0x[0-9a-fA-F]+``
    float   ``[-+]?(.[0-9]+|[0-9]+(.[0-9]*)?)([eE][-+]?[0-9]+)?``, ``.inf`` ``-.inf`` ``.nan`` (any other text, e.g.
            ``1:30``, ``1_000`` or ``2001-01-01``, is a string)

Merge keys (``<<: *base``) still work. A mapping that names a key twice is refused (PyYAML keeps the last one without
a word). Bounded input: a document nests at most :data:`MAX_DEPTH` collections deep (deeper was a RecursionError in
PyYAML's composer) and expands to at most :data:`MAX_VALUES` values once every alias is followed (an "alias bomb" of
a few hundred bytes expands to billions: PyYAML shares the nodes, so the bomb goes off later, in whatever walks the
value: validation, an error message, a copy), and stops composing at :data:`MAX_VALUES` values written out (a 40 MB
flat list took minutes); a recursive alias is refused. The config loader also refuses a file above
:data:`MAX_CONFIG_BYTES` before parsing it. Each refusal is a ``yaml.YAMLError``
with the position of the offending node, which the config loader turns into one line.

:func:`dump_yaml` writes what both schemas read back the same: a string that either schema would take for another
type (``'no'``, ``'010'``, ``'0o17'``, ``'1e3'``) is quoted, so a run's ``config.yaml`` reads back unchanged here and
in any YAML 1.1 reader.
"""
from __future__ import annotations

import re

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, SequenceNode

__all__ = ["MAX_DEPTH", "MAX_VALUES", "MAX_CONFIG_BYTES", "Yaml12Loader", "load_yaml", "dump_yaml"]

MAX_DEPTH = 64  # collections inside collections; a config needs about 5
MAX_VALUES = 100_000  # values after following every alias; a config holds a few hundred
MAX_CONFIG_BYTES = 4 << 20  # a config file's size (the loader reads at most this much + 1 byte)

_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|"
                    r"\.(?:nan|NaN|NAN))$")
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_NULL = re.compile(r"^(?:~|null|Null|NULL|)$")


class Yaml12Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with the YAML 1.2 core schema, no duplicate keys, and the depth and expansion bounds
    (module notes)."""

    yaml_implicit_resolvers: dict = {}  # this class's own table (filled below), not SafeLoader's 1.1 one

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    # -- bounds -------------------------------------------------------------------------------------------------------
    def compose_node(self, parent, index):
        self._depth += 1
        self._nodes += 1  # written out (aliases count once here): a huge flat document stops early, not after
        try:
            if self._depth > MAX_DEPTH:
                raise ComposerError(None, None, f"nested more than {MAX_DEPTH} levels deep; a config needs far fewer",
                                    self.peek_event().start_mark)
            if self._nodes > MAX_VALUES:
                raise ComposerError(None, None, f"more than {MAX_VALUES} values; a config holds far fewer",
                                    self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            _check_expansion(node)
        return node

    # -- no duplicate keys --------------------------------------------------------------------------------------------
    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value != "<<":
                if key_node.value in seen:
                    raise ConstructorError(None, None, f"duplicate key {_short(key_node.value)}; only the last one "
                                           f"would count", key_node.start_mark)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)

    # -- the 1.2 core schema's values (an explicit tag gets the same rules: ``!!bool yes`` is refused, not false) -----
    def _scalar_of(self, node, pattern, kind: str) -> str:
        text = self.construct_scalar(node)
        if not pattern.match(text):
            raise ConstructorError(None, None, f"{_short(text)} is not a YAML 1.2 {kind}", node.start_mark)
        return text

    def construct_yaml_int(self, node):
        text = self._scalar_of(node, _INT, "integer")
        if text.startswith("0o"):
            return int(text[2:], 8)
        if text.startswith("0x"):
            return int(text[2:], 16)
        return int(text, 10)

    def construct_yaml_float(self, node):
        text = self._scalar_of(node, _FLOAT, "number")
        lowered = text.lower()
        if lowered.endswith(".inf"):
            return float("-inf") if text.startswith("-") else float("inf")
        if lowered == ".nan":
            return float("nan")
        return float(text)

    def construct_yaml_bool(self, node):
        return self._scalar_of(node, _BOOL, "boolean (true or false)").lower() == "true"


Yaml12Loader.add_constructor("tag:yaml.org,2002:int", Yaml12Loader.construct_yaml_int)
Yaml12Loader.add_constructor("tag:yaml.org,2002:float", Yaml12Loader.construct_yaml_float)
Yaml12Loader.add_constructor("tag:yaml.org,2002:bool", Yaml12Loader.construct_yaml_bool)
for _tag, _regexp, _first in (
        ("tag:yaml.org,2002:bool", _BOOL, list("tTfF")),
        ("tag:yaml.org,2002:null", _NULL, ["~", "n", "N", ""]),
        ("tag:yaml.org,2002:int", _INT, list("-+0123456789")),
        ("tag:yaml.org,2002:float", _FLOAT, list("-+.0123456789")),
        ("tag:yaml.org,2002:merge", re.compile(r"^(?:<<)$"), ["<"])):
    Yaml12Loader.add_implicit_resolver(_tag, _regexp, _first)


def _short(text: str, limit: int = 40) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def _check_expansion(root) -> None:
    """Refuse a node graph that expands (every alias followed) to more than MAX_VALUES values, or holds a cycle.
    Each node's expanded size is computed once (aliases share nodes), so this costs one pass over the document."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    stack = [(root, False)]  # iterative: a document is at most MAX_DEPTH deep, but stay off the C stack anyway
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        if isinstance(node, SequenceNode):
            children = node.value
        elif isinstance(node, MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            sizes[key] = 1
            continue
        if children_done:
            open_.discard(key)
            total = 1 + sum(sizes[id(c)] for c in children)
            if total > MAX_VALUES:
                raise ComposerError(None, None, f"the aliases expand to more than {MAX_VALUES} values (an alias "
                                    f"bomb?); a config holds far fewer", node.start_mark)
            sizes[key] = total
            continue
        if key in open_:
            raise ComposerError(None, None, "a recursive alias (a collection that contains itself)", node.start_mark)
        open_.add(key)
        stack.append((node, True))
        for c in children:
            if id(c) in open_:
                raise ComposerError(None, None, "a recursive alias (a collection that contains itself)",
                                    c.start_mark)
            if id(c) not in sizes:
                stack.append((c, False))


def load_yaml(stream):
    """One YAML document (a string or an open text file) read with :class:`Yaml12Loader`."""
    return yaml.load(stream, Loader=Yaml12Loader)


class _BothSchemasDumper(yaml.SafeDumper):
    """Plain scalars only where YAML 1.1 (PyYAML's own table) and 1.2 (:class:`Yaml12Loader`'s) read them alike."""

    def resolve(self, kind, value, implicit):
        tag = super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode and implicit[0]:
            for t, regexp in Yaml12Loader.yaml_implicit_resolvers.get(value[:1] if value else "", []):
                if regexp.match(value):
                    return t if tag == self.DEFAULT_SCALAR_TAG else tag
        return tag


def dump_yaml(data) -> str:
    """``data`` as YAML text (keys in their order) that reads back equal under YAML 1.1 and 1.2 (module notes)."""
    return yaml.dump(data, Dumper=_BothSchemasDumper, sort_keys=False, allow_unicode=True)
