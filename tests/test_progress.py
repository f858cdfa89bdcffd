"""Nothing silent: a wait over its grace says what it waits for, where its log is and how long it has waited; a
short wait prints nothing. Real threads and real time (waits of a second or less)."""

from __future__ import annotations

import re
import time

import pytest

from miles_core.progress import GRACE_ENV, GRACE_S, grace_s, notice, waiting_for


def test_a_long_wait_says_what_it_waits_for_its_log_and_the_time(capfd: pytest.CaptureFixture) -> None:
    with waiting_for("engine-0 to start", log="runs/latest/logs/engine-0.log", grace=0.2, every_s=0.3):
        time.sleep(1.0)  # blocks this thread, as ray.init does: the report comes from a thread of its own
    lines = capfd.readouterr().err.splitlines()
    waiting = [line for line in lines if line.startswith("miles: waiting for engine-0 to start")]
    assert len(waiting) >= 2, lines  # at 0.2 s, then every 0.3 s
    assert all(
        re.fullmatch(r"miles: waiting for engine-0 to start \(log: runs/latest/logs/engine-0.log\) \.\.\. \d+ s", line)
        for line in waiting
    ), waiting
    assert lines[-1] == "miles: engine-0 to start: done after 1 s"


def test_a_short_wait_prints_nothing(capfd: pytest.CaptureFixture) -> None:
    with waiting_for("something quick", grace=5.0):
        time.sleep(0.05)
    assert capfd.readouterr().err == ""


def test_a_wait_that_fails_says_so(capfd: pytest.CaptureFixture) -> None:
    with pytest.raises(RuntimeError), waiting_for("a doomed start", grace=0.1):
        time.sleep(0.3)
        raise RuntimeError("it exited")
    assert capfd.readouterr().err.splitlines()[-1] == "miles: a doomed start: failed after 0 s"


def test_the_grace_is_five_seconds_unless_the_environment_says_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GRACE_ENV, raising=False)
    assert grace_s() == GRACE_S == 5.0
    for value, expected in [("0.5", 0.5), ("inf", float("inf")), ("soon", 5.0), ("-1", 5.0), ("nan", 5.0)]:
        monkeypatch.setenv(GRACE_ENV, value)
        assert grace_s() == expected, value
    monkeypatch.setenv(GRACE_ENV, "inf")  # no reports at all
    with waiting_for("anything") as wait:
        time.sleep(0.05)
    assert wait.reported == 0


def test_a_notice_is_one_line_on_stderr(capfd: pytest.CaptureFixture) -> None:
    notice("engine-1 failed (its process exited); restarting it")
    captured = capfd.readouterr()
    assert captured.err == "miles: engine-1 failed (its process exited); restarting it\n" and captured.out == ""
