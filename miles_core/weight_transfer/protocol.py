"""The interface of a weight-transfer protocol.

A protocol is constructed once per run, connected to the engines once, then called once per weight update with
the buckets of HF-named tensors that the trainer's ``HfWeightIterator`` yields. Engines speak SGLang's native HTTP
API, so a protocol may use any of its ``/update_weights_*`` routes, or a channel of its own.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from miles_core.weight_transfer.routes import LOCAL_ENGINE, EngineCapabilities
from miles_core.weight_transfer.settings import ProtocolSettings, validate_settings
from miles_core.workers.provider import SharedPath

if TYPE_CHECKING:  # torch is imported by the implementations; the interface stays light
    import torch

WeightBucket = list[tuple[str, "torch.Tensor"]]
"""One bucket of ``(HF name, tensor)`` pairs, at most the configured bucket size in bytes."""


@dataclasses.dataclass(frozen=True)
class EngineEndpoint:
    """An engine as a protocol sees it: its name (the cell id), base URL, admin key and the weight routes its backend
    declares (:class:`~miles_core.weight_transfer.routes.EngineCapabilities`)."""

    name: str
    url: str
    admin_key: str | None = None
    capabilities: EngineCapabilities = LOCAL_ENGINE

    def headers(self) -> dict[str, str]:
        """Authorization headers for the engine's control routes."""
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    def to_wire(self) -> dict[str, Any]:
        """A JSON-ready form, for the holders' tasks (:meth:`from_wire` reads it back)."""
        return {"name": self.name, "url": self.url, "admin_key": self.admin_key, **self.capabilities.to_wire()}

    @classmethod
    def from_wire(cls, value: dict[str, Any]) -> EngineEndpoint:
        return cls(value["name"], value["url"], value.get("admin_key"), EngineCapabilities.from_wire(value))


@dataclasses.dataclass(frozen=True)
class TransferReport:
    """What one transfer moved and how fast."""

    protocol: str
    version: int
    num_bytes: int
    seconds: float
    num_engines: int
    checksum_ok: bool | None = None  # None when no checksum was checked
    checksum: str | None = None  # of the weights sent, combined from the holders' digests (protocols that send there)

    @property
    def gb_per_s(self) -> float:
        """Throughput in GB/s (10^9 bytes per second) of the trainer's bytes."""
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class WeightTransferProtocol(abc.ABC):
    """Base class of every protocol. Subclasses set :attr:`name` and :attr:`settings_model` and implement the three
    steps.

    The constructor takes the run's ``weight_transfer.settings`` (``--weight-transfer-settings '{...}'``) as keyword
    arguments; this base validates them against :attr:`settings_model`
    (:func:`~miles_core.weight_transfer.settings.validate_settings`, the same check the config build makes, so a run
    never reaches a constructor with settings its model refuses) and keeps the model as :attr:`settings`, which the
    protocol reads by attribute (``self.settings.timeout_s``). Settings its model refuses are a
    :class:`~miles_core.errors.ConfigError` naming the protocol, each setting, the value and what is allowed. A check
    the model cannot make because it depends on this machine (NCCL needs a CUDA device) raises a
    :class:`~miles_core.errors.MilesError` from the constructor, which the run reports as a configuration error too.
    Anything else a constructor raises is a bug of the protocol.
    """

    name: ClassVar[str]
    settings_model: ClassVar[type[ProtocolSettings]] = ProtocolSettings
    """The protocol's settings, a :class:`~miles_core.weight_transfer.settings.ProtocolSettings` subclass (this base
    model, with no fields: the protocol takes no settings)."""
    settings: ProtocolSettings
    """The validated settings this protocol was built with (an instance of :attr:`settings_model`)."""
    routes_same_node: ClassVar[tuple[str, ...] | None] = None
    """The engine routes (:mod:`miles_core.weight_transfer.routes`) this protocol can use for an engine on the
    sender's node, in order of preference; ``None``: not declared, not checked."""
    routes_other_node: ClassVar[tuple[str, ...] | None] = None
    """The same for an engine on another node (``()``: it cannot reach one)."""
    verify_samples: int = 0
    """Parameters read back from each engine that reports them (SGLang's ``/get_weights_by_name``) after each update
    and compared with the sender's (``--weight-transfer-verify-checksum`` sets it; the protocols that load SGLang
    through Miles' loader check them)."""

    def __init__(self, **settings: Any) -> None:
        self.settings = validate_settings(type(self), settings)

    @abc.abstractmethod
    async def connect(self, engines: Sequence[EngineEndpoint]) -> None:
        """Prepare the channel to every engine (called once, and again after an engine was replaced)."""

    @abc.abstractmethod
    async def transfer(self, buckets: Iterable[WeightBucket], *, version: int) -> TransferReport:
        """Move every bucket to every engine and publish ``version``; an engine never serves a mix of versions."""

    async def close(self) -> None:  # noqa: B027 - optional step, most protocols hold nothing to release
        """Release the channel. The default does nothing."""

    def shared_directories(self) -> list[SharedPath]:
        """Directories whose files the engines read by path (``disk``'s work directory): on a cluster, every engine's
        node must see each as the driver does, which the worker provider checks before engines start there. The
        default: none."""
        return []


class SendsFromHolders(abc.ABC):
    """A protocol whose sending side runs where the weights are: in each of the trainer's
    :class:`~miles_core.weight_transfer.holders.WeightHolders` (the Megatron ranks; the driver for the torch trainer),
    each sending its share, while the driver only coordinates. The controller uses it whenever the trainer offers
    holders, and keeps no copy of the weights: :meth:`republish` must restore a published version to an engine that
    comes back without them (from what the protocol keeps outside the driver, or from the holders)."""

    @abc.abstractmethod
    async def transfer_from_holders(self, holders: Any, *, version: int, checksum: bool = False) -> TransferReport:
        """Have every holder send its share to every engine and publish ``version``; with ``checksum``, the report
        carries the checksum of the weights sent (:func:`~miles_core.weight_transfer.digests.combine_digests` of
        digests the holders compute)."""

    def sends_from_holders(self) -> bool:
        """Whether this protocol, as configured, sends from the holders (the default). One that cannot with some of
        its settings answers ``False`` there, and the controller gives it the driver's buckets instead."""
        return True

    @abc.abstractmethod
    async def republish(self, version: int) -> None:
        """Load the published ``version`` into every connected engine again (after one restarted)."""
