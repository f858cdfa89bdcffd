"""Bounds of the settings that size processes, threads, buffers and connections, and checks of the addresses a
setting names, for the settings models of protocols (``--weight-transfer-settings``) and the config sections.

A sizing setting has two bounds: a hard cap in its field (``pydantic.Field(le=...)``, the same on every machine, so
that the flag docs generated from the models state it) and a bound that follows from the machine that builds the
config (:func:`at_most_per_cpu`, :func:`at_most_memory_share`), checked when a value is given. An address setting is
checked twice: its form when the config is built (:func:`check_host`: a host name or an IP address, at most
:data:`MAX_HOST_CHARS` characters), and where the run would use it (:func:`check_own_address`: it resolves, and to an
address of the node that binds it).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from typing import Any

import psutil
import pydantic

MAX_HOST_CHARS = 253
"""The longest host name DNS allows (RFC 1035); an address setting is refused past it."""
MAX_BUFFER_MB = 1 << 20
"""The hard cap of a buffer size in MiB (1 TiB), whatever the machine."""
MAX_KEPT_VERSIONS = 64
"""The most whole copies of the weights a protocol keeps on disk."""
MAX_LANES = 64
"""The hard cap of the parallel readers (actors, threads) one engine rank starts, whatever the machine."""
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def machine_cpus() -> int:
    """The CPUs of this machine (at least 1)."""
    return os.cpu_count() or 1


def machine_memory_mib() -> int:
    """The physical memory of this machine, in MiB."""
    return psutil.virtual_memory().total >> 20


def at_most_per_cpu(per_cpu: int, *, what: str) -> Any:
    """A validator of a whole-number setting that starts ``what`` (processes, threads, actors) per unit: refused
    above ``per_cpu`` per CPU of this machine, since more of them only wait for a CPU and each costs memory."""

    def check(value: int) -> int:
        bound = per_cpu * machine_cpus()
        if value > bound:
            raise ValueError(
                f"more than {per_cpu} {what} per CPU of this machine ({machine_cpus()} CPUs: at most {bound}); more "
                "would only wait for a CPU, each holding its memory"
            )
        return value

    return pydantic.AfterValidator(check)


def at_most_memory_share(copies: int, *, what: str) -> Any:
    """A validator of a size in MiB of which the run holds ``copies`` at once (double buffering: 2): refused when
    those copies would take more than half of this machine's physical memory."""

    def check(value: float) -> float:
        bound = machine_memory_mib() // (2 * copies)
        if value > bound:
            raise ValueError(
                f"{copies} {what} of {value:g} MiB would take more than half of this machine's "
                f"{machine_memory_mib()} MiB of memory (at most {bound} MiB each)"
            )
        return value

    return pydantic.AfterValidator(check)


def check_host(value: str) -> str:
    """``value`` if it is an IP address or a host name (dot-separated labels of letters, digits and hyphens, at most
    :data:`MAX_HOST_CHARS` characters); otherwise a :class:`ValueError` saying what is allowed. Nothing is looked up."""
    if len(value) > MAX_HOST_CHARS:
        raise ValueError(f"{len(value)} characters; a host name has at most {MAX_HOST_CHARS}")
    try:
        ipaddress.ip_address(value.strip("[]"))
        return value
    except ValueError:
        pass
    if not all(_LABEL.match(label) for label in value.removesuffix(".").split(".")):
        raise ValueError(
            "neither an IP address nor a host name (labels of 1-63 letters, digits and hyphens, separated by dots)"
        )
    return value


def resolve(host: str) -> set[str]:
    """The IP addresses ``host`` resolves to; a :class:`ValueError` naming it when it resolves to none."""
    try:
        found = socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"{host!r} does not resolve ({exc})") from None
    return {str(entry[4][0]).split("%", 1)[0] for entry in found}


def addresses_of_this_node() -> set[str]:
    """Every IP address of this machine's network interfaces (loopback too)."""
    return {
        entry.address.split("%", 1)[0]
        for entries in psutil.net_if_addrs().values()
        for entry in entries
        if entry.family in (socket.AF_INET, socket.AF_INET6)
    }


def check_own_address(host: str, *, setting: str) -> str:
    """``host`` if it resolves to an address of this node, the one that binds it; otherwise a :class:`ValueError`
    that names ``setting`` and says what to give instead."""
    found = resolve(host)
    own = addresses_of_this_node()
    if not found & own:
        raise ValueError(
            f"{setting} {host!r} resolves to {', '.join(sorted(found))}, not an address of this node "
            f"({', '.join(sorted(own)) or 'none found'}), which binds it; give one of this node's addresses that "
            f"the engines reach, or leave {setting} unset for this node's address"
        )
    return host
