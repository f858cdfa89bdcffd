"""Adapter-only weight sync (LoRA): the trainer writes its adapter in peft's format to the run directory, and every
engine loads it by path, as SGLang's ``/load_lora_adapter`` does, under a name per weight version; generation names it
in ``lora_path``. Only the adapter's bytes move, whatever the base's size; the engine's answer carries the digest of
the adapter as it serves it (Miles' local engine), which must equal the trainer's."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

from miles_core.engines.client import EngineClient, EngineError
from miles_core.errors import MilesError

PROTOCOL_NAME = "lora_adapter"
"""The name reports give the adapter-only sync (in ``weight_transfer/protocol``)."""


@dataclasses.dataclass(frozen=True)
class PublishedAdapter:
    """An adapter as published: its directory (peft's format), the name engines serve it under, its digest and the
    weight version it is."""

    path: Path
    name: str
    digest: str
    version: int

    @property
    def num_bytes(self) -> int:
        """The bytes an engine reads: the adapter's files."""
        return sum(file.stat().st_size for file in self.path.iterdir() if file.is_file())


def adapter_name(version: int) -> str:
    """The name engines serve weight version ``version``'s adapter under."""
    return f"miles-lora-v{version}"


async def load_on_engine(client: EngineClient, adapter: PublishedAdapter, *, previous: str | None) -> bool:
    """``client``'s engine serves ``adapter`` (checked against its digest where the engine reports one) as weight
    version ``adapter.version``; then the ``previous`` adapter is unloaded. Returns whether the digest was checked
    (SGLang reports none)."""
    with contextlib.suppress(EngineError):  # a restarted engine may hold it already, or not: load it afresh
        await client.unload_lora_adapter(adapter.name)
    answer = await client.load_lora_adapter(adapter.name, str(adapter.path))
    served = answer.get("digest")
    if served is not None and served != adapter.digest:
        raise MilesError(
            f"engine {client.name} serves the adapter {adapter.name!r} with digest {served}, the trainer's is "
            f"{adapter.digest}: the adapter reached it changed"
        )
    await client.update_weight_version(str(adapter.version))
    if previous is not None and previous != adapter.name:
        with contextlib.suppress(EngineError):  # a restarted engine never loaded it
            await client.unload_lora_adapter(previous)
    return served is not None
