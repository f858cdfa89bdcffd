"""``RayWorkerProvider``: workers placed on Ray placement-group bundles, one actor per worker.

Placement: :meth:`RayWorkerProvider.place` reserves one bundle per worker (CPUs, and GPUs where asked) in a
placement group, starts one actor in each bundle, asks each where it landed, and hands the workers out in a
deterministic order: by node address, then device id, then bundle index. A Python worker is hosted inside its
actor (so it can use Ray itself, which RDT weight transfer needs); a command worker is a child process that its
actor starts, watches and, on stop, kills with its whole process tree.

Pinning: each worker spec has a role (trainer, engine, router); the bundles of a role also ask for the custom
resources configured for it (``run.ray_{role}_resources``), so Ray puts them only on nodes that offer those. A
resource that the cluster's nodes do not offer in the amount asked fails the placement at once, naming it.

Network: with no cluster address (``address``, or Ray's own ``RAY_ADDRESS``), the provider starts a local Ray
whose node address is 127.0.0.1, so every port Ray opens (GCS, raylet, object manager, workers, runtime-env agent)
listens on loopback only; it starts no dashboard. Given a cluster address, it joins that cluster as configured
(a cluster whose head is on loopback, such as several raylets on one machine, is joined on loopback).

Authentication: a local Ray has Ray's token authentication, set up explicitly (:func:`local_token_auth`): one token
per driver process, shared by every Ray that process starts, so Ray prints no warning about it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import os
import re
import secrets
import signal
import socket
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import ray
from ray._private import ray_constants
from ray._raylet import AuthenticationTokenLoader
from ray._raylet import Config as RayConfig
from ray.exceptions import AuthenticationError as RayAuthenticationError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from miles_core.progress import waiting_for
from miles_core.workers.errors import PortTakenError, WorkerError, WorkerStartError
from miles_core.workers.node import collective_interface_env, set_node_address
from miles_core.workers.node_check import NodeCheckError, make_witnesses, miles_packages, node_problems, probe_node
from miles_core.workers.process import (
    PORT_ATTEMPTS,
    SupervisedProcess,
    Watchdog,
    free_ports,
    log_tail,
    wait_until,
)
from miles_core.workers.provider import BaseWorkerProvider, WorkerInfo
from miles_core.workers.python_worker import build_target, make_server
from miles_core.workers.ray_settings import (
    RESERVED_RESOURCES,
    check_ray_address,
    check_resources,
    is_loopback_address,
    split_address,
)
from miles_core.workers.rpc.wire import HEALTH_PATH, TOKEN_ENV
from miles_core.workers.specs import CommandWorkerSpec, PythonWorkerSpec, WorkerSpec

ZERO_CPU_BUNDLE = 0.01
"""The CPU share of a bundle for workers that reserve no CPU (Ray refuses bundles of zeros)."""


@ray.remote(max_restarts=0)
class WorkerActor:
    """Holds one bundle and hosts (Python) or supervises (command) one worker."""

    def __init__(self) -> None:
        self.server = None
        self.process: SupervisedProcess | None = None

    def locate(self) -> dict[str, Any]:
        """Where this actor runs: node address and id, GPU ids, pid."""
        context = ray.get_runtime_context()
        return {
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": context.get_node_id(),
            "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
            "pid": os.getpid(),
        }

    def start(self, spec_json: str, kind: str, *, token: str, log_file: str, host: str) -> dict[str, Any]:
        """Start the worker, bound to ``host`` (this node's address); the worker and the processes it starts find
        that address in ``MILES_NODE_ADDRESS``."""
        spec_class = PythonWorkerSpec if kind == "python" else CommandWorkerSpec
        spec = spec_class.model_validate_json(spec_json)
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        set_node_address(host)
        if isinstance(spec, PythonWorkerSpec):
            return self._start_python(spec, token=token, log_file=log_file, host=host)
        return self._start_command(spec, token=token, log_file=log_file, host=host)

    def _start_python(self, spec: PythonWorkerSpec, *, token: str, log_file: str, host: str) -> dict[str, Any]:
        log = open(log_file, "ab", buffering=0)  # noqa: SIM115 - lives as long as the actor process
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        os.environ.update(spec.env)
        self.server = make_server(spec, build_target(spec), token=token, host=host)
        self.server.start_in_thread()
        url = self.server.url
        return {"url": url, "pid": os.getpid(), "ports": {}, "health_url": f"{url}{HEALTH_PATH}"}

    def _start_command(self, spec: CommandWorkerSpec, *, token: str, log_file: str, host: str) -> dict[str, Any]:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            ports = dict(zip(spec.ports, free_ports(len(spec.ports), host), strict=True))
            command = spec.resolve(ports, host=host, token=token)
            env = {**os.environ, TOKEN_ENV: token, **collective_interface_env(host), **command.env}
            self.process = SupervisedProcess(command.argv, env=env, log_file=log_file, cwd=spec.cwd)
            if command.health_url is None or self._wait_healthy(command.health_url, spec.startup_timeout_s):
                return {"url": command.url, "pid": self.process.pid, "ports": ports, "health_url": command.health_url}
            port_taken = self.process.found_port_taken()
            what = "exited while starting" if not self.process.is_alive() else "did not become healthy in time"
            what = "found its port taken while starting" if port_taken else what
            detail = f"  {self.process.describe()}, exit code {self.process.exit_code}\n  --- log tail ---\n"
            self.process.stop()
            if not port_taken or attempt == PORT_ATTEMPTS:
                error = PortTakenError if port_taken else WorkerStartError
                raise error(f"worker {spec.name} {what} ({command.health_url})\n{detail}{log_tail(log_file)}")
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _wait_healthy(self, url: str, timeout_s: float) -> bool:
        import httpx  # deferred: only command workers with a health URL need it

        def healthy() -> bool:
            if not self.process.is_alive() or self.process.found_port_taken():
                return True  # stop waiting; the caller sees the exit or the taken port
            try:
                return httpx.get(url, timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False

        return (
            wait_until(healthy, timeout_s=timeout_s, interval_s=0.1)
            and self.process.is_alive()
            and not self.process.found_port_taken()
        )

    def is_alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        return self.server is not None

    def tree_pids(self) -> list[int]:
        return [os.getpid(), *(self.process.tree_pids() if self.process else [])]

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def kill(self, sig: int) -> None:
        if self.process is not None:
            self.process.kill(sig)
        else:
            os.kill(os.getpid(), sig)


@dataclasses.dataclass
class _Slot:
    """A bundle handed to one worker name: its placement group, bundle index and location."""

    group: PlacementGroup
    bundle_index: int
    location: dict[str, Any]
    actor: Any = None


class RayWorkerProvider(BaseWorkerProvider):
    """Places workers with Ray placement groups; connects to ``address`` (or ``RAY_ADDRESS``) or starts a local
    Ray on 127.0.0.1 (:func:`init_ray`). ``role_resources`` maps a role (``WorkerSpec.role``: trainer, engine,
    router) to custom Ray resources that each bundle of its workers also asks for, pinning the role to the nodes
    that offer them."""

    hosts_in_ray = True  # engines run under Ray actors: Ray Direct Transport (rdt) can reach beside them

    def __init__(
        self,
        *,
        token: str,
        run_dir: str | Path,
        address: str | None = None,
        role_resources: Mapping[str, Mapping[str, float]] | None = None,
        **ray_init: Any,
    ) -> None:
        super().__init__(token=token)
        self.run_dir = Path(run_dir)
        self.role_resources = {role: check_resources(wanted) for role, wanted in (role_resources or {}).items()}
        if not ray.is_initialized():
            init_ray(address, **ray_init)
        self.driver_ip = ray.util.get_node_ip_address()
        set_node_address(self.driver_ip)  # the driver's own listeners (a protocol's group) bind its node's address
        self.require_shared(self.run_dir, what="the run directory", setting="run.output_dir (--output-dir)", owned=True)
        self.checked_nodes = {ray.get_runtime_context().get_node_id()}  # the driver's node sees what it sees
        self.witnesses: list | None = None  # made at the first node check (the shared paths are known by then)
        self.reported_losses: set[tuple[str, str]] = set()  # (node, worker) whose loss the run was told of
        self.slots: dict[str, _Slot] = {}
        self.groups: list[PlacementGroup] = []

    @classmethod
    def for_run(cls, run: Any, *, token: str, run_dir: str | Path) -> RayWorkerProvider:
        """The provider of a run: it joins ``run.ray_address`` (else ``RAY_ADDRESS``, else a local Ray) and pins
        each role to the nodes that offer ``run.ray_{role}_resources``."""
        return cls(token=token, run_dir=run_dir, address=run.ray_address, role_resources=run.ray_resources_by_role)

    def bundle(self, spec: WorkerSpec) -> dict[str, float]:
        """The resources of ``spec``'s bundle: its CPUs and GPUs, and its role's custom resources."""
        # Ray refuses an all-zero bundle; a worker that reserves nothing (a CPU engine sharing cores) gets a token
        return {
            "CPU": spec.num_cpus or ZERO_CPU_BUNDLE,
            **({"GPU": spec.num_gpus} if spec.num_gpus else {}),
            **self.role_resources.get(spec.role or "", {}),
        }

    async def place(self, specs: list[WorkerSpec], *, strategy: str = "PACK") -> list[_Slot]:
        """Reserve one bundle per spec in one placement group and assign them in the documented order."""
        if not specs:
            return []
        shapes = {tuple(sorted(self.bundle(spec).items())) for spec in specs}
        if len(shapes) > 1:
            raise WorkerError(f"workers placed together need the same resources; got {sorted(shapes)}")
        bundle = dict(shapes.pop())
        names = ", ".join(spec.name for spec in specs)
        check_cluster_offers(bundle, count=len(specs), names=names)
        group = placement_group([dict(bundle) for _ in specs], strategy=strategy)
        timeout_s = max(spec.startup_timeout_s for spec in specs)
        try:
            await asyncio.wait_for(group.ready(), timeout=timeout_s)
        except TimeoutError:
            remove_placement_group(group)
            raise WorkerStartError(
                f"cannot place {_workers(len(specs))} ({names}) of {bundle} each within {timeout_s:.0f} s; the "
                f"cluster has {_node_resources(ray.available_resources())} free of "
                f"{_node_resources(ray.cluster_resources())}"
            ) from None
        self.groups.append(group)
        num_cpus, num_gpus = specs[0].num_cpus, specs[0].num_gpus
        actors = [self._new_actor(group, index, num_cpus, num_gpus) for index in range(len(specs))]
        try:
            locations = await asyncio.gather(*(actor.locate.remote() for actor in actors))
            await self._check_nodes({location["node_id"]: location["node_ip"] for location in locations})
        except BaseException as exc:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            remove_placement_group(group)
            self.groups.remove(group)
            if isinstance(exc, ray.exceptions.RayActorError):
                raise WorkerStartError(
                    f"the Ray actors of {names} could not start on their nodes ({exc}); every node needs the same "
                    "Miles and plugins installed"
                ) from None
            raise
        slots = [
            _Slot(group, index, location, actor)
            for index, (actor, location) in enumerate(zip(actors, locations, strict=True))
        ]
        slots.sort(key=placement_order)
        for spec, slot in zip(specs, slots, strict=True):
            slot.location = {**slot.location, "bundle_index": slot.bundle_index, "placement_group": group.id.hex()}
            self.slots[spec.name] = slot
        return slots

    async def _check_nodes(self, nodes: Mapping[str, str]) -> None:
        """Each node (id: address) other than the driver's, the first time a worker is placed there: it sees the
        shared directories (:meth:`require_shared`: the run directory and what the run added) and imports the
        driver's Miles packages; one that does not is a :class:`NodeCheckError` naming it."""
        new = {node_id: ip for node_id, ip in nodes.items() if node_id not in self.checked_nodes}
        if not new:
            return
        if self.witnesses is None:
            self.witnesses = make_witnesses(self.shared_paths)
        wire = [(witness.file, witness.digest) for witness in self.witnesses]
        packages = miles_packages()
        probes = {
            node_id: _probe_node.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
            ).remote(wire, packages)
            for node_id in new
        }
        for node_id, probe in probes.items():
            try:
                found = await asyncio.wait_for(probe, timeout=NODE_CHECK_TIMEOUT_S)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                raise NodeCheckError(
                    f"node {new[node_id]} (id {node_id[:8]}) did not run the node check within "
                    f"{NODE_CHECK_TIMEOUT_S:.0f} s ({type(exc).__name__}: {str(exc)[:500]}); every node needs the "
                    "same Miles and plugins installed"
                ) from None
            problems = node_problems(f"{new[node_id]} (id {node_id[:8]})", self.witnesses, found)
            if problems is not None:
                raise NodeCheckError(problems)
            self.checked_nodes.add(node_id)

    def _new_actor(self, group: PlacementGroup, index: int, num_cpus: float, num_gpus: float) -> Any:
        strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)
        return WorkerActor.options(num_cpus=num_cpus, num_gpus=num_gpus, scheduling_strategy=strategy).remote()

    async def start(self, spec: WorkerSpec) -> WorkerInfo:
        self._check_new(spec)
        if spec.name not in self.slots:
            await self.place([spec])
        slot = self.slots[spec.name]
        if slot.actor is None:  # restarted: a fresh actor in the same bundle, which may be on another node now
            await self._replace_actor(spec, slot)
        log_file = str(spec.log_file or self.run_dir / "logs" / f"{spec.name}.log")
        host = slot.location["node_ip"]  # loopback for a local Ray; the node's cluster address otherwise
        try:
            with waiting_for(f"{spec.name} to start on {host}", log=log_file):
                started = await slot.actor.start.remote(
                    spec.model_dump_json(), spec.kind, token=self.token, log_file=log_file, host=host
                )
        except ray.exceptions.RayTaskError as exc:
            await self._kill_actor(slot)
            raise WorkerStartError(f"worker {spec.name} failed to start on {slot.location}: {exc.cause}") from None
        info = WorkerInfo(
            name=spec.name,
            kind=spec.kind,
            url=started["url"],
            ports=started["ports"],
            pid=started["pid"],
            node=slot.location["node_ip"],
            log_file=log_file,
            health_url=started["health_url"],
            placement=dict(slot.location),
        )
        self.workers[spec.name] = info
        self.specs[spec.name] = spec
        return info

    async def _replace_actor(self, spec: WorkerSpec, slot: _Slot) -> None:
        """A new actor in ``slot``'s bundle, located again. A bundle whose node died is re-placed by Ray on a node
        that offers its resources, when one has room: until then this fails at once (the health monitor tries again
        at its next check), saying which node went and what happens next, so a lost node never holds up the run."""
        state = placement_group_table(slot.group).get("state")
        if state != "CREATED":
            node = f"{slot.location['node_ip']} (id {slot.location['node_id'][:8]})"
            if (node, spec.name) not in self.reported_losses:
                self.reported_losses.add((node, spec.name))
                alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}.get(slot.location["node_id"], False)
                print(
                    f"miles: node {node} is {'alive' if alive else 'gone'} and its bundle for {spec.name} is "
                    f"{str(state).lower()}; {spec.name} starts again once Ray re-places the bundle on a node that "
                    f"offers {self.bundle(spec)} (the node's return, or another with room); the run goes on without it",
                    flush=True,
                )
            raise WorkerStartError(f"worker {spec.name}: its bundle is {state}, not placed on a live node yet")
        slot.actor = self._new_actor(slot.group, slot.bundle_index, spec.num_cpus, spec.num_gpus)
        try:
            location = await asyncio.wait_for(slot.actor.locate.remote(), timeout=spec.startup_timeout_s)
            await self._check_nodes({location["node_id"]: location["node_ip"]})
        except BaseException:
            await self._kill_actor(slot)
            raise
        slot.location = {**slot.location, **location}

    async def stop(self, name: str) -> None:
        slot = self.slots.get(name)
        if slot is not None and slot.actor is not None:
            pids: list[int] = []
            # already dead (only the handle is left), or on a node that is gone (the call would wait for it)
            with contextlib.suppress(ray.exceptions.RayActorError, TimeoutError):
                pids = await asyncio.wait_for(slot.actor.tree_pids.remote(), timeout=STOP_CALL_TIMEOUT_S)
                await asyncio.wait_for(slot.actor.stop.remote(), timeout=STOP_CALL_TIMEOUT_S)
            await self._kill_actor(slot)
            if slot.location["node_ip"] == self.driver_ip:  # ray.kill returns before the process is gone
                await asyncio.to_thread(wait_until, lambda: not any(map(_running, pids)), timeout_s=30)
        self.workers.pop(name, None)

    async def is_alive(self, name: str) -> bool:
        slot = self.slots.get(name)
        if slot is None or slot.actor is None:
            return False
        try:
            return await asyncio.wait_for(slot.actor.is_alive.remote(), timeout=10.0)
        except (ray.exceptions.RayActorError, TimeoutError):
            return False

    def logs(self, name: str, *, tail_bytes: int = 4096) -> str:
        info = self.workers.get(name)
        return log_tail(info.log_file if info else None, tail_bytes)

    async def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ray.exceptions.RayActorError):  # the actor killed itself, as asked
            await self.slots[name].actor.kill.remote(sig)

    async def tree_pids(self, name: str) -> list[int]:
        """The pids of the worker's actor and of the processes it started."""
        return await self.slots[name].actor.tree_pids.remote()

    async def shutdown(self) -> None:
        await super().shutdown()
        for witness in self.witnesses or []:
            if witness.probe:
                Path(witness.file).unlink(missing_ok=True)
        self.witnesses = None
        for group in self.groups:
            remove_placement_group(group)
        self.groups.clear()
        self.slots.clear()

    async def _kill_actor(self, slot: _Slot) -> None:
        ray.kill(slot.actor, no_restart=True)
        slot.actor = None


STOP_CALL_TIMEOUT_S = 10.0
"""How long a stopping worker's actor may take to answer (one on a node that died never does)."""
NODE_CHECK_TIMEOUT_S = 120.0
"""How long a node may take to run its check (it imports the driver's Miles packages, some of them heavy)."""


@ray.remote(num_cpus=0, max_retries=0)
def _probe_node(witnesses: list[tuple[str, str]], packages: list[str]) -> dict[str, list[str]]:
    return probe_node(witnesses, packages)


CLUSTER_ENV = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
"""``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``: ``0`` makes Ray keep a loopback node address (see :func:`init_ray`)."""


def init_ray(address: str | None = None, **ray_init: Any) -> None:
    """Join the Ray cluster at ``address`` (or ``RAY_ADDRESS``); with neither, start a local Ray (never one that a
    ``ray start`` left running) whose node address, and so every port, is on 127.0.0.1 only, with token
    authentication (:func:`local_token_auth`). An address of the wrong form, or a cluster that cannot be joined, is
    a :class:`WorkerError` that names the address and its source."""
    if address is not None:
        _join_cluster(address, "run.ray_address (--run-ray-address)", ray_init)
        return
    if os.environ.get("RAY_ADDRESS"):
        _join_cluster(os.environ["RAY_ADDRESS"], "RAY_ADDRESS", ray_init)
        return
    local_token_auth()
    before = {child.pid for child in psutil.Process().children()}
    with loopback_node_address(), keep_signal_handlers(), waiting_for("a local Ray to start"):
        ray.init(
            address="local", _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False, **ray_init
        )
    # Ray ties its GCS and raylet to this process, but their agents may outlive it by many seconds: a watchdog
    # stops them all when the driver goes (it ends by itself when ray.shutdown stops them)
    Watchdog.start_for(trees=[child.pid for child in psutil.Process().children() if child.pid not in before])
    node_ip = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node_ip).is_loopback:
        ray.shutdown()
        raise WorkerError(
            f"the local Ray took the node address {node_ip} instead of 127.0.0.1, so its ports would "
            "be reachable from other machines; set RAY_ADDRESS to use a cluster on purpose"
        )


def _join_cluster(address: str, source: str, ray_init: dict[str, Any]) -> None:
    """Connect to the cluster at ``address`` (named by ``source`` in errors). A cluster on loopback is joined with
    clusters switched off, as it was started: otherwise Ray rewrites 127.0.0.1 into the machine's routable address
    and waits for a GCS and a raylet that are not there."""
    try:
        check_ray_address(address)
    except ValueError as exc:
        raise WorkerError(f"{source} = {address!r}: {exc}") from None
    if address != "auto":
        _check_listening(address, source)
    if any(os.environ.get(name) for name in TOKEN_ENV_VARS):  # (so that Ray, reloading, finds one)
        reload_token_auth()  # Ray kept the token of an earlier Ray of this process: send the one given now
    loopback = loopback_node_address() if is_loopback_address(address) else contextlib.nullcontext()
    if not is_loopback_address(address) and "_node_ip_address" not in ray_init:
        node_ip = local_raylet_address()
        if node_ip is not None:  # else Ray picks, as it would
            ray_init = {**ray_init, "_node_ip_address": node_ip}
    try:
        with loopback, keep_signal_handlers(), waiting_for(f"the Ray cluster at {address} to be joined"):
            ray.init(address=address, include_dashboard=False, log_to_driver=False, **ray_init)
    except (ConnectionError, RayAuthenticationError) as exc:
        raise WorkerError(f"cannot join the Ray cluster at {address} ({source}): {_join_failure(exc)}") from None


def local_raylet_address() -> str | None:
    """The node address of the Ray node on this host: of the raylets this process sees, the one whose node address
    is one of this host's (its network interfaces', not loopback); ``None`` when there is not exactly one.

    Without it Ray attaches a driver to any raylet it finds in the process table, the head's first: where hosts share
    one process table but not the network (network namespaces, containers that share the host's pids), a driver on
    another host's node took the head's node and advertised the head's address as its own, which nothing of the
    driver listens on. Objects it owns were then out of reach: every RDT read of its weights waited without end."""
    local = {entry.address.split("%", 1)[0] for entries in psutil.net_if_addrs().values() for entry in entries}
    found = set()
    for process in psutil.process_iter(["name", "cmdline"]):
        if process.info["name"] != "raylet":
            continue
        for arg in process.info["cmdline"] or []:
            flag, _, value = arg.partition("=")
            if flag == "--node_ip_address" and value in local and not ipaddress.ip_address(value).is_loopback:
                found.add(value)
    return found.pop() if len(found) == 1 else None


JOIN_PROBE_TIMEOUT_S = 10.0
"""How long the head's port may take to accept a connection before joining is given up (``ray.init`` itself waits
for an absent GCS without end)."""


def _check_listening(address: str, source: str) -> None:
    host, port = split_address(address)
    try:
        socket.create_connection((host, port), timeout=JOIN_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise WorkerError(
            f"cannot join the Ray cluster at {address} ({source}): nothing accepts connections there "
            f"({type(exc).__name__}: {exc}); start its head with `ray start --head --port {port}` or fix the address"
        ) from None


def _join_failure(exc: BaseException) -> str:
    """Why ``ray.init`` could not join, and what to do: Ray reports a refused token as text in a RuntimeError
    under its ConnectionError."""
    chain = []
    while exc is not None and len(chain) < 5:
        chain.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    if any("InvalidAuthToken" in text or "AuthenticationError" in text for text in chain):
        return (
            "the cluster refused this driver's authentication token. A cluster with token authentication needs "
            "RAY_AUTH_MODE=token here (Ray sends no token to an explicit address otherwise) and the cluster's "
            "token in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token"
        )
    return f"{chain[0][:600]}; is a Ray head node (`ray start --head`) listening there?"


KEPT_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


@contextlib.contextmanager
def keep_signal_handlers():
    """While Ray starts in this process: its core worker installs handlers of its own (SIGTERM: print a stack and
    abort), which would replace the driver's clean stop (``miles_core.cli.stop_signals``); the handlers in place
    before are installed again afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in KEPT_SIGNALS}
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            for sig, handler in saved.items():
                if handler is not None:
                    signal.signal(sig, handler)


@contextlib.contextmanager
def loopback_node_address():
    """While a local Ray starts: Ray turns a node address of 127.0.0.1 into the machine's routable address (and
    its servers bind the node address) unless clusters are switched off, as they are by default on macOS and
    Windows. Its constant is read at import in this process, and from the environment in the processes it
    starts (GCS, raylet, agents, workers: they inherit it)."""
    saved_env, saved_constant = os.environ.get(CLUSTER_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[CLUSTER_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_constant
        if saved_env is None:
            os.environ.pop(CLUSTER_ENV, None)
        else:
            os.environ[CLUSTER_ENV] = saved_env


AUTH_MODE_ENV_VAR = "RAY_AUTH_MODE"
"""Ray's authentication mode: ``token`` or ``disabled``; unset, Ray turns tokens on for a new local Ray and warns."""
TOKEN_ENV_VARS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
"""Where Ray looks for a token before its file ``~/.ray/auth_token``, in this order."""


def local_token_auth() -> None:
    """Before a local Ray starts: token authentication set explicitly, so Ray prints no warning (it warns only when
    it turns authentication on by itself, mode unset), with one token for this process.

    ``RAY_AUTH_MODE=token``, and unless a token is given (``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``), a fresh
    one in ``RAY_AUTH_TOKEN``; nothing is written to ``~/.ray``. Both stay in this process's environment, as Ray
    leaves ``RAY_AUTH_MODE`` after its own default start: Ray loads a token once per process and keeps it, so every
    Ray this process starts later (by Miles or with Ray's own API) must get that same token, and the processes a Ray
    starts (GCS, raylet, workers) read it from the environment they inherit. A ``RAY_AUTH_MODE`` other than
    ``token`` (``disabled``) is the user's choice and is left as it is."""
    if os.environ.get(AUTH_MODE_ENV_VAR, "token").lower() != "token":
        return
    os.environ[AUTH_MODE_ENV_VAR] = "token"
    if not any(os.environ.get(name) for name in TOKEN_ENV_VARS):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # 256 bits, as Ray makes its own
    reload_token_auth()


def reload_token_auth() -> None:
    """Make this process's Ray read its authentication settings again: its config (read at import, so a mode set
    since is not seen otherwise) and the token it keeps once loaded. The config first, as Ray's own tests do."""
    RayConfig.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def check_cluster_offers(bundle: Mapping[str, float], *, count: int, names: str) -> None:
    """Fail at once, naming the resource, when the cluster's nodes together cannot hold ``count`` bundles of the
    custom resources in ``bundle`` (a placement group would wait for them forever)."""
    offered = ray.cluster_resources()
    for name, amount in bundle.items():
        if name in ("CPU", "GPU"):
            continue  # the placement timeout reports these with the cluster's free resources
        if offered.get(name, 0.0) + 1e-9 < amount * count:
            custom = {key: value for key, value in _node_resources(offered).items() if _is_custom(key)}
            raise WorkerStartError(
                f"cannot place {_workers(count)} ({names}): each asks for {amount:g} of the custom resource {name!r}, "
                f"{amount * count:g} in all, and the cluster's nodes offer {offered.get(name, 0.0):g}; start nodes "
                f"with --resources='{{\"{name}\": N}}' or change run.ray_*_resources (custom resources offered: "
                f"{custom or 'none'}; a node whose Ray started without the cluster's token never joins: `ray start` "
                "on it says InvalidAuthToken)"
            )


_GROUP_RESOURCE = re.compile(r"_group_(\d+_)?[0-9a-f]{36}$")
"""What Ray appends to a resource's name for the share that a placement group (or one bundle of it) holds."""


def _node_resources(resources: Mapping[str, float]) -> dict[str, float]:
    """``resources`` without the shares that placement groups hold (Ray lists each under a name of its own), sorted."""
    return {name: amount for name, amount in sorted(resources.items()) if not _GROUP_RESOURCE.search(name)}


def _is_custom(resource: str) -> bool:
    return resource not in RESERVED_RESOURCES and not resource.startswith(("node:", "accelerator_type:"))


def _workers(count: int) -> str:
    return f"{count} worker{'s' if count != 1 else ''}"


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def placement_order(slot: _Slot) -> tuple:
    """Node address, then first device id, then bundle index: the same workers land in the same order."""
    ip = tuple(int(part) if part.isdigit() else part for part in slot.location["node_ip"].split("."))
    gpus = slot.location.get("gpu_ids") or [""]
    return (ip, gpus[0].zfill(8), slot.bundle_index)
