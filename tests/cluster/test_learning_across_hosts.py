"""``miles train`` across three hosts (network namespaces, each its own network stack): the driver on A, the trainer
ranks on B, the engines on C. Over each protocol (from the Megatron ranks; from the torch trainer in the driver over
``rdt``) every update's checksum agrees on every engine; over ``rdt`` (what ``auto`` chooses between hosts) the run
learns the echo-last task, over the others it runs a few steps (what the weights do to learning does not depend on the
protocol that carried them, once every checksum agrees, and CI's minutes are few). The Megatron runs also lose an
engine mid-run and bring it back from the ranks.

``tensor`` between hosts sends each bucket as safetensors bytes over HTTP (shared memory only between processes of
one node); ``rdt`` reads the senders' memory over NIXL with UCX held to TCP; ``broadcast``'s groups meet at each
sender's node address; ``disk`` needs a directory that every node sees (here the machine's own file system, which
every namespace shares; the check that refuses a node that cannot see it is in ``test_bad_input_across_hosts``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_core.builtin.dashboard.store import DB_NAME, open_for_reading
from tests.cluster.conftest import DRIVER, ENGINE, PINS, TRAINER
from tests.cluster.hosts import MILES, Hosts
from tests.test_train_moe import LEARNING_FLAGS, LEARNING_MARGIN, save_echo_last_moe

pytestmark = pytest.mark.slow

STEPS = int(LEARNING_FLAGS[LEARNING_FLAGS.index("--num-steps") + 1])
LEARNS_OVER = "rdt"
"""The protocol whose runs learn; ``auto`` chooses it between hosts."""
CHECKED_STEPS = 5
"""Steps of a run over another protocol: each version checked on every engine (the engine killed at the third)."""


def steps_over(mode: str) -> int:
    return STEPS if mode == LEARNS_OVER else CHECKED_STEPS


ENGINE_KILLER = """\
import os
import signal

from miles_core import hookimpl

CONTROLLER = None


@hookimpl
def prepare_rollout(rollout_id, controller):
    global CONTROLLER
    CONTROLLER = controller
    if rollout_id == 3:  # engine-1, on host C, dies as a rollout starts
        os.kill(controller.provider.workers["engine-1"].pid, signal.SIGKILL)


@hookimpl
def on_metrics(rollout_id, metrics):
    restarts = {cell_id: cell.restarts for cell_id, cell in CONTROLLER.cells.cells.items()}
    print(f"RESTARTS {rollout_id} {restarts['engine-0']} {restarts['engine-1']}", flush=True)
    print(f"DRIVER_COPY {len(CONTROLLER.published)} {CONTROLLER.published_by_holders}", flush=True)
"""


def run_on_driver_host(hosts: Hosts, tmp_path: Path, *flags: str, timeout_s: float = 600):
    """``miles train`` on host A joined to the cluster, on the tiny MoE and echo-last prompts of the learning tests."""
    model_dir, train_prompts, eval_prompts = save_echo_last_moe(tmp_path)
    return hosts.head.run(
        [
            MILES, "train", "--model", model_dir, "--output-dir", tmp_path / "run",
            "--prompts", train_prompts, "--rollout-eval-prompts", eval_prompts, *LEARNING_FLAGS,
            "--run-worker-provider", "ray", "--run-ray-address", hosts.ray_address, *PINS, *flags,
        ],
        env=hosts.env(),
        cwd=tmp_path,
        timeout_s=timeout_s,
    )  # fmt: skip


def where(stdout: str, worker: str) -> str:
    """The node address ``miles train`` printed for ``worker`` (``NAME pid N node ADDRESS (id ...)``)."""
    return stdout.split(f"{worker} pid ", 1)[1].split(" node ", 1)[1].split(" ", 1)[0]


def assert_learned(run: Path) -> None:
    """The held-out reward rose by the learning tests' margin."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval/reward_mean"] for row in rows if "eval/reward_mean" in row]
    assert len(evals) == 2 and evals[-1] >= evals[0] + LEARNING_MARGIN, evals


def weight_updates(run: Path) -> tuple[list[tuple], list[tuple]]:
    """The dashboard's weight updates (version, engines, checksum agreed, protocol) and each engine's last version."""
    with open_for_reading(run / DB_NAME) as db:
        updates = db.execute("SELECT version, num_engines, checksum_ok, protocol FROM weight_updates").fetchall()
        cells = db.execute("SELECT cell_id, weight_version FROM engines ORDER BY cell_id").fetchall()
    return [tuple(row) for row in updates], [tuple(row) for row in cells]


def assert_checked_updates(run: Path, *, mode: str, engines: int) -> None:
    """Every version reached every engine, checksums agreeing, over ``mode``; each engine ends at the last version;
    over :data:`LEARNS_OVER`, the run learned."""
    steps = steps_over(mode)
    if mode == LEARNS_OVER:
        assert_learned(run)
    updates, cells = weight_updates(run)
    assert updates == [(version, engines, 1, mode) for version in range(1, steps + 1)]
    assert cells == [(f"engine-{index}", steps) for index in range(engines)]


def test_the_torch_trainer_on_host_a_learns_with_engines_on_host_c(hosts: Hosts, tmp_path: Path) -> None:
    """The torch trainer runs in the driver (A, its one holder); two engines on C read each version over rdt. (Each
    protocol's sending side is the same code whichever process holds the weights: the Megatron runs below carry
    every protocol between hosts, from holders on B.)"""
    mode = LEARNS_OVER
    steps = ["--num-steps", str(steps_over(mode))]
    result = run_on_driver_host(hosts, tmp_path, "--weight-transfer-mode", mode, "--engine-num-engines", "2", *steps)
    assert result.returncode == 0, result.stderr[-3000:]
    for cell in ("engine-0", "engine-1"):
        assert where(result.stdout, cell) == hosts.hosts[ENGINE].address, result.stdout
    assert hosts.hosts[DRIVER].address != hosts.hosts[ENGINE].address
    assert_checked_updates(tmp_path / "run", mode=mode, engines=2)


@pytest.mark.parametrize("mode", ["disk", "tensor", "broadcast", "rdt"])
def test_megatron_ranks_on_host_b_send_to_engines_on_host_c_learn_and_recover_a_killed_engine(
    hosts: Hosts, tmp_path: Path, mode: str
) -> None:
    """Two Megatron ranks (TP=2) on B send every version themselves to two engines on C (the driver on A keeps no
    copy); engine-1 is killed as the third rollout starts and gets the published version back from the ranks."""
    killer = tmp_path / "killer.py"
    killer.write_text(ENGINE_KILLER)
    result = run_on_driver_host(
        hosts, tmp_path,
        "--trainer", "megatron", "--megatron-tensor-parallel", "2", "--megatron-cpus-per-rank", "0.5",
        "--engine-num-engines", "2", "--weight-transfer-mode", mode, "--plugin", str(killer),
        "--num-steps", str(steps_over(mode)),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert {where(result.stdout, f"megatron-rank{rank}") for rank in (0, 1)} == {hosts.hosts[TRAINER].address}
    assert {where(result.stdout, f"engine-{index}") for index in (0, 1)} == {hosts.hosts[ENGINE].address}
    restarts = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("RESTARTS")]
    assert restarts[-1][1:] == ["0", "1"], restarts[-1]  # engine-1 was killed once and brought back
    copies = {line for line in result.stdout.splitlines() if line.startswith("DRIVER_COPY")}
    assert copies == {"DRIVER_COPY 0 True"}  # every version was sent by the ranks, none kept in the driver
    assert_checked_updates(tmp_path / "run", mode=mode, engines=2)


def test_a_driver_on_a_node_other_than_the_head_sends_over_rdt_to_engines_on_another_host(
    hosts: Hosts, tmp_path: Path
) -> None:
    """The driver (the torch trainer, its one holder) runs on B, not the head's host, and two engines on C read its
    weights over rdt. The hosts share one process table, where Ray would attach the driver to the head's node and
    advertise the head's address as the driver's: the engines' reads of the objects it owns then waited without end.
    A few steps, each version on both engines with agreeing checksums."""
    steps = 3
    quick = ["--no-progress", "--rollout-batch-size", "4", "--rollout-group-size", "4", "--run-eval-every", "0"]
    result = hosts.hosts[TRAINER].run(
        [
            MILES, "train", "--output-dir", tmp_path / "run", *quick, "--num-steps", str(steps),
            "--run-worker-provider", "ray", "--run-ray-address", hosts.ray_address, *PINS,
            "--engine-num-engines", "2", "--weight-transfer-mode", "rdt",
            "--weight-transfer-settings", '{"timeout_s": 60}', "--weight-transfer-verify-checksum", "true",
        ],
        env=hosts.env(),
        cwd=tmp_path,
        timeout_s=400,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    assert {where(result.stdout, f"engine-{index}") for index in (0, 1)} == {hosts.hosts[ENGINE].address}
    updates, cells = weight_updates(tmp_path / "run")
    assert updates == [(version, 2, 1, "rdt") for version in range(1, steps + 1)]
    assert cells == [("engine-0", steps), ("engine-1", steps)]
