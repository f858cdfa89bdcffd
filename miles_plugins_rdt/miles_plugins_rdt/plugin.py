"""The Miles plugin module of miles-plugins-rdt, registered through the entry-point group ``miles.plugins``.

Provides the weight-transfer protocol ``rdt`` (``--update-weight-transfer-mode rdt``) and checks, when the config is
built, that a run selecting it hosts its engines in Ray actors (the core validates its settings against
``RdtSettings``). Every ``miles`` command imports this module, so it imports nothing heavy at the top (the protocol is
named by an import string).
"""

from __future__ import annotations

from typing import Any

from miles_core import ConfigError, Implementation, hookimpl


@hookimpl
def provide_weight_transfer_protocols() -> list[Implementation]:
    return [
        Implementation(
            "rdt",
            "miles_plugins_rdt.protocol:RdtProtocol",
            "Ray Direct Transport P2P into engine staging buckets (nixl, gloo)",
        )
    ]


@hookimpl
def validate_config(config: Any) -> None:
    if config.weight_transfer.mode != "rdt":
        return
    if config.run.worker_provider != "ray":
        raise ConfigError(
            f"weight_transfer.mode (--update-weight-transfer-mode) = 'rdt' needs engines hosted in Ray actors, but "
            f"run.worker_provider (--run-worker-provider) = {config.run.worker_provider!r}; add "
            f"--run-worker-provider ray, or pick another protocol (tensor, broadcast, disk)"
        )
