"""The entry points of the project's groups, found and loaded with stevedore.

Two groups: ``miles.plugins`` names plugin modules (or plugin classes), ``miles.weight_transfer`` names protocol
classes by protocol name. stevedore lists a group without importing anything (from its cache of the installed
distributions' entry points, keyed by ``sys.path``) and loads one entry point by name as a driver. What stevedore's
entry points lack is the distribution that declares each; :func:`declared` adds it, with its version, so that every
message about an entry point names both.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from importlib import metadata  # distributions and versions only: stevedore finds and loads the entry points
from typing import Any

import stevedore

PLUGIN_GROUP = "miles.plugins"
WEIGHT_TRANSFER_GROUP = "miles.weight_transfer"


@dataclasses.dataclass(frozen=True)
class DeclaredEntryPoint:
    """One entry point of a group and the distribution that declares it (``None`` when no installed distribution
    does, as for an entry point of a package on ``sys.path`` without metadata)."""

    group: str
    name: str
    value: str
    distribution: str | None
    version: str | None

    @property
    def module(self) -> str:
        return self.value.partition(":")[0].strip()

    @property
    def line(self) -> str:
        """``miles.plugins: name = module:object``, as the distribution declares it."""
        return f"{self.group}: {self.name} = {self.value}"

    @property
    def origin(self) -> str:
        """``distribution NAME VERSION``, or ``from entry point`` when no distribution declares it."""
        if self.distribution is None:
            return "from entry point"
        return f"distribution {self.distribution} {self.version or '(unknown version)'}"


def declared(group: str) -> list[DeclaredEntryPoint]:
    """Every entry point of ``group``, ordered by distribution, then name; nothing is imported."""
    listing = stevedore.NamedExtensionManager(group, names=[], on_missing_entrypoints_callback=None)  # loads none
    found = []
    for ep in listing.list_entry_points():
        dist = _declaring_distribution(ep.group, ep.name, ep.value)
        found.append(
            DeclaredEntryPoint(
                group=ep.group,
                name=ep.name,
                value=ep.value,
                distribution=dist.name if dist is not None else None,
                version=dist.version if dist is not None else None,
            )
        )
    return sorted(found, key=lambda ep: (ep.distribution or "", ep.name, ep.value))


def load(entry_point: DeclaredEntryPoint) -> Any:
    """Import the object ``entry_point`` names, as stevedore's driver of that name; whatever the import raises is
    raised. Another distribution's entry point of the same name (one the user blocked, or a duplicate that the
    registries report) is not this one's concern: its failure is ignored and it is never returned."""

    def failed(_manager: Any, ep: metadata.EntryPoint, exc: BaseException) -> None:
        if ep.value == entry_point.value:
            raise exc

    def this_one(_namespace: str, _name: str, extensions: list[stevedore.extension.Extension]) -> Any:
        return next((ext for ext in extensions if ext.entry_point.value == entry_point.value), extensions[0])

    driver = stevedore.DriverManager(
        entry_point.group,
        entry_point.name,
        on_load_failure_callback=failed,
        on_missing_entrypoints_callback=None,
        conflict_resolver=this_one,
    )
    if driver.extensions[0].entry_point.value != entry_point.value:
        raise LookupError(f"the entry point {entry_point.line} is no longer installed")
    return driver.driver


def _declaring_distribution(group: str, name: str, value: str) -> metadata.Distribution | None:
    """The installed distribution that declares this entry point: first the one named like the entry point's
    top-level package (the usual case, one metadata lookup), else any that ships that package."""
    for candidate in _candidate_distributions(value.partition(":")[0].strip().split(".")[0]):
        try:
            dist = metadata.distribution(candidate)
        except metadata.PackageNotFoundError:
            continue
        if any((ep.group, ep.name, ep.value) == (group, name, value) for ep in dist.entry_points):
            return dist
    return None


def _candidate_distributions(top_level: str) -> Iterator[str]:
    yield top_level
    yield from _packages_distributions().get(top_level, [])


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    """Top-level package -> the distributions that ship it (reads every distribution's file list: about 0.1 s)."""
    return metadata.packages_distributions()


def version_of(distribution: str | None) -> str | None:
    """The installed version of ``distribution``, or ``None``."""
    if distribution is None:
        return None
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def distribution_of(module: Any) -> str | None:
    """The distribution that ships ``module``'s top-level package (for a plugin named by module or file)."""
    top_level = getattr(module, "__name__", type(module).__module__).split(".")[0]
    names = _packages_distributions().get(top_level)
    return names[0] if names else None
