"""The KL weight an estimator declares (``AdvantageEstimator.default_kl_coef``): resolved once, in
``choose_algorithm``, where ``train.kl_coef`` is unset; an explicit value wins, 0 included; grpo's stays 0 (the
default run unchanged); the trainers read the resolved weight."""

from __future__ import annotations

import pytest
import transformers

from miles_core.builtin.algorithms import DrGrpo, Grpo, PpoClip, Rloo
from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.build import build_config
from miles_core.config.sections import TrainSection
from miles_core.errors import ConfigError
from miles_core.plugin_manager import MilesPluginManager
from miles_core.testkit.tiny_models import tiny_llama_config
from miles_core.training.algorithms import AlgorithmChoice, choose_algorithm, resolve_kl_coef
from miles_core.training.objective import Objective, objective_from_spec


@pytest.fixture(scope="module")
def manager() -> MilesPluginManager:
    return MilesPluginManager.load(environ={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})


def chosen(manager: MilesPluginManager, **overrides) -> AlgorithmChoice:
    config = build_config(manager, overrides=overrides)
    return choose_algorithm(
        config.train,
        manager.registries,
        group_size=config.rollout.group_size,
        max_new_tokens=config.rollout.max_new_tokens,
    )


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("grpo", 0.0),
        ("gspo", 0.0),
        ("ppo", 0.05),
        ("dr_grpo", 0.05),
        ("rloo", 0.05),
        ("reinforce_plus_plus", 0.05),
        ("reinforce_plus_plus_baseline", 0.05),
    ],
)
def test_an_unset_kl_coef_is_the_estimators_default(manager: MilesPluginManager, estimator: str, expected) -> None:
    assert TrainSection().kl_coef is None
    choice = chosen(manager, **{"train.advantage_estimator": estimator})
    assert choice.kl_coef == expected
    assert choice.trainer_spec()["kl_coef"] == expected


def test_the_default_run_has_no_kl(manager: MilesPluginManager) -> None:
    """grpo, the default: weight 0, so no reference model and a loss without a KL term, as before the default."""
    choice = chosen(manager)
    assert (choice.estimator_name, choice.kl_coef) == ("grpo", 0.0)
    assert "KL" not in choice.describe()


@pytest.mark.parametrize(("estimator", "value"), [("rloo", 0.0), ("rloo", 0.2), ("grpo", 0.1), ("dr_grpo", 0.0)])
def test_an_explicit_kl_coef_wins(manager: MilesPluginManager, estimator: str, value: float) -> None:
    choice = chosen(manager, **{"train.advantage_estimator": estimator, "train.kl_coef": value})
    assert choice.kl_coef == value
    objective = objective_from_spec(TrainSection(kl_coef=value), choice.trainer_spec())
    assert objective.train.kl_coef == value


def test_the_trainer_side_objective_reads_the_drivers_resolved_weight(manager: MilesPluginManager) -> None:
    choice = chosen(manager, **{"train.advantage_estimator": "rloo"})
    assert "KL 0.05 (k3)" in choice.describe()
    objective = objective_from_spec(TrainSection(advantage_estimator="rloo"), choice.trainer_spec())
    assert objective.train.kl_coef == Rloo.default_kl_coef == 0.05


def test_a_plugins_estimator_declares_its_default() -> None:
    class Anchored(Grpo):
        name = "anchored"
        default_kl_coef = 0.3

    assert resolve_kl_coef(TrainSection(), Anchored()) == 0.3
    assert resolve_kl_coef(TrainSection(kl_coef=0), Anchored()) == 0.0
    assert resolve_kl_coef(TrainSection(), None) == 0.0  # no estimator: no default to take


@pytest.mark.parametrize(("kl_coef", "has_reference"), [(None, True), (0.0, False), (0.1, True)])
def test_the_torch_trainer_loads_a_reference_for_the_resolved_weight(kl_coef, has_reference: bool) -> None:
    settings = TrainSection(advantage_estimator="dr_grpo", kl_coef=kl_coef)
    objective = Objective(train=settings, policy_loss=PpoClip(), estimator=DrGrpo())
    model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    trainer = TorchTrainer(model, settings, objective=objective)
    assert (trainer.reference is not None) == has_reference
    expected = DrGrpo.default_kl_coef if kl_coef is None else kl_coef
    assert trainer.settings.kl_coef == objective.train.kl_coef == expected


def test_the_kl_in_the_reward_needs_a_weight(manager: MilesPluginManager) -> None:
    overrides = {"train.advantage_estimator": "ppo", "train.kl_placement": "reward", "train.kl_coef": 0}
    with pytest.raises(ConfigError, match=r"train\.kl_coef is 0: set it .*'ppo''s default"):
        build_config(manager, overrides=overrides)
    on_default = chosen(manager, **{"train.advantage_estimator": "reinforce_plus_plus", "train.kl_placement": "reward"})
    assert on_default.kl_coef == 0.05


def test_config_show_notes_an_unset_weight_only_where_the_estimator_gives_one() -> None:
    """``miles config show``: rloo's unset weight is noted with its value; the default run's output (grpo: no KL) and
    an explicit weight get no note."""
    from tests.conftest import run_miles

    noted = run_miles("config", "show", "--train-advantage-estimator", "rloo")
    assert noted.returncode == 0, noted.stderr
    assert "# train.kl_coef: unset, so rloo's default, 0.05" in noted.stdout
    for args in ((), ("--train-advantage-estimator", "rloo", "--train-kl-coef", "0")):
        shown = run_miles("config", "show", *args)
        assert shown.returncode == 0, shown.stderr
        assert "train.kl_coef: unset" not in shown.stdout, args
