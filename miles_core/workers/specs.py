"""Worker specs: what to start. Every kind of worker (engine, router, trainer rank, session server) is one of these.

Strings in a :class:`CommandWorkerSpec` (argv, env values, health URL) may hold ``{host}`` and ``{NAME}`` for each
port named in ``ports``; the provider fills them in with the address of the worker's node (where it must bind, never
``0.0.0.0``) and free ports there.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import pydantic

from miles_core.workers.node import LOOPBACK, url_host

WorkerName = Annotated[str, pydantic.StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")]
WorkerRole = Annotated[str, pydantic.StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
TRAINER = "trainer"
"""The role of trainer ranks (``WorkerSpec.role``; ``--run-ray-trainer-resources`` pins it)."""
ENGINE = "engine"
"""The role of engine workers (set by the controller unless the backend set one)."""
ROUTER = "router"
"""The role of a router in front of the engines."""
SESSION_SERVER = "session_server"
"""The role of an agent run's session servers."""


class _Spec(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    name: WorkerName
    env: dict[str, str] = pydantic.Field(default_factory=dict, description="Extra environment variables.")
    num_cpus: float = pydantic.Field(default=1.0, ge=0, description="CPUs reserved for the worker.")
    num_gpus: float = pydantic.Field(default=0.0, ge=0, description="GPUs reserved for the worker.")
    startup_timeout_s: float = pydantic.Field(default=120.0, gt=0, description="Time allowed to become healthy.")
    log_file: str | None = pydantic.Field(default=None, description="Log path; default: RUN_DIR/logs/NAME.log.")
    role: WorkerRole | None = pydantic.Field(
        default=None,
        description="What the worker is to the run (trainer, engine, router, ...); providers may place by role "
        "(the Ray provider pins a role to the nodes that offer its custom resources).",
    )


class PythonWorkerSpec(_Spec):
    """A Python worker: ``target`` (``"module:Class"``) built with keyword-only ``kwargs``, served over RPC."""

    kind: str = "python"
    target: str = pydantic.Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
    kwargs: dict[str, Any] = pydantic.Field(default_factory=dict)
    rpc_groups: dict[str, int | None] | None = pydantic.Field(
        default=None, description="Concurrency groups of the worker's RPC server (default: control=1, query=None)."
    )
    result_ttl_s: float = pydantic.Field(default=12 * 3600.0, gt=0, description="How long call results are kept.")


class CommandWorkerSpec(_Spec):
    """A worker that is a command line (an SGLang server, the router), supervised by its provider."""

    kind: str = "command"
    argv: list[str] = pydantic.Field(min_length=1)
    cwd: str | None = None
    ports: list[str] = pydantic.Field(default_factory=list, description="Names of ports to allocate.")
    health_url: str | None = pydantic.Field(
        default=None, description="URL that answers 200 once the worker is ready, e.g. http://{host}:{port}/health."
    )

    def resolve(self, ports: dict[str, int], *, host: str = LOOPBACK, token: str = "") -> ResolvedCommand:
        """Fill ``{host}`` (the address of the node the provider started the worker on: it binds there and is
        reached there), ``{token}`` (the run's token, for servers that take their admin key as a flag) and the port
        placeholders in with the allocated ``ports``."""
        fill = {"host": host, "token": token, **{name: str(port) for name, port in ports.items()}}
        try:
            return ResolvedCommand(
                argv=[arg.format(**fill) for arg in self.argv],
                env={key: value.format(**fill) for key, value in self.env.items()},
                health_url=self.health_url.format(**fill) if self.health_url else None,
                url=f"http://{url_host(host)}:{ports[self.ports[0]]}" if self.ports else None,
            )
        except (KeyError, IndexError) as exc:
            raise ValueError(
                f"worker {self.name}: placeholder {exc} is not host, token or one of ports {self.ports}"
            ) from None


@dataclasses.dataclass(frozen=True)
class ResolvedCommand:
    """A command worker's argv, extra environment and URLs with every placeholder filled in."""

    argv: list[str]
    env: dict[str, str]
    health_url: str | None
    url: str | None


WorkerSpec = PythonWorkerSpec | CommandWorkerSpec
"""What a provider starts: a Python worker (a class run behind the worker RPC) or a command line."""


def with_role(spec: WorkerSpec, role: str) -> WorkerSpec:
    """``spec`` with ``role``, unless its maker gave it one already."""
    return spec if spec.role is not None else spec.model_copy(update={"role": role})
