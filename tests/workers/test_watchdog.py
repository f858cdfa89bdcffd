"""The watchdog beside each supervised worker: the worker's whole tree (a descendant in a session of its own too) and
the dead processes' shared-memory files go when the process that started the worker is killed; a clean stop ends the
watchdog too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

from miles_core.workers.process import SupervisedProcess, wait_until
from miles_core.workers.watchdog import GRACE_S, POLL_S

STARTER = """
import os, sys, time
from miles_core.workers.process import SupervisedProcess
worker = SupervisedProcess(["sh", "-c", "setsid sleep 300 & sleep 300"], env=os.environ, log_file=sys.argv[1])
open(os.path.join(os.environ["MILES_WEIGHT_STAGING_DIR"], f"miles-test-{os.getpid()}-bucket"), "w").close()
print(worker.pid, worker.watchdog.pid, flush=True)
time.sleep(300)
"""
GONE_WITHIN_S = POLL_S + GRACE_S + 5.0  # a poll, the grace after SIGTERM, and a loaded machine's slack


def test_kill_9_of_the_starter_stops_the_worker_tree_and_removes_the_dead_processes_files(tmp_path: Path) -> None:
    env = {**os.environ, "MILES_WEIGHT_STAGING_DIR": str(tmp_path)}
    kept = tmp_path / f"miles-test-{os.getpid()}-bucket"  # this process is alive: its file stays
    kept.touch()
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(tmp_path / "worker.log")], stdout=subprocess.PIPE, text=True, env=env
    )
    tree: list[psutil.Process] = []
    try:
        worker_pid, watchdog_pid = map(int, starter.stdout.readline().split())
        worker = psutil.Process(worker_pid)
        assert wait_until(lambda: len(worker.children(recursive=True)) == 2, timeout_s=10)
        tree = [worker, *worker.children(recursive=True)]
        assert len({os.getsid(process.pid) for process in tree}) == 2  # the setsid'd sleep has a session of its own
        starter.kill()
        starter.wait()
        assert wait_until(lambda: not any(_running(p) for p in tree), timeout_s=GONE_WITHIN_S), "the tree outlived it"
        assert wait_until(lambda: not _running_pid(watchdog_pid), timeout_s=5), "the watchdog did not end"
        assert sorted(tmp_path.glob("miles-test-*")) == [kept]  # the killed starter's file is gone
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        for process in tree:
            if _running(process):
                process.kill()


def test_a_clean_stop_ends_the_watchdog(tmp_path: Path) -> None:
    worker = SupervisedProcess(["sleep", "300"], env=os.environ, log_file=tmp_path / "worker.log")
    try:
        assert _running_pid(worker.watchdog.pid)
    finally:
        worker.stop()
    assert not worker.is_alive()
    assert wait_until(lambda: not _running_pid(worker.watchdog.pid), timeout_s=5)


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _running_pid(pid: int) -> bool:
    try:
        return _running(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False
