"""The ``metrics`` section from the command line: what it accepts, what it refuses and how, and that naming no
exporter (the default) imports neither library."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import config_json, plugins_json
from tests.test_config_hostile import refused

NEEDS_LIBRARIES = pytest.mark.skipif(
    not all(
        importlib.util.find_spec(name) for name in ("prometheus_client", "tensorboard", "wandb", "mlflow", "sqlalchemy")
    ),
    reason="the exporters' libraries are not installed (pip install -e '.[test]' installs them)",
)


def test_no_exporter_by_default() -> None:
    assert config_json()["metrics"]["exporters"] == []


@NEEDS_LIBRARIES
@pytest.mark.parametrize(
    ("value", "exporters"),
    [
        ("tensorboard", ["tensorboard"]),
        ("prometheus,tensorboard", ["prometheus", "tensorboard"]),
        (" prometheus , tensorboard ", ["prometheus", "tensorboard"]),
        ("[tensorboard, prometheus]", ["tensorboard", "prometheus"]),
        ("", []),
    ],
)
def test_metrics_flag_takes_names_comma_separated_or_as_a_yaml_list(value: str, exporters: list[str]) -> None:
    assert config_json("--metrics", value)["metrics"]["exporters"] == exporters


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--metrics", "grafana"],
            "metrics.exporters.0 = 'grafana': Input should be 'prometheus', 'tensorboard', 'wandb' or 'mlflow'",
        ),
        (["--metrics", "prometheus,prometheus"], "exporter 'prometheus' is named twice"),
        (["--metrics", "{a: 1}"], "metrics.exporters = {'a': 1}: Input should be a valid list"),
        (["--metrics-prometheus-port", "70000"], "metrics.prometheus_port = '70000': Input should be less than"),
        (["--metrics-prometheus-port", "-1"], "metrics.prometheus_port = '-1': Input should be greater than"),
        (["--metrics-prometheus-port", "http"], "metrics.prometheus_port = 'http': Input should be a valid integer"),
        (["--metrics-prometheus-host", " "], "metrics.prometheus_host must be an address or a name"),
        (["--metrics-prometheus-host", "0.0.0.0"], "metrics.prometheus_allow_remote = true"),
        (["--metrics-prometheus-host", "192.0.2.1"], "reachable from other machines"),
        (["--metrics-tensorboard-dir", ""], "metrics.tensorboard_dir = '': String should have at least 1 character"),
        (["--metrics", "wandb,comet"], "metrics.exporters.1 = 'comet': Input should be 'prometheus', 'tensorboard'"),
        (["--metrics-wandb-mode", "dryrun"], "metrics.wandb_mode = 'dryrun': Input should be 'online' or 'offline'"),
        (["--metrics-wandb-project", ""], "metrics.wandb_project = '': String should have at least 1 character"),
        (["--metrics-wandb-project", "a/b"], "a W&B project or entity is letters, digits"),
        (["--metrics-wandb-project", "p" * 129], "metrics.wandb_project = 'ppp"),
        (["--metrics-run-name", "r" * 129], "String should have at most 128 characters"),
        (["--metrics-labels", "[a, b]"], "metrics.labels = ['a', 'b']: Input should be a valid dictionary"),
        (["--metrics-labels", "{'a b': x}"], "label 'a b': a key is letters, digits"),
        (["--metrics-labels", "{a: " + "v" * 70 + "}"], "KEY=VALUE is at most 64 characters"),
        (["--metrics-labels", "{" + ", ".join(f"k{i}: v" for i in range(65)) + "}"], "65 labels; at most 64"),
        (["--metrics-mlflow-tracking-uri", "ftp://host/x"], "a tracking URI starts with one of sqlite:, file:"),
        (["--metrics-mlflow-tracking-uri", "http://"], "an http(s) tracking URI names a host"),
        (["--metrics-mlflow-tracking-uri", "u" * 2049], "String should have at most 2048 characters"),
        (["--metrics-mlflow-experiment", ""], "metrics.mlflow_experiment = '': String should have at least 1"),
        (["--metrics-wandb", "x"], "metrics-wandb"),
    ],
)
def test_bad_metrics_settings_are_refused_by_name(args: list[str], expected: str) -> None:
    assert expected in refused(*args)


def test_a_remote_host_is_accepted_on_purpose() -> None:
    section = config_json("--metrics-prometheus-host", "0.0.0.0", "--metrics-prometheus-allow-remote", "true")
    assert (section["metrics"]["prometheus_host"], section["metrics"]["prometheus_allow_remote"]) == ("0.0.0.0", True)


HIDE_LIBRARIES = """
import sys
sys.modules["prometheus_client"] = None  # as if not installed: find_spec and import both see no module
sys.modules["tensorboard"] = None
sys.modules["wandb"] = None
sys.modules["sqlalchemy"] = None
from miles_core.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    ("exporter", "package", "install"),
    [
        ("prometheus", "prometheus-client", "prometheus-client"),
        ("tensorboard", "tensorboard", "tensorboard"),
        ("wandb", "wandb", "wandb (or miles-core[wandb])"),
        ("mlflow", "sqlalchemy", "mlflow-skinny sqlalchemy alembic (or miles-core[mlflow])"),
    ],
)
def test_missing_library_is_a_config_error_naming_the_package(exporter: str, package: str, install: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", HIDE_LIBRARIES, "config", "show", "--metrics", exporter],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert f"the {exporter} exporter needs the package {package}, which is not installed: pip install {install}" in (
        result.stderr
    )


IMPORTS = """
import contextlib, io, json, sys
from miles_core.cli.main import main
with contextlib.redirect_stdout(io.StringIO()):
    status = main(sys.argv[1:])
print(json.dumps({"status": status, "loaded": sorted(m for m in sys.modules
                  if m.split(".")[0] in ("prometheus_client", "tensorboard", "wandb", "mlflow"))}))
"""


@NEEDS_LIBRARIES
@pytest.mark.parametrize("args", [[], ["--metrics", "prometheus,tensorboard"], ["--metrics", "wandb,mlflow"]])
def test_config_imports_no_exporter_library(args: list[str]) -> None:
    """Building (and checking) the config finds the libraries without importing them; only a run does."""
    result = subprocess.run(
        [sys.executable, "-c", IMPORTS, "config", "show", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1]) == {"status": 0, "loaded": []}


def test_the_metrics_plugin_is_built_in_and_can_be_blocked() -> None:
    assert config_json("--plugin", "no:metrics").keys() >= {"run", "dashboard"}
    assert "metrics" not in config_json("--plugin", "no:metrics")
    assert plugins_json()["metrics"]["source"] == "builtin"


@NEEDS_LIBRARIES
def test_a_tensorboard_dir_that_cannot_be_a_directory_is_refused(tmp_path) -> None:
    (tmp_path / "file").write_text("")
    stderr = refused("--metrics", "tensorboard", "--metrics-tensorboard-dir", str(tmp_path / "file" / "tb"))
    assert "metrics.tensorboard_dir (--metrics-tensorboard-dir) = " in stderr
    assert "is not a directory, so nothing can be under it" in stderr
