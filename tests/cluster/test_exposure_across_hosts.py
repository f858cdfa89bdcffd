"""Every port a run's workers open on another host, tried from another host without credentials.

One agent run across the hosts (driver on A; Megatron ranks on B; an sglang-router, two local engines behind it and
the session servers on C; ``broadcast`` groups) learns the tool task, and as its second rollout starts a plugin lists
every socket that listens on B and C (``ss`` in each namespace) and, for those of the run's workers (processes of
the Ray actors that host them, and their children), sends each control request of the project's servers from host A
without a token: the RPC server's submit, an engine's weight update, the router's worker registration, a session
server's session creation. Each answers 401 on every server that has the route (404 where it has not, never 2xx).
A socket that does not speak HTTP is a torch.distributed store (the Megatron ranks' rendezvous, a ``broadcast``
group), which has no authentication: the rule is that it listens on its node's cluster address alone. No worker
socket listens on a wildcard or on loopback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster.conftest import ENGINE, PINS, TRAINER
from tests.cluster.hosts import MILES, Hosts

pytestmark = pytest.mark.slow

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
            if any(is_worker(pid) for pid in row["pids"]):
                found = {"host": host, **row, "answers": answers(row["address"], row["port"])}
                print("PROBE " + json.dumps(found), flush=True)
"""


def test_no_port_of_a_worker_on_another_host_takes_control_without_the_token(hosts: Hosts, tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    namespaces = {"B": hosts.hosts[TRAINER].namespace, "C": hosts.hosts[ENGINE].namespace}
    result = hosts.head.run(
        [
            MILES, "train", "--output-dir", tmp_path / "run", "--no-progress", "--task", "tool_lookup",
            "--num-steps", "3", "--rollout-batch-size", "4", "--rollout-group-size", "4", "--run-eval-every", "0",
            "--run-checkpoint-every", "0", "--rollout-session-servers", "2",
            "--trainer", "megatron", "--megatron-tensor-parallel", "2", "--megatron-cpus-per-rank", "0.5",
            "--engine", "sglang", "--sglang-launch-command", LOCAL_ENGINE_COMMAND,
            "--sglang-router", "true", "--engine-num-engines", "2", "--weight-transfer-mode", "broadcast",
            "--run-worker-provider", "ray", "--run-ray-address", hosts.ray_address, *PINS,
            "--run-ray-router-resources", '{"engine_node": 0.5}', "--run-ray-session-resources", '{"engine_node": 0.5}',
            "--plugin", probe,
        ],
        env=hosts.env(PROBE_NAMESPACES=json.dumps(namespaces)),
        cwd=tmp_path,
        timeout_s=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    probes = [json.loads(line[6:]) for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    address = {"B": hosts.hosts[TRAINER].address, "C": hosts.hosts[ENGINE].address}
    assert {row["host"] for row in probes} == {"B", "C"}, probes
    for row in probes:
        assert row["address"] == address[row["host"]], row  # never 0.0.0.0, *, or loopback
    http = [row for row in probes if any(isinstance(code, int) for code in row["answers"].values())]
    stores = [row for row in probes if row not in http]
    for row in http:
        codes = set(row["answers"].values())
        assert 401 in codes and codes <= {401, 404, 405}, row
    guarded = {path for row in http for path, code in row["answers"].items() if code == 401}
    assert guarded == {"/rpc/submit", "/update_weights_from_disk", "/workers", "/sessions"}, http
    # the ranks' RPC servers, two engines, the router and two session servers answer HTTP; the rest are stores
    assert len(http) >= 2 + 2 + 1 + 2, http
    assert stores and all(set(row["answers"].values()) - {401, 404} for row in stores), stores
