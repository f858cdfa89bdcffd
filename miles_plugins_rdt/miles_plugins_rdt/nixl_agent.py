"""NIXL agents whose progress thread sleeps between polls.

Ray creates the NIXL agent of a process lazily (at its first RDT transfer or memory registration) through nixl's
Python API, and that API sets the progress thread's delay to 0: the thread polls UCX without pause and keeps a whole
core busy for the rest of the process's life, transfers or not. On the 2-core machines this project runs on, that
halved everything else (measured with one sender and one receiver: 0.97 core busy in each while idle, and 1.32 GB/s
per transfer; with a 100 us delay, 0.03 core and 3.04 GB/s). Neither Ray nor nixl exposes the setting, so
:func:`use_polite_progress_thread` wraps the binding that builds agents in this process to set it.
"""

from __future__ import annotations

import sys

PROGRESS_THREAD_DELAY_US = 100


def use_polite_progress_thread(delay_us: int = PROGRESS_THREAD_DELAY_US) -> None:
    """Make every NIXL agent created from now on in this process sleep ``delay_us`` between progress polls.
    Call it before the process's first RDT transfer; calling it again changes nothing."""
    import nixl._api  # deferred: loads nixl and UCX  # noqa: F401 - fills sys.modules["nixl._api"]

    bindings = sys.modules["nixl._api"].nixlBind
    if getattr(bindings.nixlAgent, "miles_polite", False):
        return
    build_agent = bindings.nixlAgent

    def polite_agent(name: str, config: object) -> object:
        config.pthrDelay = delay_us
        return build_agent(name, config)

    polite_agent.miles_polite = True
    bindings.nixlAgent = polite_agent
