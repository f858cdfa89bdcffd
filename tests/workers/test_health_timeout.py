"""The controller's health monitor waits ``engine.health_check_timeout_s`` for an engine's health URL: a busy SGLang
server answers ``/health_generate`` only once its scheduler next produces output (up to 20 s), and a check that gave
up after 5 s restarted a healthy engine in the middle of a rollout (seen with real SGLang behind the router)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from miles_core.builtin.local_engine.backend import LocalEngineBackend
from miles_core.config.build import build_config
from miles_core.plugin_manager import MilesPluginManager
from miles_core.rollout.controller import InferenceController
from miles_core.workers.local_provider import LocalWorkerProvider
from miles_core.workers.specs import CommandWorkerSpec

SLOW_HEALTH_DELAY_S = 6.0  # longer than the 5 s the monitor used to wait
SLOW_HEALTH_SERVER = """\
import http.server, sys, time

answered = []


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if answered:  # the start-up check is answered at once, the later ones as a busy server does
            time.sleep(float(sys.argv[2]))
        answered.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_an_engine_whose_health_check_answers_slowly_is_not_restarted(tmp_path: Path) -> None:
    config = build_config(MilesPluginManager.load(), overrides={})
    assert config.engine.health_check_timeout_s > SLOW_HEALTH_DELAY_S
    provider = LocalWorkerProvider(token="t", run_dir=tmp_path)
    spec = CommandWorkerSpec(
        name="engine-0",
        argv=[sys.executable, "-c", SLOW_HEALTH_SERVER, "{port}", str(SLOW_HEALTH_DELAY_S)],
        ports=["port"],
        health_url="http://{host}:{port}/health_generate",
    )
    controller = InferenceController(
        config=config, hooks=None, provider=provider, protocol=None, backend=LocalEngineBackend(), model_path=""
    )

    async def scenario() -> None:
        try:
            controller.cells.add_server("engine", count=1, specs=lambda cell_id: [spec])
            await controller.cells.start_all()
            pid = controller.cells.get("engine-0").workers[0].pid
            assert await controller.monitor.check_once() == []  # nothing restored: it was never restarted
            assert controller.monitor.failures == {"engine-0": 0}
            assert controller.cells.get("engine-0").workers[0].pid == pid
        finally:
            await provider.shutdown()

    asyncio.run(scenario())
