"""What each hook may return (as documented in :mod:`miles_core.hookspecs`), checked on every call.

:func:`problem_with` is the check that :func:`miles_core.plugin_guard.guard_hook_calls` applies to each result, so a
plugin that returns the wrong shape is named right there instead of failing later, somewhere in the core.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from miles_core.config.flags import ConfigFlag
from miles_core.registry import ANY_FAMILY, REGISTRY_HOOKS, Implementation

_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_TARGET = re.compile(rf"^{_DOTTED}(?::{_DOTTED})?$")
_NAME = re.compile(r"^[^\s/]+$")
_MODEL_NAME = re.compile(rf"^(?:[a-z0-9_]+|{re.escape(ANY_FAMILY)})/[^\s/]+$")
_SECTION = re.compile(r"^[a-z][a-z0-9_]*$")
_FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*$")
_CONFIG_PATH = re.compile(r"^[a-z][a-z0-9_]*(?:\.[A-Za-z0-9_]+)+$")
# The options of the command itself (cli/main.py, cli/config_args.py): a config flag named so would clash with
# argparse, or (--plugin, taken out of the command line first) never receive its value.
COMMAND_FLAGS = frozenset({"--plugin", "--config", "--help", "--json", "--no-progress"})


def problem_with(hook: str, result: Any) -> str | None:
    """What is wrong with ``result`` as a return value of ``hook`` (``None``: nothing)."""
    check = _CHECKS.get(hook)
    return None if check is None else check(result)


def shown(value: Any) -> str:
    """``value`` for a message: its repr (shortened) and its type."""
    text = repr(value)
    return f"{text[:77]}... ({type(value).__name__})" if len(text) > 80 else f"{text} ({type(value).__name__})"


def _registry_entries(model_names: bool) -> Callable[[Any], str | None]:
    def check(result: Any) -> str | None:
        if result is None:
            return None
        if not isinstance(result, list | tuple):
            return f"{shown(result)}; expected a list of miles_core.Implementation, or None"
        for entry in result:
            if not isinstance(entry, Implementation):
                return f"{shown(entry)} in its list; expected miles_core.Implementation entries"
            problem = implementation_problem(entry, model_name=model_names)
            if problem is not None:
                return f"the entry {entry.name!r} with {problem}"
        return None

    return check


def implementation_problem(entry: Implementation, *, model_name: bool = False) -> str | None:
    """What is malformed in a registry entry: its name, target, description or loader."""
    if not isinstance(entry.name, str) or not (_MODEL_NAME if model_name else _NAME).match(entry.name):
        allowed = (
            "'FAMILY/IMPL' (build it with miles_core.model_implementation)"
            if model_name
            else "text without spaces or '/'"
        )
        return f"a malformed name (allowed: {allowed})"
    if isinstance(entry.target, str) and not _TARGET.match(entry.target):
        return f"target {entry.target!r} (allowed: 'package.module:attribute' or the object itself)"
    if entry.target is None:
        return "target None (allowed: 'package.module:attribute' or the object itself)"
    if not isinstance(entry.description, str) or not isinstance(entry.provider, str):
        return "a description or provider that is not text"
    if entry.loader is not None and not callable(entry.loader):
        return f"loader {shown(entry.loader)}, which is not callable"
    return None


def _config_sections(result: Any) -> str | None:
    if result is None:
        return None
    if not isinstance(result, dict):
        return f"{shown(result)}; expected {{section_name: Section subclass}} or None"
    from miles_core.config.section import Section  # deferred: pydantic; this hook runs only when a config is built

    for name, model in result.items():
        if not isinstance(name, str) or not _SECTION.match(name):
            return f"the section name {shown(name)}; allowed: lowercase letters, digits and '_', starting with a letter"
        if not (isinstance(model, type) and issubclass(model, Section)):
            return f"the section {name!r} as {shown(model)}; expected a subclass of miles_core.config.Section"
    return None


def _config_flags(result: Any) -> str | None:
    if result is None:
        return None
    if not isinstance(result, list | tuple):
        return f"{shown(result)}; expected a list of miles_core.config.ConfigFlag, or None"
    for flag in result:
        if not isinstance(flag, ConfigFlag):
            return f"{shown(flag)} in its list; expected miles_core.config.ConfigFlag entries"
        problem = config_flag_problem(flag)
        if problem is not None:
            return f"the flag {flag.flag!r} with {problem}"
    return None


def config_flag_problem(flag: ConfigFlag) -> str | None:
    """What is malformed in a :class:`ConfigFlag`."""
    if not isinstance(flag.flag, str) or not _FLAG.match(flag.flag):
        return "a malformed flag (allowed: '--' then lowercase letters, digits and '-', like '--my-flag')"
    if flag.flag in COMMAND_FLAGS:
        return f"a flag of the miles command itself (taken: {', '.join(sorted(COMMAND_FLAGS))})"
    if not isinstance(flag.path, str) or not _CONFIG_PATH.match(flag.path):
        return f"path {flag.path!r} (allowed: a dotted config path 'section.field', like 'rollout.batch_size')"
    if not isinstance(flag.help, str) or not (flag.metavar is None or isinstance(flag.metavar, str)):
        return "a help or metavar that is not text"
    if not isinstance(flag.mapping, bool):
        return f"mapping = {flag.mapping!r} (allowed: True or False)"
    if flag.const is not None and not isinstance(flag.const, str):
        return f"const = {flag.const!r} (allowed: text or None)"
    if flag.mapping and flag.const is not None:
        return "both mapping=True and a const (a KEY=VALUE flag always takes a value)"
    return None


def _none(hook: str, what: str) -> Callable[[Any], str | None]:
    def check(result: Any) -> str | None:
        return None if result is None else f"{shown(result)}; {hook} returns None ({what})"

    return check


def _list_or_none(result: Any) -> str | None:
    return None if result is None or isinstance(result, list) else f"{shown(result)}; expected a list or None"


def _context_manager_or_none(result: Any) -> str | None:
    if result is None or (hasattr(result, "__enter__") and hasattr(result, "__exit__")):
        return None
    return f"{shown(result)}; expected a context manager or None"


_CHECKS: dict[str, Callable[[Any], str | None]] = {
    **{hook: _registry_entries(model_names=kind == "model_implementations") for kind, hook in REGISTRY_HOOKS.items()},
    "config_sections": _config_sections,
    "config_flags": _config_flags,
    "validate_config": _none("validate_config", "it raises miles_core.ConfigError to refuse a config"),
    "weight_update_wrapper": _context_manager_or_none,
}
