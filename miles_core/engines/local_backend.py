"""The ``local`` engine backend: each engine cell is one local-engine server process (a command worker)."""

from __future__ import annotations

import sys
from typing import Any

from miles_core.default.threads import engine_threads, omp_wait_policy
from miles_core.workers.specs import CommandWorkerSpec, WorkerSpec


class LocalEngineBackend:
    """:class:`~miles_core.engines.backend.EngineBackend` of Miles' own local engine; no router."""

    def engine_specs(self, config: Any, *, cell_id: str, model_path: str) -> list[WorkerSpec]:
        return [local_engine_spec(config, cell_id=cell_id, model_path=model_path)]

    def router_spec(self, config: Any) -> WorkerSpec | None:
        return None


def local_engine_spec(config: Any, *, cell_id: str, model_path: str) -> CommandWorkerSpec:
    """The command worker that serves ``model_path`` with SGLang's HTTP API on a free port."""
    threads = engine_threads(config)
    argv = [
        sys.executable,
        "-m",
        "miles_core.engines.local_server",
        "--model-path",
        model_path,
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--max-batch-size",
        str(config.engine.max_batch_size),
        "--random-seed",
        str(config.run.seed),
        *(["--cpu-threads", str(threads)] if threads is not None else []),
    ]
    return CommandWorkerSpec(
        name=cell_id,
        argv=argv,
        ports=["port"],
        health_url="http://{host}:{port}/health_generate",
        env=omp_wait_policy(),
        startup_timeout_s=config.engine.startup_timeout_s,
        num_cpus=0,
    )
