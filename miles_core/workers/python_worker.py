"""Hosting a :class:`PythonWorkerSpec`: build the target object and serve its RPC methods.

Run as ``python -m miles_core.workers.python_worker`` by the local provider (the spec, the token and the path of a
ready file come in environment variables), or called in-process by a Ray actor.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import uvloop

from miles_core.registry import Implementation
from miles_core.workers.rpc.server import RpcServer
from miles_core.workers.rpc.wire import TOKEN_ENV
from miles_core.workers.specs import PythonWorkerSpec

SPEC_ENV = "MILES_WORKER_SPEC"
READY_FILE_ENV = "MILES_WORKER_READY_FILE"


def build_target(spec: PythonWorkerSpec) -> Any:
    """Import the spec's class and construct it with its keyword-only arguments."""
    cls = Implementation(name=spec.name, target=spec.target, provider="worker spec").load()
    return cls(**spec.kwargs)


def make_server(spec: PythonWorkerSpec, target: Any, *, token: str, host: str | None = None) -> RpcServer:
    """The RPC server for a built worker object, on ``host`` (default: this node's address)."""
    return RpcServer(
        target, token=token, name=spec.name, host=host, groups=spec.rpc_groups, result_ttl_s=spec.result_ttl_s
    )


def write_ready_file(path: str | Path, *, url: str) -> None:
    """Tell the provider where the worker listens (written atomically)."""
    path = Path(path)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    partial.rename(path)


async def _serve(spec: PythonWorkerSpec, token: str, ready_file: str) -> None:
    server = make_server(spec, build_target(spec), token=token)
    await server.start()
    write_ready_file(ready_file, url=server.url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()


def main() -> None:
    spec = PythonWorkerSpec.model_validate_json(os.environ[SPEC_ENV])
    uvloop.run(_serve(spec, os.environ[TOKEN_ENV], os.environ[READY_FILE_ENV]))


if __name__ == "__main__":
    main()
