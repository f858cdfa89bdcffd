"""The Ray provider on a multi-node Ray cluster on one machine (Ray's own way to test several nodes: raylets of their
own, each with its own resources, here from ``ray.cluster_utils.Cluster``, all on 127.0.0.1): placement across nodes
keeps the documented order, roles are pinned to the nodes that offer their custom resources, a resource no node
offers fails at once, and ``miles train`` joins the cluster with ``--run-ray-address`` or ``RAY_ADDRESS``. Learning
runs with the ranks and the engines on other hosts than the driver, over each protocol, are in ``tests/cluster/``
(network namespaces: each host its own network stack, which raylets on one loopback are not).

The cluster uses token authentication, as Ray 2.60 sets up a new local cluster: the token of ``~/.ray/auth_token``
(made if missing, as ``ray.init`` does), and ``RAY_AUTH_MODE=token`` for the drivers that join it; after a local Ray
of Miles in this process, that process's token (in ``RAY_AUTH_TOKEN``, which Ray reads first, and which its nodes
and the drivers started here inherit)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray._private.authentication.authentication_token_setup import (
    enable_token_auth_by_default,
    ensure_token_if_auth_enabled,
)
from ray._private.utils import get_ray_address_file, read_ray_address
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table

from miles_core.builtin.ray_provider import RayWorkerProvider, loopback_node_address, placement_order
from miles_core.testkit.echo_worker import EchoWorker
from miles_core.workers.errors import WorkerStartError
from miles_core.workers.handle import WorkerHandle
from miles_core.workers.specs import ENGINE, ROUTER, TRAINER
from tests.conftest import run_miles
from tests.workers.test_ray_provider import echo_spec

pytestmark = pytest.mark.slow

TOKEN = "cluster-token"
UCX_TCP_ONLY = {"UCX_TLS": "tcp"}
"""For the raylets' workers and the drivers that join: ``rdt`` moves weights between raylets over TCP, not the
cross-memory attach or shared memory that UCX would pick between processes of one machine."""
PINS = {TRAINER: {"trainer_node": 1.0}, ENGINE: {"engine_node": 1.0}, ROUTER: {"engine_node": 0.5}}


@dataclasses.dataclass(frozen=True)
class TwoNodes:
    """A head node with no custom resources and two worker nodes: one offers ``trainer_node``, one ``engine_node``
    (each also 2 CPUs and 2 GPUs that Ray counts but that need no device: ids in ``CUDA_VISIBLE_DEVICES``)."""

    address: str
    head: str  # node ids
    trainer: str
    engine: str


@pytest.fixture(scope="module")
def cluster() -> Iterator[TwoNodes]:
    enable_token_auth_by_default()  # what ray.init does for a new local cluster: RAY_AUTH_MODE=token ...
    ensure_token_if_auth_enabled({}, create_token_if_missing=True)  # ... and a token in ~/.ray/auth_token
    previous = read_ray_address()
    # NIXL's UCX over TCP only, as between two machines without RDMA: the raylets' workers take this environment
    with loopback_node_address(), _environment(UCX_TCP_ONLY):  # every node's address (and ports) on 127.0.0.1
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"node_ip_address": "127.0.0.1", "num_cpus": 2, "include_dashboard": False},
        )
        trainer = cluster.add_node(node_ip_address="127.0.0.1", num_cpus=2, num_gpus=2, resources={"trainer_node": 4})
        engine = cluster.add_node(node_ip_address="127.0.0.1", num_cpus=2, num_gpus=2, resources={"engine_node": 4})
    _restore_address_file(previous, written=cluster.address)
    try:
        cluster.wait_for_nodes()
        yield TwoNodes(cluster.address, cluster.head_node.node_id, trainer.node_id, engine.node_id)
    finally:
        cluster.shutdown()


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment for the body (the raylets started there inherit them)."""
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _restore_address_file(previous: str | None, *, written: str) -> None:
    """Put back the address Ray keeps in ``/tmp/ray/ray_current_cluster``, which the head just overwrote: this cluster
    is joined by its address only, and a ``ray.init()`` elsewhere on the machine must not find it there."""
    if read_ray_address() != written:
        return
    if previous is None:
        Path(get_ray_address_file(None)).unlink(missing_ok=True)
    else:
        Path(get_ray_address_file(None)).write_text(previous)


@pytest.fixture(scope="module")
def joined(cluster: TwoNodes, tmp_path_factory: pytest.TempPathFactory, loop) -> Iterator[Path]:
    """This process joined to the cluster (by the first provider); the run directory of the tests' providers."""
    assert not ray.is_initialized(), "an earlier test left its Ray connected"
    run_dir = tmp_path_factory.mktemp("cluster-run")
    first = RayWorkerProvider(token=TOKEN, run_dir=run_dir, address=cluster.address)
    yield run_dir
    loop.run_until_complete(first.shutdown())
    ray.shutdown()


@pytest.fixture
def provider(joined: Path, loop) -> Iterator[RayWorkerProvider]:
    """A provider of each test's own, whose shutdown frees its placement groups for the next test."""
    provider = RayWorkerProvider(token=TOKEN, run_dir=joined, role_resources=PINS)
    yield provider
    loop.run_until_complete(provider.shutdown())


def test_the_provider_joined_the_cluster_on_loopback(cluster: TwoNodes, provider: RayWorkerProvider) -> None:
    nodes = {node["NodeID"]: node for node in ray.nodes() if node["Alive"]}
    assert set(nodes) == {cluster.head, cluster.trainer, cluster.engine}
    assert {node["NodeManagerAddress"] for node in nodes.values()} == {"127.0.0.1"}
    assert provider.driver_ip == "127.0.0.1"


def test_placement_across_raylets_is_node_then_device_then_bundle(
    cluster: TwoNodes, provider: RayWorkerProvider, loop
) -> None:
    """Four one-GPU workers spread over the two GPU nodes: handed out in (address, device, bundle) order, each where
    Ray's placement table says its bundle is, each reachable from the driver."""

    async def scenario() -> None:
        specs = [echo_spec(f"spread-{i}", num_gpus=1) for i in range(4)]
        slots = await provider.place(specs, strategy="SPREAD")
        table = placement_group_table(slots[0].group)
        infos = [await provider.start(spec) for spec in specs]
        try:
            assert slots == sorted(slots, key=placement_order)
            nodes = [info.placement["node_id"] for info in infos]
            assert sorted(nodes) == sorted([cluster.trainer, cluster.trainer, cluster.engine, cluster.engine])
            assert [info.placement["gpu_ids"] for info in infos] == [["0"], ["0"], ["1"], ["1"]]  # one address
            for info in infos:
                assert info.placement["node_id"] == table["bundles_to_node_id"][info.placement["bundle_index"]]
            for pair in ([infos[0], infos[1]], [infos[2], infos[3]]):  # same address and device: by bundle
                assert pair[0].placement["bundle_index"] < pair[1].placement["bundle_index"]
            handles = [WorkerHandle(provider.client(spec.name), EchoWorker) for spec in specs]
            assert [(await handle.identity())["label"] for handle in handles] == [spec.name for spec in specs]
            for handle in handles:
                await handle.client.aclose()
        finally:
            for spec in specs:
                await provider.stop(spec.name)

    loop.run_until_complete(scenario())


def test_roles_are_pinned_to_the_nodes_that_offer_their_resources(
    cluster: TwoNodes, provider: RayWorkerProvider, loop
) -> None:
    """Trainer ranks (placed together) on the trainer node, engines and the router (one bundle each) on the engine
    node; the head, where Ray would put them first, gets none. Each bundle asks for its role's resource."""

    async def scenario() -> None:
        ranks = [echo_spec(f"rank-{i}", role=TRAINER) for i in range(2)]
        others = [echo_spec("engine-a", role=ENGINE), echo_spec("engine-b", role=ENGINE), echo_spec("rt", role=ROUTER)]
        await provider.place(ranks)
        infos = {spec.name: await provider.start(spec) for spec in [*ranks, *others]}
        try:
            where = {name: info.placement["node_id"] for name, info in infos.items()}
            assert where == {
                "rank-0": cluster.trainer,
                "rank-1": cluster.trainer,
                "engine-a": cluster.engine,
                "engine-b": cluster.engine,
                "rt": cluster.engine,
            }
            bundles = placement_group_table(provider.slots["rank-0"].group)["bundles"]
            assert [bundle["trainer_node"] for bundle in bundles.values()] == [1.0, 1.0]
            router_bundle = placement_group_table(provider.slots["rt"].group)["bundles"][0]
            assert router_bundle["engine_node"] == 0.5
        finally:
            for name in infos:
                await provider.stop(name)

    loop.run_until_complete(scenario())


def test_a_resource_no_node_offers_fails_at_once_naming_it(
    cluster: TwoNodes, provider: RayWorkerProvider, loop
) -> None:
    """Unmet, a placement group waits forever: the provider refuses before making one, naming the resource, the
    amount asked and what the nodes offer (the start-up timeout here is an hour, so a wait would show)."""
    missing = RayWorkerProvider(token=TOKEN, run_dir=provider.run_dir, role_resources={TRAINER: {"gpu_island": 1}})
    too_much = RayWorkerProvider(token=TOKEN, run_dir=provider.run_dir, role_resources={TRAINER: {"trainer_node": 3}})
    loop.run_until_complete(provider.place([echo_spec("holder", role=ENGINE)]))  # a group holding engine_node
    slow = {"startup_timeout_s": 3600.0}
    ranks = [echo_spec(f"unplaced-{i}", role=TRAINER).model_copy(update=slow) for i in range(2)]
    with pytest.raises(WorkerStartError, match="the custom resource 'gpu_island', 2 in all, and the cluster's nodes"):
        loop.run_until_complete(missing.place(ranks))
    enough = "asks for 3 of the custom resource 'trainer_node', 6 in all, and the cluster's nodes offer 4;"
    with pytest.raises(WorkerStartError, match=enough):
        loop.run_until_complete(too_much.place(ranks))
    offered = str(_error(loop, missing.place(ranks))).split("custom resources offered: ", 1)[1].split(";", 1)[0]
    assert offered == "{'engine_node': 4.0, 'trainer_node': 4.0}"  # not the holder's share (engine_node_group_...)
    assert not missing.groups and not too_much.groups
    assert [group for group in placement_group_table().values() if group["state"] == "PENDING"] == []  # none waits


def _error(loop, coroutine) -> BaseException:
    with pytest.raises(WorkerStartError) as caught:
        loop.run_until_complete(coroutine)
    return caught.value


def _pid(stdout: str, name: str) -> str:
    return stdout.split(f"{name} pid ", 1)[1].split(" ", 1)[0]


def test_joining_without_the_clusters_token_is_a_clear_error(cluster: TwoNodes, tmp_path: Path) -> None:
    """Ray sends no token to an explicit address unless RAY_AUTH_MODE=token; the flag wins over RAY_ADDRESS."""
    env = {"RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": "127.0.0.1:9"}
    result = run_miles(
        *("train", "--output-dir", str(tmp_path), "--no-progress", "--run-worker-provider", "ray"),
        *("--run-ray-address", cluster.address),
        env=env,
        timeout_s=240,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"cannot join the Ray cluster at {cluster.address} (run.ray_address (--run-ray-address))" in result.stderr
    assert "refused this driver's authentication token" in result.stderr and "RAY_AUTH_MODE=token" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "metrics.jsonl").exists()


def test_ray_address_from_the_environment_joins_the_cluster(cluster: TwoNodes, tmp_path: Path) -> None:
    """RAY_ADDRESS keeps working: a one-step run (torch trainer in the driver) with its engine pinned."""
    result = run_miles(
        *("train", "--output-dir", str(tmp_path), "--no-progress", "--run-worker-provider", "ray"),
        *("--run-ray-engine-resources", '{"engine_node": 0.01}', "--num-steps", "1", "--run-eval-every", "0"),
        *("--rollout-batch-size", "4", "--rollout-group-size", "4"),
        env={"RAY_AUTH_MODE": "token", "RAY_ADDRESS": cluster.address},
        timeout_s=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"engine-0 pid {_pid(result.stdout, 'engine-0')} node 127.0.0.1 (id {cluster.engine[:8]})" in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["weight_transfer/gb_per_s"] > 0 for row in rows if "train/loss" in row] == [True]


def test_a_run_on_the_cluster_refuses_a_resource_no_node_offers(cluster: TwoNodes, tmp_path: Path) -> None:
    result = run_miles(
        *("train", "--output-dir", str(tmp_path), "--no-progress", "--run-worker-provider", "ray"),
        *("--run-ray-address", cluster.address, "--run-ray-engine-resources", '{"a100_node": 1}'),
        env={"RAY_AUTH_MODE": "token"},
        timeout_s=240,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "cannot place 1 worker (engine-0)" in result.stderr
    assert "the custom resource 'a100_node', 1 in all, and the cluster's nodes offer 0" in result.stderr
    assert "'engine_node': 4.0" in result.stderr and "'trainer_node': 4.0" in result.stderr
