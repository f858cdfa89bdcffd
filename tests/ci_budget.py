"""CI's time budget, guarded: a serial test that runs over a minute must be listed here with its reason.

CI (``bash .ci/run``) must finish in 40 minutes on a 2-core machine, and the serial tests (``pytest -m "serial and
paired"``, two at a time, then ``pytest -m "serial and not paired"``, one at a time) are most of it. A new slow test
quietly added is how CI drifts towards its 90-minute cut, so each serial pass fails at its end when a test took longer
than :data:`LONG_TEST_S` (setup, call and teardown together; twice that in the paired pass, where two tests share the
machine) without an entry in :data:`LONG_SERIAL_TESTS`, and the list itself is capped (:data:`MAX_LONG_SERIAL_TESTS`,
checked by ``tests/test_ci_budget.py``): to add one, make another cheaper. The parallel pass is not guarded: its tests
overlap freely.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping

import pytest

LONG_TEST_S = 60.0
"""A serial test that takes longer than this (on a machine of :data:`REFERENCE_WORKLOAD_S`'s speed, scaled on a slower
one: :func:`machine_slowness`) must be listed in :data:`LONG_SERIAL_TESTS`."""

REFERENCE_WORKLOAD_S = 0.26
""":func:`time_workload` on a 2-core Xeon without AMX, the machine quiet: the median of seven timings (0.21 to
0.29 s)."""

MAX_LONG_SERIAL_TESTS = 14
"""How many tests may be listed: together they are about half of the serial pass."""

LONG_SERIAL_TESTS: dict[str, str] = {
    # A test function (every parametrisation) or one parametrisation, by its pytest node id: why it needs the time.
    # Listed: those that took over 35 s on a 2-core Xeon with AMX (a slower CI machine may take 1.5x), and those over
    # 45 s on a 2-core Xeon without AMX, where the default run over rdt went over the minute (46 s, then 61 s).
    "tests/cluster/test_sglang_across_hosts.py::"
    "test_the_default_run_learns_with_a_real_sglang_engine_on_another_host_through_rdt_chosen_by_auto": (
        "learning with a real SGLang engine across hosts: 110 steps (0.0 to 0.37 on one host; 0.2 asked)"
    ),
    "tests/cluster/test_sglang_across_hosts.py::"
    "test_real_sglang_engines_behind_the_router_on_another_host_take_every_version": (
        "two real SGLang servers and the real router started on another host (about 25 s each to start)"
    ),
    "tests/sglang/test_real_router.py::test_real_sglang_behind_the_router_spreads_and_survives_an_engine_death": (
        "three real SGLang starts (two engines, then the killed one again) behind the real router"
    ),
    "tests/megatron/test_megatron_train.py::test_the_megatron_trainer_learns_on_a_tiny_deepseek_v4_at_tp2": (
        "two Megatron ranks learn a tiny DeepSeek-V4 (49 to 51 s on a 2-core Xeon without AMX)"
    ),
    "tests/megatron/test_megatron_train.py::test_default_run_learns_with_megatron": (
        "two Megatron ranks learn the default task in its shortened run (45 to 48 s on a 2-core Xeon without AMX)"
    ),
    "tests/megatron/test_megatron_train.py::test_megatron_run_resumes_from_its_checkpoint": (
        "a Megatron run stopped, then resumed from its checkpoint to the end (44 to 48 s on a 2-core Xeon without AMX)"
    ),
    "tests/sglang/test_real_fully_async.py::test_fully_async_partial_rollouts_through_the_router": (
        "real SGLang servers behind the router, generations aborted and resumed across weight versions"
    ),
    "tests/cluster/test_node_loss.py::test_a_lost_engine_node_is_named_the_run_goes_on_and_the_engine_comes_back": (
        "a Ray node is lost and rejoins: Ray's own heartbeat timeouts decide when it is declared dead"
    ),
    "tests/cluster/test_learning_across_hosts.py::"
    "test_megatron_ranks_on_host_b_send_to_engines_on_host_c_learn_and_recover_a_killed_engine": (
        "Megatron ranks, engines and the driver on three hosts learn the MoE task; an engine is killed and restarted"
    ),
    "tests/test_train_lora.py::test_a_lora_run_learns_the_default_task_sending_only_the_adapter": (
        "a LoRA run learns the default task: 200 steps (a rank-16 adapter learns slower than full weights; 122 s on a "
        "loaded AMD EPYC)"
    ),
    "tests/cluster/test_exposure_across_hosts.py::test_the_ranks_router_and_engines_refuse_control_without_the_token": (
        "Megatron ranks on one host, a router and two engines on another, every server probed (67 s on an AMD EPYC)"
    ),
    "tests/cluster/test_exposure_across_hosts.py::"
    "test_an_agent_run_with_its_session_servers_on_another_host_trains_and_they_refuse_strangers": (
        "an agent run with engines and session servers on another host, every server probed (79 s on an AMD EPYC)"
    ),
}


def time_workload() -> float:
    """Seconds of a fixed piece of the tests' own work on one core: interpreted Python (the start-up and bookkeeping
    that most serial tests spend their time in) and small float32 matrix products (the tiny models' steps)."""
    import torch

    start = time.perf_counter()
    total = 0
    for number in range(3_000_000):
        total += number % 7
    with torch.inference_mode():
        matrix = torch.ones(256, 256)
        for _ in range(200):
            matrix = torch.tanh(matrix @ matrix * 0.01)
    return time.perf_counter() - start


def machine_slowness(samples: int = 5) -> float:
    """How much slower than the reference machine this one runs now (1.0 when as fast or faster): the median of a few
    timings of :func:`time_workload`, so one preempted sample does not decide it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        measured = statistics.median(time_workload() for _ in range(samples))
    finally:
        torch.set_num_threads(threads)
    return max(1.0, measured / REFERENCE_WORKLOAD_S)


def listed_reason(nodeid: str) -> str | None:
    """The reason a test may run long: its own entry, or its function's (without the parameters)."""
    return LONG_SERIAL_TESTS.get(nodeid) or LONG_SERIAL_TESTS.get(nodeid.split("[", 1)[0])


def unlisted_long_tests(durations: Mapping[str, float], slowness: float = 1.0) -> dict[str, float]:
    """The tests over :data:`LONG_TEST_S` (times ``slowness``) that no entry of :data:`LONG_SERIAL_TESTS` covers,
    slowest first."""
    limit = LONG_TEST_S * slowness
    over = {nodeid: seconds for nodeid, seconds in durations.items() if seconds > limit and not listed_reason(nodeid)}
    return dict(sorted(over.items(), key=lambda item: -item[1]))


GUARDED_PASSES: dict[str, int] = {"serial": 1, "serial and not paired": 1, "serial and paired": 2}
"""The passes guarded, by their ``-m`` expression, and how many tests run at once in each: a test's limit is
:data:`LONG_TEST_S` times that (and times the machine's slowness)."""


class SerialBudget:
    """Sums each serial test's setup, call and teardown; at the end, reports and fails the unlisted long ones."""

    def __init__(self, sharing: int = 1) -> None:
        self.durations: dict[str, float] = {}
        self.sharing = sharing
        self.slowness_at_start = 1.0
        self.slowness: float | None = None

    def pytest_sessionstart(self) -> None:
        self.slowness_at_start = machine_slowness()

    def measured_slowness(self) -> float:
        """The larger of the slowness measured as the pass started and as it ended (a machine slowed for part of the
        pass does not fail tests that a quiet one runs in time), times the tests that share the machine."""
        if self.slowness is None:
            self.slowness = max(self.slowness_at_start, machine_slowness())
        return self.slowness * self.sharing

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if "serial" in report.keywords:
            nodeid = report.nodeid.split("@", 1)[0]  # without the pytest-xdist group that --dist loadgroup appends
            self.durations[nodeid] = self.durations.get(nodeid, 0.0) + report.duration

    def pytest_terminal_summary(self, terminalreporter) -> None:
        slowness = self.measured_slowness()
        over = unlisted_long_tests(self.durations, slowness)
        terminalreporter.section("CI budget", red=bool(over), bold=bool(over))
        terminalreporter.line(
            f"serial pass ({self.sharing} at a time): its tests {sum(self.durations.values()):.0f} s together; this "
            f"machine {slowness / self.sharing:.2f}x the reference's time (tests/ci_budget.py), so the limit of an "
            f"unlisted test is {LONG_TEST_S * slowness:.0f} s"
        )
        if not over:
            return
        terminalreporter.line(
            f"serial tests over {LONG_TEST_S * slowness:.0f} s that tests/ci_budget.py does not list (make them "
            f"cheaper, or list one with its reason; the list holds at most {MAX_LONG_SERIAL_TESTS}):"
        )
        for nodeid, seconds in over.items():
            terminalreporter.line(f"  {seconds:7.1f} s  {nodeid}")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if unlisted_long_tests(self.durations, self.measured_slowness()) and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    # Only the serial passes are guarded, in the session that reports (not in a pytest-xdist worker).
    sharing = GUARDED_PASSES.get(config.getoption("markexpr", ""))
    if sharing is not None and not hasattr(config, "workerinput"):
        config.pluginmanager.register(SerialBudget(sharing), "miles-ci-budget")
