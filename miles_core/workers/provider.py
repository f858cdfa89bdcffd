"""The provider interface: start, stop, watch and read the logs of workers, whoever hosts them."""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from miles_core.workers.errors import PortTakenError, WorkerError, WorkerStartError
from miles_core.workers.rpc.client import RpcClient
from miles_core.workers.specs import WorkerSpec


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """A started worker: where it listens and where it runs."""

    name: str
    kind: str  # "python" or "command"
    url: str | None  # RPC URL of a Python worker; http://host:PORT of a command worker's first port
    ports: dict[str, int]
    pid: int | None
    node: str  # node address
    log_file: str
    health_url: str | None = None  # answers 200 while the worker is healthy (a Python worker's needs the token)
    placement: dict[str, Any] = dataclasses.field(default_factory=dict)  # provider-specific (bundle index, ...)

    def describe(self) -> str:
        """``NAME pid N``, where a provider placed it on a node (Ray): ``node ADDRESS (id ABCDEF12) bundle I``, and
        where it serves: ``at URL``."""
        text = f"{self.name} pid {self.pid}"
        if "node_id" in self.placement:
            text += f" node {self.node} (id {self.placement['node_id'][:8]})"
        if "bundle_index" in self.placement:
            text += f" bundle {self.placement['bundle_index']}"
        if self.url:
            text += f" at {self.url}"
        return text


@dataclasses.dataclass(frozen=True)
class SharedPath:
    """A directory that workers on other nodes must see as the driver does (shared storage): the run directory, a
    model directory, a protocol's work directory. ``what`` names it and ``setting`` is where the user sets it."""

    path: str
    what: str
    setting: str
    owned: bool = False  # the run's own (its directory, a protocol's work directory): a check may write a probe there


class BaseWorkerProvider(abc.ABC):
    """Starts workers from specs and supervises them. All methods are safe to call from one event loop."""

    hosts_in_ray: bool = False
    """Whether workers run under Ray actors (what the rdt protocol needs beside each engine)."""

    def __init__(self, *, token: str) -> None:
        self.token = token
        self.workers: dict[str, WorkerInfo] = {}
        self.specs: dict[str, WorkerSpec] = {}
        self.shared_paths: list[SharedPath] = []

    def require_shared(self, path: str | Path, *, what: str, setting: str, owned: bool = False) -> None:
        """Workers this provider starts on another node than the driver's will read ``path``: a provider that places
        workers on other machines checks, before it starts any there, that each such node sees it (one that runs
        every worker on the driver's machine has nothing to check)."""
        shared = SharedPath(str(Path(path).absolute()), what, setting, owned)
        if shared not in self.shared_paths:
            self.shared_paths.append(shared)

    @classmethod
    def for_run(cls, run: Any, *, token: str, run_dir: str | Path) -> BaseWorkerProvider:
        """The provider of a ``miles train`` run, made from the config's ``run`` section; a provider with settings
        there (the Ray provider's ``ray_*``) overrides this to read them."""
        return cls(token=token, run_dir=run_dir)

    @abc.abstractmethod
    async def start(self, spec: WorkerSpec) -> WorkerInfo:
        """Start a worker and return once it is healthy; a failure raises :class:`WorkerStartError` with the
        tail of its log. Names are unique among running workers."""

    @abc.abstractmethod
    async def stop(self, name: str) -> None:
        """Stop a worker and every process it started. Stopping a stopped worker does nothing."""

    @abc.abstractmethod
    async def is_alive(self, name: str) -> bool:
        """Whether the worker's process still runs."""

    @abc.abstractmethod
    def logs(self, name: str, *, tail_bytes: int = 4096) -> str:
        """The tail of the worker's log."""

    @abc.abstractmethod
    async def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send a signal to the worker's main process, bypassing a clean stop (fault injection, tests)."""

    async def restart(self, name: str) -> WorkerInfo:
        """Stop the worker (if it still runs) and start it again from its spec."""
        spec = self.specs[name]
        await self.stop(name)
        return await self.start(spec)

    async def shutdown(self) -> None:
        """Stop every worker."""
        for name in list(self.workers):
            await self.stop(name)

    def client(self, name: str, *, timeout_s: float = 600.0) -> RpcClient:
        """An RPC client for a Python worker, which fails fast once the worker's process is dead."""
        info = self.workers.get(name)
        if info is None or info.kind != "python" or info.url is None:
            raise WorkerError(f"no running Python worker named {name!r}; running: {sorted(self.workers)}")
        return RpcClient(
            info.url, token=self.token, worker=name, timeout_s=timeout_s, liveness=lambda: self.is_alive(name)
        )

    def _check_new(self, spec: WorkerSpec) -> None:
        if spec.name in self.workers:
            raise WorkerError(f"a worker named {spec.name!r} is already running; stop it first")


async def wait_healthy(
    *,
    name: str,
    url: str,
    deadline: float,
    alive: Any,
    describe: Any,
    headers: dict[str, str] | None = None,
    port_taken: Callable[[], bool] | None = None,
) -> None:
    """Poll ``url`` until it answers 200, the process dies (``alive()`` false) or ``deadline`` passes.

    ``describe()`` gives the text (command, log tail) put into the error. When ``port_taken()`` says the worker's
    bind found its port taken, the wait ends at once with :class:`PortTakenError` (the worker may hang rather than
    exit).
    """
    async with httpx.AsyncClient(timeout=5.0, headers=headers) as client:
        while True:
            if not await alive():
                raise WorkerStartError(f"worker {name} exited while starting\n{await describe()}")
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if port_taken is not None and port_taken():
                raise PortTakenError(f"worker {name} found its port taken while starting\n{await describe()}")
            if time.monotonic() > deadline:
                raise WorkerStartError(f"worker {name} did not become healthy at {url} in time\n{await describe()}")
            await asyncio.sleep(0.1)
