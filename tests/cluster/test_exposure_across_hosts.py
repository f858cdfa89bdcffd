"""Every port a run's workers open on another host, tried from another host without credentials.

Two runs across the hosts, the driver on A: Megatron ranks on B with an sglang-router and two local engines behind it
on C (``broadcast`` groups); and an agent run of the tool task with its session servers and engines on C (a short
run: that the tool task learns through session servers is ``tests/test_train_agent.py``'s; here, that every step
trains on what the sessions on C sampled).
Once the first step is done, every server a run printed (``NAME pid N node ADDRESS ... at URL``: the ranks' RPC
servers, the engines, the router, the session servers) is sent each control request of the project's servers from
host A without a token: the RPC server's submit, an engine's weight update, the router's worker registration, a
session server's session creation. Each answers 401 on every server that has the route (404 where it has not, never
2xx). Every other socket that listens on B and C in a worker's processes (``ss`` in each namespace) is a
torch.distributed store or a gloo pair (the ranks' rendezvous and groups, a ``broadcast`` group), which has no
authentication and is sent nothing (a stray byte can break a group): the rule is that it listens on its node's
cluster address alone, never on a wildcard or on loopback. The sockets of Ray's own core worker in each actor process
(Ray's worker port range, authenticated by Ray with the cluster's token) are Ray's, not looked at.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest

from tests.cluster.conftest import ENGINE, PINS, TRAINER
from tests.cluster.hosts import MILES, RAY_WORKER_PORTS, Host, Hosts

pytestmark = pytest.mark.slow

GUARDED = ("/rpc/submit", "/update_weights_from_disk", "/workers", "/sessions")
"""The control routes the probe tries (with bodies that would act, were the token not asked for)."""

LOCAL_ENGINE_COMMAND = json.dumps(["{python}", "-m", "miles_core.builtin.local_engine.server"])
"""Engines of the sglang backend that are local engines (they speak its API): the router routes to them."""

CONTROL_REQUESTS = [
    ("POST", "/rpc/submit", {"call_id": "x", "method": "setup", "args": [], "kwargs": {}}),
    ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent"}),
    ("POST", "/workers", {"url": "http://10.0.0.1:1"}),
    ("POST", "/sessions", {"messages": []}),
]
TRY_WITHOUT_TOKEN = """\
import json, sys
import httpx
results = {}
for url in json.loads(sys.argv[1]):
    codes = {}
    for method, path, body in json.loads(sys.argv[2]):
        try:
            codes[path] = httpx.request(method, url + path, json=body, timeout=10).status_code
        except httpx.HTTPError as exc:
            codes[path] = type(exc).__name__
    results[url] = codes
print(json.dumps(results))
"""
"""Run on host A: each control request, without a token, to each server URL; the status codes by URL and path."""
PLACED = re.compile(r"(\S+) pid (\d+) node (\S+) \(id \w+\)(?: bundle \d+)? at (http://\S+?)(?:,|$)")
"""A worker as ``miles train`` prints where it placed it: name, pid, node address, URL."""


def worker_sockets(host: Host) -> list[dict]:
    """Every socket listening on ``host`` that belongs to a worker (a process of a Ray actor hosting one, or one
    of its children), except Ray's own core-worker ports."""
    listed = subprocess.run(["ip", "netns", "exec", host.namespace, "ss", "-ltnpH"], capture_output=True, text=True)
    rows = []
    for line in listed.stdout.splitlines():
        address, port = line.split()[3].rsplit(":", 1)
        pids = [int(pid) for pid in re.findall(r"pid=(\d+)", line)]
        owners = [_process(pid) for pid in pids]
        in_worker = any(
            any("ray::WorkerActor" in _cmdline(p) for p in [owner, *owner.parents()]) for owner in owners if owner
        )
        rays_own = RAY_WORKER_PORTS[0] <= int(port) <= RAY_WORKER_PORTS[1] and all(
            owner and _cmdline(owner).startswith("ray::") for owner in owners
        )
        if in_worker and not rays_own:
            rows.append({"host": host.name, "address": address, "port": int(port)})
    return rows


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


ROUTER_RUN = [
    "--trainer", "megatron", "--megatron-tensor-parallel", "2", "--megatron-cpus-per-rank", "0.5",
    "--engine", "sglang", "--sglang-launch-command", LOCAL_ENGINE_COMMAND, "--sglang-router", "true",
    "--engine-num-engines", "2", "--weight-transfer-mode", "broadcast", "--run-ray-router-resources",
    '{"engine_node": 0.5}', "--num-steps", "8", "--rollout-batch-size", "4", "--rollout-group-size", "4",
]  # fmt: skip
"""Megatron ranks on B (RPC servers, their rendezvous store), the router and two engines on C (broadcast groups)."""
AGENT_STEPS = 6
AGENT_RUN = [
    "--task", "tool_lookup", "--rollout-session-servers", "2", "--run-ray-session-resources", '{"engine_node": 0.5}',
    "--engine-num-engines", "2", "--num-steps", str(AGENT_STEPS), "--rollout-batch-size", "4",
]  # fmt: skip
"""An agent run with its session servers and engines on C, on ``tests/test_train_agent.py``'s tool task."""


def probed_run(hosts: Hosts, tmp_path: Path, flags: list[str]) -> tuple[dict, list[dict], Path]:
    """``miles train`` on A; once its first step is done (every worker serving), the URLs it printed tried without
    a token from A, and every other worker socket on B and C listed: (answers by URL, other sockets, run dir)."""
    argv = [
        MILES, "train", "--output-dir", tmp_path / "run", "--no-progress", "--run-eval-every", "0",
        "--run-checkpoint-every", "0", "--run-worker-provider", "ray", "--run-ray-address", hosts.ray_address,
        *PINS, *flags,
    ]  # fmt: skip
    stderr_file = tmp_path / "stderr.txt"
    with open(stderr_file, "w") as stderr_sink:
        run = subprocess.Popen(
            hosts.head.command(argv), env=hosts.env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=stderr_sink,
            text=True,
        )  # fmt: skip
    urls: dict[str, str] = {}  # URL -> worker name
    answers, others = {}, []
    try:
        for line in run.stdout:
            urls.update({url: name for name, _, _, url in PLACED.findall(line)})
            if line.startswith("step    1 ") and not answers:
                tried = hosts.head.run(
                    [sys.executable, "-c", TRY_WITHOUT_TOKEN, json.dumps(sorted(urls)), json.dumps(CONTROL_REQUESTS)],
                    env=hosts.env(),
                    timeout_s=120,
                )
                answers = json.loads(tried.stdout)
                served = {(urlsplit(url).hostname, urlsplit(url).port) for url in urls}
                sockets = [row for index in (TRAINER, ENGINE) for row in worker_sockets(hosts.hosts[index])]
                others = [row for row in sockets if (row["address"], row["port"]) not in served]
        run.wait(timeout=900)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, stderr_file.read_text()[-3000:]
    return {urls[url]: codes for url, codes in answers.items()}, others, tmp_path / "run"


def check_answers(answers: dict, *, guarded: set[str], workers: set[str]) -> None:
    """Each of ``workers`` (by name) answered every control request without the token with 401, or 404 where it
    has no such route; together they guard ``guarded``."""
    assert set(answers) == workers, answers
    for name, codes in answers.items():
        assert 401 in codes.values() and set(codes.values()) <= {401, 404, 405}, (name, codes)
    assert {path for codes in answers.values() for path, code in codes.items() if code == 401} == guarded, answers


def check_other_sockets(hosts: Hosts, others: list[dict]) -> None:
    """The worker sockets that are not a server of the project (torch.distributed stores, gloo pairs: no
    authentication, so not sent a byte) listen on their node's cluster address alone."""
    address = {host.name: host.address for host in hosts.hosts}
    elsewhere = [row for row in others if row["address"] != address[row["host"]]]
    assert not elsewhere, elsewhere  # never 0.0.0.0, *, or loopback


def test_the_ranks_router_and_engines_refuse_control_without_the_token(hosts: Hosts, tmp_path: Path) -> None:
    answers, others, _ = probed_run(hosts, tmp_path, ROUTER_RUN)
    workers = {"megatron-rank0", "megatron-rank1", "router", "engine-0", "engine-1"}
    check_answers(answers, guarded=set(GUARDED) - {"/sessions"}, workers=workers)
    check_other_sockets(hosts, others)
    assert any(row["host"] == hosts.hosts[TRAINER].name for row in others)  # the ranks' store and gloo pairs, on B


def test_an_agent_run_with_its_session_servers_on_another_host_trains_and_they_refuse_strangers(
    hosts: Hosts, tmp_path: Path
) -> None:
    answers, others, run = probed_run(hosts, tmp_path, AGENT_RUN)
    workers = {"engine-0", "engine-1", "session-server-0", "session-server-1"}
    check_answers(answers, guarded={"/update_weights_from_disk", "/sessions"}, workers=workers)
    check_other_sockets(hosts, others)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [(row["step"], row["rollout/samples"]) for row in rows if "train/loss" in row]
    assert trained == [(step, 4 * 8) for step in range(1, AGENT_STEPS + 1)], trained  # every sample of every step
