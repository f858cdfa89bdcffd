"""The config's type: the core's sections are typed fields of :class:`MilesConfig` (whatever the plugins), and a
plugin's section is read through one typed accessor, :meth:`MilesConfig.section`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from miles_core.builtin.metrics.config import MetricsSection
from miles_core.config.build import MilesConfig, build_config, config_model
from miles_core.config.section import Section
from miles_core.config.sections import RolloutSection, RunSection, TrainSection
from miles_core.errors import ConfigError
from miles_core.plugin_manager import MilesPluginManager

NO_AUTOLOAD = {"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"}


@pytest.fixture(scope="module")
def manager() -> MilesPluginManager:
    return MilesPluginManager.load(environ=NO_AUTOLOAD)


def test_the_core_sections_are_static_fields_of_every_config_model(manager: MilesPluginManager) -> None:
    assert MilesConfig.model_fields["train"].annotation is TrainSection
    assert MilesConfig.model_fields["rollout"].annotation is RolloutSection
    config = build_config(manager, overrides={"rollout.batch_size": 4})
    assert isinstance(config, MilesConfig)
    assert isinstance(config.run, RunSection) and config.rollout.batch_size == 4
    assert list(type(config).model_fields)[:6] == ["run", "model", "rollout", "train", "engine", "weight_transfer"]


def test_a_plugin_section_is_read_through_the_typed_accessor(manager: MilesPluginManager) -> None:
    config = build_config(manager, overrides={"metrics.exporters": []})
    metrics = config.section("metrics", MetricsSection)
    assert isinstance(metrics, MetricsSection) and metrics is config.metrics
    with pytest.raises(ConfigError, match=r"config has no section 'sglang9' \(its sections: run, model, .*loaded\?"):
        config.section("sglang9", MetricsSection)
    with pytest.raises(ConfigError, match="config section 'metrics' is a MetricsSection, not a TrainSection"):
        config.section("metrics", TrainSection)
    with pytest.raises(ConfigError, match="no section 'model_config'"):  # pydantic's own attributes are no section
        config.section("model_config", MetricsSection)


class OtherTrain(Section):
    """A plugin's section that claims the core's name ``train``."""

    lr: float = 0.5


def test_a_plugin_may_not_replace_a_core_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "claims_train.py").write_text(
        "from miles_core import hookimpl\n"
        "from tests.test_typed_config import OtherTrain\n\n"
        "@hookimpl\n"
        "def config_sections():\n"
        "    return {'train': OtherTrain}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "claims_train", raising=False)
    claims = MilesPluginManager.load(["claims_train"], environ=NO_AUTOLOAD)
    with pytest.raises(ConfigError, match="section 'train' is contributed twice, by plugin 'core' and by plugin"):
        config_model(claims)
