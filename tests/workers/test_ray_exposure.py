"""A default run on the Ray provider (no cluster address) opens no port beyond loopback: Ray's GCS, raylet, object
manager, runtime-env agent, every worker process, and the Miles workers it hosts all listen on 127.0.0.1.

Ray 2.60 binds its servers to the node address, and turns a requested node address of 127.0.0.1 into the machine's
routable address unless clusters are switched off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the default on macOS
and Windows); the provider switches them off while it starts a local Ray. Before, the GCS, raylet and workers
listened on every interface (``::``) and the runtime-env agent on the machine's address."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback  # ::ffff:127.0.0.1 is loopback too


def test_a_default_ray_run_listens_on_loopback_only(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}  # a default run: no cluster
    result = subprocess.run(
        [sys.executable, "-m", "tests.workers.ray_ports", str(tmp_path / "run")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ports = json.loads(result.stdout.strip().splitlines()[-1])
    names = " ".join(row["name"] for row in ports)
    for part in ("gcs_server", "raylet", "RuntimeEnvAgent", "WorkerActor", "http.server"):  # what the run opened
        assert part in names, f"no listening port of {part} found: {json.dumps(ports, indent=1)}"
    exposed = [row for row in ports if not is_loopback(row["address"])]
    assert not exposed, "ports beyond loopback:\n" + "\n".join(
        f"  {row['address']}:{row['port']}  pid {row['pid']}  {row['name']}" for row in exposed
    )
