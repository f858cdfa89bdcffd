"""``sharded-disk``: each bucket becomes one shard of a sharded HF checkpoint that engines load from disk."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pydantic
from safetensors.torch import save_file

from miles_core import (
    MAX_KEPT_VERSIONS,
    EngineEndpoint,
    MilesError,
    ProtocolSettings,
    TransferReport,
    WeightBucket,
    WeightTransferProtocol,
)

INDEX_FILE = "model.safetensors.index.json"


class ShardedDiskSettings(ProtocolSettings):
    """The settings of ``sharded-disk``: declared, so the core validates them when the config is built and names a
    refused one, its value and what is allowed."""

    example = '{"directory": "/data/weights", "keep_versions": 3}'

    directory: str | None = pydantic.Field(
        default=None, description="Where versions are written; null: a temporary directory, removed at close."
    )
    keep_versions: int = pydantic.Field(
        default=2,
        ge=1,
        le=MAX_KEPT_VERSIONS,
        description="How many version directories to keep (at most 64: each is a whole copy of the weights).",
    )
    timeout_s: float = pydantic.Field(
        default=600.0, gt=0, description="Seconds an engine may take to load a version from disk."
    )


class ShardedDiskProtocol(WeightTransferProtocol):
    """Writes a sharded safetensors checkpoint per version and calls ``/update_weights_from_disk`` on every engine."""

    name = "sharded-disk"

    settings_model = ShardedDiskSettings
    settings: ShardedDiskSettings

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)  # validated against ShardedDiskSettings (the core refuses bad ones)
        self._owned_tmp = self.settings.directory is None
        self.directory = Path(self.settings.directory or tempfile.mkdtemp(prefix="miles-sharded-disk-"))
        self.engines: list[EngineEndpoint] = []

    async def connect(self, engines: Sequence[EngineEndpoint]) -> None:
        self.engines = list(engines)
        self.directory.mkdir(parents=True, exist_ok=True)

    async def transfer(self, buckets: Iterable[WeightBucket], *, version: int) -> TransferReport:
        start = time.perf_counter()
        version_dir, num_bytes = self.write_version(buckets, version=version)
        await asyncio.gather(*(self._load(engine, version_dir, version) for engine in self.engines))
        self._prune(keep=version_dir)
        return TransferReport(
            protocol=self.name,
            version=version,
            num_bytes=num_bytes,
            seconds=time.perf_counter() - start,
            num_engines=len(self.engines),
        )

    def write_version(self, buckets: Iterable[WeightBucket], *, version: int) -> tuple[Path, int]:
        """Write the buckets as shards of ``directory/v{version}``; returns the directory and the tensor bytes."""
        version_dir = self.directory / f"v{version}"
        staging = self.directory / f".v{version}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        shards: list[tuple[str, list[str]]] = []
        num_bytes = 0
        for index, bucket in enumerate(buckets):
            shard_name = f"shard-{index:05d}.safetensors"
            save_file({name: tensor.contiguous() for name, tensor in bucket}, str(staging / shard_name))
            shards.append((shard_name, [name for name, _ in bucket]))
            num_bytes += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
        weight_map = self._rename_shards(staging, shards)
        (staging / INDEX_FILE).write_text(
            json.dumps({"metadata": {"total_size": num_bytes}, "weight_map": weight_map}, indent=1)
        )
        shutil.rmtree(version_dir, ignore_errors=True)
        staging.rename(version_dir)  # engines only ever see a complete version directory
        return version_dir, num_bytes

    @staticmethod
    def _rename_shards(staging: Path, shards: list[tuple[str, list[str]]]) -> dict[str, str]:
        weight_map: dict[str, str] = {}
        for index, (shard_name, names) in enumerate(shards):
            final_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
            (staging / shard_name).rename(staging / final_name)
            weight_map.update(dict.fromkeys(names, final_name))
        return weight_map

    async def _load(self, engine: EngineEndpoint, version_dir: Path, version: int) -> None:
        payload: dict[str, Any] = {"model_path": str(version_dir), "weight_version": str(version)}
        async with httpx.AsyncClient(timeout=self.settings.timeout_s) as client:
            try:
                response = await client.post(
                    f"{engine.url}/update_weights_from_disk", json=payload, headers=engine.headers()
                )
            except httpx.TransportError as exc:  # the engine is down: a failed transfer, which the run retries
                raise MilesError(f"engine {engine.name} ({engine.url}) did not take weights v{version}: {exc}") from exc
        body = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
        if response.status_code != 200 or not body.get("success", False):
            raise MilesError(
                f"engine {engine.name} ({engine.url}) refused weights v{version} from {version_dir}: "
                f"HTTP {response.status_code} {body.get('message') or response.text[:500]}"
            )

    def _prune(self, *, keep: Path) -> None:
        versions = sorted(
            (p for p in self.directory.glob("v*") if p.is_dir() and p.name[1:].isdigit()),
            key=lambda p: int(p.name[1:]),
        )
        for old in versions[: -self.settings.keep_versions]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

    async def close(self) -> None:
        if self._owned_tmp:
            shutil.rmtree(self.directory, ignore_errors=True)
