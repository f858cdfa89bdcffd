"""Which weight routes an engine serves, which a protocol can use, and the one place that matches them.

An engine backend declares the routes its engines serve (:class:`EngineCapabilities`, from
``EngineBackend.weight_capabilities``); a protocol declares the routes it can use for an engine on the sender's node
and for one on another node (:attr:`WeightTransferProtocol.routes_same_node`, ``routes_other_node``) and whether it
needs engines hosted in Ray actors. :func:`route_for` picks the route a protocol takes to one engine, or raises the
error naming the engine, the protocol and the protocols that would reach it; :func:`choose_protocol` is
``--update-weight-transfer-mode auto``'s choice per engine.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from miles_core.errors import ConfigError

if TYPE_CHECKING:
    from miles_core.config.build import MilesConfig

DISK = "disk"
"""``/update_weights_from_disk``: the engine reads a checkpoint directory by path (shared storage across nodes)."""
DISTRIBUTED = "distributed"
"""``/init_weights_update_group`` and ``/update_weights_from_distributed``: the engine joins a gloo/NCCL group."""
STAGING_SWAP = "staging_swap"
"""The engine serves from a staging file in shared memory itself (Miles' local engine: no copy)."""
STAGING_COPY = "staging_copy"
"""The engine copies a version out of a staging file in shared memory on its node (Miles' local engine's
``/update_weights_from_staging``; SGLang's ``/update_weights_from_tensor`` with Miles' loader)."""
TENSOR_BYTES = "tensor_bytes"
"""The request body carries the tensors as safetensors bytes (Miles' local engine)."""
CHECKSUM = "checksum"
"""``/weights_checksum``: the engine reports a digest of the weights it serves (Miles' local engine)."""
WEIGHTS_BY_NAME = "weights_by_name"
"""``/get_weights_by_name``: the engine reads a parameter back (SGLang)."""
LORA_ADAPTERS = "lora_adapters"
"""``/load_lora_adapter`` and ``/unload_lora_adapter`` by path, ``lora_path`` on ``/generate``: the engine serves LoRA
adapters (Miles' local engine; SGLang started with ``--enable-lora``)."""


@dataclasses.dataclass(frozen=True)
class EngineCapabilities:
    """What an engine serves for weights: its ``routes``, the ``staging_loader`` (SGLang's ``load_format`` naming
    Miles' loader, for engines whose :data:`STAGING_COPY` goes through ``/update_weights_from_tensor``; ``None``: the
    route ``/update_weights_from_staging``) and its ``tp_size`` (one payload per TP rank there)."""

    routes: frozenset[str]
    staging_loader: str | None = None
    tp_size: int = 1

    def serves(self, route: str) -> bool:
        return route in self.routes

    def to_wire(self) -> dict[str, Any]:
        return {"routes": sorted(self.routes), "staging_loader": self.staging_loader, "tp_size": self.tp_size}

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> EngineCapabilities:
        return cls(frozenset(value["routes"]), value.get("staging_loader"), int(value.get("tp_size", 1)))


LOCAL_ENGINE = EngineCapabilities(
    frozenset({DISK, DISTRIBUTED, STAGING_SWAP, STAGING_COPY, TENSOR_BYTES, CHECKSUM, LORA_ADAPTERS})
)
"""Miles' local engine (``miles_core.builtin.local_engine.server``)."""
SGLANG_HTTP_API = EngineCapabilities(frozenset({DISK, DISTRIBUTED}))
"""Any server of SGLang's HTTP API without Miles' loader: what a backend that declares nothing is taken to serve."""


def capabilities_of(backend: Any, config: MilesConfig) -> EngineCapabilities:
    """The backend's declared capabilities (``weight_capabilities(config)``), else :data:`SGLANG_HTTP_API`."""
    declare = getattr(backend, "weight_capabilities", None)
    return declare(config) if callable(declare) else SGLANG_HTTP_API


def route_for(protocol: Any, engine: str, capabilities: EngineCapabilities, *, same_node: bool) -> str | None:
    """The first route of ``protocol`` (a protocol class or instance) that ``engine`` (``"engine engine-0"``, as the
    error names it) serves where it runs (``None``
    for a protocol that declares no routes: it is not checked); a :class:`ConfigError` naming the engine, the
    protocol and what would reach the engine when there is none."""
    wanted = protocol.routes_same_node if same_node else protocol.routes_other_node
    if wanted is None:
        return None
    for route in wanted:
        if capabilities.serves(route):
            return route
    where = "on the sender's node" if same_node else "on another node than the sender"
    needs = " or ".join(wanted) if wanted else "nothing it can use there"
    raise ConfigError(
        f"weight_transfer.mode (--update-weight-transfer-mode) = {protocol.name!r} cannot reach {engine} "
        f"({where}): {protocol.name} needs {needs}, and the engine serves {', '.join(sorted(capabilities.routes))}; "
        f"{alternatives(capabilities, same_node=same_node)}"
    )


def alternatives(capabilities: EngineCapabilities, *, same_node: bool) -> str:
    """What to pick instead, for an error message."""
    reach = [name for name, cls in builtin_protocol_classes().items() if _reaches(cls, capabilities, same_node)]
    return f"protocols that reach it: {', '.join(['auto', *reach])}"


def choose_protocol(capabilities: EngineCapabilities, *, same_node: bool, in_ray: bool) -> tuple[str, str]:
    """``auto``'s choice for one engine: the protocol and why. On the sender's node: ``tensor`` (shared memory);
    on another node: ``rdt`` when NIXL is installed and engines run in Ray actors, else ``broadcast``; ``disk`` only
    for an engine that serves nothing else."""
    if same_node and (capabilities.serves(STAGING_SWAP) or capabilities.serves(STAGING_COPY)):
        return "tensor", "on the trainer's node: shared memory"
    if not same_node:
        if in_ray and nixl_reason() is None and capabilities.serves(STAGING_COPY):
            return "rdt", "on another node, NIXL installed: NIXL reads beside the engine"
        if capabilities.serves(DISTRIBUTED):
            reason = nixl_reason() if in_ray else "engines not in Ray actors (rdt needs --run-worker-provider ray)"
            return "broadcast", f"on another node, {reason}: a gloo/NCCL group"
    if capabilities.serves(DISTRIBUTED):
        return "broadcast", "the engine serves no staging route: a gloo/NCCL group"
    if capabilities.serves(DISK):
        return "disk", "the engine serves only /update_weights_from_disk"
    raise ConfigError(f"the engine serves no weight route Miles knows ({', '.join(sorted(capabilities.routes))})")


def nixl_reason() -> str | None:
    """Why rdt's NIXL transport is unavailable here (``None``: both nixl and miles-plugins-rdt are installed)."""
    for module, package in (("miles_plugins_rdt", "miles-plugins-rdt"), ("nixl", "nixl")):
        if importlib.util.find_spec(module) is None:
            return f"{package} not installed"
    return None


BUILTIN_ROUTES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tensor": ((STAGING_SWAP, STAGING_COPY, TENSOR_BYTES), (TENSOR_BYTES,)),
    "broadcast": ((DISTRIBUTED,), (DISTRIBUTED,)),
    "disk": ((DISK,), (DISK,)),
    "rdt": ((STAGING_SWAP, STAGING_COPY), (STAGING_SWAP, STAGING_COPY)),
}
"""The routes of the protocols Miles ships (same node, other node), as their classes declare them; named in
errors without importing a plugin (rdt needs miles-plugins-rdt and --run-worker-provider ray)."""


def builtin_protocol_classes() -> dict[str, Any]:
    """The shipped protocols as :func:`_reaches` reads them."""
    return {
        name: type(name, (), {"routes_same_node": same, "routes_other_node": other})
        for name, (same, other) in BUILTIN_ROUTES.items()
    }


def _reaches(protocol: Any, capabilities: EngineCapabilities, same_node: bool) -> bool:
    wanted: Iterable[str] = protocol.routes_same_node if same_node else protocol.routes_other_node
    return any(map(capabilities.serves, wanted))
