"""The harness itself: each host has its own loopback and address, the Ray nodes form one cluster with one token,
and tearing down leaves no namespace, link or process behind."""

from __future__ import annotations

import subprocess
import sys

from tests.cluster.conftest import ENGINE, TRAINER
from tests.cluster.hosts import Hosts, hosts_or_skip

SERVE = "import http.server, sys; http.server.HTTPServer((sys.argv[1], 8765), http.server.SimpleHTTPRequestHandler)"
FETCH = (
    "import sys, urllib.request\n"
    "try:\n    print(urllib.request.urlopen(sys.argv[1], timeout=3).status)\n"
    "except OSError as exc:\n    print(type(exc).__name__)\n"
)


def _serving(hosts: Hosts, index: int, address: str) -> subprocess.Popen:
    script = SERVE + ".serve_forever()"
    return subprocess.Popen(hosts.hosts[index].command([sys.executable, "-c", script, address]))


def test_each_host_has_its_own_loopback_and_reaches_the_others_at_their_address(hosts: Hosts) -> None:
    """A server on C's loopback answers on C only; one on C's address answers from B too."""
    engine, trainer = hosts.hosts[ENGINE], hosts.hosts[TRAINER]
    for address, from_trainer in (("127.0.0.1", "URLError"), (engine.address, "200")):
        server = _serving(hosts, ENGINE, address)
        try:
            url = f"http://{address}:8765/"
            for _attempt in range(50):
                seen_on_engine = engine.run([sys.executable, "-c", FETCH, url], env=hosts.env(), timeout_s=30)
                if seen_on_engine.stdout.strip() == "200":
                    break
            assert seen_on_engine.stdout.strip() == "200", seen_on_engine
            seen = trainer.run([sys.executable, "-c", FETCH, url], env=hosts.env(), timeout_s=30)
            assert seen.stdout.strip() == from_trainer, (address, seen)
        finally:
            server.kill()
            server.wait()


def test_the_ray_nodes_form_one_cluster_with_one_token(hosts: Hosts) -> None:
    probe = "import ray; ray.init(); print(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']))"
    joined = hosts.head.run([sys.executable, "-c", probe], env=hosts.env(RAY_ADDRESS=hosts.ray_address), timeout_s=60)
    assert joined.stdout.strip().splitlines()[-1] == str(sorted(host.address for host in hosts.hosts)), joined.stderr
    refused = hosts.head.run(
        [sys.executable, "-c", probe],
        env=hosts.env(RAY_ADDRESS=hosts.ray_address, RAY_AUTH_TOKEN="x" * 32),
        timeout_s=60,
    )
    assert refused.returncode != 0 and "InvalidAuthToken" in refused.stderr


def test_teardown_removes_namespaces_links_and_processes_even_after_a_failure() -> None:
    """A harness whose body raises: afterwards none of its namespaces, links or processes is left."""
    made = {}
    try:
        with hosts_or_skip([{"solo": 1}]) as solo:
            made = {"namespaces": [h.namespace for h in solo.hosts], "pids": solo.head.pids(), "bridge": solo.bridge}
            assert made["pids"], "the head's Ray processes run in its namespace"
            raise RuntimeError("a failing test")
    except RuntimeError:
        pass
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(namespace in listed for namespace in made["namespaces"])
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert made["bridge"] not in links
    assert not [pid for pid in made["pids"] if _running(pid)]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False
