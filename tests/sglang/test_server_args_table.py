"""``sglang.server_args`` values checked against SGLang's ``ServerArgs`` before any engine starts: each field's type,
choices and documented range, from the table shipped with the plugin; and the table is what the SGLang environment's
``ServerArgs`` says (``tools/sglang_server_args_table.py``), whenever that environment exists."""

from __future__ import annotations

import json
import subprocess

import pytest
from miles_plugins_sglang.config import TABLE_FILE, find_sglang_python, server_args_table

from miles_core.config.build import build_config
from miles_core.errors import ConfigError
from miles_core.plugin_manager import MilesPluginManager
from tests.conftest import REPO, run_miles

TOOL = REPO / "tools" / "sglang_server_args_table.py"


@pytest.fixture(scope="module")
def manager() -> MilesPluginManager:
    return MilesPluginManager.load()


def sglang_config(manager: MilesPluginManager, server_args: dict) -> object:
    overrides = {"engine.backend": "sglang", "weight_transfer.mode": "disk", "sglang.server_args": server_args}
    return build_config(manager, overrides=overrides)


@pytest.mark.parametrize(
    ("server_args", "problem"),
    [
        ({"mem_fraction_static": 2}, "mem_fraction_static = 2: out of range: SGLang allows > 0 and <= 1"),
        ({"mem_fraction_static": 0}, "mem_fraction_static = 0: out of range: SGLang allows > 0 and <= 1"),
        ({"mem_fraction_static": "most"}, "mem_fraction_static = 'most': expected a number, got str"),
        ({"mem_fraction_static": True}, "mem_fraction_static = True: expected a number, got bool"),
        ({"max_running_requests": 0}, "max_running_requests = 0: out of range: SGLang allows >= 1"),
        ({"max_running_requests": 2.5}, "max_running_requests = 2.5: expected a whole number, got float"),
        ({"enable_metrics": "yes"}, "enable_metrics = 'yes': expected true or false, got str"),
        ({"revision": 1234}, "revision = 1234: expected a string (quote it), got int"),
        ({"attention_backend": "flash"}, "attention_backend = 'flash': not one of 'triton', 'torch_native'"),
        ({"dtype": "fp64"}, "dtype = 'fp64': not one of 'auto', 'half', 'float16', 'bfloat16', 'float', 'float32'"),
        ({"cuda_graph_bs_decode": [1, "two"]}, "cuda_graph_bs_decode = [1, 'two']: expected a whole number, got str"),
        ({"cuda_graph_bs_decode": 8.5}, "cuda_graph_bs_decode = 8.5: expected a whole number, got float"),
    ],
)
def test_a_value_that_does_not_fit_serverargs_is_refused_naming_it(manager, server_args: dict, problem: str) -> None:
    with pytest.raises(ConfigError) as error:
        sglang_config(manager, server_args)
    assert problem in str(error.value) and "sglang.server_args" in str(error.value)


def test_values_that_fit_are_kept_as_given(manager) -> None:
    server_args = {
        "mem_fraction_static": 1,  # an int is a number; 1 is the top of the range
        "attention_backend": "intel_amx",
        "max_running_requests": 8,
        "enable_metrics": True,
        "revision": "1234",
        "cuda_graph_bs_decode": [1, 2, 4],
        "gc_threshold": 700,  # one value of a list setting, as on SGLang's command line
        "chunked_prefill_size": None,  # null leaves SGLang's default
        "json_model_override_args": {"rope": 1},  # a mapping for a JSON setting travels as its JSON text
    }
    assert sglang_config(manager, server_args).sglang.server_args == server_args


def test_the_command_line_refuses_an_out_of_range_value_before_any_engine_starts() -> None:
    result = run_miles("train", "--engine", "sglang", "--sglang-server-args", "{mem_fraction_static: 2}")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "mem_fraction_static = 2: out of range: SGLang allows > 0 and <= 1" in result.stderr


def test_the_table_covers_every_field_with_a_type() -> None:
    table = server_args_table()
    assert len(table) > 500 and {"mem_fraction_static", "tp_size", "attention_backend"} <= set(table)
    kinds = {"bool", "int", "float", "str", "dict", "list", "list[int]", "list[str]", "list[float]", "any"}
    assert {entry["type"] for entry in table.values()} <= kinds
    assert table["mem_fraction_static"]["range"]["gt"] == 0 and table["mem_fraction_static"]["range"]["le"] == 1


def test_the_shipped_table_is_what_the_sglang_environment_s_serverargs_says() -> None:
    """Regenerate with ``.venv-sglang/bin/python tools/sglang_server_args_table.py --write`` when this fails."""
    python, how = find_sglang_python()
    probe = subprocess.run([python, "-c", "import sglang"], capture_output=True, timeout=120, check=False)
    if probe.returncode != 0:
        pytest.skip(f"no SGLang environment to compare with ({python}, {how}): `make sglang` makes one")
    done = subprocess.run([python, str(TOOL)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == json.loads(TABLE_FILE.read_text()), f"regenerate {TABLE_FILE.name} with {TOOL}"
