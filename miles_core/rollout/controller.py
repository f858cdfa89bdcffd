"""``InferenceController``: the engines of a run as infrastructure: cells, health, pause/continue, weight updates.

Engines start from the worker specs of the run's engine backend (:class:`EngineBackend`) through the worker
provider, in cells
``engine-0``, ``engine-1``, ... A health monitor restarts a failed engine and brings it to the current weights.
A weight update pauses generation, moves every bucket through the protocol, publishes the version, optionally
checks checksums, and resumes; an engine that fails half-way is re-synced (or restarted), so no engine ever
serves a mix of versions. An update reads the trainer's weights once: the buckets the protocol sends are copied to
CPU on their way (:class:`RecordedWeights`), and the checksum and a restarted engine's weights come from that copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import torch

from miles_core.engines.backend import EngineBackend
from miles_core.engines.client import EngineClient, EngineError
from miles_core.errors import MilesError
from miles_core.events import EngineInfo, EngineWorker, RouterInfo
from miles_core.progress import notice
from miles_core.training.weight_iterator import bucketize
from miles_core.weight_transfer.adapters import PROTOCOL_NAME as ADAPTER_PROTOCOL
from miles_core.weight_transfer.adapters import PublishedAdapter, adapter_name, load_on_engine
from miles_core.weight_transfer.digests import checksum
from miles_core.weight_transfer.holders import WeightHolders
from miles_core.weight_transfer.protocol import (
    EngineEndpoint,
    SendsFromHolders,
    TransferReport,
    WeightTransferProtocol,
)
from miles_core.weight_transfer.routes import CHECKSUM, capabilities_of
from miles_core.workers.cells import Cell, CellManager
from miles_core.workers.health import HealthMonitor
from miles_core.workers.provider import BaseWorkerProvider, WorkerInfo
from miles_core.workers.specs import ENGINE, ROUTER, CommandWorkerSpec, PythonWorkerSpec, WorkerSpec, with_role

if TYPE_CHECKING:
    from miles_core.config.build import MilesConfig

WeightSource = Callable[[], Iterable[list]]
"""Returns a fresh iterator of weight buckets (``HfWeightIterator``) each time it is called."""
NamedTensors = list[tuple[str, torch.Tensor]]
T = TypeVar("T")
WORKER_SPECS = (CommandWorkerSpec, PythonWorkerSpec)


class RecordedWeights:
    """One pass over a source's weight buckets, as the protocol consumes them: each bucket is yielded unchanged after
    its tensors are copied to CPU (:attr:`copy`). ``complete`` once the protocol has taken every bucket."""

    def __init__(self, buckets: Iterable[list]) -> None:
        self._buckets = buckets
        self.copy: NamedTensors = []
        self.complete = False

    def __iter__(self) -> Iterator[list]:
        for bucket in self._buckets:
            self.copy.extend((name, tensor.detach().to("cpu", copy=True)) for name, tensor in bucket)
            yield bucket
        self.complete = True


class InferenceController:
    def __init__(
        self,
        *,
        config: MilesConfig,
        hooks: Any,
        provider: BaseWorkerProvider,
        protocol: WeightTransferProtocol,
        backend: EngineBackend,
        model_path: str,
    ) -> None:
        self.config = config
        self.backend = backend
        self.capabilities = capabilities_of(backend, config)  # the weight routes every engine serves
        self.hooks = hooks
        self.provider = provider
        self.protocol = protocol
        self.model_path = model_path
        self.cells = CellManager(provider)
        self.monitor = HealthMonitor(
            self.cells,
            interval_s=config.engine.health_check_interval_s,
            timeout_s=config.engine.health_check_timeout_s,
            failures_to_restart=config.engine.health_check_failures,
            on_recovered=[self._bring_back],
        )
        self.version = 0
        self.published: NamedTensors = []  # a CPU copy of the last published weights, for restarted engines
        self.published_by_holders = False  # the last version was sent by the trainer's holders: no copy here
        self._weights_lock = asyncio.Lock()  # one use of the protocol at a time: an update, or a restarted engine's
        self._updating = False
        self._generation_held = False  # inside _generation_paused: the engines produce nothing until it ends
        # fully_async (and --rollout-partial): generation runs through every update; the rollout sends cut requests
        # again itself, so that each token's weight version is known
        self.pause_mode = "abort" if config.run.schedule == "fully_async" or config.rollout.partial else "retract"
        self._connected: list[EngineEndpoint] = []
        self.clients: dict[str, EngineClient] = {}
        self.reports: list[TransferReport] = []
        self.router: WorkerInfo | None = None  # the backend's router (``EngineBackend.router_spec``), if any
        self.router_client: EngineClient | None = None
        self.adapter: PublishedAdapter | None = None  # LoRA: the adapter every engine serves, once one was published

    @property
    def lora_name(self) -> str | None:
        """LoRA: the name of the adapter generation runs with (``lora_path``); ``None``: the base weights."""
        return self.adapter.name if self.adapter is not None else None

    # -- lifecycle --------------------------------------------------------------------------------------------

    async def start(self, *, version: int = 0) -> None:
        """Start the router (when a plugin launches one), every engine cell, connect the protocol, start health
        monitoring. ``version`` is the weight version the engines start with (a resumed run's step)."""
        self.version = version
        await self._start_router()
        self.cells.add_server("engine", count=self.config.engine.num_engines, specs=self._specs)
        started = await asyncio.gather(*(self.cells.start(c) for c in self.cells.cells), return_exceptions=True)
        failures = [result for result in started if isinstance(result, BaseException)]
        if failures:  # every start has settled, so stop() can reach every engine that did start
            raise failures[0]
        self._refresh_clients()
        await asyncio.gather(*(client.flush_cache() for client in self.engine_clients()))  # drop warm-up state
        await self._connect()
        self.hooks.register_engines(engines=self.describe_engines())
        self.monitor.start()

    async def stop(self) -> None:
        await self.monitor.stop()
        if self.cells.running():
            self.hooks.register_engines(engines=[])  # routers stop sending to engines that are going away
        with contextlib.suppress(Exception):  # engines may already be gone
            await self.protocol.close()
        for client in self.clients.values():
            await client.aclose()
        await self.cells.stop_all()
        if self.router is not None:
            await self.router_client.aclose()
            await self.provider.stop(self.router.name)
            self.router = None

    async def _start_router(self) -> None:
        spec = self.backend.router_spec(self.config)
        if spec is None:
            return
        if not isinstance(spec, WORKER_SPECS):
            raise MilesError(
                f"engine backend {self.config.engine.backend!r} returned {spec!r:.80} as its router; "
                "expected a CommandWorkerSpec or PythonWorkerSpec, or None"
            )
        self.router = await self.provider.start(with_role(spec, ROUTER))
        self.router_client = EngineClient(
            self.router.url, name=self.router.name, admin_key=self.provider.token, is_router=True
        )
        self.hooks.register_router(
            router=RouterInfo(
                name=self.router.name, url=self.router.url, pid=self.router.pid, admin_key=self.provider.token
            )
        )

    def _specs(self, cell_id: str) -> list[WorkerSpec]:
        specs = self.backend.engine_specs(self.config, cell_id=cell_id, model_path=self.model_path)
        if not (isinstance(specs, list) and specs and all(isinstance(spec, WORKER_SPECS) for spec in specs)):
            raise MilesError(
                f"engine backend {self.config.engine.backend!r} returned {specs!r:.80} for {cell_id}; "
                "expected a non-empty list of CommandWorkerSpec or PythonWorkerSpec"
            )
        return [with_role(spec, ENGINE) for spec in specs]

    # -- engines ----------------------------------------------------------------------------------------------

    def endpoints(self) -> list[EngineEndpoint]:
        return [
            EngineEndpoint(cell.cell_id, cell.workers[0].url, self.provider.token, self.capabilities)
            for cell in self.cells.running()
        ]

    def engine_clients(self) -> list[EngineClient]:
        """Clients of the engines that are running now."""
        return [self.clients[cell.cell_id] for cell in self.cells.running() if cell.cell_id in self.clients]

    def describe_engines(self) -> list[EngineInfo]:
        """Every engine cell as ``register_engines`` reports it."""
        return [
            EngineInfo(
                cell_id=cell.cell_id,
                server_id=cell.server_id,
                index=cell.index,
                state=cell.state.value,
                restarts=cell.restarts,
                last_error=cell.last_error,
                workers=tuple(EngineWorker(w.name, w.url, w.pid, w.node) for w in cell.workers),
                weight_version=self.version,
            )
            for cell in self.cells.cells.values()
        ]

    def describe_placement(self) -> str:
        """Where the router and each engine worker run (:meth:`WorkerInfo.describe`), in start order."""
        workers = [self.router] if self.router is not None else []
        workers += [worker for cell in self.cells.cells.values() for worker in cell.workers]
        return ", ".join(worker.describe() for worker in workers)

    def _refresh_clients(self) -> None:
        for cell in self.cells.running():
            url = cell.workers[0].url
            if cell.cell_id not in self.clients or self.clients[cell.cell_id].url != url:
                self.clients[cell.cell_id] = EngineClient(url, admin_key=self.provider.token, name=cell.cell_id)

    async def wait_for_engines(self, timeout_s: float) -> None:
        """After a failure: restore dead engines now (not at the next health check) and wait until every cell
        runs again, up to ``timeout_s``. While generation is paused for a weight update, only engines whose processes
        exited are restored: a paused engine cannot pass a generation health check, and is not failing."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        await self.monitor.check_once(ignore_pause=True, liveness_only=self._generation_held)
        while len(self.cells.running()) < len(self.cells.cells):
            if asyncio.get_running_loop().time() > deadline:
                raise MilesError(f"engines not back within {timeout_s:.0f} s: {self.cells.topology()}")
            await asyncio.sleep(0.2)
        self._refresh_clients()

    async def _bring_back(self, cell: Cell) -> None:
        """A restarted engine: reconnect the protocol and load the last published weights (during an update, the
        update's own retry does that)."""
        self._refresh_clients()
        await self.clients[cell.cell_id].flush_cache()
        # An update in progress re-syncs every engine itself (holding the lock); one that starts meanwhile waits for
        # the lock, since its protocol calls would interleave with these (the ranks and engines take them in turn).
        if not self._updating:
            async with self._weights_lock:
                await self._republish()
        self.hooks.register_engines(engines=self.describe_engines())

    async def _republish(self) -> None:
        """Every engine (a restarted one among them) given the published version again."""
        if self.adapter is not None:
            await asyncio.gather(*(load_on_engine(c, self.adapter, previous=None) for c in self.engine_clients()))
        elif self.published_by_holders:
            await self._connect(force=True)
            await self.protocol.republish(self.version)
        elif self.published:
            published = self.published
            await self._connect(force=True)
            await self.protocol.transfer(
                bucketize(published, self.config.weight_transfer.bucket_size_mb << 20), version=self.version
            )

    # -- weights ----------------------------------------------------------------------------------------------

    async def update_weights(
        self, weights: WeightSource, *, version: int, holders: WeightHolders | None = None
    ) -> TransferReport:
        """Publish new weights as ``version`` on every engine. With the trainer's ``holders`` and a protocol that
        sends from them (:class:`SendsFromHolders`), the holders send and the driver only coordinates, keeping no
        copy; otherwise the driver reads ``weights()`` once (again only to retry a failed transfer) and keeps a copy
        for engines that restart."""
        from_holders = (
            holders is not None and isinstance(self.protocol, SendsFromHolders) and self.protocol.sends_from_holders()
        )
        self._updating = True
        try:
            async with self._weights_lock:
                report, published = await self._update(weights if not from_holders else holders, version, from_holders)
        finally:
            self._updating = False
        self.published, self.published_by_holders = published, from_holders
        self.hooks.after_weight_update(version=version, protocol=self.protocol, report=report)
        self.reports.append(report)
        return report

    async def update_adapter(self, path: Path, *, version: int, digest: str) -> TransferReport:
        """LoRA: publish the adapter the trainer wrote to ``path`` (peft's format; ``digest`` its tensors') as
        ``version`` on every engine, which loads it by path (SGLang's ``/load_lora_adapter``) and then serves it to
        every generation; the engines' base weights are never sent."""
        adapter = PublishedAdapter(path=path, name=adapter_name(version), digest=digest, version=version)
        previous = self.lora_name
        started = time.perf_counter()
        self._updating = True
        try:
            async with self._weights_lock, self.monitor.paused(), self._generation_paused():
                self.hooks.before_weight_update(version=version, protocol=self.protocol)
                clients = self.engine_clients()
                checked = await asyncio.gather(*(load_on_engine(c, adapter, previous=previous) for c in clients))
                self.adapter, self.version = adapter, version
        finally:
            self._updating = False
        report = TransferReport(
            ADAPTER_PROTOCOL,
            version,
            adapter.num_bytes,
            time.perf_counter() - started,
            len(clients),
            True if checked and all(checked) else None,  # every digest compared (a mismatch raised)
            digest,
        )
        self.hooks.after_weight_update(version=version, protocol=self.protocol, report=report)
        self.reports.append(report)
        return report

    async def _update(
        self, weights: WeightSource | WeightHolders, version: int, from_holders: bool = False
    ) -> tuple[TransferReport, NamedTensors]:
        async with self.monitor.paused(), self._generation_paused():
            self.hooks.before_weight_update(version=version, protocol=self.protocol)
            with contextlib.ExitStack() as wrappers:
                for wrapper in self.hooks.weight_update_wrapper(version=version, protocol=self.protocol):
                    if wrapper is not None:
                        wrappers.enter_context(wrapper)
                if from_holders:
                    return await self._transfer_from_holders(weights, version), []
                return await self._transfer_all(weights, version)

    async def _transfer_all(
        self, weights: WeightSource, version: int, *, attempts: int = 2
    ) -> tuple[TransferReport, NamedTensors]:
        async def send() -> tuple[TransferReport, RecordedWeights]:
            recorded = RecordedWeights(weights())
            return await self.protocol.transfer(iter(recorded), version=version), recorded

        report, recorded = await self._retried(send, version, attempts)
        if not recorded.complete:
            raise MilesError(
                f"the {type(self.protocol).__name__} protocol reported v{version} sent before taking "
                f"every weight bucket ({len(recorded.copy)} tensors taken)"
            )
        self.version = version
        if self.config.weight_transfer.verify_checksum:
            report = await self._verify(report, recorded.copy)
        return report, recorded.copy

    async def _transfer_from_holders(
        self, holders: WeightHolders, version: int, *, attempts: int = 2
    ) -> TransferReport:
        """The holders send (retried once after re-syncing the engines); checked against the checksum combined from
        their digests when asked."""
        verify = self.config.weight_transfer.verify_checksum

        async def send() -> TransferReport:
            return await self.protocol.transfer_from_holders(holders, version=version, checksum=verify)

        report = await self._retried(send, version, attempts)
        self.version = version
        if verify:
            if report.checksum is None:
                raise MilesError(f"the {type(self.protocol).__name__} protocol reported no checksum of what it sent")
            report = await self._verify_digest(report, report.checksum)
        return report

    async def _retried(self, send: Callable[[], Awaitable[T]], version: int, attempts: int) -> T:
        """``send()`` after (re)connecting the protocol; a failure re-syncs every engine and tries again, up to
        ``attempts`` times (at least 1)."""
        for attempt in range(1, attempts + 1):
            try:
                await self._connect(force=attempt > 1)
                return await send()
            except (EngineError, MilesError, OSError, httpx.TransportError) as exc:  # an engine that died, say
                if attempt == attempts:
                    raise MilesError(f"weight update to v{version} failed {attempts} times: {exc}") from exc
                notice(
                    f"weight update to v{version} failed ({exc}); re-syncing every engine and sending it again "
                    f"(attempt {attempt + 1} of {attempts})"
                )
                await self.wait_for_engines(self.config.engine.startup_timeout_s)
        raise ValueError(f"attempts must be at least 1, got {attempts}")

    async def _connect(self, *, force: bool = False) -> None:
        """(Re)connect the protocol when the set of engines changed (or after a failure)."""
        endpoints = self.endpoints()
        if force or endpoints != self._connected:
            await self.protocol.connect(endpoints)
            self._connected = endpoints

    async def _verify(self, report: TransferReport, sent: NamedTensors) -> TransferReport:
        return await self._verify_digest(report, checksum(sent))

    async def _verify_digest(self, report: TransferReport, expected: str) -> TransferReport:
        if not self.capabilities.serves(CHECKSUM):  # SGLang: the protocol read sampled parameters back instead
            return report
        served = await asyncio.gather(*(client.weights_checksum() for client in self.engine_clients()))
        ok = all(digest == expected for digest in served)
        if not ok:
            raise MilesError(f"checksum mismatch after v{report.version}: trainer {expected}, engines {served}")
        return TransferReport(**{**report.__dict__, "checksum_ok": True})

    @contextlib.asynccontextmanager
    async def _generation_paused(self):
        """No engine generates while the weights change. ``retract`` (``sync``, ``one_step_off``; not ``in_place``:
        SGLang refuses a weight update, HTTP 400 "the cache was not flushed", while a request sits paused in place in
        its running batch, and a router's health-check generation can be one): requests in flight go back to the
        queue and are recomputed with the new weights after ``/continue_generation``. ``abort`` (``fully_async``, or
        ``--rollout-partial``): requests in flight end at once with what they generated, and the rollout sends them
        again (continued with ``--rollout-partial``), so each token's weight version is known."""
        clients = self.engine_clients()
        self._generation_held = True
        await asyncio.gather(*(c.pause_generation(self.pause_mode) for c in clients), return_exceptions=True)
        try:
            yield
        finally:
            self._generation_held = False
            await asyncio.gather(*(c.continue_generation() for c in self.engine_clients()), return_exceptions=True)
