"""CI's time budget, guarded: a test of the serial pass that runs over a minute must be listed here with its reason.

CI (``bash .ci/run``) must finish in 40 minutes on a 2-core machine, and the serial pass (``pytest -m serial``: one
test at a time) is most of it. A new slow test quietly added is how CI drifts towards its 90-minute cut, so the serial
pass fails at its end when a test took longer than :data:`LONG_TEST_S` (setup, call and teardown together) without an
entry in :data:`LONG_SERIAL_TESTS`, and the list itself is capped (:data:`MAX_LONG_SERIAL_TESTS`, checked by
``tests/test_ci_budget.py``): to add one, make another cheaper. The parallel pass is not guarded: its tests overlap.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest

LONG_TEST_S = 60.0
"""A serial test that takes longer than this must be listed in :data:`LONG_SERIAL_TESTS`."""

MAX_LONG_SERIAL_TESTS = 14
"""How many tests may be listed: together they are about half of the serial pass."""

LONG_SERIAL_TESTS: dict[str, str] = {
    # A test function (every parametrisation) or one parametrisation, by its pytest node id: why it needs the time.
}


def listed_reason(nodeid: str) -> str | None:
    """The reason a test may run long: its own entry, or its function's (without the parameters)."""
    return LONG_SERIAL_TESTS.get(nodeid) or LONG_SERIAL_TESTS.get(nodeid.split("[", 1)[0])


def unlisted_long_tests(durations: Mapping[str, float]) -> dict[str, float]:
    """The tests over :data:`LONG_TEST_S` that no entry of :data:`LONG_SERIAL_TESTS` covers, slowest first."""
    over = {
        nodeid: seconds for nodeid, seconds in durations.items() if seconds > LONG_TEST_S and not listed_reason(nodeid)
    }
    return dict(sorted(over.items(), key=lambda item: -item[1]))


class SerialBudget:
    """Sums each serial test's setup, call and teardown; at the end, reports and fails the unlisted long ones."""

    def __init__(self) -> None:
        self.durations: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if "serial" in report.keywords:
            self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration

    def pytest_terminal_summary(self, terminalreporter) -> None:
        over = unlisted_long_tests(self.durations)
        if not over:
            return
        terminalreporter.section("CI budget", red=True, bold=True)
        terminalreporter.line(
            f"serial tests over {LONG_TEST_S:.0f} s that tests/ci_budget.py does not list (make them cheaper, or list "
            f"one with its reason; the list holds at most {MAX_LONG_SERIAL_TESTS}):"
        )
        for nodeid, seconds in over.items():
            terminalreporter.line(f"  {seconds:7.1f} s  {nodeid}")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if unlisted_long_tests(self.durations) and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    # Only the serial pass is guarded: with -m serial the session runs nothing else, one test at a time.
    if config.getoption("markexpr", "") == "serial":
        config.pluginmanager.register(SerialBudget(), "miles-ci-budget")
