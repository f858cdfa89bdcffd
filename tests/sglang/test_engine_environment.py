"""The engine environment (``sglang.python``) and the CPU launch settings of the sglang plugin, on every machine:
how the interpreter is found, what a stock SGLang server gets on CPU, what overrides it, a missing environment as a
clear error before any engine starts, and server settings checked against the engine environment's ``ServerArgs``."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from pathlib import Path

import pytest
from miles_plugins_sglang.config import SGLANG_PYTHON_ENV, resolve_sglang_python, server_arg_fields
from miles_plugins_sglang.launch import KV_TOKENS_RANGE, check_engine_environment, sglang_engine_spec

from miles_core.config.build import build_config
from miles_core.errors import ConfigError
from miles_core.plugin_manager import MilesPluginManager
from miles_core.run_setup import default_model


@pytest.fixture(scope="module")
def manager():
    return MilesPluginManager.load()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return default_model(tmp_path_factory.mktemp("model"), seed=0)


def config(manager, **overrides):
    return build_config(manager, overrides={"engine.backend": "sglang", "weight_transfer.mode": "disk", **overrides})


def fake_environment(root: Path, fields: list[str]) -> Path:
    """An interpreter whose ``sglang.srt.server_args.ServerArgs`` has ``fields``: a stand-in package (named as such)
    on the path of this interpreter, for what a real SGLang environment answers."""
    package = root / "site" / "sglang" / "srt"
    package.mkdir(parents=True)
    for folder in (package.parent, package):
        (folder / "__init__.py").write_text("")
    body = "\n".join(f"    {name}: int = 0" for name in fields)
    (package / "server_args.py").write_text(
        f"import dataclasses\n\n@dataclasses.dataclass\nclass ServerArgs:\n{body}\n"
    )
    python = root / "bin" / "python"
    python.parent.mkdir()
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{root / "site"}" exec "{sys.executable}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


def test_the_interpreter_is_the_setting_else_the_variable_else_the_make_target_else_this_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SGLANG_PYTHON_ENV, raising=False)
    assert resolve_sglang_python("/opt/sglang/bin/python") == "/opt/sglang/bin/python"
    with contextlib.chdir(tmp_path):
        assert resolve_sglang_python("auto") == sys.executable  # nothing else here
        made = tmp_path / ".venv-sglang" / "bin" / "python"
        made.parent.mkdir(parents=True)
        made.write_text("")
        assert resolve_sglang_python("auto") == str(made)
        monkeypatch.setenv(SGLANG_PYTHON_ENV, "/from/the/variable/python")
        assert resolve_sglang_python("auto") == "/from/the/variable/python"


def test_a_stock_server_on_cpu_gets_the_cpu_settings_and_server_args_override_them(manager, model: Path) -> None:
    spec = sglang_engine_spec(
        config(manager, **{"sglang.python": "/env/bin/python"}), cell_id="engine-0", model_path=str(model)
    )
    argv = spec.argv
    assert argv[:3] == ["/env/bin/python", "-m", "sglang.launch_server"]
    assert argv[argv.index("--device") + 1] == "cpu" and argv[argv.index("--attention-backend") + 1] == "torch_native"
    assert {"--disable-overlap-schedule", "--sleep-on-idle", "--skip-tokenizer-init"} <= set(argv)
    assert argv[argv.index("--cuda-graph-backend-decode") + 1] == "disabled"
    tokens = int(argv[argv.index("--max-total-tokens") + 1])
    assert KV_TOKENS_RANGE[0] <= tokens <= KV_TOKENS_RANGE[1]
    assert argv[argv.index("--max-running-requests") + 1] == "256"  # engine.max_batch_size
    assert spec.env == {"SGLANG_USE_CPU_ENGINE": "1"} and spec.num_gpus == 0
    overridden = sglang_engine_spec(
        config(
            manager,
            **{
                "sglang.python": "/env/bin/python",
                "sglang.server_args": {
                    "attention_backend": "intel_amx",
                    "sleep_on_idle": False,
                    "max_total_tokens": 1024,
                },
                "sglang.env": {"OMP_NUM_THREADS": "1"},
            },
        ),
        cell_id="engine-0",
        model_path=str(model),
    ).argv
    assert overridden.count("--attention-backend") == 1 and "intel_amx" in overridden
    assert "--sleep-on-idle" not in overridden and overridden[overridden.index("--max-total-tokens") + 1] == "1024"
    off = sglang_engine_spec(config(manager, **{"sglang.cpu_launch": "off"}), cell_id="e", model_path=str(model))
    assert "--device" not in off.argv and off.env == {} and "--skip-tokenizer-init" in off.argv


def test_another_server_speaking_sglangs_api_gets_no_sglang_settings(manager, model: Path) -> None:
    local = ["{python}", "-m", "miles_core.builtin.local_engine.server"]
    spec = sglang_engine_spec(config(manager, **{"sglang.launch_command": local}), cell_id="e", model_path=str(model))
    assert spec.argv[0] == sys.executable and spec.env == {}
    assert not {"--device", "--skip-tokenizer-init", "--sleep-on-idle"} & set(spec.argv)


def test_a_missing_engine_environment_is_a_clear_error_before_any_engine_starts(manager, tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"interpreter '/nowhere/bin/python' does not exist: create one with "
        r"`make sglang`",
    ):
        check_engine_environment(config(manager, **{"sglang.python": "/nowhere/bin/python"}))
    without = fake_environment(tmp_path / "plain", ["device"])
    (tmp_path / "plain" / "site" / "sglang" / "__init__.py").unlink()
    (tmp_path / "plain" / "site" / "sglang" / "srt" / "__init__.py").unlink()
    os.rename(tmp_path / "plain" / "site" / "sglang", tmp_path / "plain" / "site" / "not_sglang")
    with pytest.raises(ConfigError, match=r"has no sglang \(import sglang fails\)"):
        check_engine_environment(config(manager, **{"sglang.python": str(without)}))
    local = ["{python}", "-m", "miles_core.builtin.local_engine.server"]
    check_engine_environment(config(manager, **{"sglang.launch_command": local, "sglang.python": "/nowhere"}))


def test_server_args_are_checked_against_the_engine_environments_sglang(manager, tmp_path: Path) -> None:
    python = fake_environment(tmp_path / "env", ["device", "only_in_this_release"])
    fields, source = server_arg_fields(str(python))
    assert fields == {"device", "only_in_this_release"} and "engine environment" in source
    checked = config(manager, **{"sglang.python": str(python), "sglang.server_args": {"only_in_this_release": 1}})
    assert checked.sglang.server_args == {"only_in_this_release": 1}
    with pytest.raises(
        ConfigError,
        match=r"'mem_fraction_static' is not an SGLang server setting.*checked against "
        r"the ServerArgs of sglang in the engine environment",
    ):
        config(manager, **{"sglang.python": str(python), "sglang.server_args": {"mem_fraction_static": 0.5}})
    script = tmp_path / "broken"
    script.write_text("#!/bin/sh\nexit 1\n")
    script.chmod(0o755)
    assert "shipped with miles-plugins-sglang" in server_arg_fields(str(script))[1]  # cannot ask: the shipped list


def test_bad_environment_variables_are_refused(manager) -> None:
    with pytest.raises(ConfigError, match="environment variable names"):
        config(manager, **{"sglang.env": {"A=B": "1"}})


def test_the_kv_budget_follows_the_model_and_the_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from miles_core.testkit.tiny_models import save_tiny_llama
    from miles_plugins_sglang import launch

    monkeypatch.setattr(launch.psutil, "virtual_memory", lambda: SimpleNamespace(available=1 << 30))
    small = launch.kv_token_budget(str(save_tiny_llama(tmp_path / "s", hidden_size=64, num_hidden_layers=2)))
    large = launch.kv_token_budget(
        str(
            save_tiny_llama(
                tmp_path / "l", hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8
            )
        )
    )
    bytes_per_token = 2 * 8 * 8 * 64 * 2  # keys and values, 8 layers, 8 heads of 64, 2 bytes
    assert small == KV_TOKENS_RANGE[1] and large == int((1 << 30) * launch.KV_MEMORY_FRACTION) // bytes_per_token


def test_a_model_sglang_cannot_serve_on_cpu_is_refused_naming_the_missing_kernels(manager, tmp_path: Path) -> None:
    """SGLang's DeepSeek-V4 runs on CUDA and NPU kernels only: on CPU the engine is refused before it starts, with the
    kernels it lacks and what would serve the model; off CPU the same checkpoint gets its command line."""
    from miles_core.testkit.tiny_models import save_tiny_deepseek_v4

    dsv4 = save_tiny_deepseek_v4(tmp_path / "dsv4")
    with pytest.raises(ConfigError) as error:
        sglang_engine_spec(config(manager, **{"sglang.python": "/env/bin/python"}), cell_id="e", model_path=str(dsv4))
    message = str(error.value)
    assert "cannot serve the deepseek_v4 model" in message and "sglang.kernels.ops.attention.dsv4" in message
    assert "dsv4_wo_a" in message and "--engine local" in message
    on_gpus = config(manager, **{"sglang.cpu_launch": "off"})
    assert "--model-path" in sglang_engine_spec(on_gpus, cell_id="e", model_path=str(dsv4)).argv
