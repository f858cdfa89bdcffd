"""The Ray provider on a local Ray cluster: bundle order, Python and command workers, recovery, clean stop."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import psutil
import pytest
import ray
from ray.util.placement_group import placement_group_table

from miles_core.builtin.ray_provider import RayWorkerProvider, _Slot, placement_order
from miles_core.testkit.echo_worker import ECHO_GROUPS, EchoWorker
from miles_core.workers.cells import CellManager
from miles_core.workers.errors import WorkerDiedError, WorkerStartError
from miles_core.workers.handle import WorkerHandle
from miles_core.workers.health import HealthMonitor
from miles_core.workers.specs import CommandWorkerSpec, PythonWorkerSpec

pytestmark = pytest.mark.slow

TOKEN = "ray-token"


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory, loop):
    provider = RayWorkerProvider(token=TOKEN, run_dir=tmp_path_factory.mktemp("ray-run"), num_cpus=4)
    yield provider
    loop.run_until_complete(provider.shutdown())
    ray.shutdown()


def echo_spec(name: str, *, role: str | None = None, num_gpus: float = 0.0) -> PythonWorkerSpec:
    return PythonWorkerSpec(
        name=name,
        target="miles_core.testkit.echo_worker:EchoWorker",
        kwargs={"label": name},
        rpc_groups=ECHO_GROUPS,
        num_cpus=0.25,
        num_gpus=num_gpus,
        role=role,
    )


def gone(pids: list[int]) -> bool:
    return all(not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE for pid in pids)


def test_placement_order_is_node_then_device_then_bundle() -> None:
    def slot(ip: str, gpus: list[str], index: int) -> _Slot:
        return _Slot(group=None, bundle_index=index, location={"node_ip": ip, "gpu_ids": gpus})

    slots = [
        slot("10.0.0.10", ["1"], 0),
        slot("10.0.0.9", ["3"], 1),
        slot("10.0.0.9", ["10"], 2),
        slot("10.0.0.10", ["0"], 3),
        slot("10.0.0.9", ["2"], 4),
    ]
    ordered = sorted(slots, key=placement_order)
    assert [(s.location["node_ip"], s.location["gpu_ids"][0]) for s in ordered] == [
        ("10.0.0.9", "2"),
        ("10.0.0.9", "3"),
        ("10.0.0.9", "10"),
        ("10.0.0.10", "0"),
        ("10.0.0.10", "1"),
    ]


def test_workers_land_on_bundles_in_the_documented_order(provider: RayWorkerProvider, loop) -> None:
    async def scenario() -> None:
        specs = [echo_spec(f"placed-{i}") for i in range(3)]
        slots = await provider.place(specs)
        table = placement_group_table(slots[0].group)
        infos = [await provider.start(spec) for spec in specs]
        assert [info.placement["bundle_index"] for info in infos] == [0, 1, 2]  # one node, no GPUs
        for info, slot in zip(infos, slots, strict=True):
            assert info.pid == slot.location["pid"]  # hosted by the actor that holds the bundle
            assert info.placement["node_id"] == table["bundles_to_node_id"][info.placement["bundle_index"]]
            assert info.url.startswith("http://127.0.0.1:")
        handle = WorkerHandle(provider.client("placed-1"), EchoWorker)
        assert (await handle.identity())["label"] == "placed-1"
        await handle.client.aclose()
        for spec in specs:
            await provider.stop(spec.name)
        assert gone([info.pid for info in infos])

    loop.run_until_complete(scenario())


def test_python_worker_killed_then_recovered_in_its_bundle(provider: RayWorkerProvider, loop) -> None:
    async def scenario() -> None:
        cells = CellManager(provider)
        cells.add_server("ray-engine", count=1, specs=lambda cell_id: [echo_spec(cell_id)])
        cell = await cells.start("ray-engine-0")
        old = cell.workers[0]
        handle = WorkerHandle(provider.client("ray-engine-0", timeout_s=60), EchoWorker)
        call = asyncio.create_task(handle.sleep(30.0))
        await asyncio.sleep(0.5)
        await provider.kill("ray-engine-0")
        with pytest.raises(WorkerDiedError, match="worker ray-engine-0 died"):
            await call
        await handle.client.aclose()
        monitor = HealthMonitor(cells, failures_to_restart=1)
        assert await monitor.check_once() == ["ray-engine-0"]
        new = cells.get("ray-engine-0").workers[0]
        assert new.pid != old.pid and new.placement["bundle_index"] == old.placement["bundle_index"]
        handle = WorkerHandle(provider.client("ray-engine-0"), EchoWorker)
        assert await handle.record("after", 5) == 10
        await handle.client.aclose()
        await cells.stop_all()
        assert gone([old.pid, new.pid])

    loop.run_until_complete(scenario())


def test_command_worker_is_supervised_by_its_actor(provider: RayWorkerProvider, loop) -> None:
    async def scenario() -> None:
        spec = CommandWorkerSpec(
            name="ray-http",
            argv=["bash", "-c", f"{sys.executable} -m http.server {{port}} --bind {{host}} & wait"],
            ports=["port"],
            health_url="http://{host}:{port}/",
            num_cpus=0.25,
        )
        info = await provider.start(spec)
        tree = await provider.tree_pids("ray-http")
        assert len(tree) == 3  # the actor, bash, and the server
        assert await provider.is_alive("ray-http")
        await provider.stop("ray-http")
        assert gone(tree)
        assert not await provider.is_alive("ray-http")
        assert info.url == f"http://127.0.0.1:{info.ports['port']}"

    loop.run_until_complete(scenario())


def test_command_that_fails_under_ray_reports_its_log(provider: RayWorkerProvider, loop, tmp_path: Path) -> None:
    spec = CommandWorkerSpec(
        name="ray-bad",
        argv=[sys.executable, "-c", "print('no such model'); raise SystemExit(2)"],
        ports=["port"],
        health_url="http://{host}:{port}/health",
        num_cpus=0.25,
    )
    with pytest.raises(WorkerStartError) as caught:
        loop.run_until_complete(provider.start(spec))
    assert "worker ray-bad exited while starting" in str(caught.value)
    assert "no such model" in str(caught.value)


def test_workers_that_reserve_no_cpu_are_placed_and_too_big_ones_fail_clearly(
    provider: RayWorkerProvider, loop
) -> None:
    async def scenario() -> None:
        free = echo_spec("no-cpu").model_copy(update={"num_cpus": 0.0})  # like a CPU engine sharing the cores
        info = await provider.start(free)
        assert info.placement["bundle_index"] == 0
        await provider.stop("no-cpu")
        too_big = echo_spec("too-big").model_copy(update={"num_cpus": 64.0, "startup_timeout_s": 2.0})
        with pytest.raises(WorkerStartError, match=r"cannot place 1 worker \(too-big\) of \{'CPU': 64.0\}"):
            await provider.place([too_big])

    loop.run_until_complete(scenario())


def test_a_command_worker_that_keeps_finding_its_port_taken_fails_fast_after_each_try(
    provider: RayWorkerProvider, loop
) -> None:
    """A server whose bind finds its port taken and then hangs (SGLang's does) is stopped as soon as its log says so
    and started on fresh ports, up to three tries, each a separate start in the same log; the error says why, long
    before the start-up deadline."""
    import time

    hangs = CommandWorkerSpec(
        name="always-taken",
        argv=[
            sys.executable,
            "-c",
            "import time; print('ERROR: [Errno 98] address already in use', flush=True); time.sleep(600)",
        ],
        ports=["port"],
        health_url="http://{host}:{port}/",
        startup_timeout_s=300,
        num_cpus=0.25,
    )
    started = time.monotonic()
    with pytest.raises(WorkerStartError, match="worker always-taken found its port taken while starting"):
        loop.run_until_complete(provider.start(hangs))
    assert time.monotonic() - started < 120  # three quick tries, not one 300 s deadline
    log = Path(provider.run_dir / "logs" / "always-taken.log").read_text()
    assert log.count("address already in use") == 3
