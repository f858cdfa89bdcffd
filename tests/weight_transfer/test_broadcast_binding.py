"""The ``broadcast`` protocol's process group listens only where it is told: its store (unauthenticated: anyone who
reaches it can join or corrupt the group) on the master address, its gloo connections on the address that reaches
the master. With the default master address, 127.0.0.1, nothing of the group is reachable from another machine
(torch's own TCPStore socket would listen on every interface)."""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import sys
import threading
from pathlib import Path

import psutil
import pytest
import torch

from miles_core.distributed import tcp_init_method_address
from miles_core.engines.client import EngineClient
from miles_core.engines.weights import broadcast, new_weight_update_group
from miles_core.testkit.tiny_models import save_tiny_llama
from miles_core.weight_transfer.broadcast import BroadcastProtocol
from miles_core.weight_transfer.protocol import EngineEndpoint
from miles_core.workers.local_provider import LocalWorkerProvider
from miles_core.workers.process import free_ports
from miles_core.workers.specs import CommandWorkerSpec

ADMIN = "binding-admin-key"


def listening(pid: int) -> set[tuple[str, int]]:
    """The ``(address, port)`` pairs that process ``pid`` listens on (TCP, IPv4 and IPv6)."""
    connections = psutil.Process(pid).net_connections(kind="tcp")
    return {(c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN}


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback too
    return (mapped or ip).is_loopback


def ipv6_loopback_available() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


NO_IPV6 = pytest.mark.skipif(not ipv6_loopback_available(), reason="this machine has no IPv6 loopback (::1)")
MASTERS = ["127.0.0.1", "localhost", pytest.param("::1", marks=NO_IPV6)]


@pytest.mark.parametrize("master", MASTERS)
def test_a_group_on_a_loopback_master_listens_on_loopback_only(master: str) -> None:
    (port,) = free_ports(1, master)
    before = listening(psutil.Process().pid)
    groups: dict[int, object] = {}
    failures: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            groups[rank] = new_weight_update_group(
                master_address=master, master_port=port, rank=rank, world_size=2, group_name="binding", timeout_s=60
            )
        except BaseException as exc:  # reported below, in the test's thread
            failures.append(exc)

    members = [threading.Thread(target=member, args=(rank,)) for rank in (0, 1)]
    for thread in members:
        thread.start()
    for thread in members:
        thread.join(timeout=120)
    assert not failures, failures
    opened = listening(psutil.Process().pid) - before
    assert port in {p for _, p in opened}, f"the store's port {port} is not listening: {opened}"
    assert opened and all(is_loopback(address) for address, _ in opened), (
        f"the group listens beyond loopback: {sorted(opened)}"
    )
    tensors = [torch.arange(4.0), torch.zeros(4)]  # the group still works: rank 0's tensor reaches rank 1
    senders = [threading.Thread(target=broadcast, args=(groups[rank], tensors[rank])) for rank in (0, 1)]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join(timeout=60)
    assert torch.equal(tensors[1], torch.arange(4.0))


def test_the_protocol_with_a_real_engine_listens_on_loopback_only(tmp_path: Path) -> None:
    """The whole path: ``miles``'s trainer side (store and gloo) and a local engine's side (gloo, joined through
    ``/init_weights_update_group``), both inspected while the group is up."""
    model_dir = save_tiny_llama(tmp_path / "model")
    argv = [
        sys.executable,
        "-m",
        "miles_core.builtin.local_engine.server",
        "--model-path",
        str(model_dir),
        "--host",
        "{host}",
        "--port",
        "{port}",
    ]
    spec = CommandWorkerSpec(name="engine-0", argv=argv, ports=["port"], health_url="http://{host}:{port}/health")
    provider = LocalWorkerProvider(token=ADMIN, run_dir=tmp_path / "run")

    async def scenario() -> dict[str, set[tuple[str, int]]]:
        info = await provider.start(spec)
        engine_pid = info.pid
        trainer_before = listening(psutil.Process().pid)
        engine_before = listening(engine_pid)
        protocol = BroadcastProtocol(backend="gloo", timeout_s=60)
        try:
            await protocol.connect([EngineEndpoint(name=info.name, url=info.url, admin_key=ADMIN)])
            state = {"model.norm.weight": torch.full((64,), 0.5)}
            await protocol.transfer([list(state.items())], version=1)  # forms the group, which stays up
            opened = {
                "trainer": listening(psutil.Process().pid) - trainer_before,
                "engine": listening(engine_pid) - engine_before,
            }
            async with EngineClient(info.url, admin_key=ADMIN) as client:
                assert await client.weight_version() == "1"  # the group carried the weights
            return opened
        finally:
            await protocol.close()
            await provider.shutdown()

    opened = asyncio.run(scenario())
    assert opened["trainer"] and opened["engine"], opened  # the store and gloo on one side, gloo on the other
    for side, addresses in opened.items():
        assert all(is_loopback(address) for address, _ in addresses), f"{side} listens beyond loopback: {addresses}"


@pytest.mark.parametrize("init_method", ["tcp://127.0.0.1:29500", "tcp://[::1]:80", "tcp://localhost:1"])
def test_tcp_init_methods_are_read(init_method: str) -> None:
    host, port = tcp_init_method_address(init_method)
    assert f"{host}:{port}" in init_method.replace("[::1]", "::1")


@pytest.mark.parametrize("init_method", ["env://", "tcp://127.0.0.1", "tcp://:80", "tcp://h:99999", "file:///x"])
def test_other_init_methods_are_refused_by_name(init_method: str) -> None:
    with pytest.raises(ValueError, match=f"init method {re.escape(repr(init_method))}: expected tcp://HOST:PORT"):
        tcp_init_method_address(init_method)
