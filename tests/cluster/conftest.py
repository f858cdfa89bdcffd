"""The multi-host harness's fixtures: three hosts for the learning runs (driver on A, trainer ranks on B, engines on
C), built once per session and torn down even when a test fails (:mod:`tests.cluster.hosts`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster.hosts import Hosts, hosts_or_skip

DRIVER, TRAINER, ENGINE = 0, 1, 2
"""The hosts' indices: A runs the driver (the Ray head), B the trainer ranks, C the engines."""
THREE_HOSTS = [{"driver_node": 1}, {"trainer_node": 4}, {"engine_node": 4}]
PINS = ["--run-ray-trainer-resources", '{"trainer_node": 1}', "--run-ray-engine-resources", '{"engine_node": 1}']
"""The flags that put the trainer ranks on B and the engines (and a router) on C."""


@pytest.fixture(scope="session")
def hosts() -> Iterator[Hosts]:
    with hosts_or_skip(THREE_HOSTS) as built:
        yield built
