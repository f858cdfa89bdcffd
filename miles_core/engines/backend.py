"""``EngineBackend``: what an engine backend provides, as one type.

An entry of the ``engine_backends`` registry (``provide_engine_backends``; chosen with ``--engine NAME``) names a
class that satisfies :class:`EngineBackend`. The controller loads the configured entry, makes one instance with no
arguments for the run, and asks it for the worker specs of each engine cell (again for a restarted cell) and for the
router in front of the engines, if any. Nothing else decides how engines start: no hook, no check of
``config.engine.backend`` inside a plugin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from miles_core.errors import RegistryError

if TYPE_CHECKING:
    from miles_core.config.build import MilesConfig
    from miles_core.workers.specs import WorkerSpec


@runtime_checkable
class EngineBackend(Protocol):
    """Launches the engines of a run (servers that speak SGLang's HTTP API) and the router in front of them."""

    def engine_specs(self, config: MilesConfig, *, cell_id: str, model_path: str) -> list[WorkerSpec]:
        """The worker specs of the engine cell ``cell_id`` (``"engine-0"``, ...) serving ``model_path`` first;
        usually one ``CommandWorkerSpec`` with ``{host}``/``{port}`` placeholders. A setting that cannot work is a
        ``ConfigError`` raised here, before any engine starts."""
        ...

    def router_spec(self, config: MilesConfig) -> WorkerSpec | None:
        """The worker spec of a router in front of the engines (``register_router`` and ``register_engines`` then
        tell plugins about it), or ``None`` for none: generation goes to the engines directly."""
        ...


def load_engine_backend(registries: Any, name: str) -> EngineBackend:
    """An instance of the engine backend registered as ``name``; a target that is not an :class:`EngineBackend`
    class is a ``RegistryError`` naming it."""
    entry = registries.engine_backends.get_or_raise(name)
    target = entry.load()
    backend = target() if isinstance(target, type) else None
    if not isinstance(backend, EngineBackend):
        raise RegistryError(
            f"engine backend {name!r} ({entry.target}) is {target!r:.80}, not a class with "
            "engine_specs and router_spec (miles_core.EngineBackend)"
        )
    return backend
