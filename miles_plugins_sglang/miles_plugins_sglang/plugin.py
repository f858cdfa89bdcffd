"""The Miles plugin of miles-plugins-sglang: :class:`SglangPlugin`, registered through the entry-point group
``miles.plugins`` (one instance per plugin manager).

Provides the engine backend ``sglang`` (:class:`miles_plugins_sglang.launch.SglangEngineBackend`: servers started
from ``sglang.launch_command``, by default ``python -m sglang.launch_server``, and the sglang-router as a worker in
front of them with ``--sglang-router true``), the ``sglang`` config section, and the router kept in step with the
engines through ``register_router`` and ``register_engines``. Every ``miles`` command imports this module, so it
imports nothing heavy at the top.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles_core import ConfigError, Implementation, hookimpl

if TYPE_CHECKING:
    from miles_core import EngineInfo, RouterInfo
    from miles_plugins_sglang.router import RouterRegistrar


class SglangPlugin:
    """The ``sglang`` engine backend, its config section and the sglang-router; the run's router registrars (by
    router name) live on the instance, so two plugin managers in one process never share a router."""

    def __init__(self) -> None:
        self.routers: dict[str, RouterRegistrar] = {}

    @hookimpl
    def config_sections(self) -> dict[str, type]:
        from miles_plugins_sglang.config import SglangSection  # deferred: pydantic

        return {"sglang": SglangSection}

    @hookimpl
    def provide_engine_backends(self) -> list[Implementation]:
        description = "servers speaking SGLang's HTTP API, from sglang.launch_command"
        return [Implementation("sglang", "miles_plugins_sglang.launch:SglangEngineBackend", description)]

    @hookimpl
    def validate_config(self, config: Any) -> None:
        """Which protocol reaches these engines is the routes' business (``weight_capabilities``); here, only the
        router's own setting."""
        backend = config.engine.backend
        if config.sglang.router and backend != "sglang":
            raise ConfigError(
                f"sglang.router = true needs engine.backend = 'sglang' (--engine sglang), not {backend!r}"
            )

    @hookimpl
    def register_router(self, router: RouterInfo) -> None:
        from miles_plugins_sglang.router import RouterRegistrar

        previous = self.routers.pop(router.name, None)
        if previous is not None:
            previous.close()
        self.routers[router.name] = RouterRegistrar(router.url, admin_key=router.admin_key)

    @hookimpl
    def register_engines(self, engines: list[EngineInfo]) -> None:
        """Route to exactly the running engines (the controller calls this once they serve the current weights)."""
        urls = [url for engine in engines if engine.state == "running" for url in engine.urls]
        for registrar in self.routers.values():
            registrar.sync(urls)
            if not engines:  # the run is stopping: forget the router with its engines
                registrar.close()
        if not engines:
            self.routers.clear()
