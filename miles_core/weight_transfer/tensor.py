"""``tensor``: each bucket travels as safetensors bytes in ``/update_weights_from_tensor``; to engines on this
machine (``shared_memory``, the default when the engine's host is loopback) the bytes go through a file in
``/dev/shm`` instead of the HTTP body."""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlparse

from safetensors.torch import save_file

from miles_core.engines.client import EngineClient
from miles_core.weight_transfer.http_engines import HttpEngineProtocol
from miles_core.weight_transfer.protocol import TransferReport, WeightBucket

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class TensorProtocol(HttpEngineProtocol):
    name = "tensor"

    def __init__(self, *, shared_memory: bool | None = None, shm_dir: str | None = None) -> None:
        super().__init__(shared_memory=shared_memory, shm_dir=shm_dir)
        self.shared_memory = shared_memory
        self.shm_dir = Path(shm_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()))

    def _local(self, client: EngineClient) -> bool:
        if self.shared_memory is not None:
            return self.shared_memory
        return urlparse(client.url).hostname in LOOPBACK

    async def transfer(self, buckets: Iterable[WeightBucket], *, version: int) -> TransferReport:
        started = time.perf_counter()
        num_bytes = 0
        for bucket in buckets:
            tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in bucket}
            num_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
            await self.on_each_engine(lambda client, tensors=tensors: self._send(client, tensors))
        await self.publish_version(version)
        return self.report(version=version, num_bytes=num_bytes, started=started)

    async def _send(self, client: EngineClient, tensors: dict) -> None:
        if not self._local(client):
            await client.update_weights_from_tensor(tensors)
            return
        path = self.shm_dir / f"miles-weights-{uuid.uuid4().hex}.safetensors"
        save_file(tensors, str(path))
        try:
            await client._control("/update_weights_from_tensor", serialized_named_tensors=[str(path)],
                                  load_format="safetensors_path")  # fmt: skip
        finally:
            path.unlink(missing_ok=True)  # the engine removes it after loading; this covers failures
