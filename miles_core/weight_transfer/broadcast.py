"""``broadcast``: a process group of its own between the trainer (rank 0) and every engine (ranks 1..N), with
SGLang's handshake: ``/init_weights_update_group`` once; per update ``/begin_weight_update``, then per bucket
``/update_weights_from_distributed`` (names, dtypes, shapes) while the trainer broadcasts the tensors, then
``/end_weight_update``.

An engine that refuses a bucket (or does not answer within ``timeout_s``) would leave the trainer's broadcast
waiting for a rank that never joins: the update fails at once naming that engine, and the group is rebuilt at the
next connect.

The group's backend is the setting ``backend``: ``auto`` (the default) is NCCL where the trainer process has a CUDA
device and gloo otherwise; ``nccl`` and ``gloo`` force one. NCCL needs every rank (trainer and each engine) on a
GPU of its own."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Sequence

from miles_core.engines.client import EngineError
from miles_core.engines.weights import broadcast, group_device, new_weight_update_group, resolve_group_backend
from miles_core.weight_transfer.http_engines import HttpEngineProtocol
from miles_core.weight_transfer.protocol import (
    EngineEndpoint,
    TransferReport,
    WeightBucket,
    check_setting,
    is_positive_number,
)
from miles_core.workers.process import free_ports

GROUP_NAME = "miles_weight_update"


class BroadcastProtocol(HttpEngineProtocol):
    name = "broadcast"

    def __init__(self, *, master_address: str = "127.0.0.1", timeout_s: float = 120.0, backend: str = "auto") -> None:
        check_setting(
            "broadcast",
            "master_address",
            master_address,
            valid=isinstance(master_address, str) and bool(master_address),
            allowed="this machine's address that the engines can reach (a non-empty string)",
        )
        check_setting(
            "broadcast",
            "timeout_s",
            timeout_s,
            valid=is_positive_number(timeout_s),
            allowed="a number of seconds above 0",
        )
        super().__init__(master_address=master_address, timeout_s=timeout_s, backend=backend)
        self.master_address = master_address
        self.timeout_s = timeout_s
        self.backend = resolve_group_backend(backend)  # a bad value fails here, before any engine is contacted
        self.device = group_device(self.backend)
        self.group = None

    async def connect(self, engines: Sequence[EngineEndpoint]) -> None:
        await self._destroy_group()  # a reconnect (say, after an engine restart) builds a new group
        await super().connect(engines)
        (port,) = free_ports(1, self.master_address)
        world_size = len(engines) + 1
        joins = [
            client.init_weights_update_group(
                master_address=self.master_address,
                master_port=port,
                rank_offset=rank + 1,
                world_size=world_size,
                group_name=GROUP_NAME,
                backend=self.backend,
            )
            for rank, client in enumerate(self.clients)
        ]
        self.group, *_ = await asyncio.gather(
            asyncio.to_thread(
                new_weight_update_group,
                master_address=self.master_address,
                master_port=port,
                rank=0,
                world_size=world_size,
                group_name=GROUP_NAME,
                timeout_s=self.timeout_s,
                backend=self.backend,
            ),
            *joins,
        )

    async def transfer(self, buckets: Iterable[WeightBucket], *, version: int) -> TransferReport:
        started = time.perf_counter()
        num_bytes = 0
        async with self._weight_update_session():
            for bucket in buckets:
                tensors = [(name, tensor.detach().to(self.device).contiguous()) for name, tensor in bucket]
                num_bytes += sum(t.numel() * t.element_size() for _, t in tensors)
                await self._broadcast_bucket(tensors)
        await self.publish_version(version)
        return self.report(version=version, num_bytes=num_bytes, started=started)

    @contextlib.asynccontextmanager
    async def _weight_update_session(self) -> AsyncIterator[None]:
        """Every engine's weight-update session open for the body, closed after it; never left open on one engine
        when another refused to open (a later update could not open it again)."""
        opened = await asyncio.gather(*(c.begin_weight_update() for c in self.clients), return_exceptions=True)
        failures = [result for result in opened if isinstance(result, BaseException)]
        if failures:
            opened_clients = [c for c, r in zip(self.clients, opened, strict=True) if not isinstance(r, BaseException)]
            await self._end_sessions(opened_clients)
            raise failures[0]
        try:
            yield
        except BaseException:
            await self._end_sessions(self.clients)
            raise
        await self.on_each_engine(lambda client: client.end_weight_update())

    @staticmethod
    async def _end_sessions(clients: list) -> None:
        """Close sessions on the way out of a failure (an engine that died cannot answer: that is not news)."""
        await asyncio.gather(*(client.end_weight_update() for client in clients), return_exceptions=True)

    async def _broadcast_bucket(self, tensors: list) -> None:
        """Send one bucket while every engine receives it; an engine that refuses or stays silent fails the update
        by name (the sender would otherwise wait for it forever)."""
        names = [n for n, _ in tensors]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in tensors]
        shapes = [list(t.shape) for _, t in tensors]
        receives = {
            asyncio.ensure_future(
                client.update_weights_from_distributed(names=names, dtypes=dtypes, shapes=shapes, group_name=GROUP_NAME)
            ): client.name
            for client in self.clients
        }
        send = asyncio.ensure_future(asyncio.to_thread(self._send, tensors))
        pending = set(receives)
        while pending:
            done, pending = await asyncio.wait(pending, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                silent = sorted(receives[task] for task in pending)
                self._abandon(pending, send)
                raise EngineError(
                    f"broadcast: engine(s) {', '.join(silent)} did not receive the weights within "
                    f"{self.timeout_s:.0f} s (timeout_s)"
                )
            for task in done:
                if task.exception() is not None:
                    self._abandon(pending, send)
                    raise EngineError(
                        f"broadcast: engine {receives[task]} did not join the broadcast, so the "
                        f"update stops: {task.exception()}"
                    ) from task.exception()
        await send

    @staticmethod
    def _abandon(pending: set, send: asyncio.Future) -> None:
        """Stop waiting. The sending thread ends when the group's own timeout expires (its error is the expected
        consequence, not news); the controller's retry reconnects, which builds a new group."""
        for task in pending:
            task.cancel()
        send.add_done_callback(lambda future: future.cancelled() or future.exception())

    def _send(self, tensors: list) -> None:
        for _, tensor in tensors:
            broadcast(self.group, tensor, root=0)

    async def close(self) -> None:
        await self._destroy_group()
        await super().close()

    async def _destroy_group(self) -> None:
        if self.group is not None and self.clients:
            await asyncio.gather(
                *(c.destroy_weights_update_group(GROUP_NAME) for c in self.clients), return_exceptions=True
            )
        self.group = None
