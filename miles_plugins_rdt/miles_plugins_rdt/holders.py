"""The holders' side of ``rdt``: each process that holds a share of the trainer's weights (a Megatron rank, or the
driver for the torch trainer) offers it to the engines' receivers, which read it P2P over NIXL.

Two holder tasks per update (:class:`~miles_plugins_rdt.protocol.RdtProtocol` runs them on every holder):

* :func:`keep_share` copies the holder's share into a send buffer of its own, registered once with NIXL (it is
  reused while the share's size does not grow), and returns the share's layout in it. The buffer holds the version
  until the next one, so that an engine that restarts can read it again (:meth:`RdtProtocol.republish`).
* :func:`send_kept` puts one RDT object per receive lane over a contiguous byte range of the buffer and has every
  engine's receive lanes read it straight into their staging bucket, at the offset the driver placed this holder's
  share. Every holder sends at once; no byte passes through the driver. A receive that fails is reported by engine
  name, not raised, so the holder (a rank that must go on with its peers) lives on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from typing import Any

import ray
import torch

from miles_core import MilesError, NamedTensorShare, StagingLayout, tensor_digest
from miles_plugins_rdt.nixl_agent import configure_nixl_agents
from miles_plugins_rdt.staging import align_up

LANE_CUT = 4096
"""A holder's share is cut into receive lanes on multiples of this many bytes."""
ANSWER_GRACE_S = 5.0
"""How much longer than a read's own deadline a holder waits for the receive lane's answer, so that a lane's error
(which names its node) comes before the holder's."""


@dataclasses.dataclass
class _Kept:
    """One holder's send buffer (registered with NIXL) and the version and layout it holds."""

    buffer: torch.Tensor | None = None
    version: int | None = None
    layout: StagingLayout | None = None


_KEPT: dict[tuple[str, int], _Kept] = {}
"""By (protocol key, holder index): one process may be several holders (tests) or the driver too."""


def keep_share(share: NamedTensorShare, *, holder: int, holders: int, key: str, version: int, digests: bool) -> dict:
    """The holder task that copies this holder's share into its send buffer as ``version``; the share's layout in
    the buffer, the names' digests (``None`` without ``digests``) and the bytes."""
    configure_nixl_agents(progress_thread=True)  # this process offers memory: before its agent exists
    tensors = [(name, tensor.detach().cpu()) for name, tensor in share]
    layout = StagingLayout.of(tensors, alignment=1)
    kept = _KEPT.setdefault((key, holder), _Kept())
    kept.version = None  # the buffer is being overwritten: it holds no whole version until this returns
    if kept.buffer is None or kept.buffer.numel() < layout.size:
        _replace_buffer(kept, layout.size)
    for (_, tensor), target in zip(tensors, layout.views(kept.buffer).values(), strict=True):
        target.copy_(tensor)
    kept.version, kept.layout = version, layout
    return {
        "layout": layout.to_wire(),
        "digests": {name: tensor_digest(name, tensor) if digests else None for name, tensor in tensors},
        "bytes": sum(entry.nbytes for entry in layout.tensors),
    }


def _replace_buffer(kept: _Kept, size: int) -> None:
    from ray.experimental import deregister_nixl_memory, register_nixl_memory  # deferred: imports nixl

    if kept.buffer is not None:
        with contextlib.suppress(Exception):  # Ray may still hold a registration of its own: it drops it later
            deregister_nixl_memory(kept.buffer)
    kept.buffer = torch.zeros(max(size, 1), dtype=torch.uint8)  # zeroed: its pages exist before any read
    register_nixl_memory(kept.buffer)


def send_kept(
    share: NamedTensorShare,
    *,
    holder: int,
    holders: int,
    key: str,
    version: int,
    bases: list[int],
    slot: int,
    lanes: dict[str, list[str]],
    timeout_s: float,
) -> dict:
    """The holder task in which every engine's receive lanes (the named receiver actors of ``lanes``, by engine)
    read this holder's kept ``version`` into their staging bucket ``slot`` from byte ``bases[holder]``; the share is
    not read. The engines whose reads failed, with why."""
    kept = _KEPT.get((key, holder))
    if kept is None or kept.version != version:
        held = None if kept is None else kept.version
        raise MilesError(f"rdt holder {holder} keeps version {held}, not {version}: nothing to send")
    size = kept.layout.size
    if size == 0:
        return {"bytes": 0, "failures": {}}
    lane_count = min(len(names) for names in lanes.values()) if lanes else 1
    cuts = _lane_cuts(size, lane_count)
    refs = [ray.put([kept.buffer[start:end]], _tensor_transport="nixl") for start, end in cuts]
    base = bases[holder]
    calls = [
        (
            engine,
            names[lane],
            ray.get_actor(names[lane]).receive_nixl.remote([ref], [[base + start, end - start]], slot, timeout_s),
        )
        for engine, names in lanes.items()
        for lane, (ref, (start, end)) in enumerate(zip(refs, cuts, strict=True))
    ]
    failures = _wait_all(calls, timeout_s + ANSWER_GRACE_S)
    del refs, calls
    return {"bytes": size, "failures": failures}


def _lane_cuts(size: int, lanes: int) -> list[tuple[int, int]]:
    """``[start, end)`` byte ranges of about equal size that cover ``0 .. size``, one per lane (fewer if small)."""
    bounds = sorted({min(size, align_up(size * lane // lanes, LANE_CUT)) for lane in range(lanes)} | {size})
    return [(start, end) for start, end in itertools.pairwise(bounds) if end > start]


def _wait_all(calls: list[tuple[str, str, Any]], timeout_s: float) -> dict[str, str]:
    """Wait for every ``(engine, receive lane's actor name, read call)`` until one deadline, ``timeout_s`` from now;
    each engine's first failure, by engine."""
    deadline = time.monotonic() + timeout_s
    failures: dict[str, str] = {}
    for engine, lane, call in calls:
        try:
            ray.get(call, timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:  # the lane did not even report its own timeout: stuck or unreachable
            failures.setdefault(engine, f"TimeoutError: receive lane {lane} did not answer within {timeout_s:g} s")
        except Exception as exc:  # the engine's failure, reported by name
            cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
            failures.setdefault(engine, f"{type(cause).__name__}: {cause}")
    return failures


def forget(key: str) -> None:
    """Let go of every buffer this process keeps for the protocol ``key`` (the driver's own, at close)."""
    from ray.experimental import deregister_nixl_memory  # deferred: imports nixl

    for state_key in [k for k in _KEPT if k[0] == key]:
        kept = _KEPT.pop(state_key)
        if kept.buffer is not None:
            with contextlib.suppress(Exception):
                deregister_nixl_memory(kept.buffer)
