"""The watchdog beside every supervised worker: the worker goes when the process that started it goes.

:class:`~miles_core.workers.process.SupervisedProcess` starts it beside each worker it starts, as
``python -P watchdog.py WATCHED_PID WATCHED_START WORKER_GROUP``. It watches the process that started the worker (the
``miles`` driver, or the Ray actor that hosts a command worker), known by its pid and start time so that a reused pid
is never mistaken for it: when that process is gone, however it went (``kill -9``, the OOM killer, a lost node), the
watchdog stops the worker's process group and everything descended from it (SIGTERM, then SIGKILL after
:data:`GRACE_S`), and removes the shared-memory files that dead processes of Miles left (:func:`remove_dead_files`:
the driver's among them, which nothing else would remove). It ends by itself when the worker's group is empty, and on
SIGTERM (how a provider's clean stop ends it).

It detaches from its starter at once (a second fork; it prints its pid for the starter): a Ray worker process kills
its direct children when it exits, before a child could clean up. A parent-death signal (``PR_SET_PDEATHSIG``) is not
used: it fires when the *thread* that started the child exits, and workers are started from worker threads (an event
loop in a thread, ``asyncio.to_thread``).

Stdlib only, and run by path rather than as a module of the ``miles_core`` package: it starts in milliseconds and
holds a few MB, one per worker.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

POLL_S = 0.5
"""How often the parent and the worker's group are checked: a dead driver's workers get SIGTERM within this."""
GRACE_S = 3.0
"""How long the worker's processes have to exit after SIGTERM before SIGKILL."""
SHARED_FILE = re.compile(r"^miles-[a-z]+(?:-[a-z]+)*-(\d+)-")
"""A shared-memory file (or directory) of Miles: ``miles-<kind>-<pid of its maker>-...`` (staging files, send
buffers, export directories); one whose maker is gone is an orphan."""
STAGING_DIR_ENV = "MILES_WEIGHT_STAGING_DIR"  # as miles_core.engines.staging names it (not imported: stdlib only)


def main(argv: list[str]) -> int:
    """``WATCHED_PID WATCHED_START GROUP`` (a worker's process group) or ``WATCHED_PID WATCHED_START tree:PID,...``
    (processes that are no group of their own, such as a local Ray's GCS and raylet in the driver's group: they and
    their descendants, followed while they live, since a descendant whose parent dies first is re-parented)."""
    watched, watched_start, target = int(argv[1]), int(argv[2]), argv[3]
    child = os.fork()
    if child:  # the starter reads the watchdog's pid, and reaps this process at once
        print(child, flush=True)
        os._exit(0)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the starter's pipe closes with the first process
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop)
    if target.startswith("tree:"):
        follow = Tree([int(pid) for pid in target[len("tree:") :].split(",") if pid])
    else:
        follow = Group(int(target))
    while follow.alive():
        if start_time(watched) != watched_start:  # gone (or a zombie, or its pid reused)
            for sig in STOP_SIGNALS:  # the cleanup is not cut short
                signal.signal(sig, signal.SIG_IGN)
            stop_all(follow)
            remove_dead_files()
            return 0
        time.sleep(POLL_S)
    return 0


class Group:
    """A worker's process group (its session): its members and all their descendants."""

    def __init__(self, group: int) -> None:
        self.group = group

    def alive(self) -> bool:
        return group_alive(self.group)

    def processes(self) -> set[int]:
        return group_and_descendants(self.group)


class Tree:
    """Processes known by pid and their descendants, each remembered with its start time while it lives."""

    def __init__(self, roots: list[int]) -> None:
        self.known = {pid: start for pid in roots if (start := start_time(pid)) is not None}

    def alive(self) -> bool:
        self.known = {pid: start for pid, start in self.known.items() if start_time(pid) == start}
        parents = {pid: ppid for pid, ppid, _group in _processes()}
        for pid in descendants(set(self.known), parents) - set(self.known):
            if (start := start_time(pid)) is not None:
                self.known[pid] = start
        return bool(self.known)

    def processes(self) -> set[int]:
        return {pid for pid, start in self.known.items() if start_time(pid) == start}


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _stop(_signum: int, _frame: object) -> None:
    raise SystemExit(0)


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, as ``/proc/PID/stat`` says); ``None`` when it is gone or a
    zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return None if fields[0] in "ZX" else int(fields[19])


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member that is not ours: the group exists
        return True
    return True


def stop_all(follow: Group | Tree) -> None:
    """SIGTERM the followed processes, SIGKILL what is left of them (and what they started meanwhile) after
    :data:`GRACE_S`."""
    pids = follow.processes()
    signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.05)
    signal_all(pids | follow.processes(), signal.SIGKILL)


def signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def group_and_descendants(group: int) -> set[int]:
    """The pids of the group's members and of all their descendants, from ``/proc``."""
    table = _processes()
    members = {pid for pid, _ppid, pgrp in table if pgrp == group}
    return descendants(members, {pid: ppid for pid, ppid, _group in table}) - {os.getpid()}


def descendants(roots: set[int], parents: dict[int, int]) -> set[int]:
    """``roots`` and every process descended from them (``parents``: pid to parent pid)."""
    found = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in found and pid not in found:
                found.add(pid)
                grew = True
    return found


def _processes() -> list[tuple[int, int, int]]:
    """(pid, ppid, process group) of every process."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
        found.append((int(entry), int(fields[1]), int(fields[2])))
    return found


def _running(pid: int) -> bool:
    return start_time(pid) is not None


def remove_dead_files() -> list[Path]:
    """Remove this user's Miles shared-memory files (:data:`SHARED_FILE`) whose maker is gone, in ``/dev/shm`` and
    the weight-staging directory; returns what it removed."""
    staging = os.environ.get(STAGING_DIR_ENV) or f"/dev/shm/miles-staging-{os.getuid()}"
    removed = []
    for directory in {Path("/dev/shm"), Path(staging)}:
        with contextlib.suppress(OSError):
            for path in directory.iterdir():
                match = SHARED_FILE.match(path.name)
                if match is None or _running(int(match.group(1))):  # a zombie maker (not reaped yet) is gone
                    continue
                with contextlib.suppress(OSError):
                    if path.lstat().st_uid != os.getuid():
                        continue
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink()
                    removed.append(path)
    return removed


if __name__ == "__main__":
    sys.exit(main(sys.argv))
