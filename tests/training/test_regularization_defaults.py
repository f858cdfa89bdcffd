"""The KL and entropy weights an estimator declares (``AdvantageEstimator.default_kl_coef`` and
``default_entropy_coef``): resolved once, in ``choose_algorithm``, where ``train.kl_coef`` / ``train.entropy_coef`` is
unset; an explicit value wins, 0 included; grpo's stay 0 (the default run unchanged); the trainers read the resolved
weights. The built-in estimators without a per-group std division default to an entropy bonus (against the collapse
measured in docs/concepts/algorithms.md) and no KL, so no reference model."""

from __future__ import annotations

import pytest
import transformers

from miles_core.builtin.algorithms import ENTROPY_COEF_AGAINST_COLLAPSE, DrGrpo, Grpo, PpoClip, Rloo
from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.build import build_config
from miles_core.config.sections import TrainSection
from miles_core.errors import ConfigError
from miles_core.plugin_manager import MilesPluginManager
from miles_core.testkit.tiny_models import tiny_llama_config
from miles_core.training.algorithms import AlgorithmChoice, choose_algorithm, resolve_entropy_coef, resolve_kl_coef
from miles_core.training.objective import Objective, objective_from_spec

BONUS = ENTROPY_COEF_AGAINST_COLLAPSE


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
    ("estimator", "entropy"),
    [
        ("grpo", 0.0),
        ("gspo", 0.0),
        ("ppo", 0.05),  # its own, measured
        ("dr_grpo", BONUS),
        ("rloo", BONUS),
        ("reinforce_plus_plus", BONUS),
        ("reinforce_plus_plus_baseline", BONUS),
    ],
)
def test_unset_weights_are_the_estimators_defaults(manager: MilesPluginManager, estimator: str, entropy) -> None:
    assert TrainSection().kl_coef is None and TrainSection().entropy_coef is None
    choice = chosen(manager, **{"train.advantage_estimator": estimator})
    assert (choice.kl_coef, choice.entropy_coef) == (0.0, entropy)
    assert (choice.trainer_spec()["kl_coef"], choice.trainer_spec()["entropy_coef"]) == (0.0, entropy)


def test_the_default_run_has_no_kl_and_no_entropy_bonus(manager: MilesPluginManager) -> None:
    """grpo, the default: both weights 0, so no reference model and a loss of the policy term alone, as before."""
    choice = chosen(manager)
    assert (choice.estimator_name, choice.kl_coef, choice.entropy_coef) == ("grpo", 0.0, 0.0)
    assert "KL" not in choice.describe() and "entropy" not in choice.describe()


@pytest.mark.parametrize(
    ("estimator", "kl_coef", "entropy_coef"),
    [("rloo", 0.0, 0.0), ("rloo", 0.2, 0.01), ("grpo", 0.1, 0.02), ("dr_grpo", 0.05, 0.0)],
)
def test_explicit_weights_win(manager: MilesPluginManager, estimator: str, kl_coef: float, entropy_coef: float) -> None:
    overrides = {"train.advantage_estimator": estimator, "train.kl_coef": kl_coef, "train.entropy_coef": entropy_coef}
    choice = chosen(manager, **overrides)
    assert (choice.kl_coef, choice.entropy_coef) == (kl_coef, entropy_coef)
    objective = objective_from_spec(TrainSection(kl_coef=kl_coef, entropy_coef=entropy_coef), choice.trainer_spec())
    assert (objective.train.kl_coef, objective.train.entropy_coef) == (kl_coef, entropy_coef)


def test_the_trainer_side_objective_reads_the_drivers_resolved_weights(manager: MilesPluginManager) -> None:
    choice = chosen(manager, **{"train.advantage_estimator": "rloo"})
    assert f"entropy bonus {BONUS:g}" in choice.describe() and "KL" not in choice.describe()
    objective = objective_from_spec(TrainSection(advantage_estimator="rloo"), choice.trainer_spec())
    assert objective.train.entropy_coef == Rloo.default_entropy_coef == BONUS
    assert objective.train.kl_coef == Rloo.default_kl_coef == 0.0


def test_a_plugins_estimator_declares_its_defaults() -> None:
    class Anchored(Grpo):
        name = "anchored"
        default_kl_coef = 0.3
        default_entropy_coef = 0.01

    assert resolve_kl_coef(TrainSection(), Anchored()) == 0.3
    assert resolve_kl_coef(TrainSection(kl_coef=0), Anchored()) == 0.0
    assert resolve_kl_coef(TrainSection(), None) == 0.0  # no estimator: no default to take
    assert resolve_entropy_coef(TrainSection(), Anchored()) == 0.01
    assert resolve_entropy_coef(TrainSection(entropy_coef=0), Anchored()) == 0.0
    assert resolve_entropy_coef(TrainSection(), None) == 0.0


@pytest.mark.parametrize(
    ("kl_coef", "entropy_coef", "has_reference"), [(None, None, False), (0.0, 0.0, False), (0.1, None, True)]
)
def test_the_torch_trainer_takes_the_resolved_weights(kl_coef, entropy_coef, has_reference: bool) -> None:
    """A reference model exactly when the resolved KL weight is not 0; the entropy's gradient (the bonus) follows
    the resolved entropy weight."""
    settings = TrainSection(advantage_estimator="dr_grpo", kl_coef=kl_coef, entropy_coef=entropy_coef)
    objective = Objective(train=settings, policy_loss=PpoClip(), estimator=DrGrpo())
    model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    trainer = TorchTrainer(model, settings, objective=objective)
    assert (trainer.reference is not None) == has_reference
    assert trainer.settings.kl_coef == objective.train.kl_coef == (kl_coef or 0.0)
    expected_entropy = DrGrpo.default_entropy_coef if entropy_coef is None else entropy_coef
    assert trainer.settings.entropy_coef == objective.train.entropy_coef == expected_entropy


def test_the_kl_in_the_reward_needs_a_weight(manager: MilesPluginManager) -> None:
    """No built-in estimator brings a KL weight of its own now: the KL in the reward needs the user's."""
    for estimator, kl_coef in (("ppo", 0), ("reinforce_plus_plus", None)):
        overrides = {"train.advantage_estimator": estimator, "train.kl_placement": "reward"}
        if kl_coef is not None:
            overrides["train.kl_coef"] = kl_coef
        with pytest.raises(ConfigError, match=rf"train\.kl_coef is 0: set it .*'{estimator}''s default"):
            build_config(manager, overrides=overrides)
    weighted = {"train.advantage_estimator": "reinforce_plus_plus", "train.kl_placement": "reward"}
    assert chosen(manager, **weighted, **{"train.kl_coef": 0.05}).kl_coef == 0.05


def test_config_show_notes_an_unset_weight_only_where_the_estimator_gives_one() -> None:
    """``miles config show``: rloo's unset entropy weight is noted with its value; the default run's output (grpo:
    neither) and explicit weights get no note."""
    from tests.conftest import run_miles

    noted = run_miles("config", "show", "--train-advantage-estimator", "rloo")
    assert noted.returncode == 0, noted.stderr
    assert f"# train.entropy_coef: unset, so rloo's default, {BONUS:g}" in noted.stdout
    assert "train.kl_coef: unset" not in noted.stdout  # rloo's KL default is 0
    explicit = ("--train-advantage-estimator", "rloo", "--train-kl-coef", "0", "--train-entropy-coef", "0")
    for args in ((), explicit):
        shown = run_miles("config", "show", *args)
        assert shown.returncode == 0, shown.stderr
        assert "unset, so" not in shown.stdout, args
