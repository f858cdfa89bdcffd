"""Workers do not outlive their driver: ``kill -9`` of ``miles train`` mid-step leaves no process of the run and no
shared-memory file of it after :data:`GONE_WITHIN_S`; SIGTERM stops the run as Ctrl-C does (the resume hint, exit
143). With the local provider, the Ray provider (a local Ray the run started) and a Megatron run at TP=2.

The run's processes are found by a marker in their environment, which every process the run starts inherits (its
workers, their watchdogs, the local Ray's GCS, raylet and workers): they are in sessions of their own, so the driver's
process group does not find them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_core.engines.staging import weight_staging_dir
from tests.conftest import MILES

pytestmark = pytest.mark.slow
QUICK = ["--no-progress", "--num-steps", "50", "--rollout-batch-size", "4", "--rollout-group-size", "4"]
QUICK += ["--run-eval-every", "0", "--run-checkpoint-every", "0"]
PROVIDERS = {"local": [], "ray": ["--run-worker-provider", "ray"]}
MEGATRON_TP2 = ["--trainer", "megatron", "--megatron-tensor-parallel", "2"]
GONE_WITHIN_S = 10.0
"""The issue's bound: a watchdog polls every 0.5 s and gives SIGTERM 3 s before SIGKILL."""
WATCHDOGS_END_WITHIN_S = 2.0
"""A watchdog sees its worker's group empty (or its local Ray gone) at its next poll, every 0.5 s."""
MARKER_ENV = "MILES_TEST_LIFECYCLE_RUN"
START_TIMEOUT_S = 240.0


class Run:
    """A ``miles train`` in a session of its own, marked in its environment."""

    def __init__(self, run_dir: Path, args: list[str]) -> None:
        self.marker = uuid.uuid4().hex
        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            [str(MILES), "train", "--output-dir", str(run_dir), *QUICK, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=run_dir.parent,
            env={**os.environ, MARKER_ENV: self.marker},
            start_new_session=True,
            preexec_fn=_default_signals,
        )

    def wait_for_step(self, step: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for line in self.proc.stdout:
            if line.startswith(f"step {step:4d}"):
                return
            assert time.monotonic() < deadline, f"no step {step} within {START_TIMEOUT_S:.0f} s"
        raise AssertionError(f"the run ended before step {step}: {self.proc.stderr.read()[-3000:]}")

    def processes(self) -> list[int]:
        """The run's live processes (zombies are gone: only their exit status is left for their parent)."""
        found = []
        needle = f"{MARKER_ENV}={self.marker}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0") and _state(entry) not in "ZX":
                    found.append(int(entry.name))
            except (OSError, ValueError):
                continue
        return found

    def kill_all(self) -> None:
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def start(tmp_path: Path) -> Iterator:
    runs: list[Run] = []

    def start_run(*args: str) -> Run:
        runs.append(Run(tmp_path / "run", list(args)))
        return runs[-1]

    yield start_run
    for run in runs:  # whatever the test saw, nothing it started stays
        run.kill_all()


def _default_signals() -> None:
    """Ctrl-C's default action in the child (a shell that starts pytest in the background ignores SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _state(proc_entry: Path) -> str:
    stat = (proc_entry / "stat").read_text()
    return stat[stat.rindex(")") + 2]


def shared_files(pids: list[int]) -> list[Path]:
    """The shared-memory files (and directories) made by ``pids``: Miles names them ``miles-<kind>-<pid>-...``."""
    pattern = re.compile(r"^miles-[a-z]+(?:-[a-z]+)*-(\d+)-")
    found = []
    for directory in (Path("/dev/shm"), weight_staging_dir()):
        for path in directory.iterdir() if directory.is_dir() else []:
            match = pattern.match(path.name)
            if match is not None and int(match.group(1)) in pids:
                found.append(path)
    return found


def gone_within(run: Run, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := run.processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def describe(pids: list[int]) -> str:
    lines = []
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        lines.append(f"{pid}: {command[:200].decode(errors='replace')}")
    return "\n".join(lines)


def assert_kill_9_leaves_nothing(run: Run) -> None:
    run.wait_for_step(1)
    pids = run.processes()
    assert len(pids) > 1, "the run started no worker"
    run.proc.kill()  # kill -9, mid-step: the next step is under way
    run.proc.wait()
    left = gone_within(run, GONE_WITHIN_S)
    assert left == [], f"processes of the run alive {GONE_WITHIN_S:.0f} s after kill -9:\n{describe(left)}"
    assert shared_files(pids) == [], "shared-memory files of the run left"


@pytest.mark.parametrize("provider", PROVIDERS)
def test_kill_9_of_the_driver_leaves_no_process_and_no_shared_memory(start, provider: str) -> None:
    assert_kill_9_leaves_nothing(start(*PROVIDERS[provider]))


def test_kill_9_of_a_megatron_tp2_driver_leaves_no_rank_and_no_engine(start) -> None:
    assert_kill_9_leaves_nothing(start(*MEGATRON_TP2))


@pytest.mark.parametrize("setting", [*PROVIDERS, "megatron_tp2"])
def test_sigterm_stops_the_run_cleanly_with_the_resume_hint(start, setting: str) -> None:
    run = start(*PROVIDERS.get(setting, MEGATRON_TP2))
    run.wait_for_step(1)
    pids = run.processes()
    run.proc.send_signal(signal.SIGTERM)
    _, stderr = run.proc.communicate(timeout=120)
    assert run.proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert f"miles: stopped by SIGTERM; the run is in {run.run_dir}" in stderr
    left = gone_within(run, WATCHDOGS_END_WITHIN_S)  # the workers are stopped; their watchdogs end by themselves
    assert left == [], f"processes of the run alive after it exited on SIGTERM:\n{describe(left)}"
    assert shared_files(pids) == [], "shared-memory files of the run left"


SECOND_SIGNAL = """
import time
from miles_core.cli.stop_signals import StopSignals

with StopSignals():
    try:
        print("ready", flush=True)
        time.sleep(60)
    except KeyboardInterrupt:
        print("stopping", flush=True)
        time.sleep(60)  # a clean stop that hangs
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_the_first_stop_signal_interrupts_and_a_second_exits_at_once(sig: int) -> None:
    proc = subprocess.Popen(
        [str(MILES.parent / "python"), "-c", SECOND_SIGNAL], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(sig)
        assert proc.stdout.readline() == "stopping\n"  # the first: KeyboardInterrupt, as Ctrl-C raises
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 128 + sig  # the second: at once, not after the hanging stop
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
