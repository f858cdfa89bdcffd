"""Workers as real local processes: start, call, kill, recover, stop, with cells and the health monitor."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from pathlib import Path

import psutil
import pytest

from miles_core.testkit.echo_worker import ECHO_GROUPS, EchoWorker
from miles_core.workers.cells import CellManager, CellState
from miles_core.workers.errors import WorkerDiedError, WorkerError, WorkerStartError
from miles_core.workers.faults import Fault, FaultInjector
from miles_core.workers.handle import WorkerHandle
from miles_core.workers.health import HealthMonitor
from miles_core.workers.local_provider import LocalWorkerProvider
from miles_core.workers.specs import CommandWorkerSpec, PythonWorkerSpec

TOKEN = "local-token"
ECHO_TARGET = "miles_core.testkit.echo_worker:EchoWorker"


def echo_spec(name: str, **kwargs) -> PythonWorkerSpec:
    return PythonWorkerSpec(name=name, target=ECHO_TARGET, kwargs={"label": name}, rpc_groups=ECHO_GROUPS, **kwargs)


def http_server_spec(name: str, **kwargs) -> CommandWorkerSpec:
    """A command worker whose real server is a grandchild (bash -> python), to prove the whole tree is stopped."""
    return CommandWorkerSpec(
        name=name,
        argv=["bash", "-c", f"{sys.executable} -m http.server {{port}} --bind {{host}} & wait"],
        ports=["port"],
        health_url="http://{host}:{port}/",
        **kwargs,
    )


def gone(pids: list[int]) -> bool:
    return all(not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE for pid in pids)


@pytest.fixture
def provider(tmp_path: Path):
    provider = LocalWorkerProvider(token=TOKEN, run_dir=tmp_path)
    yield provider
    asyncio.run(provider.shutdown())


def test_python_worker_call_and_stop(provider: LocalWorkerProvider) -> None:
    async def scenario() -> None:
        info = await provider.start(echo_spec("echo-a"))
        assert info.kind == "python" and info.url.startswith("http://127.0.0.1:")
        handle = WorkerHandle(provider.client("echo-a"), EchoWorker)
        identity = await handle.identity()
        assert identity["label"] == "echo-a" and identity["pid"] == info.pid
        await handle.client.aclose()
        with pytest.raises(WorkerError, match="already running"):
            await provider.start(echo_spec("echo-a"))
        await provider.stop("echo-a")
        assert gone([info.pid])
        assert not await provider.is_alive("echo-a")

    asyncio.run(scenario())


def test_sigkill_mid_call_then_health_monitor_recovers(provider: LocalWorkerProvider) -> None:
    async def scenario() -> None:
        cells = CellManager(provider)
        cells.add_server("engine", count=2, specs=lambda cell_id: [echo_spec(cell_id)])
        await cells.start_all()
        current_version = 7
        registered: list[str] = []

        async def bring_back(cell) -> None:  # what the controller does: re-register, re-sync weights
            registered.append(cell.cell_id)
            client = provider.client(cell.workers[0].name)
            await client.call("set_version", current_version)
            await client.aclose()

        monitor = HealthMonitor(cells, interval_s=0.2, failures_to_restart=1, on_recovered=[bring_back])
        old_pid = cells.get("engine-1").workers[0].pid
        handle = WorkerHandle(provider.client("engine-1", timeout_s=60), EchoWorker)
        call = asyncio.create_task(handle.sleep(30.0))
        await asyncio.sleep(0.5)
        start = time.monotonic()
        await FaultInjector(provider, [Fault.parse("engine-1@rollout:3")]).on_event("rollout:3")
        with pytest.raises(WorkerDiedError, match=r"worker engine-1 died during engine-1\.sleep"):
            await call
        assert time.monotonic() - start < 10  # well before the 60 s deadline
        await handle.client.aclose()

        monitor.start()
        for _ in range(150):
            if any(what == "recovered" for _, _, what in monitor.events):
                break
            await asyncio.sleep(0.1)
        await monitor.stop()
        assert registered == ["engine-1"]
        cell = cells.get("engine-1")
        assert cell.state == CellState.RUNNING and cell.restarts == 1
        handle = WorkerHandle(provider.client("engine-1"), EchoWorker)
        identity = await handle.identity()
        assert identity["pid"] != old_pid and identity["version"] == current_version
        assert await handle.record("after-recovery", 2) == 4
        await handle.client.aclose()
        assert cells.get("engine-0").restarts == 0
        assert [what for _, cell_id, what in monitor.events if cell_id == "engine-1"][-1] == "recovered"
        await cells.stop_all()
        assert gone([old_pid, identity["pid"]])

    asyncio.run(scenario())


def test_paused_monitor_does_not_check(provider: LocalWorkerProvider) -> None:
    async def scenario() -> None:
        cells = CellManager(provider)
        cells.add_server("engine", count=1, specs=lambda cell_id: [echo_spec(cell_id)])
        await cells.start_all()
        monitor = HealthMonitor(cells, failures_to_restart=1)
        async with monitor.paused():
            await provider.kill("engine-0")
            assert await monitor.check_once() == []
            assert cells.get("engine-0").restarts == 0
        assert await monitor.check_once() == ["engine-0"]
        assert cells.get("engine-0").restarts == 1
        await cells.stop_all()

    asyncio.run(scenario())


def test_command_worker_tree_is_stopped(provider: LocalWorkerProvider) -> None:
    async def scenario() -> None:
        cells = CellManager(provider)
        cells.add_server("router", count=1, specs=lambda cell_id: [http_server_spec(cell_id)])
        cell = await cells.start("router-0")
        worker = cell.workers[0]
        assert worker.url == f"http://127.0.0.1:{worker.ports['port']}"
        tree = provider.processes["router-0"].tree_pids()
        assert len(tree) == 2  # bash and its python child
        monitor = HealthMonitor(cells)
        assert await monitor.is_healthy(cell)
        topology = cells.topology()
        assert topology["cells"][0]["cell_id"] == "router-0"
        assert topology["cells"][0]["workers"][0]["ports"] == worker.ports
        await cells.stop("router-0")
        assert gone(tree)
        assert cells.get("router-0").state == CellState.STOPPED

    asyncio.run(scenario())


def test_command_that_exits_at_once_reports_its_log(provider: LocalWorkerProvider) -> None:
    spec = CommandWorkerSpec(
        name="bad-flag",
        argv=[sys.executable, "-c", "print('error: unknown flag --tp-size'); raise SystemExit(3)"],
        ports=["port"],
        health_url="http://{host}:{port}/health",
    )
    with pytest.raises(WorkerStartError) as caught:
        asyncio.run(provider.start(spec))
    message = str(caught.value)
    assert "worker bad-flag exited while starting" in message
    assert "exit code 3" in message and "error: unknown flag --tp-size" in message
    assert "bad-flag" not in provider.workers


def test_worker_that_never_becomes_healthy_times_out(provider: LocalWorkerProvider) -> None:
    spec = CommandWorkerSpec(
        name="silent",
        argv=["sleep", "60"],
        ports=["port"],
        health_url="http://{host}:{port}/health",
        startup_timeout_s=1.0,
    )
    start = time.monotonic()
    with pytest.raises(WorkerStartError, match=r"worker silent did not become healthy at http://127\.0\.0\.1:"):
        asyncio.run(provider.start(spec))
    assert time.monotonic() - start < 10
    assert "silent" not in provider.processes


def test_python_worker_with_a_bad_target(provider: LocalWorkerProvider) -> None:
    spec = PythonWorkerSpec(name="typo", target="miles_core.testkit.echo_worker:EchoWorkr")
    with pytest.raises(WorkerStartError) as caught:
        asyncio.run(provider.start(spec))
    assert "worker typo exited while starting" in str(caught.value)
    assert "EchoWorkr" in str(caught.value)  # the log tail shows the import error


def test_worker_spec_validation() -> None:
    with pytest.raises(ValueError, match="name"):
        PythonWorkerSpec(name="bad name!", target=ECHO_TARGET)
    with pytest.raises(ValueError, match="target"):
        PythonWorkerSpec(name="w", target="not a target")
    with pytest.raises(ValueError, match="argv"):
        CommandWorkerSpec(name="w", argv=[])
    with pytest.raises(WorkerError, match="WORKER@EVENT"):
        Fault.parse("engine-0")
    typo = CommandWorkerSpec(name="w", argv=["serve", "--port", "{prot}"], ports=["port"])
    with pytest.raises(ValueError, match="placeholder 'prot' is not host, token or one of ports"):
        typo.resolve({"port": 8000})
    with_token = CommandWorkerSpec(name="w", argv=["serve", "--admin-api-key", "{token}", "--json", "{{}}"])
    assert with_token.resolve({}, token="secret").argv == ["serve", "--admin-api-key", "secret", "--json", "{}"]
    resolved = http_server_spec("w").resolve({"port": 8000})
    assert resolved.health_url == "http://127.0.0.1:8000/" and resolved.url == "http://127.0.0.1:8000"
    assert "8000 --bind 127.0.0.1" in resolved.argv[2]


def test_a_workers_log_is_readable_by_its_owner_alone(provider: LocalWorkerProvider, tmp_path: Path) -> None:
    """Workers print secrets (SGLang prints its server arguments, the run's token as admin key among them)."""
    earlier = tmp_path / "logs" / "talker.log"
    earlier.parent.mkdir(parents=True, exist_ok=True)
    earlier.write_text("an earlier run's line\n")
    earlier.chmod(0o644)
    spec = CommandWorkerSpec(
        name="talker", argv=[sys.executable, "-c", f"print('admin key {TOKEN}')"], log_file=str(earlier)
    )

    async def scenario() -> None:
        await provider.start(spec)
        await asyncio.sleep(0.5)
        await provider.shutdown()

    asyncio.run(scenario())
    assert earlier.stat().st_mode & 0o777 == 0o600
    assert "an earlier run's line" in earlier.read_text()  # appended to, not replaced


def test_a_slow_start_says_which_worker_it_waits_for_and_where_its_log_is(
    provider: LocalWorkerProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """A worker whose server comes up after 2 s (an engine loading its model, say), with the notice after 0.5 s
    instead of 5 (``$MILES_WAIT_NOTICE_S``): the terminal says what it waits for, its log and the time."""
    monkeypatch.setenv("MILES_WAIT_NOTICE_S", "0.5")
    slow = CommandWorkerSpec(
        name="slow-engine",
        argv=["bash", "-c", f"sleep 2; exec {sys.executable} -m http.server {{port}} --bind {{host}}"],
        ports=["port"],
        health_url="http://{host}:{port}/",
    )
    asyncio.run(provider.start(slow))
    lines = capfd.readouterr().err.splitlines()
    log = tmp_path / "logs" / "slow-engine.log"
    assert any(line.startswith(f"miles: waiting for slow-engine to start (log: {log}) ... ") for line in lines), lines
    assert any(re.fullmatch(r"miles: slow-engine to start: done after \d+ s", line) for line in lines), lines


HANGS_ON_A_TAKEN_PORT = """  # a command template: its braces doubled
import http.server, sys, time
try:
    server = http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), http.server.SimpleHTTPRequestHandler)
except OSError as exc:
    print(f"ERROR: {{exc}}", flush=True)  # like SGLang's server: it says so, then hangs instead of exiting
    time.sleep(600)
server.serve_forever()
"""


def test_a_command_worker_whose_port_was_taken_starts_again_on_other_ports(
    provider: LocalWorkerProvider, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """Another process binds the port chosen for a worker before the worker does (CI saw it: a real SGLang server
    found its port taken 10 s into its start-up, then hung until its start-up deadline): the provider sees the bind
    error in the worker's log, stops that process at once and starts the worker again on other ports."""
    import socket

    from miles_core.workers import local_provider, process

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    choices = iter([[taken]])
    monkeypatch.setattr(
        local_provider, "free_ports", lambda count, host: next(choices, None) or process.free_ports(count, host)
    )
    spec = CommandWorkerSpec(
        name="unlucky",
        argv=[sys.executable, "-c", HANGS_ON_A_TAKEN_PORT, "{host}", "{port}"],
        ports=["port"],
        health_url="http://{host}:{port}/",
        startup_timeout_s=120.0,
    )
    started = time.monotonic()
    try:
        info = asyncio.run(provider.start(spec))
    finally:
        squatter.close()
    assert time.monotonic() - started < 30  # not the 120 s start-up deadline of the hung first try
    assert info.ports["port"] != taken
    log = Path(info.log_file).read_text()
    assert "Address already in use" in log  # the first try's line, kept in the same log
    notices = capfd.readouterr().err
    assert "miles: unlucky: a port it was given was taken while it started; starting it on other ports" in notices
    assert len(provider.processes["unlucky"].tree_pids()) == 1  # the hung first process is gone


def test_a_worker_that_fails_for_another_reason_is_not_started_again(provider: LocalWorkerProvider) -> None:
    """Only a taken port is worth another start: a worker that exits reports its log once."""
    spec = CommandWorkerSpec(
        name="crashes",
        argv=[sys.executable, "-c", "print('boom', flush=True); raise SystemExit(4)"],
        ports=["port"],
        health_url="http://{host}:{port}/",
    )
    with pytest.raises(WorkerStartError) as caught:
        asyncio.run(provider.start(spec))
    assert "exit code 4" in str(caught.value)
    assert (provider.run_dir / "logs" / "crashes.log").read_text().count("boom") == 1
