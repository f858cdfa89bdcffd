"""Several hosts on one machine: network namespaces on a bridge, each with its own loopback and address, and a Ray
node in each (the head in the first), joined with one authentication token.

:class:`Hosts` builds them and tears everything down again, even when a test fails: the processes in each
namespace (found with ``ip netns pids``, so only those this harness started, stopped by pid), the namespaces (their
veth ends go with them), the bridge, the Ray temp directories. A host can also have a directory of its own that hides
the machine's one (``private_dirs``: a tmpfs mounted over it in that host's mount namespace), the way a node without
the shared storage sees it. Traffic goes only to the namespaces' own addresses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

RAY = Path(sys.executable).parent / "ray"
MILES = Path(sys.executable).parent / "miles"
RAY_PORT = 6380
RAY_WORKER_PORTS = (10002, 19999)
"""The ports of Ray's own worker processes (its core workers' gRPC servers, which Ray authenticates with the
cluster's token): Ray's default range, given explicitly so that tests can tell those sockets from Miles' own."""
UCX_TCP_ONLY = {"UCX_TLS": "tcp"}
"""NIXL's UCX over TCP, as between machines without RDMA (the namespaces share one kernel, so UCX could otherwise
use shared memory or cross-memory attach between them)."""


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here (``None`` when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); this process runs as uid " + str(os.geteuid())
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip` (Debian package iproute2), which is not installed"
    return None


@dataclasses.dataclass(frozen=True)
class Host:
    """One namespace: its name, its address on the bridge, its Ray node's custom resources."""

    name: str
    namespace: str
    address: str
    resources: Mapping[str, float]
    private_dirs: tuple[str, ...] = ()
    wrong_token: bool = False  # its Ray node starts with another token than the cluster's (and so never joins)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in this host's network namespace (and, with private directories, behind its own mounts)."""
        inner = [str(arg) for arg in argv]
        if self.private_dirs:
            mounts = " && ".join(f"mount -t tmpfs miles-private {_quote(d)}" for d in self.private_dirs)
            inner = ["sh", "-c", f'{mounts} && exec "$@"', "sh", *inner]
        return ["ip", "netns", "exec", self.namespace, *inner]

    def run(self, argv: Sequence[str], *, env: Mapping[str, str], timeout_s: float, cwd: Path | None = None):
        """Run ``argv`` on this host to completion; the completed process (output captured as text)."""
        return subprocess.run(
            self.command(argv), env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False
        )

    def pids(self) -> list[int]:
        """The processes running in this host's namespace."""
        listed = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True, check=False)
        return [int(pid) for pid in listed.stdout.split()]


class Hosts:
    """``count`` hosts on a bridge of their own (``10.{subnet}.0.{1..count}/24``), a Ray node in each. Use as a
    context manager; :meth:`kill_host` stops one host's processes (a node that dies)."""

    def __init__(
        self,
        resources: Sequence[Mapping[str, float]],
        *,
        private_dirs: Mapping[int, Sequence[str]] = {},
        wrong_token: Sequence[int] = (),
        ray_env: Mapping[str, str] = {},
    ) -> None:
        remove_stale_harnesses()
        self.tag = f"mh{os.getpid()}x{secrets.token_hex(1)}"  # unique per harness: names of links and namespaces
        subnet = 200 + secrets.randbelow(50)
        self.hosts = [
            Host(
                name=chr(ord("A") + index),
                namespace=f"{self.tag}-{chr(ord('a') + index)}",
                address=f"10.{subnet}.0.{index + 1}",
                resources=dict(wanted),
                private_dirs=tuple(private_dirs.get(index, ())),
                wrong_token=index in wrong_token,
            )
            for index, wanted in enumerate(resources)
        ]
        self.bridge = f"{self.tag}br"[:15]
        self.token = secrets.token_hex(16)
        self.temp = Path(tempfile.mkdtemp(prefix=f"{self.tag}-", dir="/tmp"))  # short: Ray's socket paths
        self.made: list[str] = []  # what to delete: "netns NAME", "link NAME"
        self.started: dict[str, subprocess.CompletedProcess] = {}  # each host's `ray start`
        self.ray_env = dict(ray_env)  # Ray settings of every node (RAY_health_check_period_ms, ...)

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def ray_address(self) -> str:
        return f"{self.head.address}:{RAY_PORT}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a process that joins the cluster: its token, no Ray address of the machine's own."""
        env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "MILES_NODE_ADDRESS")}
        return {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, **UCX_TCP_ONLY, **extra}

    def __enter__(self) -> Hosts:
        try:
            self._build_network()
            for host in self.hosts:
                self._start_ray_node(host)
            self._wait_for_nodes()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _build_network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self.made.append(f"link {self.bridge}")
        _ip("link", "set", self.bridge, "up")
        for index, host in enumerate(self.hosts):
            _ip("netns", "add", host.namespace)
            self.made.append(f"netns {host.namespace}")
            outside = f"{self.tag}v{index}"[:15]
            _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
            _ip("link", "set", outside, "master", self.bridge, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")

    def ray_start_argv(self, host: Host) -> list[str]:
        """The ``ray start`` of ``host``'s node (the head's, or one that joins it), run in the host's namespace."""
        role = ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false"] if host is self.head else []
        return host.command([
            RAY, "start", *role, *([] if host is self.head else ["--address", self.ray_address]),
            "--node-ip-address", host.address, "--num-cpus", "2", "--disable-usage-stats",
            "--temp-dir", str(self.temp / host.name), "--resources", json.dumps(dict(host.resources)),
            "--min-worker-port", str(RAY_WORKER_PORTS[0]), "--max-worker-port", str(RAY_WORKER_PORTS[1]),
        ])  # fmt: skip

    def _start_ray_node(self, host: Host) -> None:
        env = self.env(**self.ray_env, **({"RAY_AUTH_TOKEN": secrets.token_hex(16)} if host.wrong_token else {}))
        started = subprocess.run(
            self.ray_start_argv(host), env=env, capture_output=True, text=True, timeout=120, check=False
        )
        self.started[host.name] = started
        if started.returncode != 0 and not host.wrong_token:
            raise RuntimeError(
                f"ray start on host {host.name} failed:\n{started.stdout[-2000:]}{started.stderr[-2000:]}"
            )

    def _wait_for_nodes(self, timeout_s: float = 60.0) -> None:
        probe = "import ray; ray.init(); print(sum(n['Alive'] for n in ray.nodes()))"
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.head.run(
                [sys.executable, "-c", probe], env=self.env(RAY_ADDRESS=self.ray_address), timeout_s=60
            )
            joining = sum(not host.wrong_token for host in self.hosts)
            if result.returncode == 0 and result.stdout.strip().splitlines()[-1:] == [str(joining)]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray nodes did not all join within {timeout_s:.0f} s: {result.stderr[-2000:]}")
            time.sleep(1.0)

    def kill_host(self, host: Host, sig: int = signal.SIGKILL) -> list[int]:
        """Every process on ``host`` killed (its Ray node and the workers on it): the pids."""
        pids = host.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def close(self) -> None:
        """Stop every process in the namespaces (TERM, then KILL), delete the namespaces and links, remove the
        temp directory. Safe to call twice."""
        namespaces = [host for host in self.hosts if f"netns {host.namespace}" in self.made]
        for sig, grace_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
            for host in namespaces:
                self.kill_host(host, sig)
            deadline = time.monotonic() + grace_s
            while any(host.pids() for host in namespaces) and time.monotonic() < deadline:
                time.sleep(0.2)
        for made in reversed(self.made):
            kind, name = made.split(" ", 1)
            subprocess.run(["ip", kind, "del", name], capture_output=True, check=False)
        self.made.clear()
        shutil.rmtree(self.temp, ignore_errors=True)


STALE_TAG = re.compile(r"^(mh(\d+)x[0-9a-f]{2})-[a-z]$")
"""A harness's namespace: ``mh<pid of the process that made it>x<2 hex digits>-<host letter>``."""


def remove_stale_harnesses() -> None:
    """Namespaces (their processes, by pid), links and temp directories of harnesses whose making process is gone:
    a test process killed before its teardown could run (a SIGKILL, a CI timeout) leaves them behind."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        match = STALE_TAG.match(name)
        if match is None or Path(f"/proc/{match.group(2)}").exists():
            continue
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, check=False).stdout
        for pid in map(int, pids.split()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        tag = match.group(1)
        subprocess.run(["ip", "link", "del", f"{tag}br"], capture_output=True, check=False)
        for leftover in Path("/tmp").glob(f"{tag}-*"):
            shutil.rmtree(leftover, ignore_errors=True)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


@contextlib.contextmanager
def hosts_or_skip(resources: Sequence[Mapping[str, float]], **options) -> Iterator[Hosts]:
    """:class:`Hosts`, or a skip that says why namespaces cannot be made here."""
    import pytest

    reason = namespaces_unavailable()
    if reason is not None:
        pytest.skip(f"multi-host tests: {reason}")
    with Hosts(resources, **options) as hosts:
        yield hosts
