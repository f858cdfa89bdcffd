"""Loading plugins: built-ins, then entry points, then ``MILES_PLUGINS``, then ``--plugin`` arguments.

* Built-in plugins are modules of ``miles_core`` (:data:`BUILTIN_PLUGINS`).
* Entry points of the group ``miles.plugins`` are plugin modules, loaded unless ``MILES_DISABLE_PLUGIN_AUTOLOAD=1``.
  Entry points of the group ``miles.weight_transfer`` name protocol classes; they are listed without importing
  them and fed into the protocol registry. stevedore finds and loads both (:mod:`miles_core.entry_points`).
* ``MILES_PLUGINS=mod1,mod2`` and each ``--plugin MODULE`` or ``--plugin path/to/file.py`` follow, in that order.
* ``--plugin no:NAME`` blocks the plugin registered under ``NAME`` (an entry-point name, a module name, or a
  distribution that only provides ``miles.weight_transfer`` entries). A name that no plugin has is an error, and so
  is ``no:core``: every command needs the core's config sections and registries.

Every import of plugin code and every call of a hook implementation goes through :mod:`miles_core.plugin_guard`,
so whatever a plugin raises (``sys.exit`` and ``KeyboardInterrupt`` included) or returns in the wrong shape is an
error naming the plugin and its distribution. Two plugins under one name are an error too.

``MilesPluginManager.load(keep_going=True)`` (for ``miles plugins``) records a broken entry point in
:attr:`MilesPluginManager.broken` with its error instead of raising, and loads the others; it also checks that the
module of each ``miles.weight_transfer`` entry point can be found, without importing it (protocol code imports torch,
which ``miles plugins`` does not; a run imports a protocol's class when it uses that protocol).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy

from miles_core import entry_points, hook_results, hookspecs
from miles_core.entry_points import PLUGIN_GROUP, WEIGHT_TRANSFER_GROUP, DeclaredEntryPoint
from miles_core.errors import ConfigError, PluginLoadError
from miles_core.plugin_guard import guard_hook_calls, plugin_code
from miles_core.registry import Implementation, Registries
from miles_core.user_files import check_regular_file

AUTOLOAD_ENV = "MILES_DISABLE_PLUGIN_AUTOLOAD"
PLUGINS_ENV = "MILES_PLUGINS"
BUILTIN_PLUGINS: dict[str, str] = {
    "core": "miles_core.builtin.core_plugin",
    "dashboard": "miles_core.builtin.dashboard.plugin:DashboardPlugin",
    "metrics": "miles_core.builtin.metrics.plugin:MetricsPlugin",
    "faults": "miles_core.builtin.fault_injection:FaultInjectionPlugin",
}
"""Built-in plugin name -> module, or ``module:Class`` for a plugin with state (one instance per manager)."""
UNBLOCKABLE = {"core": "every command needs its config sections (run, model, train, ...) and its registries"}
"""Plugins that ``--plugin no:NAME`` cannot block, and why."""
CORE_DISTRIBUTION = "miles-core"
MAX_PLUGIN_FILE_BYTES = 16 << 20
"""A ``--plugin path/to/file.py`` is Python source: a few KiB, rarely more than a few hundred."""


@dataclasses.dataclass(frozen=True)
class PluginInfo:
    """Where a loaded plugin came from."""

    name: str
    source: str  # "builtin", "entry point", "MILES_PLUGINS" or "--plugin"
    distribution: str | None
    version: str | None
    location: str

    @property
    def label(self) -> str:
        """The plugin for messages: ``plugin 'x' (distribution x-dist 1.0, entry point)``."""
        where = [f"distribution {self.distribution} {self.version or '(unknown version)'}"] if self.distribution else []
        return f"plugin {self.name!r} ({', '.join([*where, f'from {self.source}'])})"


@dataclasses.dataclass(frozen=True)
class BrokenPlugin:
    """An entry point that failed to load (recorded by ``MilesPluginManager.load(keep_going=True)``)."""

    name: str
    entry_point: str  # "group: name = value"
    distribution: str | None
    version: str | None
    error: str


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
        self.broken: list[BrokenPlugin] = []
        self._keep_going = False
        self._candidates: set[str] = set()  # every name a plugin goes by, loaded or blocked (for no:NAME checks)
        self._declared: dict[str, list[DeclaredEntryPoint]] = {}  # group -> its entry points, listed once

    @classmethod
    def load(
        cls, plugin_args: Sequence[str] = (), environ: dict[str, str] | None = None, *, keep_going: bool = False
    ) -> MilesPluginManager:
        """Load every plugin in the documented order. ``plugin_args`` are the ``--plugin`` values. With
        ``keep_going``, an entry point that fails to load is recorded in :attr:`broken` and the others load."""
        environ = dict(os.environ if environ is None else environ)
        manager = cls()
        manager._keep_going = keep_going
        manager._block([arg[3:] for arg in plugin_args if arg.startswith("no:")])
        for name, target in BUILTIN_PLUGINS.items():
            info = PluginInfo(name, "builtin", CORE_DISTRIBUTION, entry_points.version_of(CORE_DISTRIBUTION), target)
            with plugin_code(f"built-in {info.label} failed to load", PluginLoadError):
                plugin = _builtin_plugin(target)
            manager._register(plugin, info)
        manager._note_entry_point_names()
        if not _autoload_disabled(environ.get(AUTOLOAD_ENV, "")):
            manager._load_entry_point_plugins()
            manager._register_weight_transfer_entry_points()
        env_modules = [m.strip() for m in environ.get(PLUGINS_ENV, "").split(",") if m.strip()]
        for spec in env_modules:
            manager._load_plugin_spec(spec, source=PLUGINS_ENV)
        for spec in plugin_args:
            if not spec.startswith("no:"):
                manager._load_plugin_spec(spec, source="--plugin")
        manager._check_blocked_names()
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

    # -- blocking -------------------------------------------------------------------------------------------

    def _block(self, names: list[str]) -> None:
        for name in names:
            if not name:
                raise PluginLoadError("--plugin no: needs the name of the plugin to block, like no:example-hooks")
            if name in UNBLOCKABLE:
                raise PluginLoadError(
                    f"--plugin no:{name}: the {name} plugin cannot be blocked: {UNBLOCKABLE[name]}; block the plugin "
                    f"that conflicts with it instead (`miles plugins` lists them)"
                )
            if _is_file_spec(name):
                name = str(Path(name).resolve())  # a file plugin is registered under its absolute path
            self.blocked.add(name)
            self.pm.set_blocked(name)

    def _note_entry_point_names(self) -> None:
        """Entry-point plugins can be blocked also when autoloading is off (blocking them is then a no-op)."""
        self._declared = {group: entry_points.declared(group) for group in (PLUGIN_GROUP, WEIGHT_TRANSFER_GROUP)}
        for ep in self._declared[PLUGIN_GROUP]:
            self._candidates.add(ep.name)
        for ep in self._declared[WEIGHT_TRANSFER_GROUP]:
            self._candidates.update((ep.name, ep.distribution or ep.module))

    def _check_blocked_names(self) -> None:
        """``no:NAME`` for a name that no plugin has blocks nothing: a typo, to be said rather than ignored."""
        unknown = sorted(self.blocked - self._candidates)
        if unknown:
            names = sorted(self._candidates - set(UNBLOCKABLE))
            raise PluginLoadError(
                f"--plugin no:{unknown[0]}: no plugin is named {unknown[0]!r}, so this blocks nothing; "
                f"plugins that can be blocked: {', '.join(names) or '(none)'}"
            )

    # -- loading --------------------------------------------------------------------------------------------

    def _register(self, plugin: Any, info: PluginInfo) -> None:
        """Register ``plugin`` under ``info.name`` with every hook call guarded; a second, different plugin under
        one name is an error naming both."""
        self._candidates.add(info.name)
        if self.pm.is_blocked(info.name):
            return
        existing = self.pm.get_plugin(info.name)
        if existing is plugin or (existing is None and self.pm.is_registered(plugin)):
            return  # the same module named twice (say, by MILES_PLUGINS and --plugin) is loaded once
        if existing is not None:
            raise PluginLoadError(
                f"two plugins are named {info.name!r}: {self.infos[info.name].label}, at "
                f"{self.infos[info.name].location}, and {info.label}, at {info.location}; rename one, or block one "
                "with --plugin no:NAME"
            )
        with plugin_code(f"{info.label} cannot be registered", PluginLoadError):  # pluggy reads its attributes
            try:
                self.pm.register(plugin, name=info.name)
            except pluggy.PluginValidationError as exc:
                raise PluginLoadError(f"{info.label} is invalid: {exc}") from exc
        self.infos[info.name] = info
        guard_hook_calls(self.pm, plugin, label=info.label, check=hook_results.problem_with)

    def _register_module(
        self, module: Any, *, name: str, source: str, declared_by: DeclaredEntryPoint | None = None
    ) -> None:
        if declared_by is not None:
            distribution = declared_by.distribution
        elif _top_level(module) == "miles_core":  # known without reading every distribution's file list
            distribution = CORE_DISTRIBUTION
        else:
            distribution = entry_points.distribution_of(module)
        version = declared_by.version if declared_by is not None else entry_points.version_of(distribution)
        info = PluginInfo(
            name=name,
            source=source,
            distribution=distribution,
            version=version,
            location=str(getattr(module, "__file__", None) or type(module).__module__),
        )
        self._register(module, info)

    @contextlib.contextmanager
    def _unless_broken(self, name: str, entry_point: DeclaredEntryPoint) -> Iterator[None]:
        """Raise a failure to load ``entry_point``; with ``keep_going``, record it in :attr:`broken` instead."""
        try:
            yield
        except PluginLoadError as exc:
            if not self._keep_going:
                raise
            broken = BrokenPlugin(name, entry_point.line, entry_point.distribution, entry_point.version, str(exc))
            self.broken.append(broken)

    def _load_entry_point_plugins(self) -> None:
        for ep in self._declared[PLUGIN_GROUP]:
            if ep.name in self.blocked:
                continue
            with self._unless_broken(ep.name, ep):
                if ep.name in BUILTIN_PLUGINS:
                    raise PluginLoadError(
                        f"{_describe_entry_point(ep)} is named like the built-in plugin {ep.name!r}; rename the "
                        f"entry point (the built-in plugins are {', '.join(BUILTIN_PLUGINS)})"
                    )
                plugin = _load_plugin_entry_point(ep)
                self._register_module(plugin, name=ep.name, source="entry point", declared_by=ep)

    def _register_weight_transfer_entry_points(self) -> None:
        by_distribution: dict[str, list[DeclaredEntryPoint]] = {}
        for ep in self._declared[WEIGHT_TRANSFER_GROUP]:
            if ep.name not in self.blocked and (ep.distribution is None or ep.distribution not in self.blocked):
                by_distribution.setdefault(ep.distribution or ep.module, []).append(ep)
        for dist_name, eps in sorted(by_distribution.items()):
            if self._keep_going:  # `miles plugins`: a protocol whose module is not installed is listed as broken
                eps = [ep for ep in eps if self._protocol_module_found(dist_name, ep)]
                if not eps:
                    continue
            info = PluginInfo(
                name=dist_name,
                source=f"entry point ({WEIGHT_TRANSFER_GROUP})",
                distribution=eps[0].distribution,
                version=eps[0].version,
                location=", ".join(f"{ep.name} = {ep.value}" for ep in eps),
            )
            self._register(EntryPointProtocols(eps), info)

    def _protocol_module_found(self, dist_name: str, entry_point: DeclaredEntryPoint) -> bool:
        with self._unless_broken(dist_name, entry_point):
            with plugin_code(f"{_describe_entry_point(entry_point)} failed to load", PluginLoadError):
                if importlib.util.find_spec(entry_point.module) is None:  # runs the parent packages' __init__ only
                    raise ModuleNotFoundError(f"No module named {entry_point.module!r}")
            return True
        return False

    def _load_plugin_spec(self, spec: str, *, source: str) -> None:
        if _is_file_spec(spec):
            path = Path(spec).resolve()
            self._candidates.add(str(path))
            if self.pm.is_blocked(str(path)) or self.pm.get_plugin(str(path)) is not None:
                return  # blocked, or already loaded: a file is executed once
            self._register_module(_import_file(path, source=source), name=str(path), source=source)
            return
        self._candidates.add(spec)
        if self.pm.is_blocked(spec):
            return
        with plugin_code(f"plugin module {spec!r} (from {source}) failed to import", PluginLoadError):
            module = importlib.import_module(spec)
        self._register_module(module, name=spec, source=source)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _autoload_disabled(value: str) -> bool:
    """``MILES_DISABLE_PLUGIN_AUTOLOAD`` read strictly: a value that is neither true nor false (``"2"``,
    ``"disable"``) is an error rather than a silent "autoload on"."""
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise PluginLoadError(
        f"{AUTOLOAD_ENV}={value[:40]!r} is neither true nor false: set it to 1 (or true, yes, on) to load no "
        "entry-point plugins, or to 0 (false, no, off, empty) to load them"
    )


def _is_file_spec(spec: str) -> bool:
    """``--plugin`` names a file (``plugin.py``, ``dir/plugin.py``) rather than a module."""
    return spec.endswith(".py") or os.sep in spec


def _builtin_plugin(target: str) -> Any:
    """A built-in plugin: the module ``target``, or a new instance of the class ``module:Class``."""
    module_name, _, class_name = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name)() if class_name else module


class EntryPointProtocols:
    """A plugin object that feeds one distribution's ``miles.weight_transfer`` entry points into the protocol
    registry. The classes are imported only when a protocol is used."""

    def __init__(self, declared: Iterable[DeclaredEntryPoint]) -> None:
        self.entry_points = list(declared)

    @hookspecs.hookimpl
    def provide_weight_transfer_protocols(self) -> list[Implementation]:
        return [
            Implementation(
                name=ep.name,
                target=ep.value,
                description=f"entry point {WEIGHT_TRANSFER_GROUP}",
                loader=functools.partial(_load_entry_point, ep),
            )
            for ep in self.entry_points
        ]


def _load_entry_point(entry_point: DeclaredEntryPoint) -> Any:
    """Import what ``entry_point`` names (through stevedore); whatever the import raises is an error naming it and its
    distribution."""
    with plugin_code(f"{_describe_entry_point(entry_point)} failed to load", PluginLoadError):
        return entry_points.load(entry_point)


def _load_plugin_entry_point(entry_point: DeclaredEntryPoint) -> Any:
    """A ``miles.plugins`` entry point's plugin: the module it names, or an instance of the class it names, made
    here without arguments (one per plugin manager: a plugin's state belongs to its manager, not to its module).
    Whatever the import or the constructor raises is an error naming the entry point and its distribution."""
    loaded = _load_entry_point(entry_point)
    if not inspect.isclass(loaded):
        return loaded
    with plugin_code(f"{_describe_entry_point(entry_point)} failed to load", PluginLoadError):
        return loaded()


def _describe_entry_point(entry_point: DeclaredEntryPoint) -> str:
    return f"plugin {entry_point.name!r} ({entry_point.origin}, entry point {entry_point.line})"


def _import_file(path: Path, *, source: str) -> ModuleType:
    if path.is_dir() or not path.exists():
        what = "is a directory, not a .py file" if path.is_dir() else "does not exist"
        raise PluginLoadError(f"plugin file {str(path)!r} (from {source}) {what}")
    try:
        # Within the bound of any user file: a FIFO would hang the import, /dev/zero would never end.
        check_regular_file(
            path,
            what=f"plugin file {str(path)!r} (from {source})",
            expected="a .py file",
            limit=MAX_PLUGIN_FILE_BYTES,
            hint="a plugin file is Python source",
        )
    except ConfigError as exc:
        raise PluginLoadError(str(exc)) from None
    module_name = f"miles_plugin_file_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise PluginLoadError(f"plugin file {str(path)!r} (from {source}) is not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        with plugin_code(f"plugin file {str(path)!r} (from {source}) failed to import", PluginLoadError):
            spec.loader.exec_module(module)
    except PluginLoadError:
        del sys.modules[module_name]
        raise
    return module


def _top_level(module: Any) -> str:
    return getattr(module, "__name__", type(module).__module__).split(".")[0]
