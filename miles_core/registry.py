"""Registries of named implementations, merged from every plugin's ``provide_*`` hooks.

An :class:`Implementation` names its code by an import string and is imported only by :meth:`Implementation.load`,
so building the registries (and ``miles plugins``) never imports a heavy backend.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pluggy

from miles_core.errors import RegistryError
from miles_core.plugin_guard import plugin_code

REGISTRY_HOOKS: dict[str, str] = {
    "training_backends": "provide_training_backends",
    "engine_backends": "provide_engine_backends",
    "worker_providers": "provide_worker_providers",
    "weight_transfer_protocols": "provide_weight_transfer_protocols",
    "model_implementations": "provide_model_implementations",
    "reward_functions": "provide_reward_functions",
    "tasks": "provide_tasks",
    "rollout_filters": "provide_rollout_filters",
    "chat_formats": "provide_chat_formats",
    "agents": "provide_agents",
    "advantage_estimators": "provide_advantage_estimators",
    "policy_losses": "provide_policy_losses",
}
"""Registry name -> the hook that fills it."""

ANY_FAMILY = "*"
"""The family of a model implementation that loads every family (``transformers``: whatever transformers loads)."""

# The first-party plugin distribution that provides a well-known name, for "pip install ..." hints.
FIRST_PARTY_PROVIDERS: dict[str, dict[str, str]] = {
    "weight_transfer_protocols": {"rdt": "miles-plugins-rdt"},
    "training_backends": {"megatron": "miles-plugins-megatron"},
    "engine_backends": {"sglang": "miles-plugins-sglang"},
}


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One named implementation in a registry.

    ``target`` is ``"package.module:attribute"`` (imported lazily by :meth:`load`) or the object itself.
    ``provider`` is the name of the plugin that registered it; the core fills it in.
    ``loader``, when set, replaces the import (the core uses it to load entry points under the plugin guard, which
    names the entry point and its distribution on failure).
    """

    name: str
    target: str | Any
    description: str = ""
    provider: str = ""
    loader: Callable[[], Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    def load(self) -> Any:
        """Import and return the implementation; an import failure names the implementation and its provider."""
        if self.loader is not None:
            return self.loader()
        if not isinstance(self.target, str):
            return self.target
        module_name, _, attribute = self.target.partition(":")
        # Importing runs the plugin's code: whatever it raises is named like a failing hook.
        with plugin_code(
            f"cannot load {self.name!r} (target {self.target!r}, from plugin {self.provider!r})", RegistryError
        ):
            obj: Any = importlib.import_module(module_name)
            for part in filter(None, attribute.split(".")):
                obj = getattr(obj, part)
        return obj

    @property
    def target_text(self) -> str:
        """The target as text, for listings."""
        if isinstance(self.target, str):
            return self.target
        return f"{getattr(self.target, '__module__', '?')}:{getattr(self.target, '__qualname__', repr(self.target))}"


def model_implementation(family: str, impl: str, target: str | Any, description: str = "") -> Implementation:
    """An entry of the model-implementation registry, named ``"FAMILY/IMPL"``; ``family`` :data:`ANY_FAMILY`
    (``"*"``) provides ``IMPL`` for every family that has no implementation of that name of its own."""
    return Implementation(name=f"{family}/{impl}", target=target, description=description)


def find_model_implementation(registry: Mapping[str, Implementation], family: str, impl: str) -> Implementation | None:
    """The entry ``FAMILY/IMPL``, else ``*/IMPL`` (an implementation of every family), else ``None``."""
    return registry.get(f"{family}/{impl}") or registry.get(f"{ANY_FAMILY}/{impl}")


class Registry(Mapping[str, Implementation]):
    """One merged registry: a read-only mapping from name to :class:`Implementation`."""

    def __init__(self, kind: str, entries: Mapping[str, Implementation]) -> None:
        self.kind = kind
        self._entries = dict(sorted(entries.items()))

    def __getitem__(self, name: str) -> Implementation:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def get_or_raise(self, name: str) -> Implementation:
        """The entry called ``name``, or a :class:`RegistryError` that lists the available names."""
        if name in self._entries:
            return self._entries[name]
        raise RegistryError(unknown_name_message(self.kind, name, list(self._entries)))


def unknown_name_message(kind: str, name: str, available: list[str]) -> str:
    """Explain that ``name`` is not in the registry ``kind``: list what is there and, for a first-party name,
    which distribution provides it."""
    label = kind.replace("_", " ")
    singular = label[:-2] if label.endswith("sses") else label.rstrip("s")  # policy losses, advantage estimators
    message = f"unknown {singular} {name!r}; available: {', '.join(available) or '(none installed)'}"
    close = difflib.get_close_matches(name, available, n=3, cutoff=0.5)
    if close:
        message += f" (closest: {', '.join(close)})"
    distribution = FIRST_PARTY_PROVIDERS.get(kind, {}).get(name)
    if distribution is not None:
        if _is_installed(distribution):
            message += f" ({distribution} is installed but provides no {name!r} here: an older version, or blocked)"
        else:
            message += f"; {name!r} is provided by {distribution}: pip install {distribution}"
    return message


def _is_installed(distribution: str) -> bool:
    from importlib import metadata  # deferred: only needed for this hint

    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


class Registries:
    """All registries, built once from a plugin manager's hooks; each is an attribute (``registries.tasks``)."""

    training_backends: Registry
    engine_backends: Registry
    worker_providers: Registry
    weight_transfer_protocols: Registry
    model_implementations: Registry
    reward_functions: Registry
    tasks: Registry
    rollout_filters: Registry
    chat_formats: Registry
    agents: Registry
    advantage_estimators: Registry
    policy_losses: Registry

    def __init__(self, registries: Mapping[str, Registry]) -> None:
        if set(registries) != set(REGISTRY_HOOKS):
            raise ValueError(f"registries {sorted(registries)} are not the kinds {sorted(REGISTRY_HOOKS)}")
        self._registries = dict(registries)
        for kind, registry in registries.items():
            setattr(self, kind, registry)

    def items(self) -> Iterator[tuple[str, Registry]]:
        """``(kind, registry)`` for every registry, in :data:`REGISTRY_HOOKS` order."""
        return iter(self._registries.items())

    @classmethod
    def collect(cls, pm: pluggy.PluginManager) -> Registries:
        """Call every registry hook of every plugin and merge the results; a duplicate name is an error naming
        both plugins."""
        return cls({kind: Registry(kind, _collect_one(pm, kind, hook)) for kind, hook in REGISTRY_HOOKS.items()})

    def provided_by(self, plugin_name: str) -> dict[str, list[str]]:
        """The names a plugin provides, per registry (registries it provides nothing to are left out)."""
        provided: dict[str, list[str]] = {}
        for kind, registry in self._registries.items():
            names = [name for name, entry in registry.items() if entry.provider == plugin_name]
            if names:
                provided[kind] = names
        return provided


def _collect_one(pm: pluggy.PluginManager, kind: str, hook_name: str) -> dict[str, Implementation]:
    merged: dict[str, Implementation] = {}
    for plugin_name, entries in call_each_plugin(pm, hook_name):
        for entry in entries or []:
            if not isinstance(entry, Implementation):
                raise RegistryError(
                    f"plugin {plugin_name!r} returned {entry!r} from {hook_name}; expected miles_core.Implementation"
                )
            entry = dataclasses.replace(entry, provider=entry.provider or plugin_name)
            if entry.name in merged:
                raise RegistryError(
                    f"{kind.replace('_', ' ')}: {entry.name!r} is provided twice, by plugin "
                    f"{merged[entry.name].provider!r} and by plugin {entry.provider!r}; "
                    f"block one with --plugin no:NAME or uninstall it"
                )
            merged[entry.name] = entry
    if kind == "model_implementations":
        _check_any_family_names(merged)
    return merged


def _check_any_family_names(merged: dict[str, Implementation]) -> None:
    """``FAMILY/IMPL`` next to another plugin's ``*/IMPL`` would silently take that family from it: a duplicate."""
    for name, entry in merged.items():
        family, _, impl = name.partition("/")
        other = merged.get(f"{ANY_FAMILY}/{impl}")
        if family != ANY_FAMILY and other is not None and other.provider != entry.provider:
            raise RegistryError(
                f"model implementations: {impl!r} is provided twice for family {family!r}, by plugin "
                f"{other.provider!r} ({other.name!r}, every family) and by plugin {entry.provider!r} ({name!r}); "
                f"name the implementation differently, or block one with --plugin no:NAME"
            )


def call_each_plugin(pm: pluggy.PluginManager, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
    """Call one hook plugin by plugin (registration order), returning ``(plugin name, result)`` pairs, so that
    results can be attributed to the plugin that produced them."""
    caller = getattr(pm.hook, hook_name)
    results = []
    for impl in caller.get_hookimpls():  # registration order (pluggy calls them in reverse)
        args = {name: kwargs[name] for name in impl.argnames}
        results.append((pm.get_name(impl.plugin) or impl.plugin_name, impl.function(**args)))
    return results
