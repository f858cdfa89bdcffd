"""``broadcast``: process groups of their own between a sender (rank 0) and every engine (ranks 1..N), with SGLang's
handshake: ``/init_weights_update_group`` once per group; per update ``/begin_weight_update``, then per bucket
``/update_weights_from_distributed`` (names, dtypes, shapes) while the sender broadcasts the tensors, then
``/end_weight_update``.

Where the sending side runs:

* From the trainer's holders (:meth:`BroadcastProtocol.transfer_from_holders`; the Megatron ranks, or the driver
  for the torch trainer), each holder is the sender of a group of its own with the engines. An update is two holder
  tasks: every holder keeps a copy of its share (:func:`keep_share`, which also returns the buckets' names, dtypes
  and shapes and, when asked, the digests), then the holders broadcast what they kept one after the other
  (:func:`send_kept`; every engine is a member of every group, so the groups take turns), while the driver asks the
  engines to receive each bucket. The kept copy is what :meth:`BroadcastProtocol.republish` sends again to an engine
  that restarted, so the driver holds no weights.
* From the driver (:meth:`BroadcastProtocol.transfer`, the buckets of an ``HfWeightIterator``), the driver is the
  sender of one group.

An engine that refuses a bucket (or does not answer within ``timeout_s``) would leave the sender's broadcast
waiting for a rank that never joins: the update fails at once naming that engine, and the groups are rebuilt at
the next connect.

The groups' backend is the setting ``backend``: ``auto`` (the default) is NCCL where the trainer process has a CUDA
device and gloo otherwise; ``nccl`` and ``gloo`` force one. NCCL needs every rank (sender and each engine) on a GPU
of its own. Each group meets at its sender's node address (:func:`~miles_core.workers.node.node_address`): a
holder's group at the holder's node, the driver's at the driver's node unless ``master_address`` names another of the
driver machine's addresses. The sender opens the group's store socket on a free port there before the engines are
asked to join (:func:`reserve_master`), so the port cannot be taken in between; the store has no authentication and
listens on that one address alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import pydantic
import torch

from miles_core.bounds import MAX_HOST_CHARS, check_host, check_own_address
from miles_core.engines.client import EngineError
from miles_core.engines.weights import broadcast, group_device, new_weight_update_group, resolve_group_backend
from miles_core.errors import MilesError
from miles_core.training.weight_iterator import bucketize
from miles_core.weight_transfer.digests import combine_digests, tensor_digest
from miles_core.weight_transfer.holders import NamedTensorShare, WeightHolders, merged_digests
from miles_core.weight_transfer.http_engines import HttpEngineProtocol
from miles_core.weight_transfer.protocol import (
    EngineEndpoint,
    SendsFromHolders,
    TransferReport,
    WeightBucket,
)
from miles_core.weight_transfer.routes import DISTRIBUTED
from miles_core.weight_transfer.settings import ProtocolSettings
from miles_core.weight_transfer.staged_load import weight_update_sessions
from miles_core.workers.node import node_address
from miles_core.workers.process import listening_socket

logger = logging.getLogger(__name__)
GROUP_NAME = "miles_weight_update"
HOLDER_BUCKET_BYTES = 64 << 20
"""The most bytes of one bucket a holder broadcasts (each bucket is one ``/update_weights_from_distributed``)."""

BucketSpec = tuple[list[str], list[str], list[list[int]]]
"""A bucket as the engines receive it: names, dtype names, shapes."""


class BroadcastSettings(ProtocolSettings):
    """The settings of ``broadcast``."""

    example = '{"backend": "gloo", "timeout_s": 60}'

    master_address: str | None = pydantic.Field(
        default=None,
        min_length=1,
        max_length=MAX_HOST_CHARS,
        description="Where the driver's group meets: a host name or IP address (at most 253 characters) of the "
        "driver's machine that the engines can reach; when the run starts it must resolve to an address of that "
        "machine (it binds there). Only transfers from the driver use it: the trainer's holders meet at their own "
        "nodes (a run warns once when it is set and unused); null: the driver's node address.",
    )
    timeout_s: float = pydantic.Field(
        default=120.0,
        gt=0,
        description="Seconds an engine may take to join a group or to receive a bucket before the update fails.",
    )
    backend: Literal["auto", "gloo", "nccl"] = pydantic.Field(
        default="auto",
        description="The groups' backend: auto is NCCL where the trainer process has a CUDA device and gloo "
        "otherwise; NCCL needs a GPU for every rank.",
    )

    @pydantic.field_validator("master_address")
    @classmethod
    def _a_host(cls, value: str | None) -> str | None:
        return None if value is None else check_host(value)


class BroadcastProtocol(HttpEngineProtocol, SendsFromHolders):
    name = "broadcast"
    routes_same_node = (DISTRIBUTED,)
    routes_other_node = (DISTRIBUTED,)

    settings_model = BroadcastSettings
    settings: BroadcastSettings

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        if self.settings.master_address is not None:  # the driver binds it: refused before anything starts
            try:
                check_own_address(self.settings.master_address, setting="master_address")
            except ValueError as exc:
                raise MilesError(str(exc)) from None
        self._warned_unused = False
        self.backend = resolve_group_backend(self.settings.backend)  # NCCL without a CUDA device fails here
        self.device = group_device(self.backend)
        self.group = None  # the driver's own group (transfers of an iterator's buckets)
        self.key = uuid.uuid4().hex[:8]  # names this protocol's groups and its holders' kept shares
        self.generation = 0  # counts connects: every connect builds new groups
        self._engine_groups: list[str] = []  # the groups the engines joined since the last connect
        self._holders_joined: tuple[str, ...] | None = None  # the holders whose groups the engines joined
        self._kept: tuple[WeightHolders, int, list[list[BucketSpec]]] | None = None  # holders, version, buckets

    async def connect(self, engines: Sequence[EngineEndpoint]) -> None:
        """Remember the engines; every group is (re)built at the first transfer after this."""
        await self._destroy_groups()
        await super().connect(engines)

    # -- from the driver ------------------------------------------------------------------------------------

    async def transfer(self, buckets: Iterable[WeightBucket], *, version: int) -> TransferReport:
        started = time.perf_counter()
        await self._driver_group()
        num_bytes = 0
        async with weight_update_sessions(self.clients):
            for bucket in buckets:
                tensors = [(name, tensor.detach().to(self.device).contiguous()) for name, tensor in bucket]
                num_bytes += sum(t.numel() * t.element_size() for _, t in tensors)
                send = asyncio.ensure_future(asyncio.to_thread(self._send, tensors))
                await self._receive(bucket_spec(tensors), GROUP_NAME, send)
                await send
        await self.publish_version(version)
        return self.report(version=version, num_bytes=num_bytes, started=started)

    async def _driver_group(self) -> None:
        """The driver's own group with the engines, formed at the first transfer after a connect."""
        if self.group is None:
            address = self.settings.master_address or node_address()
            listener = reserve_master(address)

            def join(**group: Any) -> Any:
                return new_weight_update_group(**group, listener=listener)

            self.group = await self._form_group(GROUP_NAME, join, address=address, port=listener.getsockname()[1])

    def _send(self, tensors: list) -> None:
        for _, tensor in tensors:
            broadcast(self.group, tensor, root=0)

    # -- from the holders -----------------------------------------------------------------------------------

    async def transfer_from_holders(
        self, holders: WeightHolders, *, version: int, checksum: bool = False
    ) -> TransferReport:
        """Every holder keeps a copy of its share (:func:`keep_share`), then broadcasts it to every engine over its
        own group (:func:`send_kept`), one holder after the other; the driver publishes the version."""
        started = time.perf_counter()
        self._warn_master_address_unused()
        results = await asyncio.to_thread(
            holders.run_task,
            f"{__name__}:keep_share",
            key=self.key,
            version=version,
            bucket_bytes=HOLDER_BUCKET_BYTES,
            digests=checksum,
        )
        digests = merged_digests(results)
        self._kept = (holders, version, [result["buckets"] for result in results])
        await self._send_kept(version)
        report = self.report(version=version, num_bytes=sum(r["bytes"] for r in results), started=started)
        return dataclasses.replace(report, checksum=combine_digests(digests) if checksum else None)

    def _warn_master_address_unused(self) -> None:
        """Once per protocol: a ``master_address`` given where only the holders' groups run is not used."""
        if self.settings.master_address is not None and not self._warned_unused:
            self._warned_unused = True
            logger.warning(
                "broadcast: the setting master_address %r is not used: the weights go from the trainer's holders, "
                "whose groups meet at each holder's node; only transfers from the driver use master_address "
                "(remove it, or run a trainer without holders)",
                self.settings.master_address,
            )

    async def republish(self, version: int) -> None:
        """The holders broadcast the shares they kept of ``version`` again, to every engine."""
        if self._kept is None or self._kept[1] != version:
            raise MilesError(f"broadcast: version {version} was not sent by the trainer's holders, nothing to resend")
        await self._send_kept(version)

    async def _send_kept(self, version: int) -> None:
        holders, _, buckets = self._kept
        await self._join_holder_groups(holders, len(buckets))
        async with weight_update_sessions(self.clients):
            for holder, specs in enumerate(buckets):
                send = asyncio.ensure_future(
                    asyncio.to_thread(
                        holders.run_task, f"{__name__}:send_kept", key=self.key, sender=holder, version=version
                    )
                )
                for spec in specs:
                    await self._receive(spec, self._holder_group(holder), send)
                await send
        await self.publish_version(version)

    async def _join_holder_groups(self, holders: WeightHolders, count: int) -> None:
        """Each holder forms its group with the engines (once per connect), one group after the other: an engine
        joins one group at a time. A trainer hands out a new holders object per update: the same holders are the
        same processes (:meth:`WeightHolders.describe`)."""
        if self._holders_joined == tuple(holders.describe()):
            return
        for holder in range(count):
            reserved = await asyncio.to_thread(
                holders.run_task, f"{__name__}:reserve_holder_master", key=self.key, joiner=holder
            )

            def join(holder: int = holder, **group: Any) -> list[dict]:
                return holders.run_task(f"{__name__}:join_group", key=self.key, joiner=holder, **group)

            await self._form_group(self._holder_group(holder), join, **reserved[holder])
        self._holders_joined = tuple(holders.describe())

    def _holder_group(self, holder: int) -> str:
        return f"{GROUP_NAME}_{self.key}_{self.generation}_h{holder}"

    # -- groups and sessions --------------------------------------------------------------------------------

    async def _form_group(self, group_name: str, sender_joins: Any, *, address: str, port: int) -> Any:
        """Form ``group_name`` at the sender's ``address:port`` (reserved there): the sender (``sender_joins(**group)``,
        run in a thread) as rank 0, the engines as ranks 1..N; what the sender's join returns."""
        group = dict(
            master_address=address,
            master_port=port,
            world_size=len(self.engines) + 1,
            group_name=group_name,
            timeout_s=self.settings.timeout_s,
            backend=self.backend,
        )
        joins = [
            client.init_weights_update_group(
                master_address=address,
                master_port=port,
                rank_offset=rank + 1,
                world_size=len(self.engines) + 1,
                group_name=group_name,
                backend=self.backend,
            )
            for rank, client in enumerate(self.clients)
        ]
        self._engine_groups.append(group_name)
        joined, *_ = await asyncio.gather(asyncio.to_thread(sender_joins, rank=0, **group), *joins)
        return joined

    async def _receive(self, spec: BucketSpec, group_name: str, send: asyncio.Future) -> None:
        """Every engine receives one bucket over ``group_name`` while ``send`` broadcasts it. An engine that refuses
        or stays silent fails the update by name (the sender would otherwise wait for it forever), and so does a
        sender that fails."""
        names, dtypes, shapes = spec
        receives = {
            asyncio.ensure_future(
                client.update_weights_from_distributed(names=names, dtypes=dtypes, shapes=shapes, group_name=group_name)
            ): client.name
            for client in self.clients
        }
        pending = set(receives)
        while pending:
            watched = pending if send.done() else pending | {send}
            done, _ = await asyncio.wait(watched, timeout=self.settings.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if send.done() and not send.cancelled() and send.exception() is not None:
                self._abandon(pending, send)
                raise MilesError(f"broadcast: the sender of group {group_name} failed: {send.exception()}")
            if not done:
                silent = sorted(receives[task] for task in pending)
                self._abandon(pending, send)
                raise EngineError(
                    f"broadcast: engine(s) {', '.join(silent)} did not receive the weights within "
                    f"{self.settings.timeout_s:.0f} s (timeout_s)"
                )
            for task in done & pending:
                pending.discard(task)
                if task.exception() is not None:
                    self._abandon(pending, send)
                    raise EngineError(
                        f"broadcast: engine {receives[task]} did not join the broadcast, so the "
                        f"update stops: {task.exception()}"
                    ) from task.exception()

    @staticmethod
    def _abandon(pending: set, send: asyncio.Future) -> None:
        """Stop waiting. The sending thread ends when the group's own timeout expires (its error is the expected
        consequence, not news); the controller's retry reconnects, which builds new groups."""
        for task in pending:
            task.cancel()
        send.add_done_callback(lambda future: future.cancelled() or future.exception())

    async def close(self) -> None:
        await self._destroy_groups()
        for state_key in [k for k in _HOLDER_STATE if k[0] == self.key]:  # holders in this process (the driver)
            del _HOLDER_STATE[state_key]
        self._kept = None
        await super().close()

    async def _destroy_groups(self) -> None:
        if self._engine_groups and self.clients:
            await asyncio.gather(
                *(c.destroy_weights_update_group(name) for c in self.clients for name in self._engine_groups),
                return_exceptions=True,
            )
        self._engine_groups = []
        self.group = None
        self._holders_joined = None
        self.generation += 1


def bucket_spec(tensors: list[tuple[str, torch.Tensor]]) -> BucketSpec:
    """A bucket's names, dtype names and shapes, as ``/update_weights_from_distributed`` takes them."""
    return (
        [name for name, _ in tensors],
        [str(tensor.dtype).removeprefix("torch.") for _, tensor in tensors],
        [list(tensor.shape) for _, tensor in tensors],
    )


# -- the holders' side ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _HolderState:
    """What one holder keeps for one protocol: its group with the engines and its copy of the last version."""

    group: Any = None
    listener: socket.socket | None = None  # the next group's store socket, between reserve and join
    device: str = "cpu"
    version: int | None = None
    tensors: list[tuple[str, torch.Tensor]] = dataclasses.field(default_factory=list)


_HOLDER_STATE: dict[tuple[str, int], _HolderState] = {}
"""By (protocol key, holder index): one process may be several holders (tests) or the driver too."""


def reserve_master(address: str) -> socket.socket:
    """A group's store socket, listening on a free port of ``address`` (this process's node address) until the group
    forms."""
    return listening_socket(address, 0)


def reserve_holder_master(share: NamedTensorShare, *, holder: int, holders: int, key: str, joiner: int) -> dict:
    """The holder task in which holder ``joiner`` opens its group's store socket on its node's address (the others
    return at once): ``{"address", "port"}`` for the engines to join at."""
    if holder != joiner:
        return {}
    state = _HOLDER_STATE.setdefault((key, holder), _HolderState())
    state.listener = reserve_master(node_address())
    return {"address": node_address(), "port": state.listener.getsockname()[1]}


def join_group(share: NamedTensorShare, *, holder: int, holders: int, key: str, joiner: int, **group: Any) -> dict:
    """The holder task that forms holder ``joiner``'s group with the engines at the socket that
    :func:`reserve_holder_master` opened (the others return at once, their shares untouched): ``group`` is
    :func:`new_weight_update_group`'s arguments."""
    if holder != joiner:
        return {}
    state = _HOLDER_STATE.setdefault((key, holder), _HolderState())
    state.group = None  # the last connect's group goes first
    listener, state.listener = state.listener, None
    if listener is None:
        raise MilesError(f"broadcast holder {holder} has no reserved group address (reserve_holder_master first)")
    state.group = new_weight_update_group(**group, listener=listener)
    state.device = str(group_device(group["backend"]))
    return {"group": group["group_name"]}


def keep_share(
    share: NamedTensorShare, *, holder: int, holders: int, key: str, version: int, bucket_bytes: int, digests: bool
) -> dict:
    """The holder task that keeps a copy of this holder's share as ``version`` (the previous version's copy is let
    go first); the buckets the engines will receive, the names' digests (``None`` without ``digests``) and the
    bytes."""
    state = _HOLDER_STATE.setdefault((key, holder), _HolderState())
    state.tensors, state.version = [], None
    tensors = [(name, tensor.detach().cpu().clone(memory_format=torch.contiguous_format)) for name, tensor in share]
    state.tensors, state.version = tensors, version
    return {
        "buckets": [bucket_spec(bucket) for bucket in bucketize(tensors, bucket_bytes)],
        "digests": {name: tensor_digest(name, tensor) if digests else None for name, tensor in tensors},
        "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
    }


def send_kept(share: NamedTensorShare, *, holder: int, holders: int, key: str, sender: int, version: int) -> dict:
    """The holder task in which holder ``sender`` broadcasts its kept copy of ``version`` over its group (the others
    return at once, their shares untouched)."""
    if holder != sender:
        return {}
    state = _HOLDER_STATE.get((key, holder))
    if state is None or state.group is None:
        raise MilesError(f"broadcast holder {holder} has no group with the engines (join_group first)")
    if state.version != version:
        raise MilesError(f"broadcast holder {holder} keeps version {state.version}, not {version}")
    for _, tensor in state.tensors:
        broadcast(state.group, tensor.to(state.device), root=0)
    return {"bytes": sum(t.numel() * t.element_size() for _, t in state.tensors)}
