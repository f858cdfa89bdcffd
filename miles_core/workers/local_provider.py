"""``LocalWorkerProvider``: every worker is a child process on this machine (tests, single-machine runs)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

from miles_core.progress import notice, waiting_for
from miles_core.workers.errors import PortTakenError, WorkerStartError
from miles_core.workers.node import LOOPBACK, NODE_ADDRESS_ENV
from miles_core.workers.process import PORT_ATTEMPTS, SupervisedProcess, free_ports, log_tail
from miles_core.workers.provider import BaseWorkerProvider, WorkerInfo, wait_healthy
from miles_core.workers.python_worker import READY_FILE_ENV, SPEC_ENV
from miles_core.workers.rpc.wire import HEALTH_PATH, TOKEN_ENV
from miles_core.workers.specs import CommandWorkerSpec, PythonWorkerSpec, ResolvedCommand, WorkerSpec


class LocalWorkerProvider(BaseWorkerProvider):
    """Starts workers as child processes, each in its own session, logs under ``run_dir/logs``."""

    def __init__(self, *, token: str, run_dir: str | Path) -> None:
        super().__init__(token=token)
        self.run_dir = Path(run_dir)
        self.processes: dict[str, SupervisedProcess] = {}

    async def start(self, spec: WorkerSpec) -> WorkerInfo:
        self._check_new(spec)
        log_file = Path(spec.log_file or self.run_dir / "logs" / f"{spec.name}.log")
        with waiting_for(f"{spec.name} to start", log=log_file):
            if isinstance(spec, PythonWorkerSpec):
                info = await self._start_python(spec, log_file)
            else:
                info = await self._start_command(spec, log_file)
        self.workers[spec.name] = info
        self.specs[spec.name] = spec
        return info

    async def _start_python(self, spec: PythonWorkerSpec, log_file: Path) -> WorkerInfo:
        ready_file = self.run_dir / "workers" / f"{spec.name}.ready.json"
        ready_file.parent.mkdir(parents=True, exist_ok=True)
        ready_file.unlink(missing_ok=True)
        env = {
            **os.environ,
            **spec.env,
            TOKEN_ENV: self.token,
            NODE_ADDRESS_ENV: LOOPBACK,
            SPEC_ENV: spec.model_dump_json(),
            READY_FILE_ENV: str(ready_file),
        }
        process = SupervisedProcess(
            [sys.executable, "-m", "miles_core.workers.python_worker"], env=env, log_file=log_file
        )
        self.processes[spec.name] = process
        deadline = time.monotonic() + spec.startup_timeout_s
        try:
            while not ready_file.exists():
                if not process.is_alive() or time.monotonic() > deadline:
                    what = "exited while starting" if not process.is_alive() else "did not start in time"
                    raise WorkerStartError(f"worker {spec.name} {what}\n{self._describe(spec.name)}")
                await asyncio.sleep(0.05)
            url = _read_url(ready_file)
            await wait_healthy(
                name=spec.name,
                url=f"{url}{HEALTH_PATH}",
                deadline=deadline,
                alive=self._alive_fn(spec.name),
                describe=self._describe_fn(spec.name),
                headers={"Authorization": f"Bearer {self.token}"},
            )
        except BaseException:
            await self._discard(spec.name)
            raise
        return WorkerInfo(
            name=spec.name,
            kind="python",
            url=url,
            ports={},
            pid=process.pid,
            node=LOOPBACK,
            log_file=str(log_file),
            health_url=f"{url}{HEALTH_PATH}",
        )

    async def _start_command(self, spec: CommandWorkerSpec, log_file: Path) -> WorkerInfo:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                ports, command = await self._launch_command(spec, log_file)
                break
            except PortTakenError:
                if attempt == PORT_ATTEMPTS:
                    raise
                notice(f"{spec.name}: a port it was given was taken while it started; starting it on other ports")
        return WorkerInfo(
            name=spec.name,
            kind="command",
            url=command.url,
            ports=ports,
            pid=self.processes[spec.name].pid,
            node=LOOPBACK,
            log_file=str(log_file),
            health_url=command.health_url,
        )

    async def _launch_command(self, spec: CommandWorkerSpec, log_file: Path) -> tuple[dict[str, int], ResolvedCommand]:
        """Start ``spec`` on freshly chosen ports and wait until it is healthy."""
        ports = dict(zip(spec.ports, free_ports(len(spec.ports), LOOPBACK), strict=True))
        command = spec.resolve(ports, host=LOOPBACK, token=self.token)
        env = {**os.environ, TOKEN_ENV: self.token, NODE_ADDRESS_ENV: LOOPBACK, **command.env}
        process = SupervisedProcess(command.argv, env=env, log_file=log_file, cwd=spec.cwd)
        self.processes[spec.name] = process
        if command.health_url is not None:
            try:
                await wait_healthy(
                    name=spec.name,
                    url=command.health_url,
                    deadline=time.monotonic() + spec.startup_timeout_s,
                    alive=self._alive_fn(spec.name),
                    describe=self._describe_fn(spec.name),
                    port_taken=process.found_port_taken,
                )
            except BaseException:
                await self._discard(spec.name)
                raise
        return ports, command

    async def stop(self, name: str) -> None:
        await self._discard(name)
        self.workers.pop(name, None)

    async def is_alive(self, name: str) -> bool:
        process = self.processes.get(name)
        return process is not None and process.is_alive()

    def logs(self, name: str, *, tail_bytes: int = 4096) -> str:
        process = self.processes.get(name)
        info = self.workers.get(name)
        path = process.log_file if process is not None else (info.log_file if info else None)
        return log_tail(path, tail_bytes)

    async def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.processes[name].kill(sig)

    async def _discard(self, name: str) -> None:
        process = self.processes.pop(name, None)
        if process is not None:
            await asyncio.to_thread(process.stop)

    def _alive_fn(self, name: str):
        return lambda: self.is_alive(name)

    def _describe_fn(self, name: str):
        async def describe() -> str:
            return self._describe(name)

        return describe

    def _describe(self, name: str) -> str:
        process = self.processes[name]
        return (
            f"  {process.describe()}, exit code {process.exit_code}\n  --- log tail ---\n{log_tail(process.log_file)}"
        )


def _read_url(ready_file: Path) -> str:
    return json.loads(ready_file.read_text())["url"]
