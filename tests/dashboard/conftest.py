"""Fixtures of the dashboard tests: a short real run served live, in-process servers, synthetic runs."""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles_core.builtin.dashboard.server import DashboardServer
from miles_core.config.build import build_config
from miles_core.plugin_manager import MilesPluginManager
from tests.conftest import MILES

RUN_STEPS = 3
QUICK = [
    "--no-progress",
    "--rollout-batch-size",
    "4",
    "--rollout-group-size",
    "4",
    "--run-eval-every",
    "0",
    "--run-checkpoint-every",
    "0",
]


def get_json(url: str) -> tuple[int, dict[str, Any]]:
    response = httpx.get(url, timeout=30)
    assert response.headers["content-type"] == "application/json", (url, response.status_code, response.text[:300])
    return response.status_code, response.json()


@dataclasses.dataclass
class FinishedRun:
    run_dir: Path
    stdout: str
    live_url: str  # the URL `miles train --dashboard` printed
    live_run: dict[str, Any]  # /api/run as the live server answered while the run was going on


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """A short real `miles train --dashboard` run; its live dashboard is read while it runs."""
    run_dir = tmp_path_factory.mktemp("dashboard") / "run"
    process = subprocess.Popen(
        [str(MILES), "train", "--output-dir", str(run_dir), "--num-steps", str(RUN_STEPS), *QUICK, "--dashboard"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "MILES_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True)
    reader.start()
    output, url, live = [], None, None
    try:
        deadline = time.monotonic() + 240
        while url is None and time.monotonic() < deadline:
            line = lines.get(timeout=240)
            output.append(line)
            if line.startswith("miles: dashboard at "):
                url = line.split(" at ", 1)[1].strip()
        assert url is not None, "".join(output)
        _, live = get_json(url + "api/run")  # the run is starting its engines: it is running
        assert process.wait(timeout=300) == 0, "".join(output)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
    reader.join(timeout=10)
    while not lines.empty():
        output.append(lines.get())
    return FinishedRun(run_dir=run_dir, stdout="".join(output), live_url=url, live_run=live)


@pytest.fixture
def serve() -> Iterator[Any]:
    """``serve(run_dir) -> base URL``: an in-process dashboard server on a free port, stopped afterwards."""
    servers: list[DashboardServer] = []

    def start(run_dir: Path) -> str:
        servers.append(DashboardServer(run_dir, host="127.0.0.1", port=0).start())
        return servers[-1].url

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def manager() -> MilesPluginManager:
    return MilesPluginManager.load(environ={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})


@pytest.fixture
def recording_run(tmp_path: Path, manager: MilesPluginManager) -> Iterator[tuple[Path, Any]]:
    """A run directory whose dashboard records through the real plugin hooks (no training): ``(run_dir, hooks)``.
    The run is started (``on_run_start``) and ends (``on_run_end``) when the test is over."""
    run_dir = tmp_path / "run"
    config = build_config(manager, config_file=None, overrides={"run.output_dir": str(run_dir), "run.num_steps": 4})
    run_dir.mkdir()
    manager.hook.on_run_start(config=config, run_dir=run_dir, start_step=0)
    yield run_dir, manager.hook
    manager.hook.on_run_end(status="finished", error=None)
