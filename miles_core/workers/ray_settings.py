"""What a run may ask of a Ray cluster: the address it joins and the custom resources that pin each role's workers
to nodes. Plain checks that need no Ray, so that the config validates with them at construction.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping

RESERVED_RESOURCES = {
    "CPU": "a worker's CPUs come from its spec (e.g. --megatron-cpus-per-rank)",
    "GPU": "a worker's GPUs come from its spec (e.g. --sglang-tp-size)",
    "memory": "Ray's memory resource is not reserved per worker by Miles",
    "object_store_memory": "Ray does not reserve object store memory for bundles",
}
"""Ray's built-in resources, which a role's custom resources may not name (each with the reason)."""

MIN_AMOUNT = 0.0001
"""The smallest resource amount Ray keeps (it rounds amounts to four decimals)."""
MAX_AMOUNT = 1e9
"""The largest amount a bundle may ask for (Ray keeps amounts as fixed-point numbers; no node offers more)."""
MAX_RESOURCES = 16
"""The most custom resources one role may ask for."""

_RESOURCE_NAME = re.compile(r"^[^\s,{}]{1,128}$")
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252}[A-Za-z0-9])?$")


def check_ray_address(address: str) -> str:
    """``address`` if it names a Ray cluster Miles can join: ``HOST:PORT`` of its head (GCS) or ``auto``; otherwise a
    :class:`ValueError` that says what is allowed."""
    if address == "auto":
        return address
    if address.startswith("ray://"):
        raise ValueError(
            "Ray Client addresses (ray://) are not supported: the driver calls its workers over HTTP, so run "
            "`miles train` on a node of the cluster and give the head's HOST:PORT (GCS port, 6379 by default)"
        )
    if address == "local":
        raise ValueError("'local' starts a new Ray; leave the address unset for a local Ray on 127.0.0.1")
    host, port = split_address(address)
    if host is None:
        raise ValueError(f"expected HOST:PORT of the cluster's head (e.g. 10.0.0.1:6379) or 'auto', got {address!r}")
    if not 0 < port < 65536:
        raise ValueError(f"the port of {address!r} is not in 1..65535")
    return address


def split_address(address: str) -> tuple[str | None, int]:
    """``(host, port)`` of ``HOST:PORT`` (``[IPv6]:PORT`` too); ``(None, 0)`` when it is not of that form."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or len(port) > 5:
        return None, 0
    if host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1])), int(port)
        except ValueError:
            return None, 0
    return (host, int(port)) if _HOST.match(host) else (None, 0)


def is_loopback_address(address: str) -> bool:
    """Whether ``HOST:PORT`` names this machine's loopback (``127.x.y.z``, ``[::1]``, ``localhost``)."""
    host, _ = split_address(address)
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_resources(resources: Mapping[str, float]) -> dict[str, float]:
    """``resources`` (custom Ray resource name -> amount each bundle asks for) if every name is a custom resource
    and every amount within :data:`MIN_AMOUNT` .. :data:`MAX_AMOUNT`; otherwise a :class:`ValueError` naming the bad
    entry."""
    if len(resources) > MAX_RESOURCES:
        raise ValueError(f"{len(resources)} resources given; a role may ask for at most {MAX_RESOURCES}")
    for name, amount in resources.items():
        if name in RESERVED_RESOURCES:
            raise ValueError(f"{name!r} is a built-in Ray resource, not a custom one: {RESERVED_RESOURCES[name]}")
        if not _RESOURCE_NAME.match(name):
            raise ValueError(f"resource name {name[:140]!r}: 1 to 128 characters without spaces, commas or braces")
        if not MIN_AMOUNT <= amount <= MAX_AMOUNT:
            raise ValueError(
                f"resource {name!r} asks for {amount}; an amount must be within {MIN_AMOUNT} (Ray's precision) and "
                f"{MAX_AMOUNT:g}; a small amount such as 0.001 marks the nodes a role may use without limiting how "
                "many workers fit there"
            )
    return dict(resources)
