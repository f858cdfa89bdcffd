"""The megatron backend's process groups listen on 127.0.0.1 only: the one-rank gloo world of the HF-facing model
(``ensure_single_rank_parallel_state``) and, through the same :func:`miles_core.distributed.tcp_store`, the ranks'
world (rank 0's store; torch's own store socket would listen on every interface)."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = """
import json, psutil
from miles_plugins_megatron.causal_lm import ensure_single_rank_parallel_state
before = {c.laddr for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
ensure_single_rank_parallel_state()
after = {c.laddr for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
print(json.dumps(sorted([ip, port] for ip, port in after - before)))
"""


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


@pytest.mark.slow
def test_the_single_rank_world_listens_on_loopback_only() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    opened = json.loads(result.stdout.strip().splitlines()[-1])
    assert opened, "the one-rank world opened no listening socket (its store)"
    assert all(is_loopback(ip) for ip, _ in opened), f"listening beyond loopback: {opened}"
