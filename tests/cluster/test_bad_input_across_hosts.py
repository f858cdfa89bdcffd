"""What goes wrong between hosts, each a clear error naming the node and what to do, before training starts, with
nothing left running: a Ray address that answers nothing, a node whose Ray started without the cluster's token, a
shared directory that an engine node does not see, an engine node without a plugin the run uses.

Host B sees two directories differently from the others (a tmpfs over each in its mount namespace): a directory the
test shares, and the rdt plugin's package (so on B it is not installed). Host C's Ray node started with another
token, so it never joined."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.hosts import MILES, Hosts, hosts_or_skip

pytestmark = pytest.mark.slow

BLIND, TOKENLESS = 1, 2


def installed_package_dir(package: str) -> str:
    """Where ``package`` is installed, as a process outside the repository imports it (from the repository's root
    a distribution's folder of the same name would shadow it)."""
    script = f"import {package}, os; print(os.path.dirname({package}.__file__))"
    found = subprocess.run([sys.executable, "-c", script], cwd="/", capture_output=True, text=True, check=True)
    return found.stdout.strip()


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared-but-not-on-d")


@pytest.fixture(scope="module")
def hosts(shared_dir: Path) -> Iterator[Hosts]:
    with hosts_or_skip(
        [{"driver_node": 1}, {"blind_node": 4}, {"tokenless_node": 4}],
        private_dirs={BLIND: [str(shared_dir), installed_package_dir("miles_plugins_rdt")]},
        wrong_token=[TOKENLESS],
    ) as built:
        yield built


def train(hosts: Hosts, tmp_path: Path, *flags: str, address: str | None = None):
    return hosts.head.run(
        [
            MILES, "train", "--output-dir", tmp_path / "run", "--no-progress", "--num-steps", "1",
            "--run-eval-every", "0", "--run-worker-provider", "ray", "--run-ray-address", address or hosts.ray_address,
            *flags,
        ],
        env=hosts.env(),
        cwd=tmp_path,
        timeout_s=300,
    )  # fmt: skip


def assert_refused_before_training(result, hosts: Hosts, tmp_path: Path) -> None:
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-3000:])
    assert "Traceback" not in result.stderr
    assert (
        not (tmp_path / "run" / "metrics.jsonl").exists()
        or "train/loss" not in (tmp_path / "run" / "metrics.jsonl").read_text()
    )
    for host in hosts.hosts:  # every worker actor the run started is gone (only Ray's own processes remain)
        assert not [pid for pid in host.pids() if "WorkerActor" in _cmdline(pid)], host.name


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_ray_address_that_answers_nothing(hosts: Hosts, tmp_path: Path) -> None:
    address = f"{hosts.hosts[BLIND].address}:6999"
    result = train(hosts, tmp_path, address=address)
    assert_refused_before_training(result, hosts, tmp_path)
    assert f"cannot join the Ray cluster at {address} (run.ray_address (--run-ray-address)): nothing accepts" in (
        result.stderr
    )
    assert "ray start --head --port 6999" in result.stderr


def test_a_node_started_without_the_clusters_token_never_joins_and_the_run_says_so(
    hosts: Hosts, tmp_path: Path
) -> None:
    said = hosts.started[hosts.hosts[TOKENLESS].name]
    assert "InvalidAuthToken" in said.stderr + said.stdout  # what the node itself said
    result = train(hosts, tmp_path, "--run-ray-engine-resources", json.dumps({"tokenless_node": 1}))
    assert_refused_before_training(result, hosts, tmp_path)
    assert "the custom resource 'tokenless_node', 1 in all, and the cluster's nodes offer 0" in result.stderr
    assert "a node whose Ray started without the cluster's token never joins" in result.stderr


def test_a_shared_directory_an_engine_node_does_not_see(hosts: Hosts, tmp_path: Path, shared_dir: Path) -> None:
    """``disk`` with its work directory where every node but B sees it: refused naming B, the directory and the
    setting, before any engine serves."""
    result = train(
        hosts, tmp_path, "--run-ray-engine-resources", '{"blind_node": 1}',
        "--weight-transfer-mode", "disk", "--weight-transfer-settings", json.dumps({"work_dir": str(shared_dir)}),
    )  # fmt: skip
    assert_refused_before_training(result, hosts, tmp_path)
    blind = hosts.hosts[BLIND].address
    assert f"node {blind} (id " in result.stderr and "cannot host this run's workers" in result.stderr
    assert f"it does not see the disk protocol's work directory {shared_dir} as the driver does" in result.stderr
    assert "--weight-transfer-settings '{work_dir: DIR}'" in result.stderr
    assert "the run directory" not in result.stderr  # B sees the run directory (tmp_path) like every node


def test_an_engine_node_without_a_plugin_the_run_uses(hosts: Hosts, tmp_path: Path) -> None:
    """``rdt`` (the miles-plugins-rdt distribution) with engines on B, where it is not installed."""
    result = train(hosts, tmp_path, "--run-ray-engine-resources", '{"blind_node": 1}', "--weight-transfer-mode", "rdt")
    assert_refused_before_training(result, hosts, tmp_path)
    assert f"node {hosts.hosts[BLIND].address} (id " in result.stderr
    assert "it cannot import miles_plugins_rdt (ModuleNotFoundError" in result.stderr
    assert "install the same Miles and plugins on every node (this driver has miles_plugins_rdt from " in (
        result.stderr
    )
