"""Which host the dashboard binds, and which ``Host`` headers it answers (its defence against DNS rebinding).

A page on another site can rebind its own domain name to 127.0.0.1 and then read whatever a local server answers;
the browser still sends that domain name as ``Host``. So the dashboard answers only the names it serves:
``127.0.0.1``, ``localhost``, ``[::1]`` and the host it is bound to (every name and address of this machine when
bound to all interfaces), each with its port. The Host check itself lives in :mod:`miles_core.http`, shared with the
local engine.
"""

from __future__ import annotations

import ipaddress

from miles_core.http import LOOPBACK_NAMES as LOOPBACK_NAMES  # the Host check is shared with the local engine
from miles_core.http import WILDCARD_HOSTS as WILDCARD_HOSTS
from miles_core.http import allowed_host_names as allowed_host_names
from miles_core.http import host_header_matches as host_header_matches
from miles_core.http import url_name as url_name


class DashboardHostError(ValueError):
    """A host the dashboard refuses to bind: empty or blank (which would bind every interface)."""


def check_host(host: str, *, what: str = "the dashboard host") -> str:
    """``host`` if it names an address to bind; an empty or blank one is refused with what to give instead."""
    if not isinstance(host, str) or not host.strip() or host != host.strip():
        raise DashboardHostError(
            f"{what} must be an address or a name such as 127.0.0.1, got "
            f"{host!r} (an empty host would bind every interface: give 0.0.0.0 for that "
            "on purpose)"
        )
    return host


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
