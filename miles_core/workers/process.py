"""Starting, watching and killing local processes (and their whole process trees)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import BinaryIO

import psutil

from miles_core.workers.node import node_address
from miles_core.workers.watchdog import start_time

LOG_TAIL_BYTES = 4096


PORT_FLOOR = 10000
"""The lowest port :func:`free_ports` hands out (below it sit well-known and registered services' ports)."""

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORT_ATTEMPTS = 3
"""How many times a provider starts a command worker on fresh ports when another process took one of its ports."""

ADDRESS_IN_USE = "address already in use"
"""How a bind that found its port taken reads in a worker's log (the text of ``EADDRINUSE`` on Linux, in Python,
uvicorn, Rust and C alike; compared lowercased)."""


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (``ip_local_port_range``; Linux's default where it cannot be read): the
    ports the kernel gives outgoing connections and ``bind(port 0)``."""
    try:
        low, high = map(int, EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_ports(count: int, host: str | None = None) -> list[int]:
    """``count`` distinct ports that are free on ``host`` (a name, an IPv4 or an IPv6 address; default: this node's
    address) right now (all held open until all are chosen).

    They come from below the kernel's ephemeral range where there is room (:data:`PORT_FLOOR` up to it): a worker
    binds its port seconds after this choice (a real SGLang server about 10 s), and a port of the ephemeral range may
    meanwhile become the local end of any outgoing connection on the machine (seen in CI: a server's port taken during
    its start-up). Ports of the ephemeral range are the fallback where it leaves no room below it."""
    host = host or node_address()
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    low, _high = ephemeral_port_range()
    candidates = list(range(PORT_FLOOR, low)) if low - PORT_FLOOR >= 1000 else []
    random.shuffle(candidates)
    sockets: list[socket.socket] = []
    try:
        for port in [*candidates, *[0] * count]:
            if len(sockets) == count:
                break
            sock = socket.socket(family, kind, proto)
            try:
                sock.bind((address[0], port, *address[2:]))
            except OSError:
                sock.close()
                continue
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` and on no other address (``host`` a name or an IPv4/IPv6 address):
    the one way every Miles server binds (the local engine, the RPC server, the dashboard, the Prometheus endpoint,
    the distributed store). Accepted connections get ``TCP_NODELAY`` from asyncio."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def log_tail(path: str | Path | None, max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last ``max_bytes`` of a log file, or a note when there is none."""
    if path is None:
        return "(no log file)"
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - max_bytes))
            return log.read().decode(errors="replace")
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"


def open_private_log(path: Path) -> BinaryIO:
    """``path`` for appending, readable by its owner alone: a worker may print secrets there (SGLang prints its
    server arguments, the admin key among them)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    os.fchmod(descriptor, 0o600)  # a log left by an earlier run keeps its mode otherwise
    return os.fdopen(descriptor, "ab")


WATCHDOG = Path(__file__).with_name("watchdog.py")
"""The watchdog started beside each supervised process (see :mod:`miles_core.workers.watchdog`)."""


class SupervisedProcess:
    """A child process in its own session, its output in a log file; :meth:`stop` kills its whole tree. A watchdog
    beside it stops that tree when this process goes without stopping it (``kill -9``): workers never outlive their
    driver."""

    def __init__(
        self, argv: list[str], *, env: Mapping[str, str], log_file: str | Path, cwd: str | None = None
    ) -> None:
        self.argv = list(argv)
        self.log_file = Path(log_file)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open_private_log(self.log_file) as log:
            self.log_offset = log.tell()  # where this process's output starts (a restart appends to the same log)
            self.popen = subprocess.Popen(
                self.argv,
                env=dict(env),
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.watchdog = Watchdog.start_for(self.popen.pid)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exit_code(self) -> int | None:
        return self.popen.poll()

    def tree_pids(self) -> list[int]:
        """The pids of the process and all its descendants (alive ones)."""
        try:
            root = psutil.Process(self.pid)
            return [self.pid, *(child.pid for child in root.children(recursive=True))]
        except psutil.NoSuchProcess:
            return []

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the process only (fault injection)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the whole tree, SIGKILL what is left after ``grace_s``, and reap the child."""
        kill_tree(self.tree_pids(), grace_s=grace_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=grace_s)
        self.watchdog.stop()

    def found_port_taken(self) -> bool:
        """Whether this process's log says a bind found its address in use (another process took a port between
        :func:`free_ports` and the bind; the worker may hang rather than exit, as SGLang's server does)."""
        try:
            with open(self.log_file, "rb") as log:
                log.seek(max(self.log_offset, os.fstat(log.fileno()).st_size - LOG_TAIL_BYTES))
                return ADDRESS_IN_USE in log.read().decode(errors="replace").lower()
        except OSError:
            return False

    def describe(self) -> str:
        return f"pid {self.pid}, command {' '.join(redacted(self.argv))!r}, log {self.log_file}"


@dataclasses.dataclass(frozen=True)
class Watchdog:
    """The watchdog of a supervised process (see :mod:`miles_core.workers.watchdog`), known by pid and start time."""

    pid: int
    start: int | None

    @classmethod
    def start_for(cls, group: int | None = None, *, trees: Iterable[int] = ()) -> Watchdog:
        """Start the watchdog of the process group ``group`` (a supervised process's session), or of the processes
        ``trees`` and their descendants: it stops them when this process is gone. ``-P``: the watchdog's folder
        (``miles_core/workers``) is not on its import path."""
        target = str(group) if group is not None else "tree:" + ",".join(map(str, trees))
        first = subprocess.Popen(
            [sys.executable, "-P", str(WATCHDOG), str(os.getpid()), str(start_time(os.getpid())), target],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C at the driver's terminal reaches the driver, not the watchdog
        )
        with first.stdout:
            pid = int(first.stdout.readline() or 0)
        first.wait()
        return cls(pid=pid, start=start_time(pid) if pid else None)

    def stop(self) -> None:
        if self.start is not None and start_time(self.pid) == self.start:  # never a process that reused its pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)


SECRET_FLAG_WORDS = frozenset({"key", "keys", "token", "password", "passwd", "secret"})
"""A flag whose name ends in one of these words takes a secret (``--admin-api-key``, ``--control-plane-api-keys``);
``--max-total-tokens`` and ``--skip-tokenizer-init`` do not."""


def redacted(argv: list[str]) -> list[str]:
    """``argv`` with the value of each flag that takes a secret (:data:`SECRET_FLAG_WORDS`) replaced by ``***``, in
    either form (``--api-key VALUE``, ``--api-key=VALUE``), for messages."""
    shown: list[str] = []
    for index, arg in enumerate(argv):
        flag, equals, _ = arg.partition("=")
        if arg.startswith("--") and equals and _takes_secret(flag):
            shown.append(f"{flag}=***")
        elif index and _takes_secret(argv[index - 1]) and not arg.startswith("--"):
            shown.append("***")
        else:
            shown.append(arg)
    return shown


def _takes_secret(flag: str) -> bool:
    return (
        flag.startswith("--")
        and "=" not in flag
        and flag[2:].lower().replace("_", "-").split("-")[-1] in SECRET_FLAG_WORDS
    )


def kill_tree(pids: Iterable[int], *, grace_s: float = 5.0) -> None:
    """Terminate ``pids`` (a process tree), then kill the survivors."""
    processes = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            processes.append(psutil.Process(pid))
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def wait_until(predicate, *, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passed; return its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
