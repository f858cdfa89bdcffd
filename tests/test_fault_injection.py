"""``--fault-injection``: the faults a user or a CI plans, checked when the config is built (the recovery itself is
watched by the learning runs of tests/test_train.py and tests/test_train_fully_async.py, which use this option)."""

from __future__ import annotations

import pytest

from miles_core.config.build import build_config
from miles_core.errors import ConfigError
from miles_core.fault_injection import PlannedFault
from miles_core.plugin_manager import MilesPluginManager
from tests.conftest import run_miles


@pytest.fixture(scope="module")
def manager() -> MilesPluginManager:
    return MilesPluginManager.load(environ={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})


def test_a_fault_names_an_engine_a_moment_and_a_step() -> None:
    assert PlannedFault.parse("kill_engine@step=3") == PlannedFault("kill_engine", "engine-0", "step", 3)
    fault = PlannedFault.parse(" kill_engine:engine-1@weight_update=4 ")
    assert (fault.target, fault.moment, fault.number) == ("engine-1", "weight_update", 4)
    assert str(fault) == "kill_engine:engine-1@weight_update=4"
    assert fault.when() == "as step 4's weight update starts"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kill_engine", r"is not of the form ACTION\[:ENGINE\]@MOMENT=N, like kill_engine@step=3"),
        ("kill_engine@step", "is not of the form"),
        ("kill_engine@step=-1", "is not of the form"),
        ("kill_engine@step=0", "steps count from 1"),
        ("kill_router@step=2", "unknown action 'kill_router'; actions: kill_engine"),
        ("kill_engine@eval=2", "unknown moment 'eval'; moments: step, weight_update"),
        ("kill_engine:engine 1@step=2", "is not of the form"),
    ],
)
def test_a_malformed_fault_is_refused_saying_the_form(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PlannedFault.parse(text)


def test_the_flag_takes_faults_comma_separated_and_the_config_a_list(manager) -> None:
    config = build_config(manager, overrides={"run.fault_injection": "kill_engine@step=2, kill_engine@weight_update=3"})
    assert config.run.fault_injection == ["kill_engine@step=2", "kill_engine@weight_update=3"]
    assert build_config(manager).run.fault_injection == []  # none by default


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"run.fault_injection": "kill_engine:engine-1@step=2"}, "the run has no engine-1 (its engines: engine-0)"),
        ({"run.fault_injection": "kill_engine@step=9", "run.num_steps": 4}, "the run ends at step 4 (run.num_steps)"),
        ({"run.fault_injection": "kill_engine@stepp=2"}, "unknown moment 'stepp'"),
        ({"run.fault_injection": [3]}, "run.fault_injection.0 = 3: Input should be a valid string"),
    ],
)
def test_a_fault_the_run_cannot_have_is_refused_before_it_starts(manager, overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_config(manager, overrides=overrides)


def test_the_flag_is_a_miles_flag() -> None:
    result = run_miles("config", "show", "--fault-injection", "kill_engine@step=2", "--engine-num-engines", "2")
    assert result.returncode == 0, result.stderr
    assert "fault_injection:\n  - kill_engine@step=2" in result.stdout
