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
    flag: str
    path: str
    structured: bool = False  # parse the value as YAML (lists, mappings)
    nullable: bool = False  # "none" / "null" mean None
    mapping: bool = False  # repeatable KEY=VALUE
    const: str | None = None  # the value of the flag given alone


class ConfigArguments:
    """Adds config flags to a parser and turns parsed values into dotted-path overrides."""

    def __init__(self, manager: Any) -> None:
        self._bindings: dict[str, _Binding] = {}
        self._named = self._named_flags(manager)
        self._model = config_model(manager)

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """Add ``--config`` and every config flag to ``parser``."""
        parser.add_argument("--config", metavar="FILE.yaml", help="YAML file with config sections")
        group = parser.add_argument_group("config flags (override --config, which overrides the defaults)")
        taken = {flag.flag for flag in self._named}
        for section_name, section_field in self._model.model_fields.items():
            for field_name, field in section_field.annotation.model_fields.items():
                flag = f"--{section_name}-{field_name}".replace("_", "-")
                if flag in taken:
                    continue
                origin = typing.get_origin(field.annotation)
                binding = _Binding(
                    flag=flag,
                    path=f"{section_name}.{field_name}",
                    structured=origin in _STRUCTURED or field.annotation in _STRUCTURED,
                    nullable=_allows_none(field),
                )
                self._add(group, binding, help=field.description or "", metavar=field_name.upper())
        for named in self._named:
            binding = _Binding(flag=named.flag, path=named.path, mapping=named.mapping, const=named.const)
            self._add(group, binding, help=named.help, metavar=named.metavar)

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

    def _add(self, group: Any, binding: _Binding, *, help: str, metavar: str | None) -> None:
        dest = f"config_flag_{len(self._bindings)}"
        self._bindings[dest] = binding
        optional_value = {} if binding.const is None else {"nargs": "?", "const": binding.const}
        group.add_argument(
            binding.flag,
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


def _allows_none(field: pydantic.fields.FieldInfo) -> bool:
    return type(None) in typing.get_args(field.annotation)


def _convert(binding: _Binding, raw: str) -> Any:
    if binding.nullable and raw.strip().lower() in ("none", "null"):
        return None
    if not binding.structured:
        return raw  # pydantic converts and validates scalars, naming the field on error
    return load_yaml(raw, source=f"the value of {binding.flag}")
