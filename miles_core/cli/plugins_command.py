"""``miles plugins`` and ``miles version``."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from miles_core import __version__
from miles_core.errors import PluginLoadError
from miles_core.plugin_manager import MilesPluginManager
from miles_core.registry import ANY_FAMILY, Registries


def describe_plugins(manager: MilesPluginManager) -> list[dict[str, Any]]:
    """Per plugin: name, source, distribution, version, location, hooks implemented and names provided."""
    registries = manager.registries
    return [
        {
            "name": info.name,
            "source": info.source,
            "distribution": info.distribution,
            "version": info.version,
            "location": info.location,
            "hooks": manager.hooks_of(info.name),
            "provides": registries.provided_by(info.name),
        }
        for info in manager.infos.values()
    ]


def list_plugins(plugin_args: list[str], *, as_json: bool) -> int:
    """Print the loaded plugins as a table, or as JSON. A broken entry point does not hide the others: it is listed
    as broken, with its error, and the command then fails naming it."""
    manager = MilesPluginManager.load(plugin_args, keep_going=True)
    plugins = describe_plugins(manager)
    broken = [dataclasses.asdict(b) for b in manager.broken]
    if as_json:
        print(json.dumps({"plugins": plugins, "blocked": sorted(manager.blocked), "broken": broken}, indent=2))
    else:
        rows = [
            (
                p["name"],
                f"{p['distribution'] or '-'} {p['version'] or ''}".strip(),
                p["source"],
                _provides_text(manager.registries, p["provides"]),
                ", ".join(p["hooks"]) or "-",
            )
            for p in plugins
        ]
        rows += [
            (
                b["name"],
                f"{b['distribution'] or '-'} {b['version'] or ''}".strip(),
                "entry point",
                "BROKEN (below)",
                "-",
            )
            for b in broken
        ]
        print(_table(("PLUGIN", "DISTRIBUTION", "SOURCE", "PROVIDES", "HOOKS"), rows))
        if manager.blocked:
            print(f"\nblocked: {', '.join(sorted(manager.blocked))}")
        for b in broken:
            print(f"\nbroken: {b['error']}")  # the error names the plugin, its distribution and its entry point
    if manager.broken:
        count = f"{len(manager.broken)} entry point{'s' if len(manager.broken) > 1 else ''}"
        raise PluginLoadError(  # one error a line: each names its plugin, distribution and entry point
            f"{count} failed to load (listed as broken; the other plugins are loaded); fix or uninstall the "
            "distribution, or block it with --plugin no:NAME:\n" + "\n".join(f"  {b.error}" for b in manager.broken)
        )
    return 0


def _provides_text(registries: Registries, provides: dict[str, list[str]]) -> str:
    """The PROVIDES cell; a model implementation of every family (``*/IMPL``) shows as ``IMPL: what it loads``."""
    prefix = f"{ANY_FAMILY}/"

    def shown(kind: str, name: str) -> str:
        if kind != "model_implementations" or not name.startswith(prefix):
            return name
        return f"{name.removeprefix(prefix)}: {registries.model_implementations[name].description or 'any family'}"

    return "; ".join(f"{kind}: {', '.join(shown(kind, n) for n in names)}" for kind, names in provides.items()) or "-"


def print_versions(plugin_args: list[str]) -> int:
    """Print the core version and the version of every distribution that provides a plugin."""
    manager = MilesPluginManager.load(plugin_args)
    print(f"miles-core {__version__}")
    seen = {"miles-core"}
    for info in manager.infos.values():
        if info.distribution and info.distribution not in seen:
            seen.add(info.distribution)
            print(f"{info.distribution} {info.version or '(unknown version)'}")
    return 0


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    return "\n".join(lines)
