"""Every port a run's workers open on another host, tried from another host without credentials.

Two runs across the hosts, the driver on A: Megatron ranks on B with an sglang-router and two local engines behind it
on C (``broadcast`` groups); and an agent run that learns the tool task with its session servers and engines on C.
As the second rollout starts, a plugin lists every socket that listens on B and C (``ss`` in each namespace) and, for
those of the run's workers (processes of the Ray actors that host them, and their children), sends each control
request of the project's servers from host A without a token: the RPC server's submit, an engine's weight update,
the router's worker registration, a session server's session creation. Each answers 401 on every server that has the
route (404 where it has not, never 2xx). A socket that does not speak HTTP is a torch.distributed store (the Megatron
ranks' rendezvous, a ``broadcast`` group), which has no authentication: the rule is that it listens on its node's
cluster address alone. No worker socket listens on a wildcard or on loopback. The sockets of Ray's own core worker in
each actor process (Ray's worker port range, authenticated by Ray with the cluster's token) are Ray's, not tried.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster.conftest import ENGINE, PINS, TRAINER
from tests.cluster.hosts import MILES, RAY_WORKER_PORTS, Hosts

pytestmark = pytest.mark.slow

GUARDED = ("/rpc/submit", "/update_weights_from_disk", "/workers", "/sessions")
"""The control routes the probe tries (with bodies that would act, were the token not asked for)."""

LOCAL_ENGINE_COMMAND = json.dumps(["{python}", "-m", "miles_core.engines.local_server"])
"""Engines of the sglang backend that are local engines (they speak its API): the router routes to them."""

PROBE = r"""
import json
import os
import re
import subprocess

import httpx
import psutil

from miles_core import hookimpl

CONTROL_REQUESTS = [
    ("POST", "/rpc/submit", {"call_id": "x", "method": "setup", "args": [], "kwargs": {}}),
    ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent"}),
    ("POST", "/workers", {"url": "http://10.0.0.1:1"}),
    ("POST", "/sessions", {"messages": []}),
]


def listeners(namespace):
    listed = subprocess.run(["ip", "netns", "exec", namespace, "ss", "-ltnpH"], capture_output=True, text=True)
    rows = []
    for line in listed.stdout.splitlines():
        fields = line.split()
        address, port = fields[3].rsplit(":", 1)
        pids = [int(pid) for pid in re.findall(r"pid=(\d+)", line)]
        rows.append({"address": address, "port": int(port), "pids": pids})
    return rows


def is_rays_own(row):
    # a socket of Ray's core worker in an actor process (Ray's worker port range; Ray checks the cluster token)
    low, high = json.loads(os.environ["RAY_WORKER_PORTS"])
    owners = [psutil.Process(pid).cmdline()[0] for pid in row["pids"]]
    return low <= row["port"] <= high and all(owner.startswith("ray::") for owner in owners)


def is_worker(pid):
    try:
        process = psutil.Process(pid)
        chain = [process, *process.parents()]
        return any("ray::WorkerActor" in " ".join(p.cmdline()) for p in chain)
    except psutil.Error:
        return False


def answers(address, port):
    codes = {}
    for method, path, body in CONTROL_REQUESTS:
        try:
            codes[path] = httpx.request(method, f"http://{address}:{port}{path}", json=body, timeout=5).status_code
        except httpx.HTTPError as exc:
            codes[path] = type(exc).__name__
    return codes


@hookimpl
def prepare_rollout(rollout_id, controller):
    if rollout_id != 2:
        return
    for host, namespace in json.loads(os.environ["PROBE_NAMESPACES"]).items():
        for row in listeners(namespace):
            if any(is_worker(pid) for pid in row["pids"]) and not is_rays_own(row):
                names = [" ".join(psutil.Process(pid).cmdline())[:160] for pid in row["pids"]]
                found = {"host": host, **row, "names": names, "answers": answers(row["address"], row["port"])}
                print("PROBE " + json.dumps(found), flush=True)
"""


ROUTER_RUN = [
    "--trainer", "megatron", "--megatron-tensor-parallel", "2", "--megatron-cpus-per-rank", "0.5",
    "--engine", "sglang", "--sglang-launch-command", LOCAL_ENGINE_COMMAND, "--sglang-router", "true",
    "--engine-num-engines", "2", "--weight-transfer-mode", "broadcast", "--run-ray-router-resources",
    '{"engine_node": 0.5}', "--num-steps", "3", "--rollout-batch-size", "4", "--rollout-group-size", "4",
]  # fmt: skip
"""Megatron ranks on B (RPC servers, their rendezvous store), the router and two engines on C (broadcast groups)."""
AGENT_RUN = [
    "--task", "tool_lookup", "--rollout-session-servers", "2", "--run-ray-session-resources", '{"engine_node": 0.5}',
    "--engine-num-engines", "2", "--num-steps", "70", "--rollout-batch-size", "8", "--train-lr", "0.005",
]  # fmt: skip
"""An agent run with its session servers and engines on C, as ``tests/test_train_agent.py`` learns the tool task."""


def probed_run(hosts: Hosts, tmp_path: Path, flags: list[str]) -> tuple[list[dict], Path]:
    """A run with the probe plugin: what it found, and the run directory."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    namespaces = {"B": hosts.hosts[TRAINER].namespace, "C": hosts.hosts[ENGINE].namespace}
    result = hosts.head.run(
        [
            MILES, "train", "--output-dir", tmp_path / "run", "--no-progress", "--run-eval-every", "0",
            "--run-checkpoint-every", "0", "--run-worker-provider", "ray", "--run-ray-address", hosts.ray_address,
            *PINS, *flags, "--plugin", probe,
        ],
        env=hosts.env(PROBE_NAMESPACES=json.dumps(namespaces), RAY_WORKER_PORTS=json.dumps(RAY_WORKER_PORTS)),
        cwd=tmp_path,
        timeout_s=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line[6:]) for line in result.stdout.splitlines() if line.startswith("PROBE ")], tmp_path / "run"


def check_probes(hosts: Hosts, probes: list[dict], *, hosts_probed: set[str], guarded: set[str], servers: int) -> None:
    """Every worker socket on its node's address; each HTTP one refuses control without the token (``guarded``: the
    routes that answered 401), the others are stores."""
    address = {"B": hosts.hosts[TRAINER].address, "C": hosts.hosts[ENGINE].address}
    assert {row["host"] for row in probes} == hosts_probed, probes
    elsewhere = [row for row in probes if row["address"] != address[row["host"]]]
    assert not elsewhere, json.dumps(elsewhere)  # never 0.0.0.0, *, or loopback
    http = [row for row in probes if any(isinstance(code, int) for code in row["answers"].values())]
    for row in http:
        codes = set(row["answers"].values())
        assert 401 in codes and codes <= {401, 404, 405}, row
    assert {path for row in http for path, code in row["answers"].items() if code == 401} == guarded, http
    assert len(http) >= servers, http


def test_the_ranks_router_and_engines_refuse_control_without_the_token(hosts: Hosts, tmp_path: Path) -> None:
    probes, _ = probed_run(hosts, tmp_path, ROUTER_RUN)
    # two ranks' RPC servers, two engines and the router answer HTTP
    check_probes(hosts, probes, hosts_probed={"B", "C"}, guarded=set(GUARDED) - {"/sessions"}, servers=5)
    stores = [row for row in probes if not any(isinstance(code, int) for code in row["answers"].values())]
    assert any(row["host"] == "B" for row in stores), probes  # the ranks' rendezvous store, on B's address


def test_an_agent_run_with_its_session_servers_on_another_host_learns_and_they_refuse_strangers(
    hosts: Hosts, tmp_path: Path
) -> None:
    probes, run = probed_run(hosts, tmp_path, AGENT_RUN)
    check_probes(hosts, probes, hosts_probed={"C"}, guarded={"/update_weights_from_disk", "/sessions"}, servers=4)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval/reward_mean"] for row in rows if "eval/reward_mean" in row]
    assert evals[-1] >= evals[0] + 0.3, evals  # the held-out prompts: the policy calls the tool (0.5 a call)
