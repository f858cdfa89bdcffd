"""The Ray provider on a multi-node Ray cluster on one machine (Ray's own way to test several nodes: raylets of their
own, each with its own resources, here from ``ray.cluster_utils.Cluster``, all on 127.0.0.1): placement across nodes
keeps the documented order, roles are pinned to the nodes that offer their custom resources, a resource no node
offers fails at once, and ``miles train`` runs join the cluster with ``--run-ray-address``, Megatron ranks on one
node and engines on another: over each protocol the ranks send every version themselves, the run learns, and an
engine killed mid-run gets the published version back from the ranks.

The cluster uses token authentication, as Ray 2.60 sets up a new local cluster: the token of ``~/.ray/auth_token``
(made if missing, as ``ray.init`` does), and ``RAY_AUTH_MODE=token`` for the drivers that join it."""

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

from miles_core.dashboard.store import DB_NAME, open_for_reading
from miles_core.testkit.echo_worker import EchoWorker
from miles_core.workers.errors import WorkerStartError
from miles_core.workers.handle import WorkerHandle
from miles_core.workers.ray_provider import RayWorkerProvider, loopback_node_address, placement_order
from miles_core.workers.specs import ENGINE, ROUTER, TRAINER
from tests.conftest import run_miles
from tests.test_train_moe import LEARNING_FLAGS, LEARNING_MARGIN, save_echo_last_moe
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
    offered = str(_error(loop, missing.place(ranks))).split("custom resources offered: ", 1)[1]
    assert offered == "{'engine_node': 4.0, 'trainer_node': 4.0})"  # not the holder's share (engine_node_group_...)
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


@pytest.mark.parametrize("mode", ["rdt"])
def test_each_protocol_moves_the_weights_to_engines_on_another_node(
    cluster: TwoNodes, tmp_path: Path, mode: str
) -> None:
    """The torch trainer in the driver (on the head node, its one holder) and two engines pinned to the engine node:
    ``rdt`` carries each step's weights across the raylets (NIXL over TCP from the driver's send buffer to the
    engines' receivers), checksums verified on both engines. The other protocols cross raylets from Megatron ranks
    below."""
    steps = 2
    result = run_miles(
        *("train", "--output-dir", str(tmp_path), "--no-progress", "--run-worker-provider", "ray"),
        *("--run-ray-address", cluster.address, "--run-ray-engine-resources", "{engine_node: 1}"),
        *("--weight-transfer-mode", mode, "--weight-transfer-verify-checksum", "true", "--engine-num-engines", "2"),
        *("--num-steps", str(steps), "--rollout-batch-size", "4", "--rollout-group-size", "4", "--run-eval-every", "0"),
        env={"RAY_AUTH_MODE": "token", **UCX_TCP_ONLY},
        timeout_s=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for cell in ("engine-0", "engine-1"):
        assert f"{cell} pid {_pid(result.stdout, cell)} node 127.0.0.1 (id {cluster.engine[:8]})" in result.stdout
    with open_for_reading(tmp_path / DB_NAME) as db:
        updates = db.execute("SELECT version, num_engines, checksum_ok, protocol FROM weight_updates").fetchall()
        engines = db.execute("SELECT cell_id, weight_version FROM engines ORDER BY cell_id").fetchall()
    assert [tuple(row) for row in updates] == [(version, 2, 1, mode) for version in range(1, steps + 1)]
    assert [tuple(row) for row in engines] == [("engine-0", steps), ("engine-1", steps)]


ENGINE_KILLER = """\
import os
import signal

from miles_core import hookimpl

CONTROLLER = None


@hookimpl
def prepare_rollout(rollout_id, controller):
    global CONTROLLER
    CONTROLLER = controller
    if rollout_id == 3:  # engine-1, on the engine node, dies as a rollout starts
        os.kill(controller.provider.workers["engine-1"].pid, signal.SIGKILL)


@hookimpl
def on_metrics(rollout_id, metrics):
    restarts = {cell_id: cell.restarts for cell_id, cell in CONTROLLER.cells.cells.items()}
    print(f"RESTARTS {rollout_id} {restarts['engine-0']} {restarts['engine-1']}", flush=True)
    print(f"DRIVER_COPY {len(CONTROLLER.published)} {CONTROLLER.published_by_holders}", flush=True)
"""


@pytest.mark.parametrize("mode", ["disk", "tensor", "broadcast", "rdt"])
def test_megatron_ranks_send_over_each_protocol_across_nodes_learn_and_recover_a_killed_engine(
    cluster: TwoNodes, tmp_path: Path, mode: str
) -> None:
    """Two Megatron ranks (TP=2) on the trainer node send every version themselves to two engines on the engine
    node (the driver keeps no copy: ``published_by_holders``), checksums verified; engine-1 is killed as the third
    rollout starts and comes back with the published version from the ranks (``republish``); the held-out reward
    of the echo-last task rises. ``rdt`` reads the ranks' memory over NIXL with UCX held to TCP."""
    model_dir, train_prompts, eval_prompts = save_echo_last_moe(tmp_path)
    killer = tmp_path / "killer.py"
    killer.write_text(ENGINE_KILLER)
    run = tmp_path / "run"
    result = run_miles(
        *("train", "--trainer", "megatron", "--model", str(model_dir), "--output-dir", str(run)),
        *("--prompts", str(train_prompts), "--rollout-eval-prompts", str(eval_prompts), *LEARNING_FLAGS),
        *("--run-worker-provider", "ray", "--run-ray-address", cluster.address),
        *("--run-ray-trainer-resources", json.dumps(PINS[TRAINER]), "--run-ray-engine-resources", "{engine_node: 1}"),
        *("--megatron-tensor-parallel", "2", "--megatron-cpus-per-rank", "0.5", "--engine-num-engines", "2"),
        *("--weight-transfer-mode", mode, "--plugin", str(killer)),
        env={"RAY_AUTH_MODE": "token", **UCX_TCP_ONLY},
        timeout_s=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):  # the ranks on the trainer node, in bundle order
        name = f"megatron-rank{rank}"
        assert f"{name} pid {_pid(result.stdout, name)} node 127.0.0.1 (id {cluster.trainer[:8]}) bundle {rank}" in (
            result.stdout
        )
    for cell in ("engine-0", "engine-1"):
        assert f"{cell} pid {_pid(result.stdout, cell)} node 127.0.0.1 (id {cluster.engine[:8]})" in result.stdout
    restarts = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("RESTARTS")]
    assert restarts[-1][1:] == ["0", "1"], restarts[-1]  # engine-1 was killed once and brought back
    copies = {line for line in result.stdout.splitlines() if line.startswith("DRIVER_COPY")}
    assert copies == {"DRIVER_COPY 0 True"}  # every version was sent by the ranks, none kept in the driver
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval/reward_mean"] for row in rows if "eval/reward_mean" in row]
    assert len(evals) == 2 and evals[-1] >= evals[0] + LEARNING_MARGIN, evals
    with open_for_reading(run / DB_NAME) as db:
        updates = db.execute("SELECT version, num_engines, checksum_ok, protocol FROM weight_updates").fetchall()
        engines = db.execute("SELECT cell_id, weight_version FROM engines ORDER BY cell_id").fetchall()
        versions = db.execute("SELECT step, data FROM samples").fetchall()
    steps = int(LEARNING_FLAGS[LEARNING_FLAGS.index("--num-steps") + 1])
    assert [tuple(row) for row in updates] == [(version, 2, 1, mode) for version in range(1, steps + 1)]
    by_step = {(row["step"], json.loads(row["data"])["weight_version"]) for row in versions}
    assert by_step == {(1, None), *((step, step - 1) for step in range(2, steps + 1))}  # each step's samples: the
    # version the step before sent
    assert [tuple(row) for row in engines] == [("engine-0", steps), ("engine-1", steps)]
