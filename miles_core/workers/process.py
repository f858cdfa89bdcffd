"""Starting, watching and killing local processes (and their whole process trees)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import BinaryIO

import psutil

from miles_core.workers.node import node_address

LOG_TAIL_BYTES = 4096


def free_ports(count: int, host: str | None = None) -> list[int]:
    """``count`` distinct ports that are free on ``host`` (a name, an IPv4 or an IPv6 address; default: this node's
    address) right now (all held open until all are chosen)."""
    host = host or node_address()
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.bind(address)
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


class SupervisedProcess:
    """A child process in its own session, its output in a log file; :meth:`stop` kills its whole tree."""

    def __init__(
        self, argv: list[str], *, env: Mapping[str, str], log_file: str | Path, cwd: str | None = None
    ) -> None:
        self.argv = list(argv)
        self.log_file = Path(log_file)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open_private_log(self.log_file) as log:
            self.popen = subprocess.Popen(
                self.argv,
                env=dict(env),
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

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

    def describe(self) -> str:
        return f"pid {self.pid}, command {' '.join(redacted(self.argv))!r}, log {self.log_file}"


def redacted(argv: list[str]) -> list[str]:
    """``argv`` with the value after a flag naming a key, token or password replaced by ``***`` (for messages)."""
    secret_flag = ("key", "token", "password", "secret")
    return [
        "***"
        if index and argv[index - 1].startswith("--") and any(word in argv[index - 1].lower() for word in secret_flag)
        else arg
        for index, arg in enumerate(argv)
    ]


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
