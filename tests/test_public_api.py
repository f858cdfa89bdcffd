"""The public API is the flat ``miles_core`` namespace: every name in ``__all__`` resolves (the heavy ones on first
use, so ``import miles_core`` imports neither torch nor pydantic); ``test_plugin_api_boundary.py`` holds the
plugins to it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import miles_core

REPO = Path(__file__).resolve().parent.parent


def test_every_public_name_resolves_and_light_names_stay_light() -> None:
    for name in miles_core.__all__:
        assert getattr(miles_core, name) is not None, name
    code = "import sys, miles_core; print(sorted(m for m in ('torch', 'pydantic') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
    with pytest.raises(AttributeError, match="module 'miles_core' has no attribute 'NoSuchThing'"):
        miles_core.NoSuchThing  # noqa: B018


def test_the_contracts_are_what_the_builtin_backends_satisfy() -> None:
    from miles_core.builtin.local_engine.backend import LocalEngineBackend
    from miles_core.builtin.torch_trainer import TorchTrainer
    from miles_core.training.backend import MEMBERS

    assert isinstance(LocalEngineBackend(), miles_core.EngineBackend)
    assert [name for name in MEMBERS if not hasattr(TorchTrainer, name)] == ["implementation"]  # set per instance


INCOMPLETE_TRAINER = """\
from miles_core import hookimpl
from miles_core.registry import Implementation

CLOSED = []


class HalfTrainer:
    @classmethod
    def for_run(cls, config, **kwargs):
        return cls()

    def train_step(self, batch):
        return {}

    def close(self):
        CLOSED.append(True)


@hookimpl
def provide_training_backends():
    return [Implementation("half", f"{__name__}:HalfTrainer")]
"""


def test_a_trainer_lacking_members_is_closed_and_refused_naming_them(tmp_path: Path, monkeypatch) -> None:
    from miles_core.config.build import build_config
    from miles_core.loop import _build_trainer
    from miles_core.plugin_manager import MilesPluginManager
    from miles_core.run_setup import RunSetup

    (tmp_path / "half_trainer.py").write_text(INCOMPLETE_TRAINER)
    monkeypatch.syspath_prepend(str(tmp_path))
    manager = MilesPluginManager.load(["half_trainer"], environ={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})
    config = build_config(manager, overrides={"train.backend": "half"})
    setup = RunSetup(tmp_path, tmp_path, tmp_path, None, [], [], None, token="t")
    with pytest.raises(miles_core.MilesError) as error:
        _build_trainer(config, manager.registries, setup)
    assert str(error.value) == (
        "training backend 'half' (half_trainer:HalfTrainer) made a trainer without weight_iterator, save_checkpoint, "
        "load_checkpoint, implementation, rank_names (miles_core.TrainingBackend lists what a trainer provides)"
    )
    assert sys.modules["half_trainer"].CLOSED == [True]
    sys.modules.pop("half_trainer", None)
