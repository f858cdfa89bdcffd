"""torch.distributed stores that listen only where they are told.

torch's ``TCPStore`` (and so ``init_process_group(init_method="tcp://HOST:PORT")``) opens its own listening socket
on every interface, whatever ``HOST`` is; the store is unauthenticated, so anyone who reaches it can join or
disturb the group. :func:`tcp_store` hands the master a socket bound to ``HOST`` alone instead.
"""

from __future__ import annotations

import datetime
import socket
import urllib.parse

import torch.distributed as dist

from miles_core.workers.node import url_host
from miles_core.workers.process import listening_socket


def local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (``127.0.0.1`` for ``127.0.0.1``); nothing is sent."""
    family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # a UDP connect only picks the route
        return probe.getsockname()[0]


def tcp_store(
    host: str,
    port: int,
    *,
    world_size: int,
    is_master: bool,
    timeout: datetime.timedelta,
    listener: socket.socket | None = None,
) -> dist.Store:
    """A ``TCPStore`` at ``host:port``; the master's listens on ``host`` only (it takes the socket over, ``listener``
    when one was opened there ahead, and closes it when the store goes)."""
    listen_fd = None
    if is_master:
        listen_fd = (listener or listening_socket(host, port)).detach()
    return dist.TCPStore(host, port, world_size, is_master=is_master, timeout=timeout, master_listen_fd=listen_fd)


def reserve_rendezvous(host: str) -> tuple[str, socket.socket]:
    """A ``tcp://HOST:PORT`` init method on a free port of ``host`` and the socket already listening there, kept
    open until the master's store takes it over (:func:`tcp_store`'s ``listener``): no other process can take the
    port between choosing it and the group forming."""
    listener = listening_socket(host, 0)
    return f"tcp://{url_host(host)}:{listener.getsockname()[1]}", listener


def tcp_init_method_address(init_method: str) -> tuple[str, int]:
    """``(host, port)`` of a ``tcp://HOST:PORT`` init method; anything else is a ``ValueError`` that names it."""
    parts = urllib.parse.urlsplit(init_method)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None:
        raise ValueError(f"init method {init_method!r}: expected tcp://HOST:PORT")
    return parts.hostname, port
