"""Worker specs for SGLang engines and the sglang-router: command lines, ports, health URLs, reservations."""

from __future__ import annotations

import sys
from typing import Any

from miles_core.workers.specs import CommandWorkerSpec
from miles_plugins_sglang.config import PYTHON, server_flags


def sglang_engine_spec(config: Any, *, cell_id: str, model_path: str) -> CommandWorkerSpec:
    """One engine: ``sglang.launch_command`` with the checkpoint, loopback (or node) host, an allocated port, the
    parallel sizes, the run's seed and token as admin key, then ``server_args`` and ``extra_args``. Ready once
    ``/health_generate`` answers 200."""
    sglang = config.sglang
    argv = [*_command(sglang.launch_command), "--model-path", _literal(model_path), "--host", "{host}",
            "--port", "{port}", "--tp-size", str(sglang.tp_size), "--dp-size", str(sglang.dp_size),
            "--ep-size", str(sglang.ep_size), "--random-seed", str(config.run.seed), "--admin-api-key", "{token}",
            *map(_literal, server_flags(sglang.server_args)), *map(_literal, sglang.extra_args)]  # fmt: skip
    return CommandWorkerSpec(name=cell_id, argv=argv, ports=["port"], health_url="http://{host}:{port}/health_generate",
                             startup_timeout_s=config.engine.startup_timeout_s, num_cpus=0,
                             num_gpus=_gpus_per_engine(sglang))  # fmt: skip


def router_spec(config: Any) -> CommandWorkerSpec:
    """The sglang-router, with its server and its Prometheus endpoint on the worker's host (never 0.0.0.0)."""
    sglang = config.sglang
    argv = [*_command(sglang.router_command), "--host", "{host}", "--port", "{port}", "--prometheus-host", "{host}",
            "--prometheus-port", "{prometheus}", "--policy", sglang.router_policy,
            "--health-check-interval-secs", str(sglang.router_health_check_interval_s), "--log-level", "warn",
            *map(_literal, sglang.router_extra_args)]  # fmt: skip
    return CommandWorkerSpec(name="router", argv=argv, ports=["port", "prometheus"],
                             health_url="http://{host}:{port}/health", startup_timeout_s=60.0, num_cpus=0)  # fmt: skip


def _command(command: list[str]) -> list[str]:
    return [sys.executable if part == PYTHON else _literal(part) for part in command]


def _literal(text: str) -> str:
    """Escape braces, so that a user's value (JSON, say) is not read as a placeholder."""
    return text.replace("{", "{{").replace("}", "}}")


def _gpus_per_engine(sglang: Any) -> float:
    if sglang.gpus_per_engine is not None:
        return sglang.gpus_per_engine
    import torch  # deferred: only to see whether engines will find GPUs

    return float(sglang.tp_size * sglang.dp_size) if torch.cuda.is_available() else 0.0
