"""Ray for the benchmarks: a local Ray, or raylets of their own on this machine for the trainer's and the engines'
workers (``ray.cluster_utils.Cluster``, as ``tests/workers/test_ray_cluster.py`` builds them), so that every byte a
protocol moves crosses raylets."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import ray

from miles_core.builtin.ray_provider import loopback_node_address
from miles_core.workers.specs import ENGINE, TRAINER


@contextlib.contextmanager
def ray_nodes(two_raylets: bool) -> Iterator[tuple[str | None, dict]]:
    """Nothing started (the provider starts a local Ray), or a head and two worker nodes on 127.0.0.1 that offer
    ``trainer_node`` and ``engine_node``: the address to join and the role resources that pin the trainer's
    workers and the engines to them."""
    if not two_raylets:
        yield None, {}
        return
    from ray.cluster_utils import Cluster

    with loopback_node_address():
        cluster = Cluster(initialize_head=True, head_node_args={"node_ip_address": "127.0.0.1", "num_cpus": 2})
        for resource in ("trainer_node", "engine_node"):
            cluster.add_node(node_ip_address="127.0.0.1", num_cpus=2, resources={resource: 4})
    try:
        cluster.wait_for_nodes()
        yield cluster.address, {TRAINER: {"trainer_node": 1.0}, ENGINE: {"engine_node": 1.0}}
    finally:
        ray.shutdown()
        cluster.shutdown()


HOST_RESOURCES = [{"trainer_node": 4}, {"engine_node": 4}]
"""The two hosts of ``--hosts``: A runs the trainer (the benchmark itself), B the engine."""
HOST_PINS = {ENGINE: {"engine_node": 1.0}}


@contextlib.contextmanager
def namespace_hosts() -> Iterator[object]:
    """Two hosts with network stacks of their own (network namespaces on a bridge, a Ray node in each:
    ``tests/cluster/hosts.py``), torn down on the way out; the :class:`Hosts`."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for tests.cluster.hosts
    from tests.cluster.hosts import Hosts, namespaces_unavailable

    reason = namespaces_unavailable()
    if reason is not None:
        raise SystemExit(f"--hosts: {reason}")
    with Hosts(HOST_RESOURCES) as hosts:
        yield hosts


def run_on_first_host(hosts: object, argv: list[str]) -> int:
    """``argv`` (this benchmark again, told to join) run on host A with the cluster's token; its exit status."""
    return subprocess.run(hosts.head.command(argv), env=hosts.env(), check=False).returncode
