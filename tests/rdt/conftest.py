"""One local Ray cluster for every rdt test (started once: a Ray start costs seconds on these machines)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import ray

from miles_core.builtin.ray_provider import RayWorkerProvider, init_ray
from miles_core.engines.staging import weight_staging_dir
from miles_core.testkit.protocol_contract import CONTRACT_TOKEN, ContractEngines


@pytest.fixture(scope="package")
def ray_cluster():
    started_here = not ray.is_initialized()
    if started_here:
        init_ray(num_cpus=4)  # a Ray of its own, never one that `ray start` left running
    yield
    if started_here:
        ray.shutdown()


@pytest.fixture(scope="package")
def ray_engines(ray_cluster, tmp_path_factory: pytest.TempPathFactory):
    """Two local engines started by the Ray provider (each supervised by a Ray actor), as the contract needs them."""
    root = tmp_path_factory.mktemp("rdt-engines")
    engines = ContractEngines(root, count=2, provider=RayWorkerProvider(token=CONTRACT_TOKEN, run_dir=root / "run"))
    asyncio.run(engines.start())
    yield engines
    asyncio.run(engines.provider.shutdown())


def shm_files() -> set[Path]:
    """The rdt staging buckets (in the staging directory) and send buffers (in /dev/shm) that exist now."""
    found = set(weight_staging_dir().glob("miles-rdt-*"))
    return found | (set(Path("/dev/shm").glob("miles-rdt-*")) if Path("/dev/shm").is_dir() else set())
