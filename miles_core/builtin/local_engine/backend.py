"""The ``local`` engine backend: each engine cell is one local-engine server process (a command worker)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from miles_core.default.threads import engine_threads, omp_wait_policy
from miles_core.weight_transfer.routes import LOCAL_ENGINE, EngineCapabilities
from miles_core.workers.specs import CommandWorkerSpec, WorkerSpec

if TYPE_CHECKING:
    from miles_core.config.build import MilesConfig


class LocalEngineBackend:
    """:class:`~miles_core.engines.backend.EngineBackend` of Miles' own local engine; no router."""

    def engine_specs(self, config: MilesConfig, *, cell_id: str, model_path: str) -> list[WorkerSpec]:
        return [local_engine_spec(config, cell_id=cell_id, model_path=model_path)]

    def router_spec(self, config: MilesConfig) -> WorkerSpec | None:
        return None

    def weight_capabilities(self, config: MilesConfig) -> EngineCapabilities:
        """Every route: disk, broadcast groups, staging files (served from, or copied), safetensors bytes, checksum."""
        return LOCAL_ENGINE


def local_engine_spec(config: MilesConfig, *, cell_id: str, model_path: str) -> CommandWorkerSpec:
    """The command worker that serves ``model_path`` with SGLang's HTTP API on a free port."""
    threads = engine_threads(config)
    argv = [
        sys.executable,
        "-m",
        "miles_core.builtin.local_engine.server",
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
