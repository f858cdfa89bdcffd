"""The address of the node a process runs on: where every listener of that process binds, and where peers reach it.

A worker provider tells each worker its node's address in ``MILES_NODE_ADDRESS`` (the Ray provider: the address
Ray reports for the worker's node; the local provider: loopback), and the driver learns its own when it joins a
cluster. A process that was told nothing runs on a single machine: its node address is loopback. No listener of
Miles binds ``0.0.0.0``; on a node of a multi-machine cluster, each binds the node's cluster address alone.
"""

from __future__ import annotations

import os

import psutil

NODE_ADDRESS_ENV = "MILES_NODE_ADDRESS"
LOOPBACK = "127.0.0.1"
"""The loopback address: where a server binds on one machine, and what nothing on another machine reaches."""


def node_address() -> str:
    """This process's node address: ``MILES_NODE_ADDRESS`` when a provider (or the driver's cluster) set it, else
    loopback."""
    return os.environ.get(NODE_ADDRESS_ENV) or LOOPBACK


def set_node_address(address: str) -> None:
    """Record ``address`` as this process's node address (and so its children's: they inherit it)."""
    os.environ[NODE_ADDRESS_ENV] = address


def url_host(host: str) -> str:
    """``host`` as a URL and a ``Host`` header write it: lower case, an IPv6 address in brackets."""
    host = host.lower().strip("[]")
    return f"[{host}]" if ":" in host else host


LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def is_this_node(host: str | None) -> bool:
    """Whether ``host`` (a URL's host) is this process's node: a loopback name, or the node address itself."""
    return host is not None and (host.lower() in LOOPBACK_NAMES or host == node_address())


COLLECTIVE_INTERFACE_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interface_of(address: str) -> str:
    """The network interface that carries ``address`` (``lo`` for loopback), as ``GLOO_SOCKET_IFNAME`` and
    ``NCCL_SOCKET_IFNAME`` name one; a :class:`ValueError` when no interface of this machine has it."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address.split("%", 1)[0] == address for entry in addresses):
            return name
    raise ValueError(f"no network interface of this machine has the address {address}")


def collective_interface_env(address: str) -> dict[str, str]:
    """The environment that has gloo and NCCL listen and connect on the interface of ``address`` (this node's) rather
    than on the address the machine's host name resolves to (often loopback, or an address another network
    namespace has), keeping what the user chose: for processes this one starts (an SGLang server joining a
    ``broadcast`` group). Nothing when no interface of this machine has the address (behind a NAT, say): gloo and
    NCCL then pick as they would."""
    try:
        interface = interface_of(address)
    except ValueError:
        return {}
    return {name: os.environ.get(name) or interface for name in COLLECTIVE_INTERFACE_ENVS}


def bind_collectives_to(address: str) -> None:
    """:func:`collective_interface_env` for this process's own process groups made after this (Megatron ranks)."""
    os.environ.update(collective_interface_env(address))
