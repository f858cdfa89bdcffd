"""An engine's node dies mid-run (every process of its host killed, by pid): the run says which node went and which
worker with it, goes on with the engine on the other node, and brings the lost engine back, at the published
version, once the node returns (its Ray node started again: Ray re-places the engine's bundle there). And the
driver's own host dies whole: the run's workers on the other hosts are gone within :data:`REMOTE_GONE_WITHIN_S`, and
those hosts' Ray nodes take the next run.

Hosts: A runs the driver (the torch trainer), C1 and C2 one engine each (each offers one ``engine_node``). Ray's
health checks run every second here, so that the head sees the node die within seconds."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.hosts import MILES, Host, Hosts, hosts_or_skip
from tests.cluster.test_learning_across_hosts import assert_learned, weight_updates, where
from tests.test_train_moe import LEARNING_FLAGS, save_echo_last_moe

pytestmark = pytest.mark.slow

FIRST, SECOND = 1, 2
STEPS = 40
NODE_KILLER = """\
import json
import os
import signal
import subprocess
import threading
import time

import ray

from miles_core import hookimpl

CONTROLLER = None


def bring_the_node_back(node_id, address):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not {n["NodeID"]: n["Alive"] for n in ray.nodes()}.get(node_id, True):
            break
        time.sleep(0.2)
    started = subprocess.run(json.loads(os.environ["RESTART_NODES"])[address], capture_output=True, text=True)
    print(f"NODE_BACK {started.returncode}", flush=True)


@hookimpl
def prepare_rollout(rollout_id, controller):
    global CONTROLLER
    CONTROLLER = controller
    if rollout_id == 3:  # engine-1's host dies as a rollout starts: every process in its namespace
        engine = controller.provider.workers["engine-1"]
        namespace = json.loads(os.environ["NAMESPACES"])[engine.node]
        pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
        for pid in map(int, pids.stdout.split()):
            os.kill(pid, signal.SIGKILL)
        print(f"NODE_KILLED {engine.node} {len(pids.stdout.split())}", flush=True)
        args = (engine.placement["node_id"], engine.node)
        threading.Thread(target=bring_the_node_back, args=args, daemon=True).start()


@hookimpl
def on_metrics(rollout_id, metrics):
    restarts = {cell_id: cell.restarts for cell_id, cell in CONTROLLER.cells.cells.items()}
    print(f"RESTARTS {rollout_id} {restarts['engine-0']} {restarts['engine-1']}", flush=True)
"""


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    fast_health = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
    with hosts_or_skip([{"driver_node": 1}, {"engine_node": 1}, {"engine_node": 1}], ray_env=fast_health) as built:
        yield built


def test_a_lost_engine_node_is_named_the_run_goes_on_and_the_engine_comes_back(hosts: Hosts, tmp_path: Path) -> None:
    model_dir, train_prompts, eval_prompts = save_echo_last_moe(tmp_path)
    killer = tmp_path / "killer.py"
    killer.write_text(NODE_KILLER)
    engine_hosts = [hosts.hosts[FIRST], hosts.hosts[SECOND]]
    result = hosts.head.run(
        [
            MILES, "train", "--model", model_dir, "--output-dir", tmp_path / "run", "--prompts", train_prompts,
            "--rollout-eval-prompts", eval_prompts, *LEARNING_FLAGS, "--num-steps", str(STEPS),
            "--run-worker-provider", "ray", "--run-ray-address", hosts.ray_address,
            "--run-ray-engine-resources", '{"engine_node": 1}', "--engine-num-engines", "2",
            "--engine-health-check-interval-s", "1", "--weight-transfer-mode", "tensor", "--plugin", killer,
        ],
        env=hosts.env(
            NAMESPACES=json.dumps({host.address: host.namespace for host in engine_hosts}),
            RESTART_NODES=json.dumps({host.address: hosts.ray_start_argv(host) for host in engine_hosts}),
            **hosts.ray_env,
        ),
        cwd=tmp_path,
        timeout_s=600,
    )  # fmt: skip
    (tmp_path / "stdout.txt").write_text(result.stdout)
    assert result.returncode == 0, result.stderr[-3000:]
    placed = {where(result.stdout, "engine-0"), where(result.stdout, "engine-1")}
    assert placed == {host.address for host in engine_hosts}
    lost = where(result.stdout, "engine-1")
    assert f"NODE_KILLED {lost}" in result.stdout and "NODE_BACK 0" in result.stdout, result.stdout[-3000:]
    told = [line for line in result.stdout.splitlines() if line.startswith(f"miles: node {lost} (id ")]
    assert told and "its bundle for engine-1 is rescheduling" in told[0], result.stdout[-3000:]
    assert "the run goes on without it" in told[0]
    restarts = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("RESTARTS")]
    # engine-0 never stopped; engine-1 came back (each attempt while its bundle waited for a node counts as one)
    assert restarts[-1][1] == "0" and int(restarts[-1][2]) >= 1, restarts
    assert_learned(tmp_path / "run")
    updates, cells = weight_updates(tmp_path / "run")
    assert [version for version, _, _, _ in updates] == list(range(1, STEPS + 1))
    assert {checksum_ok for _, _, checksum_ok, _ in updates} == {1}  # on the engines each version reached
    assert updates[-1][1] == 2 and cells == [("engine-0", STEPS), ("engine-1", STEPS)]  # both serve the last one


REMOTE_GONE_WITHIN_S = 90.0
"""The bound docs/concepts/workers.md states for workers on other nodes once the driver's host is lost whole."""


def test_the_driver_host_lost_whole_leaves_no_worker_on_the_other_hosts_and_their_nodes_take_the_next_run(
    hosts: Hosts, tmp_path: Path
) -> None:
    """The driver runs on C2 (not the head) with an engine on C1 and one on C2; at step 2 every process of C2 is
    killed at once (the driver, its engine, C2's Ray node). The run's processes on C1 (its Ray actor and the engine it
    started, found by their command lines) are gone within the documented bound, and a new run from A places its
    engine on C1 and trains."""
    driver_host, other = hosts.hosts[SECOND], hosts.hosts[FIRST]
    run_dir = tmp_path / "lost"
    quick = ["--no-progress", "--rollout-batch-size", "4", "--rollout-group-size", "4", "--run-eval-every", "0"]
    ray_flags = ["--run-worker-provider", "ray", "--run-ray-address", hosts.ray_address]
    ray_flags += ["--run-ray-engine-resources", '{"engine_node": 1}', "--weight-transfer-mode", "tensor"]
    driver = subprocess.Popen(
        driver_host.command([MILES, "train", "--output-dir", run_dir, *quick, *ray_flags, "--num-steps", "200",
                             "--engine-num-engines", "2"]),
        env=hosts.env(**hosts.ray_env), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        seen = _read_until_step(driver, 2, timeout_s=150)
        workers = run_processes(other, run_dir)
        assert any(command.startswith("ray::WorkerActor") for command in workers.values()), (workers, seen[-3000:])
        assert any(str(run_dir) in command for command in workers.values()), workers  # the engine C1's actor started
        killed = hosts.kill_host(driver_host)
        assert driver.pid in killed or driver.wait(timeout=10) is not None
        started = time.monotonic()
        while (left := run_processes(other, run_dir)) and time.monotonic() - started < REMOTE_GONE_WITHIN_S:
            time.sleep(1.0)
        assert left == {}, (
            f"the run's processes on {other.name} {REMOTE_GONE_WITHIN_S:.0f} s after its driver's host died: {left}"
        )
        print(f"the run's workers on {other.name} were gone {time.monotonic() - started:.1f} s after the driver's host")
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.wait()
    result = hosts.head.run(
        [MILES, "train", "--output-dir", tmp_path / "next", *quick, *ray_flags, "--num-steps", "2"],
        env=hosts.env(**hosts.ray_env), cwd=tmp_path, timeout_s=300,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    assert where(result.stdout, "engine-0") == other.address, result.stdout[-3000:]


def run_processes(host: Host, run_dir: Path) -> dict[int, str]:
    """The run's live processes on ``host``: its Ray actors (``ray::WorkerActor``) and every process whose command
    line names the run's directory (the engines), by pid."""
    found = {}
    for pid in host.pids():
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in "ZX" and (command.startswith("ray::WorkerActor") or str(run_dir) in command):
            found[pid] = command[:200]
    return found


def _read_until_step(process: subprocess.Popen, step: int, *, timeout_s: float) -> str:
    """The run's output up to its ``step`` line; an error when it ends first or takes longer than ``timeout_s``."""
    lines, deadline = [], time.monotonic() + timeout_s
    for line in process.stdout:
        lines.append(line)
        if line.startswith(f"step {step:4d}"):
            return "".join(lines)
        assert time.monotonic() < deadline, f"no step {step} within {timeout_s:.0f} s: {''.join(lines)[-3000:]}"
    raise AssertionError(f"the run ended before step {step}: {''.join(lines)[-3000:]}")
