"""``python -m tests.workers.ray_ports RUN_DIR``: start the Ray provider as a default run does (no cluster address)
with a Python and a command worker, then print, as JSON, every TCP port that the run's processes listen on: the
driver and all its descendants (GCS, raylet, runtime-env agent, the workers' actors and their children). A process
of its own, so that its Ray is the one the provider starts."""

from __future__ import annotations

import asyncio
import json
import sys

import psutil
import ray

from miles_core.builtin.ray_provider import RayWorkerProvider
from miles_core.testkit.echo_worker import ECHO_GROUPS
from miles_core.workers.specs import CommandWorkerSpec, PythonWorkerSpec


def listening_ports() -> list[dict]:
    """``{pid, name, address, port}`` for each listening socket of this process and its descendants."""
    rows = []
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            name = " ".join(process.cmdline())[:120] or process.name()
            connections = process.net_connections(kind="tcp")
        except psutil.Error:
            continue  # gone meanwhile
        rows += [
            {"pid": process.pid, "name": name, "address": c.laddr.ip, "port": c.laddr.port}
            for c in connections
            if c.status == psutil.CONN_LISTEN
        ]
    return rows


async def main(run_dir: str) -> list[dict]:
    provider = RayWorkerProvider(token="ports-token", run_dir=run_dir, num_cpus=2)
    try:
        await provider.start(
            PythonWorkerSpec(
                name="python-worker",
                target="miles_core.testkit.echo_worker:EchoWorker",
                rpc_groups=ECHO_GROUPS,
                num_cpus=0.25,
            )
        )
        await provider.start(
            CommandWorkerSpec(
                name="command-worker",
                argv=[sys.executable, "-m", "http.server", "{port}", "--bind", "{host}"],
                ports=["port"],
                health_url="http://{host}:{port}/",
                num_cpus=0.25,
            )
        )
        return listening_ports()
    finally:
        await provider.shutdown()


if __name__ == "__main__":
    ports = asyncio.run(main(sys.argv[1]))
    ray.shutdown()
    print(json.dumps(ports))
