"""Loading plugins: built-ins, then entry points, then ``MILES_PLUGINS``, then ``--plugin`` arguments.

* Built-in plugins are modules of ``miles_core`` (:data:`BUILTIN_PLUGINS`).
* Entry points of the group ``miles.plugins`` are plugin modules, loaded through stevedore unless
  ``MILES_DISABLE_PLUGIN_AUTOLOAD=1``. Entry points of the group ``miles.weight_transfer`` name protocol classes;
  they are listed without importing them and fed into the protocol registry.
* ``MILES_PLUGINS=mod1,mod2`` and each ``--plugin MODULE`` or ``--plugin path/to/file.py`` follow, in that order.
* ``--plugin no:NAME`` blocks the plugin registered under ``NAME`` (an entry-point name, a module name, or a
  distribution that only provides ``miles.weight_transfer`` entries).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy
import stevedore

from miles_core import hookspecs
from miles_core.errors import PluginLoadError
from miles_core.registry import Implementation, Registries

PLUGIN_GROUP = "miles.plugins"
WEIGHT_TRANSFER_GROUP = "miles.weight_transfer"
AUTOLOAD_ENV = "MILES_DISABLE_PLUGIN_AUTOLOAD"
PLUGINS_ENV = "MILES_PLUGINS"
BUILTIN_PLUGINS: dict[str, str] = {
    "core": "miles_core.builtin.core_plugin",
    "dashboard": "miles_core.dashboard.plugin:DashboardPlugin",
}
"""Built-in plugin name -> module, or ``module:Class`` for a plugin with state (one instance per manager)."""
CORE_DISTRIBUTION = "miles-core"


@dataclasses.dataclass(frozen=True)
class PluginInfo:
    """Where a loaded plugin came from."""

    name: str
    source: str  # "builtin", "entry point", "MILES_PLUGINS" or "--plugin"
    distribution: str | None
    version: str | None
    location: str


class MilesPluginManager:
    """A pluggy plugin manager for the project ``miles`` that knows where each plugin came from.

    Build one with :meth:`load`; read hooks through :attr:`hook` and the merged registries through
    :attr:`registries`.
    """

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.blocked: set[str] = set()

    @classmethod
    def load(cls, plugin_args: Sequence[str] = (), environ: dict[str, str] | None = None) -> MilesPluginManager:
        """Load every plugin in the documented order. ``plugin_args`` are the ``--plugin`` values."""
        environ = dict(os.environ if environ is None else environ)
        manager = cls()
        manager.blocked = {arg[3:] for arg in plugin_args if arg.startswith("no:")}
        for name in manager.blocked:
            manager.pm.set_blocked(name)
        for name, target in BUILTIN_PLUGINS.items():
            manager._register_module(_builtin_plugin(target), name=name, source="builtin")
        if environ.get(AUTOLOAD_ENV, "") not in ("1", "true", "yes"):
            manager._load_entry_point_plugins()
            manager._register_weight_transfer_entry_points()
        env_modules = [m.strip() for m in environ.get(PLUGINS_ENV, "").split(",") if m.strip()]
        for spec in env_modules:
            manager._load_plugin_spec(spec, source=PLUGINS_ENV)
        for spec in plugin_args:
            if not spec.startswith("no:"):
                manager._load_plugin_spec(spec, source="--plugin")
        manager._check_unknown_hooks()
        return manager

    @property
    def hook(self) -> Any:
        """The pluggy hook relay: ``manager.hook.prepare_rollout(...)``."""
        return self.pm.hook

    @functools.cached_property
    def registries(self) -> Registries:
        """Every registry, merged from all plugins (computed once, on first use)."""
        return Registries.collect(self.pm)

    def hooks_of(self, name: str) -> list[str]:
        """The hooks that the plugin registered under ``name`` implements."""
        plugin = self.pm.get_plugin(name)
        if plugin is None:
            return []
        return sorted(caller.name for caller in self.pm.get_hookcallers(plugin) or [])

    def _check_unknown_hooks(self) -> None:
        """A hook implementation without a spec is almost always a typo: fail, suggesting the closest hook."""
        known = [name for name in dir(hookspecs) if getattr(getattr(hookspecs, name), "miles_spec", None)]
        for caller in self.pm.hook.__dict__.values():
            if not isinstance(caller, pluggy.HookCaller) or caller.spec is not None:
                continue
            for impl in caller.get_hookimpls():
                name = self.pm.get_name(impl.plugin)
                close = difflib.get_close_matches(caller.name, known, n=1)
                raise PluginLoadError(
                    f"plugin {name!r} ({self.infos[name].source}) implements {caller.name!r}, which is not a miles "
                    f"hook{f'; did you mean {close[0]!r}?' if close else ''} (the hooks are in miles_core.hookspecs)"
                )

    # -- loading --------------------------------------------------------------------------------------------

    def _register_module(self, module: Any, *, name: str, source: str, dist: Any = None) -> None:
        if self.pm.is_blocked(name):
            return
        if self.pm.get_plugin(name) is not None:
            return  # the same module named twice (say, by MILES_PLUGINS and --plugin) is loaded once
        try:
            self.pm.register(module, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginLoadError(f"plugin {name!r} ({_describe_source(source, dist)}) is invalid: {exc}") from exc
        self.infos[name] = PluginInfo(
            name=name,
            source=source,
            distribution=dist.name if dist is not None else _distribution_of(module),
            version=dist.version if dist is not None else _version_of(_distribution_of(module)),
            location=str(getattr(module, "__file__", None) or type(module).__module__),
        )

    def _load_entry_point_plugins(self) -> None:
        entry_points = sorted(
            (ep for ep in metadata.entry_points(group=PLUGIN_GROUP) if ep.name not in self.blocked),
            key=lambda ep: (ep.dist.name if ep.dist else "", ep.name),
        )
        if not entry_points:
            return
        extensions = stevedore.NamedExtensionManager(
            namespace=PLUGIN_GROUP,
            names=[ep.name for ep in entry_points],
            name_order=True,
            on_load_failure_callback=_raise_load_failure,
            on_missing_entrypoints_callback=None,
        )
        for extension in extensions:
            self._register_module(
                extension.plugin,
                name=extension.name,
                source="entry point",
                dist=_distribution_of_entry_point(extension.entry_point),
            )

    def _register_weight_transfer_entry_points(self) -> None:
        entry_points = [
            ep
            for ep in metadata.entry_points(group=WEIGHT_TRANSFER_GROUP)
            if ep.name not in self.blocked and (ep.dist is None or ep.dist.name not in self.blocked)
        ]
        by_distribution: dict[str, list[metadata.EntryPoint]] = {}
        for ep in entry_points:
            by_distribution.setdefault(ep.dist.name if ep.dist else ep.module, []).append(ep)
        for dist_name, eps in sorted(by_distribution.items()):
            plugin = EntryPointProtocols(eps)
            self.pm.register(plugin, name=dist_name)
            dist = eps[0].dist
            self.infos[dist_name] = PluginInfo(
                name=dist_name,
                source=f"entry point ({WEIGHT_TRANSFER_GROUP})",
                distribution=dist.name if dist else None,
                version=dist.version if dist else None,
                location=", ".join(f"{ep.name} = {ep.value}" for ep in eps),
            )

    def _load_plugin_spec(self, spec: str, *, source: str) -> None:
        if spec.endswith(".py") or os.sep in spec:
            path = Path(spec).resolve()
            if self.pm.is_blocked(str(path)):
                return
            self._register_module(_import_file(path, source=source), name=str(path), source=source)
            return
        if self.pm.is_blocked(spec):
            return
        try:
            module = importlib.import_module(spec)
        except Exception as exc:
            raise PluginLoadError(
                f"plugin module {spec!r} (from {source}) failed to import: {type(exc).__name__}: {exc}"
            ) from exc
        self._register_module(module, name=spec, source=source)


def _builtin_plugin(target: str) -> Any:
    """A built-in plugin: the module ``target``, or a new instance of the class ``module:Class``."""
    module_name, _, class_name = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name)() if class_name else module


class EntryPointProtocols:
    """A plugin object that feeds one distribution's ``miles.weight_transfer`` entry points into the protocol
    registry. The classes are imported, through stevedore, only when a protocol is used."""

    def __init__(self, entry_points: Iterable[metadata.EntryPoint]) -> None:
        self.entry_points = list(entry_points)

    @hookspecs.hookimpl
    def provide_weight_transfer_protocols(self) -> list[Implementation]:
        return [
            Implementation(
                name=ep.name,
                target=ep.value,
                description=f"entry point {WEIGHT_TRANSFER_GROUP}",
                loader=functools.partial(_load_weight_transfer_entry_point, ep.name),
            )
            for ep in self.entry_points
        ]


def _load_weight_transfer_entry_point(name: str) -> Any:
    manager = stevedore.DriverManager(
        namespace=WEIGHT_TRANSFER_GROUP, name=name, on_load_failure_callback=_raise_load_failure
    )
    return manager.driver


def _raise_load_failure(_manager: Any, entry_point: metadata.EntryPoint, exc: BaseException) -> None:
    raise PluginLoadError(
        f"plugin {entry_point.name!r} ({_describe_source('entry point', _distribution_of_entry_point(entry_point))}, "
        f"entry point {entry_point.group}: {entry_point.name} = {entry_point.value}) failed to load: "
        f"{type(exc).__name__}: {exc}"
    ) from exc


def _distribution_of_entry_point(entry_point: metadata.EntryPoint) -> Any:
    """The distribution that declares ``entry_point`` (stevedore's cached entry points do not carry it)."""
    if entry_point.dist is not None:
        return entry_point.dist
    for candidate in metadata.entry_points(group=entry_point.group, name=entry_point.name):
        if candidate.value == entry_point.value:
            return candidate.dist
    return None


def _describe_source(source: str, dist: Any) -> str:
    if dist is None:
        return f"from {source}"
    return f"distribution {dist.name} {dist.version}"


def _import_file(path: Path, *, source: str) -> ModuleType:
    if not path.is_file():
        raise PluginLoadError(f"plugin file {str(path)!r} (from {source}) does not exist")
    module_name = f"miles_plugin_file_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise PluginLoadError(f"plugin file {str(path)!r} (from {source}) is not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise PluginLoadError(
            f"plugin file {str(path)!r} (from {source}) failed to import: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _distribution_of(module: Any) -> str | None:
    top_level = getattr(module, "__name__", type(module).__module__).split(".")[0]
    if top_level == "miles_core":
        return CORE_DISTRIBUTION
    names = _packages_distributions().get(top_level)
    return names[0] if names else None


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def _version_of(distribution: str | None) -> str | None:
    if distribution is None:
        return None
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
