"""When the health monitor restarts a cell: a process that exited at the first check that sees it; a live one only
after ``failures_to_restart`` failed health checks in a row; none for a caller that checks liveness only (the owner of
a generation pause). And the local engine's ``/health_generate`` answers a paused engine as SGLang does (503).

The worker is a small HTTP server that answers its health URL with 503 while its pid is in a file the test writes, so
each case is decided by the monitor's rules, not by timing, and a restarted worker (a new pid) is healthy."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_core.engines.client import EngineClient
from miles_core.testkit.tiny_models import save_tiny_llama
from miles_core.workers.cells import CellManager
from miles_core.workers.health import HealthMonitor
from miles_core.workers.local_provider import LocalWorkerProvider
from miles_core.workers.specs import CommandWorkerSpec

TOKEN = "health-token"
SWITCHED_HEALTH_SERVER = """\
import http.server, os, sys

sick_pids = sys.argv[2]


def sick():
    return os.path.exists(sick_pids) and str(os.getpid()) in open(sick_pids).read().split()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503 if sick() else 200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


CLOSING_SERVER = """\
import http.server, os, sys, threading, time

server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler)
threading.Thread(target=server.serve_forever, daemon=True).start()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
server.shutdown()
server.server_close()  # the port refuses connections from now on, while the process lives on
time.sleep(3600)
"""


def switched_spec(name: str, sick_pids: Path) -> CommandWorkerSpec:
    """A worker that answers its health URL with 503 while its pid is listed in ``sick_pids``."""
    return CommandWorkerSpec(
        name=name,
        argv=[sys.executable, "-c", SWITCHED_HEALTH_SERVER, "{port}", str(sick_pids)],
        ports=["port"],
        health_url="http://{host}:{port}/health",
    )


async def kill_and_wait(provider: LocalWorkerProvider, name: str) -> None:
    """SIGKILL the worker and wait until the provider sees it dead (the signal is delivered asynchronously)."""
    await provider.kill(name)
    for _ in range(100):
        if not await provider.is_alive(name):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} still alive 5 s after SIGKILL")


@pytest.fixture
def provider(tmp_path: Path):
    provider = LocalWorkerProvider(token=TOKEN, run_dir=tmp_path / "run")
    yield provider
    asyncio.run(provider.shutdown())


def test_a_live_cell_is_restarted_only_after_the_failures_in_a_row(provider, tmp_path: Path) -> None:
    sick = tmp_path / "sick-pids"

    async def scenario() -> None:
        cells = CellManager(provider)
        cells.add_server("engine", count=1, specs=lambda cell_id: [switched_spec(cell_id, sick)])
        await cells.start_all()
        first_pid = cells.get("engine-0").workers[0].pid
        monitor = HealthMonitor(cells, failures_to_restart=3)
        sick.write_text(str(first_pid))
        assert [await monitor.check_once() for _ in range(2)] == [[], []]
        sick.write_text("")  # it recovers by itself: the count starts again
        assert await monitor.check_once() == [] and monitor.failures == {"engine-0": 0}
        sick.write_text(str(first_pid))
        assert [await monitor.check_once() for _ in range(3)] == [[], [], ["engine-0"]]  # the third in a row
        assert cells.get("engine-0").restarts == 1
        assert cells.get("engine-0").workers[0].pid != first_pid
        assert await monitor.check_once() == []  # the new process answers
        await cells.stop_all()

    asyncio.run(scenario())


def test_an_exited_process_is_restarted_at_the_first_check_and_even_liveness_only(provider, tmp_path: Path) -> None:
    async def scenario() -> None:
        cells = CellManager(provider)
        cells.add_server("engine", count=2, specs=lambda cell_id: [switched_spec(cell_id, tmp_path / cell_id)])
        await cells.start_all()
        monitor = HealthMonitor(cells, failures_to_restart=5)
        (tmp_path / "engine-0").write_text(str(cells.get("engine-0").workers[0].pid))  # 503, as paused SGLang
        await kill_and_wait(provider, "engine-1")  # and engine-1 dies
        assert await monitor.check_once(liveness_only=True) == ["engine-1"]
        assert monitor.failures.get("engine-0", 0) == 0  # its health URL was not asked
        assert cells.get("engine-0").restarts == 0
        await kill_and_wait(provider, "engine-1")
        assert await monitor.check_once() == ["engine-1"]  # no failures in a row needed for an exited process
        assert monitor.failures["engine-0"] == 1
        await cells.stop_all()

    asyncio.run(scenario())


def test_a_live_process_whose_port_refuses_connections_is_restored_by_a_liveness_check(provider, tmp_path) -> None:
    """A process being killed closes its sockets before it can be reaped: its clients see the connection drop while
    its pid still looks alive, and the liveness check must not wait for the pid."""
    close = tmp_path / "close"

    async def scenario() -> None:
        cells = CellManager(provider)
        spec = CommandWorkerSpec(
            name="engine-0",
            argv=[sys.executable, "-c", CLOSING_SERVER, "{port}", str(close)],
            ports=["port"],
            health_url="http://{host}:{port}/",
            cwd=str(tmp_path),
        )
        cells.add_server("engine", count=1, specs=lambda cell_id: [spec])
        await cells.start_all()
        monitor = HealthMonitor(cells, failures_to_restart=5)
        assert await monitor.check_once(liveness_only=True) == []
        close.touch()
        pid = cells.get("engine-0").workers[0].pid
        for _ in range(100):  # until the port is closed
            if not await monitor.is_alive(cells.get("engine-0")):
                break
            await asyncio.sleep(0.05)
        assert await provider.is_alive("engine-0")  # the process lives
        close.unlink()  # the restarted worker keeps its port open
        assert await monitor.check_once(liveness_only=True) == ["engine-0"]
        assert cells.get("engine-0").workers[0].pid != pid
        await cells.stop_all()

    asyncio.run(scenario())


def test_the_local_engine_answers_health_generate_with_503_while_paused(provider, tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model")
    argv = [
        sys.executable,
        "-m",
        "miles_core.builtin.local_engine.server",
        "--model-path",
        str(model),
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--admin-api-key",
        "{token}",
    ]
    spec = CommandWorkerSpec(
        name="engine-0",
        argv=argv,
        ports=["port"],
        env={"SGLANG_HEALTH_CHECK_TIMEOUT": "1.5"},
        health_url="http://{host}:{port}/health_generate",
    )

    async def scenario() -> None:
        info = await provider.start(spec)
        async with EngineClient(info.url, admin_key=TOKEN) as client:
            assert await client.health_generate()
            await client.pause_generation("retract")
            assert not await client.health_generate()  # SGLang's answer: no output within the timeout
            await client.continue_generation()
            assert await client.health_generate()

    asyncio.run(scenario())


@pytest.mark.parametrize("value", ["soon", "0", "-3"])
def test_a_bad_health_check_timeout_stops_the_local_engine_at_start(value: str, tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model")
    result = subprocess.run(
        [sys.executable, "-m", "miles_core.builtin.local_engine.server", "--model-path", str(model), "--port", "0"],
        env={**os.environ, "SGLANG_HEALTH_CHECK_TIMEOUT": value},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"SGLANG_HEALTH_CHECK_TIMEOUT={value!r}" in result.stderr
