"""Generates the site's CLI reference (``reference/cli-flags.md``) at build time, with mkdocs-gen-files.

Nothing in the page is written by hand: the flags are the ones ``miles train`` parses, added to a parser by the
project's own :class:`~miles_core.cli.config_args.ConfigArguments` from the pydantic config models of the loaded
plugins (miles-core's and every installed plugin distribution's), and each setting's type, default, bounds and
description come from its pydantic field. Run it alone with ``python tools/docs/gen_cli_reference.py`` to print
the page.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import sys
import types
import typing
from collections.abc import Iterator
from typing import Any

import annotated_types
import pydantic

from miles_core.cli.config_args import ConfigArguments
from miles_core.cli.main import build_parser
from miles_core.config.build import config_model
from miles_core.config.flags import ConfigFlag
from miles_core.plugin_manager import MilesPluginManager
from miles_core.registry import call_each_plugin

PAGE = "reference/cli-flags.md"
COMMAND_HELP = (["--help"], ["plugins", "--help"], ["config", "show", "--help"], ["dashboard", "--help"])
"""The commands whose own options the page shows as ``--help`` prints them (the config flags are in the tables)."""
BOUNDS = {
    annotated_types.Gt: ">",
    annotated_types.Ge: ">=",
    annotated_types.Lt: "<",
    annotated_types.Le: "<=",
    annotated_types.MinLen: "length >=",
    annotated_types.MaxLen: "length <=",
}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the page: a config path with the flags that set it, as the parser holds them."""

    path: str
    flags: tuple[str, ...]
    metavar: str
    help: str
    repeatable: bool


def config_settings(manager: MilesPluginManager) -> list[Setting]:
    """Every documented config flag of ``miles train``, from the parser that ``ConfigArguments`` builds."""
    parser = argparse.ArgumentParser(prog="miles train")
    ConfigArguments(manager).add_to(parser)
    named = {flag.flag: flag for _, flags in call_each_plugin(manager.pm, "config_flags") for flag in flags or []}
    by_auto_flag = {auto_flag(path): path for path in field_paths(manager)}
    settings = []
    for action in parser._actions:  # argparse keeps no public list of its options; every doc generator reads this
        if action.help == argparse.SUPPRESS or not action.option_strings or action.dest == "help":
            continue
        if action.dest == "config":
            continue  # --config FILE.yaml, documented with the commands
        settings.append(_setting(action, named, by_auto_flag))
    return settings


def _setting(action: argparse.Action, named: dict[str, ConfigFlag], by_auto_flag: dict[str, str]) -> Setting:
    flags = tuple(action.option_strings)
    path = next((named[flag].path for flag in flags if flag in named), None)
    path = path or next(by_auto_flag[flag] for flag in flags if flag in by_auto_flag)
    return Setting(
        path=path,
        flags=flags,
        metavar=str(action.metavar or ""),
        help=action.help or "",
        repeatable=isinstance(action, argparse._AppendAction),
    )


def auto_flag(path: str) -> str:
    """A field's automatic flag: ``rollout.batch_size`` is ``--rollout-batch-size``."""
    return "--" + path.replace(".", "-").replace("_", "-")


def field_paths(manager: MilesPluginManager) -> Iterator[str]:
    for section_name, section_field in config_model(manager).model_fields.items():
        for field_name in section_field.annotation.model_fields:
            yield f"{section_name}.{field_name}"


def section_plugins(manager: MilesPluginManager) -> dict[str, str]:
    """Section name -> the plugin that contributes it."""
    return {
        name: plugin for plugin, sections in call_each_plugin(manager.pm, "config_sections") for name in sections or {}
    }


def type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: ``int``, ``str | None``, ``'drop' | 'retry'``, ``dict[str, float]``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(value) for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in typing.get_args(annotation))
    if origin is typing.Annotated:
        return type_name(typing.get_args(annotation)[0])
    if origin is not None:
        args = ", ".join(type_name(arg) for arg in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def bounds(field: pydantic.fields.FieldInfo) -> str:
    """The field's bounds, as pydantic checks them: ``> 0``, ``>= 1, <= 64``."""
    parts = []
    for constraint in field.metadata:
        for kind, symbol in BOUNDS.items():
            if isinstance(constraint, kind):
                parts.append(f"{symbol} {next(iter(dataclasses.asdict(constraint).values()))}")
    return ", ".join(parts)


def cell(text: str) -> str:
    """Text for a Markdown table cell: a ``|`` outside code spans escaped (inside one it does not end the cell)."""
    parts = text.replace("\n", " ").split("`")
    return "`".join(part if inside_code % 2 else part.replace("|", "\\|") for inside_code, part in enumerate(parts))


def code(text: str) -> str:
    return f"`{text}`" if text else ""


def render(manager: MilesPluginManager) -> str:
    """The whole page."""
    model = config_model(manager)
    defaults = model().model_dump(mode="json")
    plugins = section_plugins(manager)
    by_section: dict[str, list[Setting]] = {}
    for setting in config_settings(manager):
        by_section.setdefault(setting.path.split(".")[0], []).append(setting)
    lines = [
        "# Command-line flags",
        "",
        "Generated when the site is built, from the config models of the installed plugins and the parser that",
        "`miles train` and `miles config show` use (`tools/docs/gen_cli_reference.py`): this page cannot drift from",
        "the code. Every field has an automatic `--SECTION-FIELD` flag; plugins add named flags, which are aliases of",
        "their field's flag. In a `--config FILE.yaml` the same settings are written `SECTION: {FIELD: VALUE}`.",
        "Flags override the file, which overrides the defaults.",
        "",
    ]
    lines += _command_help()
    for section_name, section_field in model.model_fields.items():
        section = section_field.annotation
        lines += [
            f"## `{section_name}`",
            "",
            f"{(section.__doc__ or '').strip()} Contributed by the plugin `{plugins.get(section_name, '?')}`.",
            "",
            "| flags | type, default | description |",
            "| --- | --- | --- |",
        ]
        for setting in by_section.get(section_name, []):
            lines.append(_row(setting, section, defaults))
        lines.append("")
    return "\n".join(lines)


def _row(setting: Setting, section: type[pydantic.BaseModel], defaults: dict[str, Any]) -> str:
    section_name, field_name, *key = setting.path.split(".")
    field = section.model_fields.get(field_name)
    value = f" {setting.metavar}" if setting.metavar else ""
    flags = "<br>".join(code(f"{flag}{value}") for flag in setting.flags)
    if setting.repeatable:
        flags += " (repeatable)"
    if field is None or key:  # a named flag that sets a key inside a mapping field
        kind = ""
    else:
        limits = bounds(field)
        kind = code(type_name(field.annotation)) + (f" ({limits})" if limits else "")
        kind += f", default {code(json.dumps(defaults[section_name][field_name]))}"
    return f"| {flags} | {cell(kind)} | {cell(setting.help)} |"


def _command_help() -> list[str]:
    """The commands' own options, as ``--help`` prints them (without the config flags)."""
    lines = ["## The commands", ""]
    for argv in COMMAND_HELP:
        parser, _ = build_parser(None, [])
        text = _help_of(parser, argv)
        lines += [f"`miles {' '.join(argv)}`:", "", "```text", text.rstrip(), "```", ""]
    return lines


def _help_of(parser: argparse.ArgumentParser, argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        parser.parse_args(argv)
    return out.getvalue()


def write_page() -> None:
    """Write the page into the site being built (mkdocs-gen-files runs this module during ``mkdocs build``)."""
    import mkdocs_gen_files  # deferred: only the site build has it

    with mkdocs_gen_files.open(PAGE, "w") as out:
        out.write(render(MilesPluginManager.load()))
    mkdocs_gen_files.set_edit_path(PAGE, "tools/docs/gen_cli_reference.py")


if __name__ == "__main__":
    sys.stdout.write(render(MilesPluginManager.load()))
else:  # run by mkdocs-gen-files (as "<run_path>")
    write_page()
