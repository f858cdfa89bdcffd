"""The engine environment (``sglang.python``) and the CPU launch settings of the sglang plugin, on every machine:
how the interpreter is found, what a stock SGLang server gets on CPU, what overrides it, a missing environment as a
clear error before any engine starts, and server settings checked against the engine environment's ``ServerArgs``."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from miles_plugins_sglang.config import (
    CHECKOUT,
    SGLANG_PYTHON_ENV,
    find_sglang_python,
    recorded_environment_file,
    resolve_sglang_python,
    server_arg_fields,
)
from miles_plugins_sglang.launch import (
    ENGINE_PATH,
    KV_TOKENS_RANGE,
    STAGING_LOADER,
    check_engine_environment,
    sglang_engine_spec,
)

from miles_core.config.build import build_config
from miles_core.engines.staging import STAGING_DIR_ENV, weight_staging_dir
from miles_core.errors import ConfigError
from miles_core.plugin_manager import MilesPluginManager
from miles_core.run_setup import default_model
from tests.conftest import REPO, run_miles


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


def _made(root: Path) -> Path:
    """``root/.venv-sglang/bin/python`` as ``make sglang`` makes it (a file is all the lookup looks at)."""
    python = root / ".venv-sglang" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    return python


def test_the_interpreter_is_found_in_the_documented_order_wherever_miles_runs(tmp_path: Path) -> None:
    """$MILES_SGLANG_PYTHON, the working directory's .venv-sglang, the checkout's, the one make sglang recorded,
    this interpreter: each found, and said how."""
    assert resolve_sglang_python("/opt/sglang/bin/python") == "/opt/sglang/bin/python"
    elsewhere, checkout, config_home = tmp_path / "elsewhere", tmp_path / "checkout", tmp_path / "config"
    elsewhere.mkdir()
    environ = {"XDG_CONFIG_HOME": str(config_home)}

    def found() -> tuple[str, str]:
        return find_sglang_python(environ=environ, cwd=elsewhere, checkout=checkout)

    assert found() == (sys.executable, "the interpreter running Miles (no SGLang environment found)")
    recorded = _made(tmp_path / "installed-by-make")
    record = recorded_environment_file(environ)
    assert record == config_home / "miles" / "sglang-python"
    record.parent.mkdir(parents=True)
    record.write_text(f"{recorded}\n")
    assert found() == (str(recorded), f"recorded by make sglang in {record}")
    in_checkout = _made(checkout)
    assert found() == (str(in_checkout), f".venv-sglang of the checkout {checkout}")  # from another directory
    here = _made(elsewhere)
    assert found() == (str(here), ".venv-sglang of the working directory")
    environ[SGLANG_PYTHON_ENV] = "/from/the/variable/python"
    assert found() == ("/from/the/variable/python", "$MILES_SGLANG_PYTHON")
    assert recorded_environment_file({"HOME": str(tmp_path)}) == tmp_path / ".config" / "miles" / "sglang-python"


def test_the_checkout_looked_in_is_the_one_the_plugin_is_installed_from() -> None:
    assert REPO == CHECKOUT  # the developer install is editable: the plugin's checkout is this repository


def test_config_show_says_which_environment_it_found_and_how(tmp_path: Path) -> None:
    environ = {SGLANG_PYTHON_ENV: "/opt/sglang/bin/python", "XDG_CONFIG_HOME": str(tmp_path)}
    shown = run_miles("config", "show", env=environ, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.rstrip().endswith("# sglang.python: auto = /opt/sglang/bin/python ($MILES_SGLANG_PYTHON)")
    as_json = run_miles("config", "show", "--json", env=environ, cwd=tmp_path)
    assert json.loads(as_json.stdout)["sglang"]["python"] == "auto"  # stdout stays JSON; the note is on stderr
    assert "# sglang.python: auto = /opt/sglang/bin/python ($MILES_SGLANG_PYTHON)" in as_json.stderr
    given = run_miles("config", "show", "--sglang-python", "/my/python", env=environ, cwd=tmp_path)
    assert "# sglang.python" not in given.stdout  # a path given is shown as the setting itself


def test_from_outside_the_checkout_the_checkout_s_environment_is_found(tmp_path: Path) -> None:
    made = CHECKOUT / ".venv-sglang" / "bin" / "python"
    if not made.is_file():
        pytest.skip(f"no SGLang environment in this checkout ({made}): `make sglang` makes one")
    environ = {"XDG_CONFIG_HOME": str(tmp_path), SGLANG_PYTHON_ENV: ""}
    shown = run_miles("config", "show", env=environ, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert f"# sglang.python: auto = {made} (.venv-sglang of the checkout {CHECKOUT})" in shown.stdout


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
    loader = {"PYTHONPATH": ENGINE_PATH, STAGING_DIR_ENV: str(weight_staging_dir())}  # Miles' weight loader
    cpu = {
        "SGLANG_USE_CPU_ENGINE": "1",
        "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
        "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
    }
    assert spec.env == {**cpu, **loader} and spec.num_gpus == 0
    assert argv[argv.index("--custom-weight-loader") + 1] == STAGING_LOADER
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
    assert "--device" not in off.argv and off.env == loader and "--skip-tokenizer-init" in off.argv


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
    assert "shipped with miles-plugins-sglang" in server_arg_fields(str(script))[1]  # cannot ask: the shipped table


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
