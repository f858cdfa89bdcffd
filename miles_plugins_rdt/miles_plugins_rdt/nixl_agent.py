"""How the NIXL agents of this process's Ray Direct Transport poll: a polite progress thread, or none.

Ray creates the NIXL agent of a process lazily (at its first RDT transfer or memory registration) through nixl's
Python API, which starts a progress thread that polls UCX without pause: it keeps a whole core busy for the rest
of the process's life, transfers or not. Neither Ray nor nixl exposes the setting, so
:func:`configure_nixl_agents` wraps the binding that builds agents in this process.

* The trainer side only offers memory: other agents read it, and its own agent must still answer their connection
  requests and take Ray's completion notices, which a progress thread does. It sleeps 100 us between polls
  (measured with one sender and one receiver: 0.97 core busy in each while idle and 1.32 GB/s per transfer
  without a pause; 0.03 core and 3.04 GB/s with it).
* A receiver reads, and Ray's fetch loop polls its transfer every millisecond; each poll drives the read (on one
  host a ``process_vm_readv`` of a whole segment) to completion. A progress thread there only fights that loop for
  the UCX worker's spin lock: measured with one 256 MiB read, 1.9 cores busy and 5.1 GB/s with the thread; 1.0 core
  and 5.3 GB/s without it, and two receiving processes then read 8.8 GB/s together instead of 5.2.
"""

from __future__ import annotations

import sys

PROGRESS_THREAD_DELAY_US = 100


def configure_nixl_agents(*, progress_thread: bool, delay_us: int = PROGRESS_THREAD_DELAY_US) -> None:
    """Build every NIXL agent created from now on in this process with a progress thread that sleeps ``delay_us``
    between polls, or with none. Call it before the process's first RDT transfer or registration; the first call
    in a process decides."""
    import nixl._api  # deferred: loads nixl and UCX  # noqa: F401 - fills sys.modules["nixl._api"]

    bindings = sys.modules["nixl._api"].nixlBind
    if getattr(bindings.nixlAgent, "miles_configured", False):
        return
    build_agent = bindings.nixlAgent

    def configured_agent(name: str, config: object) -> object:
        config.useProgThread = progress_thread
        config.pthrDelay = delay_us
        return build_agent(name, config)

    configured_agent.miles_configured = True
    bindings.nixlAgent = configured_agent
