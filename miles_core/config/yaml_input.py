"""YAML written by users (config files, structured flag values), read within bounds.

A config is plain data: strings, numbers, booleans, null, lists and mappings with string keys, each key given once
(a duplicate key is an error naming it and its lines, not a silent override). Everything else is
refused with an error naming the source, and nothing that a hostile file can do (a FIFO or a device instead of a
file, binary or UTF-16 bytes, thousands of nested levels, an alias bomb, a recursive alias, a 5000-digit integer)
may cost more than the bounds below, hang, or end in a traceback.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import ConstructorError

from miles_core.errors import ConfigError
from miles_core.user_files import read_text

MAX_FILE_BYTES = 1 << 20
"""A config file is a few KiB; 1 MiB leaves room and bounds the parser's time and memory."""
MAX_DEPTH = 64
"""Nesting levels of lists and mappings (a config needs about five)."""
MAX_NODES = 100_000
"""Values in the document once aliases are expanded (an alias counts as many values as it stands for)."""
MAX_INT_DIGITS = 64
"""Digits of an integer literal (Python refuses to parse more than 4300, and no setting needs more than 20)."""
_PLAIN_DATA = "use plain strings, numbers, booleans, null, lists and mappings"


def read_config_file(path: str | Path) -> Any:
    """The data of the YAML file ``path``; a :class:`ConfigError` names the file and what is wrong with it."""
    text = _read_text(Path(path))
    return load_yaml(text, source=f"config file {str(path)!r}")


def load_yaml(text: str, *, source: str) -> Any:
    """Parse ``text`` as plain-data YAML within the bounds of this module; errors name ``source``."""
    try:
        loader = _BoundedLoader(text)  # the reader checks every character here
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML{_where(exc, text)}: {_problem(exc)}") from None
    _check_plain_data(data, source=source, budget=[MAX_NODES], path=(), ancestors=set())
    return data


def _read_text(path: Path) -> str:
    """Read a regular file of at most :data:`MAX_FILE_BYTES` as UTF-8, refusing anything else before reading it."""
    return read_text(
        path,
        what=f"config file {str(path)!r}",
        expected="a YAML file",
        limit=MAX_FILE_BYTES,
        hint="a config is a small YAML file",
    )


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded in nesting depth and in what merge keys copy, limited to plain data, with
    timestamps kept as text."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._merged = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        # The composer recurses once per level: bound it before Python's recursion limit is reached.
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def flatten_mapping(self, node: Any) -> None:
        # A merge key ('<<') copies the merged pairs into the mapping: a chain of merges, each adding a key, is
        # quadratic in the text (100 KB gave 4.5 million pairs). Count the copies against the same budget.
        merges = any(key.tag == "tag:yaml.org,2002:merge" for key, _ in node.value)
        super().flatten_mapping(node)
        if merges:
            self._merged += len(node.value)
            if self._merged > MAX_NODES:
                problem = f"merge keys ('<<') copy more than {MAX_NODES} values"
                raise ConstructorError(None, None, problem, node.start_mark)

    def construct_mapping(self, node: Any, deep: bool = False) -> dict:
        self._refuse_duplicate_keys(node)
        return super().construct_mapping(node, deep=deep)

    def _refuse_duplicate_keys(self, node: Any) -> None:
        # PyYAML keeps the last of two equal keys: a setting written twice would silently lose one of them. Keys
        # copied in by a merge key ('<<') may be overridden, as YAML allows; keys written in the mapping may not.
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                first = seen[key].line + 1
                raise ConstructorError(
                    None,
                    None,
                    f"duplicate key {_short(key)} (first at line {first}); give each key once",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark

    def construct_yaml_int(self, node: Any) -> int:
        text = self.construct_scalar(node)
        if sum(char.isalnum() for char in text) > MAX_INT_DIGITS:
            raise ConstructorError(
                None, None, f"an integer of more than {MAX_INT_DIGITS} digits is not a setting", node.start_mark
            )
        return super().construct_yaml_int(node)

    def construct_yaml_timestamp(self, node: Any) -> str:
        return self.construct_scalar(node)  # a date in a config is a name or a label, not a datetime

    def construct_refused(self, node: Any) -> Any:
        raise ConstructorError(
            None, None, f"the tag {node.tag!r} is not allowed in a config; {_PLAIN_DATA}", node.start_mark
        )


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)
_BoundedLoader.add_constructor("tag:yaml.org,2002:timestamp", _BoundedLoader.construct_yaml_timestamp)
for _tag in ("binary", "omap", "pairs", "set"):
    _BoundedLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _BoundedLoader.construct_refused)
_BoundedLoader.add_constructor(None, _BoundedLoader.construct_refused)


def _check_plain_data(value: Any, *, source: str, budget: list[int], path: tuple[str, ...], ancestors: set) -> None:
    """Walk ``value`` as pydantic will (aliases expanded), within :data:`MAX_NODES` values, refusing recursive
    aliases, non-string keys and non-finite numbers."""
    budget[0] -= 1
    where = ".".join(path) or "the top level"
    if budget[0] < 0:
        raise ConfigError(
            f"{source} holds more than {MAX_NODES} values once its aliases are expanded; "
            "a config is small (an alias bomb?)"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{source}: {where} = {value}: not a finite number; give a finite value")
    if not isinstance(value, dict | list):
        return
    if len(path) >= MAX_DEPTH:  # aliases inside aliases nest deeper than the text does
        raise ConfigError(f"{source}: {where} is nested deeper than {MAX_DEPTH} levels once aliases are expanded")
    if id(value) in ancestors:
        raise ConfigError(f"{source}: {where} contains itself (a recursive alias); {_PLAIN_DATA}")
    ancestors.add(id(value))
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        if isinstance(value, dict) and not isinstance(key, str):
            raise ConfigError(
                f"{source}: key {_short(key)} of {where} is not a string ({type(key).__name__}); quote it"
            )
        _check_plain_data(item, source=source, budget=budget, path=(*path, str(key)), ancestors=ancestors)
    ancestors.discard(id(value))


def _where(exc: yaml.YAMLError, text: str) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if mark is not None:
        return f" at line {mark.line + 1}, column {mark.column + 1}"
    position = getattr(exc, "position", None)  # a ReaderError: a character YAML does not allow
    return f" at line {text.count(chr(10), 0, position) + 1}" if position is not None else ""


def _problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.reader.ReaderError):
        character = chr(exc.character) if isinstance(exc.character, int) else exc.character
        return f"character {character!r} is not allowed in YAML (binary data?)"
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    return f"{problem} ({context})" if context and problem != context else problem


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
