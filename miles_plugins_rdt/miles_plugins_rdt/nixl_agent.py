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

Between machines without RDMA, UCX moves the bytes over TCP in segments of ``UCX_TCP_TX_SEG_SIZE`` /
``UCX_TCP_RX_SEG_SIZE``. Its defaults (8 KiB and 64 KiB) halve the rate: a 272 MiB transfer to one engine with UCX
held to TCP on one 2-core machine measured 0.97 GB/s with them and 1.8 to 2.2 GB/s with 512 KiB to 1 MiB segments
(1.4 with 4 MiB). :data:`UCX_DEFAULTS` sets 1 MiB for each one the environment does not set (UCX refuses a send
segment larger than the receive segment).
"""

from __future__ import annotations

import os
import sys

PROGRESS_THREAD_DELAY_US = 100
UCX_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}


def configure_nixl_agents(*, progress_thread: bool, delay_us: int = PROGRESS_THREAD_DELAY_US) -> None:
    """Build every NIXL agent created from now on in this process with a progress thread that sleeps ``delay_us``
    between polls, or with none, and with :data:`UCX_DEFAULTS` where the environment sets no value of its own. Call
    it before the process's first RDT transfer or registration; the first call in a process decides."""
    for name, value in UCX_DEFAULTS.items():  # UCX reads them when an agent's UCX context is created
        os.environ.setdefault(name, value)
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
