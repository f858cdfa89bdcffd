"""``rdt``: P2P weight transfer over Ray Direct Transport, into a staging bucket per engine rank.

Connect (once, and again for engines that changed): plan which trainer rank feeds which engine rank, start a
:class:`~miles_plugins_rdt.receiver.StagingReceiver` on each engine's Ray node, which maps its fixed-size staging
bucket and registers it once with the transport, and check that a Ray actor hosts each engine. For gloo, add the
trainer's send actor and form one collective group with the receivers.

Transfer (every step): the buckets of HF-named tensors from the ``HfWeightIterator`` are laid out one after the
other at dtype-aligned offsets of a staging bucket (a tensor that does not fit is an error naming it) and move P2P
into every engine rank's staging bucket while the iterator goes on (NIXL: in waves of at least ``WAVE_BYTES``; the
receiver reads the trainer's memory, registered once, straight into its registered bucket, each wave cut into byte
ranges that the engine rank's receive lanes read in parallel; gloo: each bucket as it comes, the send actor sends it
to each receiver). An RDT object over NIXL describes memory rather than holding a copy of it, so when a transfer
sends the same bytes of the same trainer memory as the last one (a trainer's weights, updated in place), it hands
the lanes the objects of the last transfer again instead of putting new ones (each ``ray.put`` costs the trainer
about 3 ms); every read gets what that memory holds when it reads. Each engine rank has two staging buckets and
serves from one while the next version fills the other. Only when every read of every engine rank has succeeded does
the trainer ask each engine to switch its weights to the new bucket and take the new version, in one request: a
transfer that fails before that leaves every engine serving the old version, whole. A failure during the switch
replaces every receiver (new buckets), so no engine's served bucket is ever written.

Where the sending side runs: with the trainer's holders (:meth:`RdtProtocol.transfer_from_holders`; the Megatron
ranks, or the driver for the torch trainer), each holder keeps its share in a registered send buffer of its own and
every engine's receive lanes read each holder's share P2P into its place in the staging bucket
(:mod:`miles_plugins_rdt.holders`): nothing passes through the driver, which places the shares, switches the
engines and publishes. The receivers are named Ray actors, so that the holders (Ray actors themselves under the Ray
worker provider) can call them. :meth:`RdtProtocol.transfer` sends an iterator's buckets from the driver instead
(also the path of the ``gloo`` transport, whose collective group has one sender: it does not send from holders).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

import pydantic
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from miles_core import (
    MAX_BUFFER_MB,
    MAX_LANES,
    STAGING_COPY,
    STAGING_SWAP,
    EngineEndpoint,
    HttpEngineProtocol,
    MilesError,
    ProtocolSettings,
    SendsFromHolders,
    StagingLayout,
    TransferReport,
    WeightBucket,
    WeightHolders,
    at_most_memory_share,
    at_most_per_cpu,
    combine_digests,
    merged_digests,
    route_for,
)
from miles_plugins_rdt import holders as holder_side
from miles_plugins_rdt.huge_pages import collapse_into_huge_pages, huge_page_span
from miles_plugins_rdt.nixl_agent import configure_nixl_agents
from miles_plugins_rdt.ray_serializer import pickle_tensors_by_reference
from miles_plugins_rdt.receiver import StagingReceiver
from miles_plugins_rdt.sender import GlooSender, new_send_bucket
from miles_plugins_rdt.staging import (
    align_up,
    bucket_layout,
    byte_range,
    in_waves,
    plan_routes,
    split_into_lanes,
)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# A receive lane's share of a wave is at least this big: each lane costs the trainer one more RDT object and read call,
# about 4 ms of its CPU (measured with cProfile), the time to read some 16 MiB at 4 GB/s.
MIN_LANE_SHARE = 16 << 20
# NIXL sends the iterator's buckets in waves of at least this many bytes: each wave costs one RDT object and one read
# call per receive lane (about 3 ms of the trainer's CPU, and a read that starts apart from the others), so a 272 MiB
# version that came as two buckets moved in 49-51 ms as one wave against 62-74 ms as two.
WAVE_BYTES = 256 << 20
ANSWER_GRACE_S = holder_side.ANSWER_GRACE_S
RELEASE_TIMEOUT_S = 10.0  # how long to wait for Ray to free dropped RDT objects before their memory is deregistered
NOT_IN_RAY = (
    "the rdt weight-transfer protocol needs engines hosted in Ray actors (start the run with --run-worker-provider ray)"
)


class RdtTransferError(MilesError):
    """A transfer that did not reach every engine rank; no engine was given the new version."""


logger = logging.getLogger(__name__)
RECEIVE_LANES_PER_CPU = 4
"""The most receive lanes (Ray actors) per CPU of the machine that builds the config."""


class RdtSettings(ProtocolSettings):
    """The settings of ``rdt``."""

    example = '{"transport": "gloo", "staging_bucket_mb": 512}'

    transport: Literal["nixl", "gloo"] = pydantic.Field(
        default="nixl",
        description="How the receivers read the weights: nixl (P2P reads of the trainer's registered memory) or gloo "
        "(a collective group with one send actor).",
    )
    staging_bucket_mb: Annotated[float, at_most_memory_share(2, what="staging buckets")] = pydantic.Field(
        default=256,
        gt=0,
        le=MAX_BUFFER_MB,
        description="MiB of each engine rank's staging bucket (two per engine rank); a version must fit in one. At "
        "most 1048576 (1 TiB) and at most a quarter of the physical memory of the machine that builds the config.",
    )
    receive_lanes: Annotated[int, at_most_per_cpu(RECEIVE_LANES_PER_CPU, what="receive lanes")] = pydantic.Field(
        default=2,
        ge=1,
        le=MAX_LANES,
        description="Actors per engine rank that read byte ranges of a wave in parallel (nixl). At most 64, and at "
        "most 4 per CPU of the machine that builds the config: each lane is a Ray actor (a process) per engine rank.",
    )
    timeout_s: float = pydantic.Field(
        default=300.0,
        gt=0,
        description="Seconds a call to a receiver (starting it, a read, a switch) may take before it counts as failed.",
    )


class RdtProtocol(HttpEngineProtocol, SendsFromHolders):
    name = "rdt"
    # the receiver runs beside each engine, on its node: the engine loads from a staging file there, wherever it is
    routes_same_node = (STAGING_SWAP, STAGING_COPY)
    routes_other_node = (STAGING_SWAP, STAGING_COPY)

    settings_model = RdtSettings
    settings: RdtSettings

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.lanes = (
            self.settings.receive_lanes if self.settings.transport == "nixl" else 1
        )  # gloo: one sender, whole chunks
        if self.settings.transport == "gloo" and "receive_lanes" in self.settings.model_fields_set:
            logger.warning(
                "rdt: the setting receive_lanes = %d is not used: transport gloo reads with one lane (one sender, "
                "whole chunks); remove it, or use transport nixl",
                self.settings.receive_lanes,
            )
        self.capacity = int(self.settings.staging_bucket_mb * (1 << 20))
        self.receivers: dict[str, tuple[EngineEndpoint, list]] = {}  # engine name -> (endpoint, its lanes' actors)
        self.routes: dict[str, int] = {}
        self.staging_paths: dict[str, list[str]] = {}  # engine name -> its staging buckets' files, on its node
        self.sender: Any = None
        self.send_bucket: tuple[Any, torch.Tensor] | None = None
        self.group: str | None = None
        self._next_slot = 0  # the staging bucket that no engine serves from
        self._registered: dict[int, torch.Tensor] = {}  # trainer-side memory registered with NIXL, by storage
        self._on_huge_pages: set[int] = set()  # the registered storages already collapsed onto huge pages
        self._registrations = 0  # counts the changes to the registered memory: an RDT object carries a snapshot of it
        self._standing: dict[tuple, StandingObject] = {}  # the last transfer's NIXL objects, by the bytes they send
        self._dropped: list[StandingObject] = []  # objects no transfer hands out again, until Ray has freed them
        self.key = uuid.uuid4().hex[:8]  # names the receivers' actors and the holders' kept shares
        self.lane_names: dict[str, list[str]] = {}  # engine name -> its receive lanes' actor names
        self._kept: tuple[WeightHolders, int, list[StagingLayout]] | None = None  # the holders' last version

    # -- connect --------------------------------------------------------------------------------------------

    async def connect(self, engines: Sequence[EngineEndpoint]) -> None:
        if not ray.is_initialized():
            raise MilesError(f"{NOT_IN_RAY}; this process has not joined a Ray cluster")
        if self.settings.transport == "nixl":
            configure_nixl_agents(progress_thread=True)  # before this process's agent exists: it offers memory
        for engine in engines:  # an engine without a staging route: an error naming it
            route_for(self, f"engine {engine.name}", engine.capabilities, same_node=False)
        await super().connect(engines)
        self.routes = plan_routes(1, [engine.name for engine in engines])
        stale = [name for name, (endpoint, _) in self.receivers.items() if endpoint not in engines]
        for name in stale:
            await self._drop_receiver(name)
        new = [endpoint for endpoint in engines if endpoint.name not in self.receivers]
        for endpoint in new:
            self.receivers[endpoint.name] = (endpoint, [self._start_receiver(endpoint)])
        try:
            await asyncio.gather(*(self._check_receiver(endpoint) for endpoint in new))
            await asyncio.gather(*(self._start_lanes(endpoint) for endpoint in new))
        except BaseException:
            for endpoint in new:
                await self._drop_receiver(endpoint.name)
            raise
        if self.settings.transport == "gloo" and (new or stale or self.group is None):
            await self._form_gloo_group()

    def _start_receiver(self, endpoint: EngineEndpoint, paths: list[str] | None = None) -> Any:
        """A receive lane of ``endpoint`` on its node, as a named actor (holders look it up by its name)."""
        name = f"miles-rdt-{self.key}-{uuid.uuid4().hex[:12]}"
        self.lane_names.setdefault(endpoint.name, []).append(name)
        return StagingReceiver.options(
            name=name,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=_node_of(endpoint.url), soft=False),
        ).remote(
            engine_name=endpoint.name,
            engine_url=endpoint.url,
            capacity=self.capacity,
            transport=self.settings.transport,
            paths=paths,
        )

    async def _start_lanes(self, endpoint: EngineEndpoint) -> None:
        """The engine's other receive lanes: processes that map its first receiver's staging files and each read
        a share of every chunk, so that one engine rank receives with several cores (on one host each read is a
        single-threaded ``process_vm_readv``: 5.3 GB/s alone, 8.8 GB/s for two, measured on 2 cores)."""
        lanes = self.receivers[endpoint.name][1]
        try:
            paths = await asyncio.wait_for(_awaitable(lanes[0].staging_paths.remote()), timeout=self.settings.timeout_s)
            self.staging_paths[endpoint.name] = paths
            lanes.extend(self._start_receiver(endpoint, paths) for _ in range(self.lanes - 1))
            await asyncio.wait_for(
                asyncio.gather(*(lane.staging_paths.remote() for lane in lanes[1:])), timeout=self.settings.timeout_s
            )
        except (ray.exceptions.RayActorError, TimeoutError) as exc:
            raise MilesError(
                f"rdt: a receive lane of engine {endpoint.name} on node {urlparse(endpoint.url).hostname} did not "
                f"start within {self.settings.timeout_s:g} s (the timeout_s setting): {type(exc).__name__} {exc}"
            ) from None

    async def _check_receiver(self, endpoint: EngineEndpoint) -> None:
        receiver = self.receivers[endpoint.name][1][0]
        try:
            await asyncio.wait_for(receiver.check_engine.remote(), timeout=self.settings.timeout_s)
        except ray.exceptions.RayTaskError as exc:
            raise MilesError(f"rdt: engine {endpoint.name}: {exc.cause}") from None
        except (ray.exceptions.RayActorError, TimeoutError) as exc:
            raise MilesError(f"rdt: the staging receiver of engine {endpoint.name} did not start: {exc}") from None

    async def _form_gloo_group(self) -> None:
        from ray.experimental.collective import create_collective_group  # deferred: Ray's collective library

        self._drop_gloo_group()
        path, bucket = new_send_bucket(self.capacity)
        self.send_bucket = (path, bucket)
        self.sender = GlooSender.remote(path=str(path), capacity=self.capacity)
        actors = [self.sender, *(lanes[0] for _, lanes in self.receivers.values())]
        self.group = f"miles-rdt-{id(self)}-{time.monotonic_ns()}"
        try:
            await asyncio.wait_for(
                asyncio.to_thread(create_collective_group, actors, backend="torch_gloo", name=self.group),
                timeout=self.settings.timeout_s,
            )
        except TimeoutError:
            raise MilesError(
                f"rdt (gloo): the collective group of the trainer's sender and the receivers of engines "
                f"{', '.join(self.receivers)} did not form within {self.settings.timeout_s:g} s (the timeout_s setting)"
            ) from None

    # -- transfer -------------------------------------------------------------------------------------------

    def _check_receivers(self) -> None:
        if not self.receivers:
            raise MilesError("rdt: call connect() before transfer()")
        lost = [engine.name for engine in self.engines if engine.name not in self.receivers]
        if lost:
            raise MilesError(
                f"rdt: engines {', '.join(lost)} lost their receivers in a failed transfer; call "
                f"connect() again before transfer()"
            )

    async def transfer(self, buckets: Iterable[WeightBucket], *, version: int) -> TransferReport:
        self._check_receivers()
        started = time.perf_counter()
        if self.settings.transport == "nixl":
            pickle_tensors_by_reference(torch.Tensor)  # about 3 ms less of this process's CPU per RDT object
        slot, layouts, sent, pending, held = self._next_slot, [], [], [], []  # held: the gloo waves' objects
        earlier = set(self._registered)  # memory registered by earlier transfers
        objects: dict[tuple, StandingObject] = {}  # this transfer's NIXL objects, new or standing
        for wave in in_waves(buckets, WAVE_BYTES if self.settings.transport == "nixl" else 0):  # received in this order
            layout = bucket_layout(wave, capacity=self.capacity, start=layouts[-1].size if layouts else 0)
            pending.extend(self._start_wave(wave, layout, slot, objects, held))
            layouts.append(layout)
            sent.extend(tensor for _, tensor in wave)
        try:
            layout = StagingLayout.concat(layouts, alignment=1)  # the whole version, as the engines will serve it
            # no engine is asked to switch before every read is in; a read's lane reports its own timeout first
            read_failures = await self._failures_of(
                pending, what="the read into its staging bucket", timeout_s=self.settings.timeout_s + ANSWER_GRACE_S
            )
            if read_failures:  # then every engine serves the bucket it served, untouched
                for name in read_failures:  # a lane may have died: connect() starts the engine's receivers anew
                    await self._drop_receiver(name)
                raise self._transfer_error(read_failures)
            await self._switch(layout, slot, version)
        except BaseException:
            self._stand({})
            objects.clear()  # an error's traceback holds this frame: its objects must not live on with it
            raise
        finally:
            del held  # the NIXL objects stand for the next transfer in `objects` (or were just dropped)
        self._next_slot = 1 - slot
        self._stand(objects)
        self._keep_registered(sent, earlier)
        return self.report(version=version, num_bytes=sum(entry.nbytes for entry in layout.tensors), started=started)

    # -- from the holders -----------------------------------------------------------------------------------

    def sends_from_holders(self) -> bool:
        """Over NIXL, yes; ``gloo``'s collective group has the driver's one sender."""
        return self.settings.transport == "nixl"

    async def transfer_from_holders(
        self, holders: WeightHolders, *, version: int, checksum: bool = False
    ) -> TransferReport:
        """Every holder copies its share into its registered send buffer (:func:`~miles_plugins_rdt.holders.
        keep_share`), then every engine's lanes read each holder's share into its place in the staging bucket
        (:func:`~miles_plugins_rdt.holders.send_kept`); the driver switches the engines to it as ``version``."""
        self._check_receivers()
        started = time.perf_counter()
        results = await self._holder_task(
            holders, "keep_share", "copy their shares into their send buffers", version=version, digests=checksum
        )
        digests = merged_digests(results)
        self._kept = (holders, version, [StagingLayout.from_wire(result["layout"]) for result in results])
        await self._send_kept()
        report = self.report(version=version, num_bytes=sum(r["bytes"] for r in results), started=started)
        return dataclasses.replace(report, checksum=combine_digests(digests) if checksum else None)

    async def republish(self, version: int) -> None:
        """The holders' kept shares of ``version`` are read again by every engine, which switches to them."""
        if self._kept is None or self._kept[1] != version:
            raise MilesError(f"rdt: version {version} was not sent by the trainer's holders, nothing to resend")
        self._check_receivers()
        await self._send_kept()

    async def _send_kept(self) -> None:
        holders, version, layouts = self._kept
        bases, layout = self._placed(layouts)
        slot = self._next_slot
        results = await self._holder_task(
            holders,
            "send_kept",
            f"have engines {', '.join(self.receivers)} read their shares",
            deadline_s=self.settings.timeout_s + 2 * ANSWER_GRACE_S,  # after the holders' own deadline on the reads
            version=version,
            bases=bases,
            slot=slot,
            lanes={name: self.lane_names[name] for name in self.receivers},
            timeout_s=self.settings.timeout_s,
        )
        failures = {engine: RuntimeError(why) for result in results for engine, why in result["failures"].items()}
        if failures:  # no engine was switched: every one serves the bucket it served
            for name in failures:
                await self._drop_receiver(name)
            raise self._transfer_error(failures)
        await self._switch(layout, slot, version)
        self._next_slot = 1 - slot

    async def _holder_task(
        self, holders: WeightHolders, task: str, what: str, *, deadline_s: float | None = None, **kwargs: Any
    ) -> list[dict[str, Any]]:
        """Run the holder task ``task`` of :mod:`~miles_plugins_rdt.holders` on every holder; an error naming the
        holders and ``what`` they were doing when it has not finished within ``deadline_s`` (the timeout_s setting
        by default). The holders' thread is left to end by itself (a thread cannot be stopped)."""
        deadline_s = self.settings.timeout_s if deadline_s is None else deadline_s
        call = asyncio.to_thread(holders.run_task, f"{holder_side.__name__}:{task}", key=self.key, **kwargs)
        try:
            return await asyncio.wait_for(call, timeout=deadline_s)
        except TimeoutError:
            raise RdtTransferError(
                f"rdt: the trainer's weight holders ({'; '.join(holders.describe())}) did not {what} within "
                f"{deadline_s:g} s (the timeout_s setting); the new version was not published"
            ) from None

    def _placed(self, layouts: list[StagingLayout]) -> tuple[list[int], StagingLayout]:
        """Where each holder's share starts in the staging bucket (one after the other, 64-byte aligned) and the
        whole version's layout there; a version larger than the bucket names the setting to raise."""
        bases, tensors, end = [], [], 0
        for layout in layouts:
            base = align_up(end, 64)
            bases.append(base)
            tensors.extend(dataclasses.replace(entry, offset=base + entry.offset) for entry in layout.tensors)
            end = base + layout.size
        if end > self.capacity:
            raise MilesError(
                f"rdt: the trainer's weights need {end} bytes of staging, more than staging_bucket_mb = "
                f"{self.capacity / (1 << 20):g} MiB gives; raise that setting to at least {-(-end // (1 << 20))}"
            )
        return bases, StagingLayout(tuple(tensors), size=end, alignment=1)

    async def _switch(self, layout: StagingLayout, slot: int, version: int) -> None:
        """Have every engine serve the tensors of its staging bucket ``slot`` (no copy) as ``version``, in one
        request each (``/update_weights_from_staging`` with ``swap``: the engine maps the bucket's file). If one fails,
        others may have switched: every receiver is replaced (new buckets), so no served bucket is written again."""
        clients = {client.name: client for client in self.clients}

        async def switch(name: str) -> None:
            endpoint, lanes = self.receivers[name]
            if endpoint.capabilities.staging_loader is None:
                await clients[name].update_weights_from_staging(
                    staging_path=self.staging_paths[name][slot],
                    buffer_size=self.capacity,
                    layout=layout,
                    swap=True,
                    weight_version=str(version),
                )
                return
            # SGLang copies the bucket in, through Miles' loader; the receiver asks it (the loader's outcome is a file
            # on the engine's node), then the engine takes the version
            await _awaitable(
                lanes[0].load_into_sglang.remote(
                    slot=slot,
                    layout=layout.to_wire(),
                    endpoint=endpoint.to_wire(),
                    version=version,
                    verify_samples=self.verify_samples,
                )
            )
            await clients[name].update_weight_version(str(version))

        try:
            failures = await self._failures_of(
                [(name, switch(name)) for name in self.receivers], what="the switch to the new staging bucket"
            )
        except BaseException:
            await self._drop_all_receivers()
            raise
        if failures:
            await self._drop_all_receivers()
            raise self._transfer_error(failures)

    def _start_wave(
        self,
        wave: list[tuple[str, torch.Tensor]],
        layout: StagingLayout,
        slot: int,
        objects: dict[tuple, StandingObject],
        held: list,
    ) -> list[tuple[str, Any]]:
        """Start moving a wave of buckets into every receiver's bucket ``slot``: ``(engine name, call)`` pairs. The
        wave's objects go into ``objects`` (NIXL) or ``held`` (gloo). Nothing waits: the next wave starts while this
        one moves."""
        if self.settings.transport == "nixl":
            return self._start_nixl_wave(wave, layout, slot, objects)
        for target, (_, tensor) in zip(layout.views(self.send_bucket[1]).values(), wave, strict=True):
            target.copy_(tensor)  # each wave has its own bytes of the send bucket: nothing in flight is overwritten
        held.append(self.sender.chunk.remote(layout))
        return [
            (name, lanes[0].receive_gloo.remote(held[-1], layout, slot)) for name, (_, lanes) in self.receivers.items()
        ]

    def _start_nixl_wave(
        self,
        wave: list[tuple[str, torch.Tensor]],
        layout: StagingLayout,
        slot: int,
        objects: dict[tuple, StandingObject],
    ) -> list[tuple[str, Any]]:
        """One RDT object per receive lane, holding that lane's byte ranges of the wave's tensors (the last
        transfer's, where it sent the same bytes); the lanes' reads are asked for once every object exists, so that
        they start together."""
        self._register(tensor for _, tensor in wave)
        slots = layout.tensors
        lane_count = max(1, min(self.lanes, sum(slot.nbytes for slot in slots) // MIN_LANE_SHARE))
        shares = [pieces for pieces in split_into_lanes(slots, lane_count) if pieces]
        refs = [
            self._lane_object([byte_range(wave[p.tensor][1], p.start, p.nbytes) for p in pieces], objects)
            for pieces in shares
        ]
        return [
            (
                name,
                lanes[lane].receive_nixl.remote(
                    [ref], [[p.offset, p.nbytes] for p in pieces], slot, self.settings.timeout_s
                ),
            )
            for lane, (ref, pieces) in enumerate(zip(refs, shares, strict=True))
            for name, (_, lanes) in self.receivers.items()
        ]

    def _lane_object(self, ranges: list[torch.Tensor], objects: dict[tuple, StandingObject]) -> Any:
        """The RDT object of one lane's byte ranges: the last transfer's object for the same bytes of the same memory
        if nothing registered has changed since it was put (its views keep that memory where it is), else a new
        one. Either way it goes into ``objects``, this transfer's."""
        key = tuple((view.data_ptr(), view.numel()) for view in ranges)
        standing = self._standing.get(key)
        if standing is None or standing.registrations != self._registrations:
            standing = StandingObject(ray.put(ranges, _tensor_transport="nixl"), ranges, self._registrations)
        objects[key] = standing
        return standing.ref

    def _stand(self, objects: dict[tuple, StandingObject]) -> None:
        """Keep ``objects`` (a transfer's) for the next transfer; the ones kept before and not among them are
        dropped."""
        kept = {id(standing) for standing in objects.values()}
        for standing in self._standing.values():
            if id(standing) not in kept:
                standing.ref = None  # Ray frees the object once no call holds it
                self._dropped.append(standing)
        self._standing = dict(objects)

    def _wait_dropped_freed(self) -> None:
        """Wait until Ray has freed the dropped objects: Ray holds a registration of its own for the memory of each
        live object, so deregistering that memory before then would leave it registered."""
        from ray.experimental import wait_tensor_freed  # deferred: RDT internals

        dropped, self._dropped = self._dropped, []
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        for view in (view for standing in dropped for view in standing.ranges):
            with contextlib.suppress(TimeoutError):  # then Ray deregisters the memory itself once it frees the object
                wait_tensor_freed(view, timeout=max(0.0, deadline - time.monotonic()))

    def _register(self, tensors: Iterable[torch.Tensor]) -> None:
        """Register the trainer's tensors with NIXL once (a trainer's weights keep their memory between steps)."""
        from ray.experimental import register_nixl_memory  # deferred: imports nixl

        for tensor in tensors:
            key = tensor.untyped_storage().data_ptr()
            if key not in self._registered:
                register_nixl_memory(tensor)
                self._registered[key] = tensor
                self._registrations += 1

    def _keep_registered(self, sent: list[torch.Tensor], earlier: set[int]) -> None:
        """After a transfer, with nothing in flight: release the registrations of memory it did not send from
        (fresh buffers, say), and move memory sent again (``earlier``: registered before it) onto huge pages."""
        from ray.experimental import deregister_nixl_memory  # deferred: imports nixl

        used = {tensor.untyped_storage().data_ptr() for tensor in sent}
        unused = set(self._registered) - used
        to_collapse = (used & earlier) - self._on_huge_pages
        if unused or to_collapse:  # the registered memory changes: no object put so far stands for later transfers
            self._stand({})
            self._registrations += 1
            self._wait_dropped_freed()
        for key in unused:
            deregister_nixl_memory(self._registered.pop(key))
            self._on_huge_pages.discard(key)
        for key in to_collapse:
            self._move_onto_huge_pages(key)
        self._dropped = []  # over memory whose registration stays as it is: Ray frees them in its own time

    def _move_onto_huge_pages(self, key: int) -> None:
        """Memory sent twice is the trainer's own, not a fresh export (which would not repay this): collapse it
        onto huge pages once (about 2.5 ms per MiB; every later read of it is about 1.6x faster), registering it
        again around that, since NIXL may pin what it registers."""
        from ray.experimental import deregister_nixl_memory, register_nixl_memory  # deferred: imports nixl

        tensor = self._registered[key]
        storage = tensor.untyped_storage()
        if huge_page_span(storage.data_ptr(), storage.nbytes())[1] > 0:  # not under 2 MiB: nothing to collapse
            deregister_nixl_memory(tensor)
            collapse_into_huge_pages(tensor)
            register_nixl_memory(tensor)
        self._on_huge_pages.add(key)

    async def _failures_of(
        self, calls: list[tuple[str, Any]], *, what: str, timeout_s: float | None = None
    ) -> dict[str, BaseException]:
        """Wait for every ``(engine name, Ray call or coroutine)``, each for ``timeout_s`` (the setting by default);
        the first failure of each engine that had one (a call that ran out of time: a ``TimeoutError`` saying that
        ``what`` did not finish)."""
        timeout_s = self.settings.timeout_s if timeout_s is None else timeout_s

        async def waited(call: Any) -> Any:
            try:
                return await asyncio.wait_for(_awaitable(call), timeout_s)
            except TimeoutError:
                raise TimeoutError(f"{what} did not finish within {timeout_s:g} s (the timeout_s setting)") from None

        results = await asyncio.gather(*(waited(call) for _, call in calls), return_exceptions=True)
        failures: dict[str, BaseException] = {}
        for (name, _), result in zip(calls, results, strict=True):
            if isinstance(result, BaseException):
                failures.setdefault(name, result)  # its first failure: later calls fail for the same reason
        return failures

    def _transfer_error(self, failures: dict[str, BaseException]) -> RdtTransferError:
        nodes = {engine.name: urlparse(engine.url).hostname for engine in self.engines}
        detail = "; ".join(
            f"engine {name}: {_describe(error)} (node {nodes.get(name, '?')})" for name, error in failures.items()
        )
        return RdtTransferError(
            f"rdt ({self.settings.transport}) transfer failed, the new version was not published: {detail}"
        )

    # -- release --------------------------------------------------------------------------------------------

    async def _drop_receiver(self, name: str) -> None:
        """Stop an engine's receivers; the first removes the staging files (ray.kill alone would leave them in
        /dev/shm)."""
        endpoint, lanes = self.receivers.pop(name)
        paths = self.staging_paths.pop(name, None)
        self.lane_names.pop(name, None)
        # Every lane's close is awaited, even after one fails (a lane killed mid-transfer fails at once): a kill
        # before the first lane's close has run would leave its files.
        closes = asyncio.gather(*(_awaitable(lane.close.remote()) for lane in lanes), return_exceptions=True)
        try:
            results = await asyncio.wait_for(closes, timeout=10)
        except TimeoutError:  # busy in a receive that does not end
            results = [TimeoutError()]
        closed = not isinstance(results[0], BaseException)  # the first lane owns the files
        for lane in lanes:
            ray.kill(lane, no_restart=True)
        if not closed and paths:
            await self._remove_files_on_node(endpoint, paths)

    async def _remove_files_on_node(self, endpoint: EngineEndpoint, paths: list[str]) -> None:
        """Remove staging files that their killed receiver left, by a task on the engine's node (the engine may
        still map one: its pages live until it lets go). A node that is gone took its files with it."""
        with contextlib.suppress(Exception):
            strategy = NodeAffinitySchedulingStrategy(node_id=_node_of(endpoint.url), soft=False)
            task = _remove_files.options(scheduling_strategy=strategy).remote(paths)
            await asyncio.wait_for(_awaitable(task), timeout=self.settings.timeout_s)

    def _drop_gloo_group(self) -> None:
        if self.group is not None:
            from ray.experimental.collective import destroy_collective_group  # deferred, as above

            with contextlib.suppress(Exception):  # a member died: the group went with it
                destroy_collective_group(self.group)
            self.group = None
        if self.sender is not None:
            ray.kill(self.sender, no_restart=True)
            self.sender = None
        if self.send_bucket is not None:
            self.send_bucket[0].unlink(missing_ok=True)
            self.send_bucket = None

    async def _drop_all_receivers(self) -> None:
        self._drop_gloo_group()
        for name in list(self.receivers):
            await self._drop_receiver(name)
        self._next_slot = 0

    async def close(self) -> None:
        if ray.is_initialized():
            await self._drop_all_receivers()
            self._stand({})
            self._keep_registered([], set())
            holder_side.forget(self.key)  # the driver's own kept share (the torch trainer's holder)
        self._kept = None
        await super().close()


@dataclasses.dataclass
class StandingObject:
    """An RDT object over NIXL that a later transfer may hand the lanes again: its byte ranges (views of the
    trainer's memory) and the count of registration changes when it was put (its transport metadata is a snapshot
    of the trainer's registered memory)."""

    ref: Any
    ranges: list[torch.Tensor]
    registrations: int


def _awaitable(call: Any) -> Any:
    return asyncio.wrap_future(call.future()) if isinstance(call, ray.ObjectRef) else call


def _describe(error: BaseException) -> str:
    if isinstance(error, ray.exceptions.RayTaskError):
        return str(error.cause)
    return f"{type(error).__name__}: {error}"


@ray.remote(num_cpus=0)
def _remove_files(paths: list[str]) -> None:
    """Unlink ``paths`` on the node this task runs on."""
    for path in paths:
        Path(path).unlink(missing_ok=True)


def _node_of(url: str) -> str:
    """The id of the Ray node whose address is the engine's host (loopback: this process's node)."""
    host = urlparse(url).hostname
    if host in LOOPBACK:
        return ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("Alive") and node.get("NodeManagerAddress") == host:
            return node["NodeID"]
    raise MilesError(f"{NOT_IN_RAY}; no Ray node has the address {host} of engine {url}")
