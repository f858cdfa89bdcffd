"""``disk``: the weights are written as a safetensors checkpoint per version; engines load it with
``/update_weights_from_disk`` (which SGLang servers implement too).

Given the trainer's buckets (:meth:`DiskProtocol.transfer`), the driver writes one file. Given its holders
(:meth:`DiskProtocol.transfer_from_holders`), each holder writes its share as one shard of a sharded checkpoint
(:func:`write_shard`, run where the weights are) and the driver writes only ``model.safetensors.index.json`` from the
names the holders report: no weight passes through the driver. A restarted engine loads the last version from disk.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pydantic
from safetensors.torch import save_file

from miles_core.bounds import MAX_KEPT_VERSIONS
from miles_core.errors import MilesError
from miles_core.weight_transfer.digests import combine_digests, tensor_digest
from miles_core.weight_transfer.holders import NamedTensorShare, WeightHolders, merged_digests
from miles_core.weight_transfer.http_engines import HttpEngineProtocol
from miles_core.weight_transfer.protocol import (
    SendsFromHolders,
    TransferReport,
    WeightBucket,
)
from miles_core.weight_transfer.routes import DISK
from miles_core.weight_transfer.settings import ProtocolSettings
from miles_core.workers.provider import SharedPath

INDEX_FILE = "model.safetensors.index.json"


def shard_file_name(holder: int, holders: int) -> str:
    """The shard a holder writes, named as transformers names the shards of a checkpoint."""
    return f"model-{holder + 1:05d}-of-{holders:05d}.safetensors"


def write_shard(
    share: NamedTensorShare, *, holder: int, holders: int, directory: str, digests: bool = True
) -> dict[str, Any]:
    """The holder task of ``disk``: write this holder's share to its shard in ``directory``; the names written, each
    with its digest (``None`` without ``digests``), and the bytes."""
    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in share}
    file = shard_file_name(holder, holders)
    metadata = {"format": "pt", "holder": str(holder), "holder_pid": str(os.getpid())}
    save_file(tensors, str(Path(directory) / file), metadata=metadata)
    return {
        "file": file,
        "digests": {name: tensor_digest(name, tensor) if digests else None for name, tensor in tensors.items()},
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
    }


def write_index(directory: str | Path, results: list[dict[str, Any]]) -> dict[str, str | None]:
    """Write ``model.safetensors.index.json`` for the shards :func:`write_shard` wrote (``results``, one per holder);
    the digests by name. A name two holders wrote is a :class:`MilesError`."""
    digests = merged_digests(results)
    weight_map = {name: result["file"] for result in results for name in result["digests"]}
    total = sum(result["bytes"] for result in results)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (Path(directory) / INDEX_FILE).write_text(json.dumps(index, indent=1))
    return digests


class DiskSettings(ProtocolSettings):
    """The settings of ``disk``."""

    example = '{"work_dir": "/shared/miles-weights", "keep_versions": 1}'

    work_dir: str | None = pydantic.Field(
        default=None,
        description="The directory the versions are written to, which every engine's node must see; null: a new "
        "temporary directory, removed when the run ends.",
    )
    keep_versions: int = pydantic.Field(
        default=2,
        ge=1,
        le=MAX_KEPT_VERSIONS,
        description="The versions kept on disk (at most 64: each is a whole copy of the model's weights).",
    )


class DiskProtocol(HttpEngineProtocol, SendsFromHolders):
    name = "disk"
    routes_same_node = (DISK,)
    routes_other_node = (DISK,)

    settings_model = DiskSettings
    settings: DiskSettings

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.work_dir = Path(self.settings.work_dir or tempfile.mkdtemp(prefix="miles-disk-"))

    def shared_directories(self) -> list[SharedPath]:
        return [
            SharedPath(
                str(self.work_dir.absolute()),
                what="the disk protocol's work directory",
                setting="weight_transfer.settings work_dir (--weight-transfer-settings '{work_dir: DIR}')",
                owned=True,
            )
        ]

    async def transfer(self, buckets: Iterable[WeightBucket], *, version: int) -> TransferReport:
        started = time.perf_counter()
        tensors = {name: tensor.detach().contiguous().cpu() for bucket in buckets for name, tensor in bucket}
        partial = self._partial_dir(version)
        save_file(tensors, str(partial / "model.safetensors"))
        await self._publish(partial, version)
        return self.report(
            version=version, num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()), started=started
        )

    async def transfer_from_holders(
        self, holders: WeightHolders, *, version: int, checksum: bool = False
    ) -> TransferReport:
        """Each holder writes its shard, the driver the index of the shards, then every engine loads them."""
        started = time.perf_counter()
        partial = self._partial_dir(version)
        results = await asyncio.to_thread(
            holders.run_task, f"{__name__}:write_shard", directory=str(partial), digests=checksum
        )
        digests = write_index(partial, results)
        num_bytes = sum(result["bytes"] for result in results)
        await self._publish(partial, version)
        report = self.report(version=version, num_bytes=num_bytes, started=started)
        return TransferReport(**{**report.__dict__, "checksum": combine_digests(digests) if checksum else None})

    async def republish(self, version: int) -> None:
        """Every engine loads ``version`` again from its directory (kept on disk for restarted engines)."""
        directory = self.work_dir / f"v{version}"
        if not directory.is_dir():
            raise MilesError(f"disk: version {version} is no longer in {self.work_dir} to load into an engine")
        await self.on_each_engine(lambda c: c.update_weights_from_disk(str(directory), weight_version=str(version)))

    async def close(self) -> None:
        """Remove the temporary work directory with its versions (a directory a user set keeps them)."""
        if self.settings.work_dir is None:  # made by __init__; a user's directory keeps the last versions
            shutil.rmtree(self.work_dir, ignore_errors=True)
        await super().close()

    def _partial_dir(self, version: int) -> Path:
        partial = self.work_dir / f".v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        return partial

    async def _publish(self, partial: Path, version: int) -> None:
        """Move a written version into place, have every engine load it, drop the versions beyond those kept."""
        directory = self.work_dir / f"v{version}"
        shutil.rmtree(directory, ignore_errors=True)
        partial.rename(directory)
        await self.on_each_engine(lambda c: c.update_weights_from_disk(str(directory), weight_version=str(version)))
        for old in sorted(self.work_dir.glob("v*"), key=lambda p: int(p.name[1:]))[: -self.settings.keep_versions]:
            shutil.rmtree(old, ignore_errors=True)
