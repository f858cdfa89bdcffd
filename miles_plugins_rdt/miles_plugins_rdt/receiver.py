"""``StagingReceiver``: the Ray actor that receives weights for one engine rank, next to that engine.

Why a Ray actor beside the engine rather than the engine itself: engines are command workers (an SGLang-API server
process) that the Ray provider's actor starts and supervises, so Ray Direct Transport cannot reach into their
memory. The receiver runs on the engine's node and owns the engine rank's staging: two fixed-size uint8 buckets,
each backed by a shared-memory file and registered once with NIXL. A version's tensors move P2P from the trainer
straight into one bucket (NIXL reads into it; gloo receives and copies into it) while the engine serves from the
other; once every engine rank holds everything, the trainer has the engine point its weights at the new bucket
(``/update_weights_from_staging`` with ``swap``: the pages are mapped by both processes, nothing is copied or
pickled) and set the version in the same step. The receiver also checks, once, that a Ray actor hosts its engine.
An engine rank's other receive lanes are receivers that map the first one's buckets and read their share of each
large wave in their own process.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil
import ray
import torch

from miles_core import StagingLayout, map_staging_file, remove_orphan_files, weight_staging_dir
from miles_plugins_rdt.nixl_agent import configure_nixl_agents

RECEIVE_PREFIX = "miles-rdt-"
"""A receiver's buckets are ``miles-rdt-<its pid>-...`` in the staging directory."""

ENGINE_CHECKS = 10
"""Looks at the engine's process tree, 0.5 s apart, before :meth:`StagingReceiver.check_engine` refuses it."""


@ray.remote(num_cpus=0, max_restarts=0, enable_tensor_transport=True)
class StagingReceiver:
    """Owns one engine rank's staging buckets and receives its share of every wave into them."""

    def __init__(
        self, *, engine_name: str, engine_url: str, capacity: int, transport: str, paths: list[str] | None = None
    ) -> None:
        """``paths``: the staging files of the engine's first receiver, for another receive lane of the same
        engine (it reads its share of every chunk into the same buckets); without them, new staging files."""
        self.engine_name, self.engine_url, self.capacity, self.transport = engine_name, engine_url, capacity, transport
        self.owns_files = paths is None  # the first receiver creates and removes them; lanes only map them
        if paths is None:
            # In the user's staging directory: the only place the engine accepts staging files from.
            staging = weight_staging_dir()
            remove_orphan_files(staging, RECEIVE_PREFIX)  # a dead receiver's buckets (its process was killed)
            self.paths = [staging / f"{RECEIVE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}" for _ in range(2)]
            self.buckets = [self._new_bucket(path) for path in self.paths]
        else:
            self.paths = [Path(path) for path in paths]
            self.buckets = [map_staging_file(path, self.capacity) for path in self.paths]
        if transport == "nixl":
            from ray.experimental import register_nixl_memory  # deferred: imports nixl

            configure_nixl_agents(progress_thread=False)  # before this process's agent exists: Ray's fetch polls
            for bucket in self.buckets:
                register_nixl_memory(bucket)  # once: every version lands in registered memory
        # A full garbage collection walks every object this Ray worker holds (torch, Ray, nixl): it took 175 ms,
        # once every few transfers, in the middle of a switch. What is alive now (modules, the agent, the buckets)
        # lives as long as the worker: freeze it, so that collections walk only what later calls allocate.
        gc.collect()
        gc.freeze()

    def _new_bucket(self, path: Path) -> torch.Tensor:
        with open(path, "wb") as staging_file:
            staging_file.truncate(self.capacity)
        bucket = map_staging_file(path, self.capacity)
        # Give the file its pages now: a transfer into pages not yet there faults once per 4 KiB page, which made
        # the first transfer into each bucket 4x slower (0.6 GB/s against 2.6 for 272 MiB).
        bucket.zero_()
        return bucket

    def staging_paths(self) -> list[str]:
        """The staging files, for the engine's other receive lanes."""
        return [str(path) for path in self.paths]

    def check_engine(self) -> dict[str, Any]:
        """The engine's pid and the Ray actor process that hosts it; an error when no Ray actor hosts it. Looked at
        again for a few seconds before that error: one CI run saw a Ray-hosted engine's ancestors without a
        ``ray::`` title once (a process tree in transition), which later looks found."""
        for _ in range(ENGINE_CHECKS - 1):
            with contextlib.suppress(RuntimeError):
                return self._engine_host()
            time.sleep(0.5)
        return self._engine_host()

    def _engine_host(self) -> dict[str, Any]:
        port = urlparse(self.engine_url).port
        listening = [
            c.pid
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
        ]
        if not listening:
            raise RuntimeError(
                f"no process on this Ray node ({ray.util.get_node_ip_address()}) listens on port "
                f"{port} of engine {self.engine_name} ({self.engine_url})"
            )
        process = psutil.Process(listening[0])
        for ancestor in [process, *process.parents()]:
            title = " ".join(ancestor.cmdline()[:1])
            if title.startswith("ray::"):
                return {"engine_pid": process.pid, "host_pid": ancestor.pid, "host": title}
        raise RuntimeError(
            f"engine {self.engine_name} ({self.engine_url}, pid {process.pid}) is not hosted by a Ray actor: the rdt "
            f"protocol needs engines started by the Ray worker provider (--run-worker-provider ray)"
        )

    def receive_nixl(self, boxed_ref: list, pieces: list[list[int]], slot: int, timeout_s: float | None = None) -> int:
        """Pull one lane's share of a chunk (an RDT object of byte ranges, wrapped in a list so Ray does not fetch
        it into fresh memory) straight into staging bucket ``slot`` at the ``[offset, nbytes]`` of ``pieces``; an
        error naming the engine and this node when the read has not finished within ``timeout_s``."""
        from ray.experimental import set_target_for_ref  # deferred: RDT internals

        bucket = self.buckets[slot]
        targets = [bucket[offset : offset + nbytes] for offset, nbytes in pieces]  # held: Ray keeps weak references
        set_target_for_ref(boxed_ref[0], targets)
        try:
            received = ray.get(boxed_ref[0], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"engine {self.engine_name}: a receive lane on node {ray.util.get_node_ip_address()} read "
                f"{sum(nbytes for _, nbytes in pieces)} bytes of the trainer's RDT object for {timeout_s:g} s without "
                f"finishing (the timeout_s setting): is the sender's node address reachable from this node?"
            ) from None
        if any(got.data_ptr() != want.data_ptr() for got, want in zip(received, targets, strict=True)):
            raise RuntimeError(f"engine {self.engine_name}: Ray received the chunk outside the staging bucket")
        return sum(nbytes for _, nbytes in pieces)

    def receive_gloo(self, tensors: list[torch.Tensor], layout: StagingLayout, slot: int) -> int:
        """A chunk that Ray received over gloo before this call, laid into staging bucket ``slot`` as ``layout``."""
        for target, tensor in zip(layout.views(self.buckets[slot]).values(), tensors, strict=True):
            target.copy_(tensor)
        return sum(entry.nbytes for entry in layout.tensors)

    def load_into_sglang(
        self, *, slot: int, layout: dict, endpoint: dict, version: int, verify_samples: int = 0
    ) -> int:
        """Have the SGLang engine beside this receiver copy staging bucket ``slot`` (``layout``) into its weights, in
        one weight-update session, and read ``verify_samples`` parameters back against the bucket's bytes; the
        tensors loaded."""
        import asyncio  # deferred: only for SGLang engines

        from miles_core import (
            EngineClient,
            EngineEndpoint,
            load_staged,
            sample_names,
            verify_sampled,
            weight_update_sessions,
        )

        target, staged = EngineEndpoint.from_wire(endpoint), StagingLayout.from_wire(layout)
        views = staged.views(self.buckets[slot])

        async def load() -> None:
            client = EngineClient(target.url, admin_key=target.admin_key, name=target.name)
            async with client, weight_update_sessions([client]):
                await load_staged(
                    client, target, staging_path=self.paths[slot], buffer_size=self.capacity, layout=staged
                )
                names = sample_names(list(views), count=verify_samples, version=version)
                await verify_sampled(client, target, {name: views[name] for name in names}, version=version)

        asyncio.run(load())
        return len(views)

    def close(self) -> None:
        """Remove the staging files (an engine that maps one keeps its pages until it lets go of them)."""
        self._remove_files()

    def __del__(self) -> None:
        self._remove_files()

    def _remove_files(self) -> None:
        if getattr(self, "owns_files", False):
            for path in self.paths:
                Path(path).unlink(missing_ok=True)
