"""Typed client handles: ``await handle.update_weights(version=3)``, checked against the worker's real signature
and type hints before it is sent, its result rebuilt as the method's return type. Arguments and results are encoded
alike (dataclasses and pydantic models as JSON objects) and rebuilt from the type hints on the other side."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from miles_core.workers.rpc.arguments import ArgumentCheck
from miles_core.workers.rpc.client import RpcClient
from miles_core.workers.rpc.server import rpc_methods_of


class WorkerHandle:
    """Calls a worker's methods through an :class:`RpcClient`, checking the arguments against the signature and
    type hints of ``interface`` first (the same strict check the worker's server runs), so a wrong call fails here
    with a ``TypeError`` (an :class:`~miles_core.workers.rpc.arguments.ArgumentError`) and is never sent.

    ``interface`` is the worker class (its :func:`~miles_core.workers.rpc.server.rpc_method` methods are exposed) or
    a ``typing.Protocol`` describing it (all its public methods are exposed).
    """

    def __init__(self, client: RpcClient, interface: type) -> None:
        self._client = client
        self._interface = interface
        marked = rpc_methods_of(interface)
        self._methods: dict[str, ArgumentCheck] = {
            name: ArgumentCheck(f"{interface.__name__}.{name}", fn, skip_self=True)
            for name, fn in (marked or _public_methods(interface)).items()
        }

    @property
    def client(self) -> RpcClient:
        return self._client

    def __getattr__(self, name: str) -> Callable[..., Any]:
        check = self.__dict__.get("_methods", {}).get(name)
        if check is None:
            raise AttributeError(
                f"{self._interface.__name__} has no RPC method {name!r}; methods: {sorted(self._methods)}"
            )
        return functools.partial(self._invoke, name, check)

    async def _invoke(self, name: str, check: ArgumentCheck, *args: Any, **kwargs: Any) -> Any:
        timeout_s = kwargs.pop("rpc_timeout_s", None)
        check.bind(args, kwargs)  # the values are sent in their JSON form: the worker validates them again
        return check.result(await self._client.call(name, *args, timeout_s=timeout_s, **kwargs))

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._methods))


def _public_methods(interface: type) -> dict[str, Callable]:
    return {name: fn for name, fn in inspect.getmembers(interface, inspect.isfunction) if not name.startswith("_")}
