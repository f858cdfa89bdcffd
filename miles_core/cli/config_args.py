"""Command-line flags for the config: automatic ``--SECTION-FIELD`` flags plus the plugins' named flags."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

import pydantic

from miles_core.config.build import config_model
from miles_core.config.flags import ConfigFlag
from miles_core.config.yaml_input import load_yaml
from miles_core.errors import ConfigError
from miles_core.registry import call_each_plugin

_STRUCTURED = (dict, list, tuple, set)


@dataclasses.dataclass(frozen=True)
class _Binding:
    flag: str  # the flag named in errors: the first of the setting's flags
    path: str
    structured: bool = False  # parse the value as YAML (lists, mappings)
    nullable: bool = False  # "none" / "null" mean None
    mapping: bool = False  # repeatable KEY=VALUE
    const: str | None = None  # the value of the flag given alone


class ConfigArguments:
    """Adds config flags to a parser and turns parsed values into dotted-path overrides.

    Each setting is one argparse option: its named flags (``--num-steps``) and its automatic ``--SECTION-FIELD``
    flag (``--run-num-steps``) are aliases of each other, so ``--help`` shows the setting once with all its names.
    """

    def __init__(self, manager: Any) -> None:
        self._bindings: dict[str, _Binding] = {}
        self._named = self._named_flags(manager)
        self._model = config_model(manager)

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """Add ``--config`` and every config flag to ``parser``."""
        parser.add_argument("--config", metavar="FILE.yaml", help="YAML file with config sections")
        group = parser.add_argument_group("config flags (override --config, which overrides the defaults)")
        taken = {flag.flag for flag in self._named}
        placed: set[str] = set()
        for section_name, section_field in self._model.model_fields.items():
            section = section_field.annotation
            for field_name, field in section.model_fields.items():
                path = f"{section_name}.{field_name}"
                auto = _auto_flag(path)
                aliases = [named for named in self._named if named.path == path and not named.mapping]
                shorthands = [named for named in self._named if named not in aliases and _sets(named, path)]
                self._add_setting(
                    group,
                    path,
                    field,
                    aliases=aliases,
                    auto=None if auto in taken else auto,
                    shown=not any(named.mapping for named in shorthands),
                )
                for named in shorthands:
                    note = f"; {auto} sets the whole mapping as YAML" if named.mapping else ""
                    self._add_named(group, named, note=note)
                placed.update(named.flag for named in [*aliases, *shorthands])
            for field_name in section.removed_fields:
                self._add_removed(group, f"{section_name}.{field_name}", taken)
        for named in self._named:
            if named.flag not in placed:  # a path outside the sections: validation names it
                self._add_named(group, named, note="")

    def _add_setting(
        self, group: Any, path: str, field: Any, *, aliases: list[ConfigFlag], auto: str | None, shown: bool
    ) -> None:
        flags = [named.flag for named in aliases] + ([auto] if auto else [])
        if not flags:
            return
        const = next((named.const for named in aliases if named.const is not None), None)
        origin = typing.get_origin(field.annotation)
        binding = _Binding(
            flag=flags[0],
            path=path,
            const=const,
            nullable=_allows_none(field),
            structured=origin in _STRUCTURED or field.annotation in _STRUCTURED,
        )
        help_text = field.description or next((named.help for named in aliases if named.help), "")
        metavar = next((named.metavar for named in aliases if named.metavar), None) or path.split(".")[-1].upper()
        self._add(group, binding, flags=flags, help=help_text if shown else argparse.SUPPRESS, metavar=metavar)

    def _add_named(self, group: Any, named: ConfigFlag, *, note: str) -> None:
        binding = _Binding(flag=named.flag, path=named.path, mapping=named.mapping, const=named.const)
        self._add(group, binding, flags=[named.flag], help=named.help + note, metavar=named.metavar)

    def _add_removed(self, group: Any, path: str, taken: set[str]) -> None:
        """A hidden flag for a removed field: it sets the field, so validation refuses it with the reason."""
        flag = _auto_flag(path)
        if flag not in taken:
            binding = _Binding(flag=flag, path=path, const="")
            self._add(group, binding, flags=[flag], help=argparse.SUPPRESS, metavar=None)

    def overrides(self, namespace: argparse.Namespace) -> dict[str, Any]:
        """The dotted-path overrides given on the command line (flags not given are absent)."""
        result: dict[str, Any] = {}
        for dest, binding in self._bindings.items():
            if not hasattr(namespace, dest):
                continue
            raw = getattr(namespace, dest)
            if binding.mapping:
                for item in raw:
                    key, sep, value = item.partition("=")
                    if not sep or not key or not value:
                        raise ConfigError(f"{binding.flag} expects KEY=VALUE, got {item!r}")
                    result[f"{binding.path}.{key}"] = value
            else:
                result[binding.path] = _convert(binding, raw)
        return result

    def _add(self, group: Any, binding: _Binding, *, flags: list[str], help: str, metavar: str | None) -> None:
        dest = f"config_flag_{len(self._bindings)}"
        self._bindings[dest] = binding
        optional_value = {} if binding.const is None else {"nargs": "?", "const": binding.const}
        group.add_argument(
            *flags,
            dest=dest,
            default=argparse.SUPPRESS,
            action="append" if binding.mapping else "store",
            help=help,
            metavar=metavar,
            **optional_value,
        )

    @staticmethod
    def _named_flags(manager: Any) -> list[ConfigFlag]:
        flags: dict[str, tuple[ConfigFlag, str]] = {}
        for plugin_name, contributed in call_each_plugin(manager.pm, "config_flags"):
            for flag in contributed or []:
                if flag.flag in flags:
                    raise ConfigError(
                        f"flag {flag.flag} is declared twice, by plugin {flags[flag.flag][1]!r} "
                        f"and by plugin {plugin_name!r}"
                    )
                flags[flag.flag] = (flag, plugin_name)
        return [flag for flag, _ in flags.values()]


def _auto_flag(path: str) -> str:
    return "--" + path.replace(".", "-").replace("_", "-")


def _sets(named: ConfigFlag, path: str) -> bool:
    """Whether ``named`` sets part of the setting ``path``: a key of it, or its keys one by one."""
    return named.path.startswith(f"{path}.") or (named.mapping and named.path == path)


def _allows_none(field: pydantic.fields.FieldInfo) -> bool:
    return type(None) in typing.get_args(field.annotation)


def _convert(binding: _Binding, raw: str) -> Any:
    if binding.nullable and raw.strip().lower() in ("none", "null"):
        return None
    if not binding.structured:
        return raw  # pydantic converts and validates scalars, naming the field on error
    return load_yaml(raw, source=f"the value of {binding.flag}")
