"""Shared-memory files of a process killed before it removed them (SIGKILL, the OOM killer): the next maker of such
files removes them. A CI run stopped with SIGKILL left rdt buckets in ``/dev/shm`` that every later rdt test found."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from miles_plugins_rdt.receiver import RECEIVE_PREFIX
from miles_plugins_rdt.sender import SEND_PREFIX, SHM_DIR, new_send_bucket

from miles_core import remove_orphan_files


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_this_users_files_of_gone_processes_are_removed(tmp_path: Path) -> None:
    gone = dead_pid()
    orphan = tmp_path / f"{RECEIVE_PREFIX}{gone}-abc"
    alive = tmp_path / f"{RECEIVE_PREFIX}{os.getpid()}-abc"
    not_a_pid = tmp_path / f"{RECEIVE_PREFIX}send-{gone}-abc"  # another kind's name under the same prefix
    other_prefix = tmp_path / f"other-{gone}-abc"
    for path in (orphan, alive, not_a_pid, other_prefix):
        path.write_bytes(b"x")
    assert remove_orphan_files(tmp_path, RECEIVE_PREFIX) == [orphan]
    assert not orphan.exists() and alive.exists() and not_a_pid.exists() and other_prefix.exists()
    assert remove_orphan_files(tmp_path, RECEIVE_PREFIX) == []


def test_a_new_send_bucket_removes_a_dead_trainers_buckets() -> None:
    left = SHM_DIR / f"{SEND_PREFIX}{dead_pid()}-left-by-a-killed-trainer"
    left.write_bytes(b"\0" * 4096)
    path, bucket = new_send_bucket(4096)
    try:
        assert not left.exists() and path.exists() and bucket.numel() == 4096
    finally:
        del bucket
        path.unlink(missing_ok=True)
        left.unlink(missing_ok=True)
