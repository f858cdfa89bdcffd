"""Which host the dashboard binds, and which ``Host`` headers it answers (its defence against DNS rebinding).

A page on another site can rebind its own domain name to 127.0.0.1 and then read whatever a local server answers;
the browser still sends that domain name as ``Host``. So the dashboard answers only the names it serves:
``127.0.0.1``, ``localhost``, ``[::1]`` and the host it is bound to (every name and address of this machine when
bound to all interfaces), each with its port.
"""

from __future__ import annotations

import ipaddress
import re
import socket

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "[::1]"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})


class DashboardHostError(ValueError):
    """A host the dashboard refuses to bind: empty or blank (which would bind every interface)."""


def check_host(host: str) -> str:
    """``host`` if it names an address to bind; an empty or blank one is refused with what to give instead."""
    if not isinstance(host, str) or not host.strip() or host != host.strip():
        raise DashboardHostError(f"the dashboard host must be an address or a name such as 127.0.0.1, got "
                                 f"{host!r} (an empty host would bind every interface: give 0.0.0.0 for that "
                                 "on purpose)")  # fmt: skip
    return host


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def url_name(host: str) -> str:
    """``host`` as a URL and a ``Host`` header write it: lower case, an IPv6 address in brackets."""
    host = host.lower().strip("[]")
    return f"[{host}]" if ":" in host else host


def allowed_host_names(host: str) -> frozenset[str]:
    """The names that a request's ``Host`` may give to a server bound to ``host``."""
    names = {*LOOPBACK_NAMES, url_name(host)}
    if host in WILDCARD_HOSTS:  # every interface: this machine's names and addresses
        import psutil  # deferred: only a server bound to every interface lists them

        names |= {url_name(socket.gethostname()), url_name(socket.getfqdn())}
        names |= {url_name(a.address.split("%")[0]) for addresses in psutil.net_if_addrs().values()
                  for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6)}  # fmt: skip
    return frozenset(names)


def host_header_matches(value: str | None, *, names: frozenset[str], port: int) -> bool:
    """Whether the ``Host`` header ``value`` is one of ``names`` with ``port`` (a header without a port means 80)."""
    if not value:
        return False
    value = value.strip().lower()
    if value.endswith("]") or ":" not in value:  # "[::1]" or "localhost": no port
        name, given_port = value, ""
    else:
        name, _, given_port = value.rpartition(":")
        if not re.fullmatch(r"[0-9]{1,5}", given_port):
            return False
    return name in names and (int(given_port) if given_port else 80) == port
