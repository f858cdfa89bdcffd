"""``tensor``: each bucket of tensors goes to the engines through ``/update_weights_from_tensor`` (or, through shared
memory, ``/update_weights_from_staging``).

* Engines on other machines get the bucket as safetensors bytes in the request body.
* Engines on this machine (``shared_memory``, the default when an engine's host is the sender's node address or
  loopback: :func:`~miles_core.workers.node.is_this_node`) share staging files in
  the user's weight-staging directory (:mod:`miles_core.engines.staging`, the only place engines accept them from)
  with the trainer: the trainer copies a bucket into one once, every engine copies it out into its weights, and the
  request carries only the file and its :class:`~miles_core.weight_transfer.staging_layout.StagingLayout`. Two files
  alternate, so the trainer fills bucket k+1 while the engines empty bucket k; they are mapped once and reused for
  every bucket and version, so a steady-state transfer costs two overlapped memory copies and no serialisation.
* With ``zero_copy`` (the default for engines on this machine) the whole model goes into one staging file and
  the engines point their parameters at it instead of copying: one memory copy per transfer. Two such files
  alternate between transfers, so the trainer never writes the file the engines serve from; after a failed
  transfer both are replaced by new files (engines keep their mapping of the old ones).
* From the trainer's holders (:meth:`TensorProtocol.transfer_from_holders`), each holder (a Megatron rank) sends its
  own share (:func:`stage_and_send`, run where the weights are): it stages the share into a staging file of its own
  and hands the engines on its machine the file's layout, the others the bytes; the driver then publishes the
  version. A holder keeps its file of the published version, from which :meth:`TensorProtocol.republish` has it send
  the share again to an engine that restarted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar
from urllib.parse import urlparse

import pydantic
import torch

from miles_core.bounds import MAX_BUFFER_MB, at_most_memory_share
from miles_core.engines.client import EngineClient
from miles_core.engines.staging import remove_orphan_files, weight_staging_dir
from miles_core.errors import MilesError
from miles_core.training.weight_iterator import bucketize
from miles_core.weight_transfer.digests import combine_digests, tensor_digest
from miles_core.weight_transfer.holders import InProcessHolders, NamedTensorShare, WeightHolders, merged_digests
from miles_core.weight_transfer.http_engines import HttpEngineProtocol
from miles_core.weight_transfer.protocol import (
    EngineEndpoint,
    SendsFromHolders,
    TransferReport,
    WeightBucket,
)
from miles_core.weight_transfer.routes import STAGING_COPY, STAGING_SWAP, TENSOR_BYTES, WEIGHTS_BY_NAME, route_for
from miles_core.weight_transfer.settings import ProtocolSettings
from miles_core.weight_transfer.staged_load import (
    held_dtypes,
    load_staged,
    sample_names,
    staging_dtypes,
    verify_sampled,
    weight_update_sessions,
)
from miles_core.weight_transfer.staging_layout import StagingLayout, map_staging_file
from miles_core.workers.node import is_this_node

T = TypeVar("T")
STAGING_PREFIX = "miles-staging-"
"""Staging files are ``miles-staging-<pid of their maker>-...`` (a dead maker's are removed as orphans)."""


@dataclasses.dataclass(frozen=True)
class Staged:
    """A bucket copied into a staging file: the file, its size and where each tensor lies in it."""

    path: Path
    buffer_size: int
    layout: StagingLayout


class TensorSettings(ProtocolSettings):
    """The settings of ``tensor``."""

    example = '{"zero_copy": false}'

    shared_memory: bool | None = pydantic.Field(
        default=None,
        description="Whether engines load through shared memory (staging files) rather than bytes over HTTP; null: "
        "shared memory for the engines on this machine, bytes for the others.",
    )
    zero_copy: bool = pydantic.Field(
        default=True,
        description="Engines on this machine serve straight from the staging file of the whole model instead of "
        "copying it into their weights (one memory copy per transfer).",
    )
    held_dtype: bool = pydantic.Field(
        default=True,
        description="Stage each weight matrix in the dtype the engines on this machine hold it in (SGLang serving "
        "bfloat16: the trainer's float32 weights are rounded during the staging copy, as SGLang's own copy would "
        "round them, and SGLang copies half the bytes); false: staged as the trainer holds them.",
    )
    staging_mb: Annotated[float, at_most_memory_share(2, what="staging files")] = pydantic.Field(
        default=2048,
        gt=0,
        le=MAX_BUFFER_MB,
        description="The trainer's buckets are gathered into staging files of up to this many MiB (of the trainer's "
        "bytes), each loaded by one request per engine on this machine: SGLang spends 6-12 ms of each request "
        "outside its copy, and filling one file while the engines copy out of the other gains little where both "
        "copies share the memory bandwidth; bigger files mean fewer requests, and more shared memory (two files). "
        "At most 1048576 (1 TiB) and at most a quarter of the physical memory of the machine that builds the config "
        "(the two files must fit in half of it).",
    )
    shm_dir: str | None = pydantic.Field(
        default=None,
        description="The directory of the staging files; null: the user's weight-staging directory, the only one "
        "Miles' engines accept them from.",
    )


class TensorProtocol(HttpEngineProtocol, SendsFromHolders):
    name = "tensor"
    routes_same_node = (STAGING_SWAP, STAGING_COPY, TENSOR_BYTES)
    routes_other_node = (TENSOR_BYTES,)

    settings_model = TensorSettings
    settings: TensorSettings

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self._next_slot = 0  # zero copy: the staging file the engines do not serve from
        shm_dir = self.settings.shm_dir
        self.shm_dir = Path(shm_dir) if shm_dir else weight_staging_dir()  # where the engines accept them
        self._staging: list[tuple[Path, torch.Tensor] | None] = [None, None]  # double buffering
        self._served_zero_copy: Staged | None = None  # zero copy: the file the engines serve from
        # the last version the holders sent, and each holder's staged file (None: the driver's zero-copy file)
        self._published_by_holders: tuple[WeightHolders, int, list[dict] | None] | None = None
        self._holder_files: set[str] = set()  # every staging file the holders reported

    def _local(self, client: EngineClient) -> bool:
        return on_sender_node(client.url, self.settings.shared_memory)

    async def connect(self, engines: Sequence[EngineEndpoint]) -> None:
        """Every engine reachable by a route it serves (SGLang on another node is not: an error naming it)."""
        for engine in engines:
            same_node = on_sender_node(engine.url, self.settings.shared_memory)
            route_for(self, f"engine {engine.name}", engine.capabilities, same_node=same_node)
        await super().connect(engines)

    def _session_clients(self) -> list[EngineClient]:
        """The engines that load inside a weight-update session (SGLang's: those loading through Miles' loader)."""
        return [c for c, e in zip(self.clients, self.engines, strict=True) if e.capabilities.staging_loader]

    async def _verify(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """The sampled parameters read back from every engine that reports them (in the open session)."""
        names = sample_names(list(tensors), count=self.verify_samples, version=version)
        checks = [
            verify_sampled(client, engine, {name: tensors[name] for name in names}, version=version)
            for client, engine in zip(self.clients, self.engines, strict=True)
            if engine.capabilities.serves(WEIGHTS_BY_NAME)
        ]
        await asyncio.gather(*checks)

    async def transfer(self, buckets: Iterable[WeightBucket], *, version: int) -> TransferReport:
        """Each staging batch (the buckets gathered up to ``staging_mb``) staged while the engines load the one
        before; the first staged while the engines open their weight-update sessions. With every engine on this
        machine and nothing to verify, the last load carries the version (no request of its own)."""
        if self._zero_copy_applies():
            return await self._transfer_zero_copy(buckets, version=version)
        started = time.perf_counter()
        held = await self._held_dtypes()
        all_local = bool(self.clients) and all(map(self._local, self.clients))
        version_with_load = all_local and not self.verify_samples
        named = (item for bucket in buckets for item in bucket)
        batches = with_last(bucketize(named, int(self.settings.staging_mb * 2**20)))
        any_local = any(map(self._local, self.clients))
        num_bytes = 0
        sent: dict[str, torch.Tensor] = {}
        staging = asyncio.create_task(self._stage_batch(next(batches, None), 0, held, any_local))
        try:
            async with weight_update_sessions(self._session_clients()):
                sending: asyncio.Task | None = None
                index = 0
                while (batch := await staging) is not None:
                    tensors, staged, last = batch
                    num_bytes += sum(t.numel() * t.element_size() for _, t in tensors)
                    if self.verify_samples:
                        sent.update(tensors)
                    if sending is not None:
                        await sending  # the engines are done with the other staging file
                    with_version = str(version) if last and version_with_load else None
                    sending = asyncio.create_task(self._send_all(tensors, staged, last=last, version=with_version))
                    index += 1
                    staging = asyncio.create_task(self._stage_batch(next(batches, None), index % 2, held, any_local))
                if sending is not None:
                    await sending
                await self._verify(sent, version)
        except BaseException:
            await asyncio.gather(staging, return_exceptions=True)  # a staging copy still running ends first
            raise
        if not version_with_load:
            await self.publish_version(version)
        return self.report(version=version, num_bytes=num_bytes, started=started)

    async def _stage_batch(
        self, batch: tuple[WeightBucket, bool] | None, slot: int, held: list, any_local: bool
    ) -> tuple[list[tuple[str, torch.Tensor]], Staged | None, bool] | None:
        """``batch`` (its tensors, whether it is the last) copied into staging file ``slot`` when an engine is on
        this machine; ``None`` after the last."""
        if batch is None:
            return None
        bucket, last = batch
        tensors = [(name, tensor.detach().contiguous().cpu()) for name, tensor in bucket]
        if not any_local:
            return tensors, None, last
        return tensors, await asyncio.to_thread(self._stage, tensors, slot, staging_dtypes(tensors, held)), last

    async def _transfer_zero_copy(self, buckets: Iterable[WeightBucket], *, version: int) -> TransferReport:
        started = time.perf_counter()
        tensors = [(name, tensor.detach().contiguous().cpu()) for bucket in buckets for name, tensor in bucket]
        slot = self._next_slot
        try:
            staged = await asyncio.to_thread(self._stage, tensors, slot)
            # the version travels with the swap: each engine serves the new weights under the new version at once,
            # and one request per engine is spared
            await self.on_each_engine(
                lambda client: client.update_weights_from_staging(
                    staging_path=str(staged.path),
                    buffer_size=staged.buffer_size,
                    layout=staged.layout,
                    swap=True,
                    weight_version=str(version),
                )
            )
        except BaseException:
            for index in range(len(self._staging)):  # engines may serve from either file: use new files
                self._drop_staging(index)  # unlinking keeps the pages valid for whoever maps them
            raise
        self._next_slot = 1 - slot
        self._served_zero_copy = staged
        return self.report(
            version=version, num_bytes=sum(t.numel() * t.element_size() for _, t in tensors), started=started
        )

    async def transfer_from_holders(
        self, holders: WeightHolders, *, version: int, checksum: bool = False
    ) -> TransferReport:
        """Every holder stages and sends its share (:func:`stage_and_send`); the driver publishes the version. The
        one holder that is the driver itself (the torch trainer) sends as :meth:`transfer` does, zero-copy included."""
        if isinstance(holders, InProcessHolders) and self._zero_copy_applies():
            return await self._transfer_in_process(holders, version=version, checksum=checksum)
        started = time.perf_counter()
        async with weight_update_sessions(self._session_clients()):  # the holders load SGLang's engines inside it
            results = await asyncio.to_thread(
                holders.run_task, f"{__name__}:stage_and_send", digests=checksum, **self._holder_arguments(version)
            )
        digests = merged_digests(results)
        await self.publish_version(version)
        self._published_by_holders = (holders, version, [result["staged"] for result in results])
        self._holder_files.update(file for result in results for file in result["files"])
        report = self.report(version=version, num_bytes=sum(r["bytes"] for r in results), started=started)
        return TransferReport(**{**report.__dict__, "checksum": combine_digests(digests) if checksum else None})

    async def _transfer_in_process(self, holders: InProcessHolders, *, version: int, checksum: bool) -> TransferReport:
        tensors = [(name, tensor.detach().contiguous().cpu()) for name, tensor in holders.named_tensors()]
        report = await self._transfer_zero_copy([tensors], version=version)
        self._published_by_holders = (holders, version, None)  # the engines serve from the staged file: it is kept
        if not checksum:
            return report
        digest = combine_digests({name: tensor_digest(name, tensor) for name, tensor in tensors})
        return TransferReport(**{**report.__dict__, "checksum": digest})

    async def republish(self, version: int) -> None:
        """The holders send the shares they kept of ``version`` again (or, for the driver's own zero-copy transfer,
        the engines map the file they served it from), and every engine serves it."""
        if self._published_by_holders is None or self._published_by_holders[1] != version:
            raise MilesError(f"tensor: version {version} was not sent by the trainer's holders, nothing to resend")
        holders, _, staged = self._published_by_holders
        if staged is None:
            served = self._served_zero_copy
            await self.on_each_engine(
                lambda client: client.update_weights_from_staging(
                    staging_path=str(served.path), buffer_size=served.buffer_size, layout=served.layout, swap=True
                )
            )
        else:
            async with weight_update_sessions(self._session_clients()):
                await asyncio.to_thread(
                    holders.run_task, f"{__name__}:resend_staged", staged=staged, **self._holder_arguments(version)
                )
        await self.publish_version(version)

    def _zero_copy_applies(self) -> bool:
        """Zero copy needs every engine on this node and serving from a staging file itself (the local engine)."""
        serve_from_file = all(engine.capabilities.serves(STAGING_SWAP) for engine in self.engines)
        return (
            self.settings.zero_copy and bool(self.clients) and serve_from_file and all(map(self._local, self.clients))
        )

    def _holder_arguments(self, version: int) -> dict:
        return {
            "engines": [endpoint.to_wire() for endpoint in self.engines],
            "shm_dir": str(self.shm_dir),
            "shared_memory": self.settings.shared_memory,
            "version": version,
            "verify_samples": self.verify_samples,
            "held_dtype": self.settings.held_dtype,
        }

    async def _held_dtypes(self) -> list[dict[str, tuple[str, int]]]:
        """What each engine on this machine holds its parameters in (see :func:`staging_dtypes`; nothing without
        ``held_dtype``)."""
        if not self.settings.held_dtype:
            return []
        local = [(c, e) for c, e in zip(self.clients, self.engines, strict=True) if self._local(c)]
        asked = (held_dtypes(client, engine, open_session=True) for client, engine in local)
        return list(await asyncio.gather(*asked))

    def _stage(
        self, tensors: list[tuple[str, torch.Tensor]], slot: int, dtypes: dict[str, torch.dtype] | None = None
    ) -> Staged:
        """Copy the bucket into staging file ``slot`` (grown when too small; ``dtypes``: tensors cast on the way);
        returns where it lies."""
        layout = StagingLayout.of(tensors, dtypes=dtypes)
        current = self._staging[slot]
        if current is None or current[1].numel() < layout.size:
            self._drop_staging(slot)
            remove_orphan_files(self.shm_dir, STAGING_PREFIX)
            path = self.shm_dir / f"{STAGING_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
            self._staging[slot] = (path, _new_staging_file(path, layout.size))
        path, buffer = self._staging[slot]
        _copy_into(buffer, layout, tensors)
        return Staged(path=path, buffer_size=buffer.numel(), layout=layout)

    async def _send_all(self, tensors: list, staged: Staged | None, *, last: bool, version: str | None) -> None:
        """One batch to every engine (``version``: the version the engines serve once the last batch is in)."""
        await asyncio.gather(
            *(
                self._send(c, e, tensors, staged, last=last, version=version)
                for c, e in zip(self.clients, self.engines, strict=True)
            )
        )

    async def _send(
        self,
        client: EngineClient,
        engine: EngineEndpoint,
        tensors: list,
        staged: Staged | None,
        *,
        last: bool,
        version: str | None,
    ) -> None:
        if staged is None or not self._local(client):
            for chunk in bucketize(tensors, HTTP_SEND_BYTES):
                await client.update_weights_from_tensor(dict(chunk))
            return
        await load_staged(
            client,
            engine,
            staging_path=staged.path,
            buffer_size=staged.buffer_size,
            layout=staged.layout,
            weight_version=version,
            flush_cache=last,  # the cache of the old weights: flushed once, when the last batch is in
        )

    def _drop_staging(self, slot: int) -> None:
        current = self._staging[slot]
        if current is not None:
            current[0].unlink(missing_ok=True)
            self._staging[slot] = None

    async def close(self) -> None:
        for slot in range(len(self._staging)):
            self._drop_staging(slot)
        for file in self._holder_files:  # the holders' files on this machine (elsewhere: removed as orphans later)
            Path(file).unlink(missing_ok=True)
        await super().close()


# -- the holders' side ------------------------------------------------------------------------------------------

HTTP_SEND_BYTES = 64 << 20
"""The most bytes sent an engine on another machine in one request (as safetensors bytes in a JSON body)."""


def stage_and_send(
    share: NamedTensorShare,
    *,
    holder: int,
    holders: int,
    engines: list[dict],
    shm_dir: str,
    shared_memory: bool | None,
    version: int,
    digests: bool = True,
    verify_samples: int = 0,
    held_dtype: bool = True,
) -> dict:
    """The holder task of ``tensor``: stage this holder's share into a staging file of its own (each matrix in the
    dtype the engines on this machine hold it in, with ``held_dtype``) and send it to every engine; the staged file,
    the names' digests (``None`` without ``digests``), the bytes and the holder's staging files. Two files alternate
    between versions, mapped once: the published version's stays as it is (:func:`resend_staged` reads it) while
    the next is staged into the other."""
    tensors = [(name, tensor.detach().contiguous().cpu()) for name, tensor in share]
    held = asyncio.run(_held_on_this_node(engines, shared_memory)) if held_dtype else []
    layout = StagingLayout.of(tensors, dtypes=staging_dtypes(tensors, held))
    path, buffer = _holder_staging_file(Path(shm_dir), holder, version % 2, layout.size)
    _copy_into(buffer, layout, tensors)
    staged = {"path": str(path), "buffer_size": buffer.numel(), "layout": layout.to_wire()}
    asyncio.run(_send_share(engines, tensors, staged, shared_memory, verify_samples=verify_samples, version=version))
    return {
        "staged": staged,
        "digests": {name: tensor_digest(name, tensor) if digests else None for name, tensor in tensors},
        "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
        "files": [str(file) for file, _ in _HOLDER_STAGING.values() if file.parent == Path(shm_dir)],
    }


_HOLDER_STAGING: dict[tuple[str, int, int], tuple[Path, torch.Tensor]] = {}
"""This process's holder staging files by (directory, holder, slot), each mapped."""


def _holder_staging_file(directory: Path, holder: int, slot: int, size: int) -> tuple[Path, torch.Tensor]:
    """Staging file ``slot`` of ``holder``, of at least ``size`` bytes: the one mapped before unless it is too small
    or was removed (by the protocol's ``close``)."""
    key = (str(directory), holder, slot)
    current = _HOLDER_STAGING.get(key)
    if current is None or current[1].numel() < size or not current[0].exists():
        if current is not None:
            current[0].unlink(missing_ok=True)
        remove_orphan_files(directory, STAGING_PREFIX)
        path = directory / f"{STAGING_PREFIX}{os.getpid()}-holder{holder}-{uuid.uuid4().hex}"
        current = _HOLDER_STAGING[key] = (path, _new_staging_file(path, size))
    return current


async def _held_on_this_node(engines: list[dict], shared_memory: bool | None) -> list[dict[str, tuple[str, int]]]:
    """:func:`held_dtypes` of each engine on this machine (the ones that load the holder's staging file)."""

    async def held(endpoint: EngineEndpoint) -> dict[str, tuple[str, int]]:
        async with EngineClient(endpoint.url, admin_key=endpoint.admin_key, name=endpoint.name) as client:
            return await held_dtypes(client, endpoint, open_session=False)  # the driver opened it

    endpoints = [EngineEndpoint.from_wire(engine) for engine in engines]
    return list(await asyncio.gather(*(held(e) for e in endpoints if on_sender_node(e.url, shared_memory))))


def resend_staged(
    share: NamedTensorShare,
    *,
    holder: int,
    holders: int,
    staged: list[dict],
    engines: list[dict],
    shm_dir: str,
    shared_memory: bool | None,
    version: int,
    verify_samples: int = 0,
    held_dtype: bool = True,  # the staged file is sent as it was staged
) -> dict:
    """The holder task of :meth:`TensorProtocol.republish`: send the staged file of this holder's share again (its
    share, the weights as they are now, is not read: they may have moved on since ``version``)."""
    mine = staged[holder]
    layout = StagingLayout.from_wire(mine["layout"])
    buffer = map_staging_file(mine["path"], mine["buffer_size"])
    tensors = [(name, view.clone()) for name, view in layout.views(buffer).items()]
    asyncio.run(_send_share(engines, tensors, mine, shared_memory, verify_samples=verify_samples, version=version))
    return {"resent": len(tensors)}


async def _send_share(
    engines: list[dict],
    tensors: list[tuple[str, torch.Tensor]],
    staged: dict,
    shared_memory: bool | None,
    *,
    verify_samples: int = 0,
    version: int = 0,
) -> None:
    """The staged file's layout to engines on this machine, the tensors' bytes (in requests of at most
    :data:`HTTP_SEND_BYTES`) to the others; then ``verify_samples`` of the share read back from the engines that
    report parameters (inside the session the driver opened)."""
    layout = StagingLayout.from_wire(staged["layout"])
    sampled = sample_names([name for name, _ in tensors], count=verify_samples, version=version)

    async def send(endpoint: EngineEndpoint) -> None:
        async with EngineClient(endpoint.url, admin_key=endpoint.admin_key, name=endpoint.name) as client:
            if on_sender_node(endpoint.url, shared_memory):
                await load_staged(
                    client, endpoint, staging_path=staged["path"], buffer_size=staged["buffer_size"], layout=layout
                )
            elif not endpoint.capabilities.serves(TENSOR_BYTES):
                # raises, naming the engine and what reaches it
                route_for(TensorProtocol, f"engine {endpoint.name}", endpoint.capabilities, same_node=False)
            else:
                for chunk in bucketize(tensors, HTTP_SEND_BYTES):
                    await client.update_weights_from_tensor(dict(chunk))
            if sampled and endpoint.capabilities.serves(WEIGHTS_BY_NAME):
                share = dict(tensors)
                await verify_sampled(client, endpoint, {name: share[name] for name in sampled}, version=version)

    await asyncio.gather(*(send(EngineEndpoint.from_wire(engine)) for engine in engines))


def with_last(items: Iterator[T]) -> Iterator[tuple[T, bool]]:
    """Each item of ``items`` and whether it is the last (one item read ahead)."""
    previous = next(items, _NOTHING)
    while previous is not _NOTHING:
        following = next(items, _NOTHING)
        yield previous, following is _NOTHING
        previous = following


_NOTHING = object()


def on_sender_node(url: str, shared_memory: bool | None) -> bool:
    """Whether an engine at ``url`` shares this process's memory (``shared_memory`` forces the answer)."""
    return shared_memory if shared_memory is not None else is_this_node(urlparse(url).hostname)


def _new_staging_file(path: Path, size: int) -> torch.Tensor:
    """A new staging file of ``size`` bytes at ``path``, mapped (a file of no bytes cannot be mapped: at least 1)."""
    size = max(size, 1)
    with open(path, "wb") as staging_file:
        staging_file.truncate(size)
    return map_staging_file(path, size)


def _copy_into(buffer: torch.Tensor, layout: StagingLayout, tensors: list[tuple[str, torch.Tensor]]) -> None:
    for (_, tensor), target in zip(tensors, layout.views(buffer).values(), strict=True):
        target.copy_(tensor)
