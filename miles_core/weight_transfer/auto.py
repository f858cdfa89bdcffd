"""``auto`` (the default ``--update-weight-transfer-mode``): per engine, the fastest protocol that engine and its place
support, chosen from what engines and protocols declare (:func:`~miles_core.weight_transfer.routes.choose_protocol`):
``tensor`` for an engine on the trainer's node (shared memory), ``rdt`` for one on another node when NIXL is installed
and engines run in Ray actors, else ``broadcast``; ``disk`` only when asked for by name (or for an engine that serves
nothing else).

The choice is made when the engines are connected, said once in the terminal (and again when it changes, as after an
engine moved to another node), and carried in every report as ``auto/<protocol>`` (``auto/tensor+rdt`` when engines
took different ones), which the dashboard and the metrics record. Engines that took the same protocol share one
instance of it; each update runs every instance in turn over the same weights.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

import pydantic

from miles_core.errors import ConfigError
from miles_core.weight_transfer.protocol import (
    EngineEndpoint,
    SendsFromHolders,
    TransferReport,
    WeightBucket,
    WeightTransferProtocol,
)
from miles_core.weight_transfer.routes import choose_protocol
from miles_core.weight_transfer.settings import ProtocolSettings
from miles_core.workers.node import is_this_node

logger = logging.getLogger(__name__)
ProtocolFactory = Callable[[str, dict[str, Any]], WeightTransferProtocol]
"""Builds a registered protocol by name from its settings (the run's registries do)."""


def _part(name: str, example: str, when: str) -> Any:
    return pydantic.Field(
        default_factory=dict,
        description=f"The settings {name} is built with when auto chooses it ({when}), as "
        f"--update-weight-transfer-mode {name} takes them, e.g. {example}.",
    )


class AutoSettings(ProtocolSettings):
    """The settings of ``auto``: per protocol it may choose, the settings that protocol is built with
    (``--weight-transfer-settings '{"tensor": {"zero_copy": false}}'``), each validated against that protocol's own
    model when the config is built, whether or not this run's engines make auto choose it."""

    example = '{"tensor": {"zero_copy": false}, "broadcast": {"timeout_s": 60}}'

    tensor: dict[str, Any] = _part("tensor", '{"zero_copy": false}', "engines on the trainer's node")
    rdt: dict[str, Any] = _part("rdt", '{"transport": "gloo"}', "engines on another node, NIXL installed, Ray")
    broadcast: dict[str, Any] = _part("broadcast", '{"timeout_s": 60}', "engines on another node otherwise")
    disk: dict[str, Any] = _part("disk", '{"keep_versions": 1}', "engines that serve nothing else")

    def settings_of(self, protocol: str) -> dict[str, Any]:
        """The settings ``protocol`` is built with when auto chooses it."""
        return dict(getattr(self, protocol))

    def settings_of_protocols(self) -> dict[str, Mapping[str, Any]]:
        given = self.model_fields_set  # those the run names, in the order of the fields
        return {name: self.settings_of(name) for name in type(self).model_fields if name in given}


class AutoProtocol(WeightTransferProtocol, SendsFromHolders):
    name = "auto"

    settings_model = AutoSettings
    settings: AutoSettings

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.factory: ProtocolFactory | None = None
        self.engines_in_ray = False
        self.chosen: dict[str, tuple[str, str]] = {}  # engine name -> (protocol, why)
        self.parts: dict[str, WeightTransferProtocol] = {}  # protocol name -> its instance
        self.warned_unused: set[str] = set()  # protocols whose settings were named unused once

    def bind(self, factory: ProtocolFactory, *, engines_in_ray: bool) -> None:
        """How to build the chosen protocols, and whether the run's engines run in Ray actors (rdt needs that)."""
        self.factory, self.engines_in_ray = factory, engines_in_ray

    async def connect(self, engines: Sequence[EngineEndpoint]) -> None:
        chosen = {engine.name: self._choose(engine) for engine in engines}
        if chosen != self.chosen:
            announce(chosen)
        self.chosen = chosen
        self._warn_unused_settings({protocol for protocol, _ in chosen.values()})
        for name in sorted({protocol for protocol, _ in chosen.values()} - set(self.parts)):
            self.parts[name] = self._build(name)
        for name, part in list(self.parts.items()):
            mine = [engine for engine in engines if chosen[engine.name][0] == name]
            if mine:
                await part.connect(mine)
            else:
                await part.close()
                del self.parts[name]

    def _warn_unused_settings(self, used: set[str]) -> None:
        """Once per protocol: settings the run gives for a protocol that auto chose for none of the engines."""
        for name in self.settings.settings_of_protocols():
            if name not in used and name not in self.warned_unused:
                self.warned_unused.add(name)
                logger.warning(
                    "auto: the settings given for %s (%s) are not used: auto chose %s for the engines of this "
                    "placement; remove them, or name the protocol with --update-weight-transfer-mode",
                    name,
                    json.dumps(self.settings.settings_of(name), default=str),
                    ", ".join(sorted(used)) or "no protocol",
                )

    def _choose(self, engine: EngineEndpoint) -> tuple[str, str]:
        same_node = is_this_node(urlparse(engine.url).hostname)
        return choose_protocol(engine.capabilities, same_node=same_node, in_ray=self.engines_in_ray)

    def _build(self, name: str) -> WeightTransferProtocol:
        if self.factory is None:
            raise ConfigError("the auto weight-transfer protocol was not bound to the run's registries (bind())")
        part = self.factory(name, self.settings.settings_of(name))
        part.verify_samples = self.verify_samples
        return part

    async def transfer(self, buckets: Iterable[WeightBucket], *, version: int) -> TransferReport:
        kept = list(buckets) if len(self.parts) > 1 else buckets  # every part reads the same buckets
        reports = [await part.transfer(kept, version=version) for part in self.parts.values()]
        return self._combined(reports, version)

    def sends_from_holders(self) -> bool:
        return all(isinstance(p, SendsFromHolders) and p.sends_from_holders() for p in self.parts.values())

    async def transfer_from_holders(self, holders: Any, *, version: int, checksum: bool = False) -> TransferReport:
        reports = [
            await part.transfer_from_holders(holders, version=version, checksum=checksum)
            for part in self.parts.values()
        ]
        return self._combined(reports, version)

    async def republish(self, version: int) -> None:
        for part in self.parts.values():
            await part.republish(version)

    async def close(self) -> None:
        for part in self.parts.values():
            await part.close()
        self.parts.clear()

    def _combined(self, reports: list[TransferReport], version: int) -> TransferReport:
        if not reports:
            return TransferReport(protocol="auto", version=version, num_bytes=0, seconds=0.0, num_engines=0)
        checksums = {r.checksum for r in reports if r.checksum is not None}
        return dataclasses.replace(
            reports[0],
            protocol="auto/" + "+".join(self.parts),
            seconds=sum(r.seconds for r in reports),
            num_engines=sum(r.num_engines for r in reports),
            checksum=checksums.pop() if len(checksums) == 1 else None,
        )


def announce(chosen: dict[str, tuple[str, str]]) -> None:
    """One terminal line per protocol: which engines take it and why."""
    by_protocol: dict[tuple[str, str], list[str]] = {}
    for engine, choice in chosen.items():
        by_protocol.setdefault(choice, []).append(engine)
    for (protocol, why), engines in by_protocol.items():
        line = f"miles: weights to {', '.join(engines)} by {protocol} (auto: {why})"
        print(line, flush=True)
        logger.info(line)
