"""``miles dashboard RUN_DIR``: serves a finished run; a missing directory, a directory without a database, a
corrupt database, a taken port and bad flags are clear errors with exit status 2, never a traceback."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
from pathlib import Path

import pytest

from miles_core.builtin.dashboard.store import DashboardStore
from tests.conftest import MILES, config_json, run_miles
from tests.dashboard.conftest import FinishedRun, get_json


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop", "start"),
    [(signal.SIGINT, None), (signal.SIGTERM, None), (signal.SIGINT, ignore_sigint)],
    ids=["sigint", "sigterm", "sigint-inherited-ignored"],  # the last: a background job of a script, as in CI
)
def test_serves_a_finished_run(finished_run: FinishedRun, stop: signal.Signals, start) -> None:
    process = subprocess.Popen(
        [str(MILES), "dashboard", str(finished_run.run_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=start,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    try:
        line = process.stdout.readline()
        assert line.startswith(f"miles: dashboard of {finished_run.run_dir} at http://127.0.0.1:"), line
        url = line.split(" at ", 1)[1].split()[0]
        assert get_json(url + "api/run")[1]["status"] == "finished"
    finally:
        os.kill(process.pid, stop)
        stopped_within_timeout(process, 30)
    assert process.returncode == 0
    assert "Traceback" not in process.stderr.read()


def stopped_within_timeout(process: subprocess.Popen, timeout_s: float) -> None:
    """Wait for ``process``; one that hangs is aborted, and the failure shows where each of its threads stood
    (``PYTHONFAULTHANDLER`` makes Python print every thread's stack on SIGABRT)."""
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGABRT)
        process.wait(timeout=30)
        pytest.fail(
            f"miles dashboard did not stop within {timeout_s} s of the stop signal; its stacks:\n"
            f"{process.stderr.read()[-6000:]}"
        )


def error_of(*args: str) -> str:
    result = run_miles("dashboard", *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return result.stderr


def test_missing_run_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    assert error_of(str(missing)) == (
        f"miles: error: run directory {str(missing)!r} does not exist (give the "
        "--output-dir of a run, e.g. runs/latest)\n"
    )


def test_a_file_instead_of_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in error_of(str(tmp_path / "file"))


def test_directory_without_a_database(tmp_path: Path) -> None:
    assert "holds no dashboard database (dashboard.sqlite)" in error_of(str(tmp_path))


@pytest.mark.parametrize("content", [b"this is not sqlite at all\n" * 100, b"", b"SQLite format 3\x00" + b"\xff" * 500])
def test_corrupt_database(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "dashboard.sqlite").write_bytes(content)
    message = error_of(str(tmp_path))
    assert message.startswith(
        f"miles: error: {str(tmp_path / 'dashboard.sqlite')!r} is not a readable dashboard database ("
    ), message
    assert message.endswith("move it aside or open another run directory\n")


def test_foreign_sqlite_database(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "dashboard.sqlite") as db:
        db.execute("CREATE TABLE other (x)")
    assert "is not a readable dashboard database (no such table: meta)" in error_of(str(tmp_path))


def test_port_in_use(tmp_path: Path) -> None:
    DashboardStore(tmp_path).close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert f"cannot serve the dashboard on 127.0.0.1:{port}" in error_of(str(tmp_path), "--port", str(port))


def test_bad_port_flag(tmp_path: Path) -> None:
    assert "'70000' is not a port (0..65535; 0 picks a free one)" in error_of(str(tmp_path), "--port", "70000")


def test_the_dashboard_flag() -> None:
    assert config_json("--dashboard")["dashboard"] == {
        "record": True,
        "serve": True,
        "host": "127.0.0.1",
        "port": 0,
        "warn_interval_s": 60.0,
    }
    assert config_json("--dashboard", "false", "--dashboard-port", "8123")["dashboard"]["serve"] is False
    result = run_miles("config", "show", "--dashboard", "--dashboard-record", "false")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "dashboard.serve (--dashboard) = True needs dashboard.record = True" in result.stderr
