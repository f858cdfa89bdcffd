"""The guard of CI's time budget: the list of long serial tests is capped, each entry names a serial test that exists
and says why it needs its time, and the guard flags exactly the long tests that no entry covers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.ci_budget import (
    LONG_SERIAL_TESTS,
    LONG_TEST_S,
    MAX_LONG_SERIAL_TESTS,
    machine_slowness,
    unlisted_long_tests,
)
from tests.conftest import REPO, SERIAL_TESTS, with_pythonpath


def collected_node_ids() -> set[str]:
    """Every test id of the serial paths, collected as pytest sees them (parametrisations included)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *SERIAL_PATHS],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {line for line in result.stdout.splitlines() if "::" in line}


SERIAL_PATHS = sorted(
    {prefix if prefix.endswith((".py", "/")) else prefix.rsplit("/", 1)[0] for prefix in SERIAL_TESTS}
)


def test_the_list_of_long_tests_is_capped_and_each_entry_gives_its_reason() -> None:
    assert len(LONG_SERIAL_TESTS) <= MAX_LONG_SERIAL_TESTS, (
        f"{len(LONG_SERIAL_TESTS)} long serial tests listed, at most {MAX_LONG_SERIAL_TESTS}: make one cheaper"
    )
    for nodeid, reason in LONG_SERIAL_TESTS.items():
        assert len(reason.split()) >= 4, f"{nodeid}: say why it needs over {LONG_TEST_S:.0f} s"


def test_each_listed_entry_names_a_serial_test_that_exists() -> None:
    collected = collected_node_ids()
    functions = {nodeid.split("[", 1)[0] for nodeid in collected}
    for nodeid in LONG_SERIAL_TESTS:
        assert nodeid.startswith(SERIAL_TESTS), f"{nodeid} is not in the serial pass (tests/conftest.py)"
        assert nodeid in collected or nodeid in functions, f"{nodeid} names no test"


def test_the_guard_flags_the_long_tests_no_entry_covers_slowest_first() -> None:
    listed = next(iter(LONG_SERIAL_TESTS), None)
    durations = {
        "tests/test_train.py::test_new_and_slow": LONG_TEST_S + 30,
        "tests/test_train.py::test_new_and_slower[a]": LONG_TEST_S + 90,
        "tests/test_train.py::test_quick": LONG_TEST_S - 1,
    }
    if listed is not None:  # a listed function covers each of its parametrisations
        durations[f"{listed}[x]" if "[" not in listed else listed] = LONG_TEST_S * 10
    assert list(unlisted_long_tests(durations)) == [
        "tests/test_train.py::test_new_and_slower[a]",
        "tests/test_train.py::test_new_and_slow",
    ]


def test_the_limit_follows_the_machines_measured_slowness() -> None:
    """On a machine twice as slow a test of 1.5 limits is within its limit; on the reference machine it is not."""
    durations = {"tests/test_train.py::test_new": LONG_TEST_S * 1.5}
    assert list(unlisted_long_tests(durations, slowness=1.0)) == ["tests/test_train.py::test_new"]
    assert unlisted_long_tests(durations, slowness=2.0) == {}


def test_the_machines_slowness_is_measured_never_below_one() -> None:
    slowness = machine_slowness(samples=3)
    assert 1.0 <= slowness < 100.0, slowness


def test_the_serial_pass_fails_at_its_end_naming_an_unlisted_long_test(tmp_path) -> None:
    """A real pytest session (the limit lowered to 0.2 s for it): a serial test that sleeps 0.5 s fails the session,
    though the test itself passed, and the summary names it; the same sleep outside the serial pass does not."""
    (tmp_path / "conftest.py").write_text(
        "import pytest\n"
        "import tests.ci_budget as budget\n"
        "budget.LONG_TEST_S = 0.2\n"
        "budget.machine_slowness = lambda: 1.0\n"
        'pytest_plugins = ["tests.ci_budget"]\n'
        "def pytest_collection_modifyitems(items):\n"
        "    for item in items:\n"
        "        item.add_marker(pytest.mark.serial)\n"
    )
    (tmp_path / "test_sleepy.py").write_text("import time\n\ndef test_sleepy():\n    time.sleep(0.5)\n")
    env = {**os.environ, **with_pythonpath(REPO)}

    def session(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
        return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120, check=False)

    guarded = session("-m", "serial")
    assert guarded.returncode == pytest.ExitCode.TESTS_FAILED, guarded.stdout
    assert "1 passed" in guarded.stdout
    assert "CI budget" in guarded.stdout and "test_sleepy.py::test_sleepy" in guarded.stdout
    unguarded = session()
    assert unguarded.returncode == pytest.ExitCode.OK, unguarded.stdout


def test_a_paired_pass_allows_each_test_its_share_of_the_machine() -> None:
    """Two tests at a time: each may take twice the limit before it must be listed, and the passes are guarded by the
    -m expressions the Makefile gives them."""
    from tests.ci_budget import GUARDED_PASSES, SerialBudget

    budget = SerialBudget(sharing=GUARDED_PASSES["serial and paired"])
    budget.slowness = 1.0  # as measured on the reference machine
    durations = {"tests/test_train.py::test_new": LONG_TEST_S * 1.5}
    assert unlisted_long_tests(durations, budget.measured_slowness()) == {}
    assert list(unlisted_long_tests(durations, SerialBudget(GUARDED_PASSES["serial and not paired"]).sharing)) == [
        "tests/test_train.py::test_new"
    ]
    makefile = (REPO / "Makefile").read_text()
    for expression in ("serial and paired", "serial and not paired"):
        assert f'-m "{expression}"' in makefile, expression
