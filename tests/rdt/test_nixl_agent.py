"""The NIXL agents' UCX settings, over the transport that crosses machines without RDMA (TCP).

Each check runs in a fresh Python process: :func:`configure_nixl_agents` changes process-wide state (the binding
that builds agents, UCX's environment), and UCX reads its environment once per agent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

READ_OVER_TCP = textwrap.dedent(
    """
    import json, os, torch
    from miles_plugins_rdt.nixl_agent import configure_nixl_agents

    configure_nixl_agents(progress_thread=True)
    from nixl._api import nixl_agent, nixl_agent_config

    source = (torch.arange(24 << 20, dtype=torch.int64) % 251).to(torch.uint8)  # 24 MiB: many 1 MiB segments
    target = torch.zeros_like(source)
    offering = nixl_agent("offering", nixl_agent_config(backends=["UCX"]))
    reading = nixl_agent("reading", nixl_agent_config(backends=["UCX"]))
    offering.register_memory([source])
    reading.register_memory([target])
    reading.add_remote_agent(offering.get_agent_metadata())
    handle = reading.initialize_xfer("READ", reading.get_xfer_descs([target]), offering.get_xfer_descs([source]),
                                     "offering", b"read")
    state = reading.transfer(handle)
    while state == "PROC":
        state = reading.check_xfer_state(handle)
    settings = {name: os.environ.get(name) for name in ("UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE")}
    print(json.dumps({"state": state, "equal": torch.equal(source, target), "settings": settings}))
    """
)


def run_read(**environment: str) -> dict:
    """Read 24 MiB from one agent into another with UCX held to TCP, in a fresh process with ``environment``."""
    inherited = {name: value for name, value in os.environ.items() if not name.startswith("UCX_")}
    env = {**inherited, "NIXL_LOG_LEVEL": "WARN", "UCX_TLS": "tcp", **environment}
    result = subprocess.run([sys.executable, "-c", READ_OVER_TCP], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_read_over_tcp_alone_uses_large_segments_and_delivers_every_byte() -> None:
    outcome = run_read()
    assert outcome["state"] == "DONE" and outcome["equal"]
    assert outcome["settings"] == {"UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}


def test_segment_sizes_set_in_the_environment_win() -> None:
    outcome = run_read(UCX_TCP_TX_SEG_SIZE="256k")
    assert outcome["state"] == "DONE" and outcome["equal"]
    assert outcome["settings"] == {"UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "1m"}
