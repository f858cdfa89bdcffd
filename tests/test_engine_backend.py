"""Engine launch goes through the ``engine_backends`` registry alone: ``--engine NAME`` picks a class satisfying
``miles_core.EngineBackend``; a target that is no such class, and specs that are not worker specs, are clear
errors naming the backend."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from miles_core.builtin.local_engine.backend import LocalEngineBackend
from miles_core.config.build import build_config
from miles_core.engines.backend import EngineBackend, load_engine_backend
from miles_core.errors import MilesError
from miles_core.plugin_manager import MilesPluginManager
from miles_core.registry import RegistryError
from miles_core.rollout.controller import InferenceController
from miles_core.workers.local_provider import LocalWorkerProvider
from miles_core.workers.specs import CommandWorkerSpec

BACKENDS_PLUGIN = """\
from miles_core import hookimpl
from miles_core.registry import Implementation


def a_function(config, *, cell_id, model_path):
    return []


class NoSpecs:
    def engine_specs(self, config, *, cell_id, model_path):
        return []

    def router_spec(self, config):
        return None


class StringRouter(NoSpecs):
    def router_spec(self, config):
        return "python -m my_router"


@hookimpl
def provide_engine_backends():
    targets = {"function": "a_function", "no-specs": "NoSpecs", "string-router": "StringRouter"}
    return [Implementation(name, f"{__name__}:{target}") for name, target in targets.items()]
"""


@pytest.fixture
def manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MilesPluginManager:
    (tmp_path / "backends_plugin.py").write_text(BACKENDS_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield MilesPluginManager.load(["backends_plugin"], environ={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})
    sys.modules.pop("backends_plugin", None)


def test_the_builtin_backend_is_an_engine_backend(manager) -> None:
    backend = load_engine_backend(manager.registries, "local")
    assert isinstance(backend, LocalEngineBackend) and isinstance(backend, EngineBackend)
    config = build_config(manager, overrides={})
    (spec,) = backend.engine_specs(config, cell_id="engine-3", model_path="/models/m")
    assert isinstance(spec, CommandWorkerSpec) and spec.name == "engine-3" and "/models/m" in spec.argv
    assert backend.router_spec(config) is None


def test_a_backend_that_is_not_an_engine_backend_class_is_refused_naming_it(manager) -> None:
    with pytest.raises(RegistryError, match=r"engine backend 'function' \(backends_plugin:a_function\) is <function"):
        load_engine_backend(manager.registries, "function")
    with pytest.raises(RegistryError, match=r"unknown engine backend 'nope'; available: function, local, no-specs"):
        load_engine_backend(manager.registries, "nope")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no-specs", "engine backend 'no-specs' returned [] for engine-0; expected a non-empty list of"),
        ("string-router", "engine backend 'string-router' returned 'python -m my_router' as its router; expected a"),
    ],
)
def test_what_a_backend_returns_is_checked_before_anything_starts(
    manager, tmp_path: Path, name: str, message: str
) -> None:
    config = build_config(manager, overrides={"engine.backend": name})
    provider = LocalWorkerProvider(token="t", run_dir=tmp_path / "run")
    backend = load_engine_backend(manager.registries, name)
    controller = InferenceController(
        config=config, hooks=manager.hook, provider=provider, protocol=None, backend=backend, model_path="/m"
    )
    with pytest.raises(MilesError) as error:
        asyncio.run(controller.start())
    assert message in str(error.value)
    assert provider.processes == {}
