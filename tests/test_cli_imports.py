"""``miles --help`` and ``miles plugins`` stay light: no torch, ray, transformers, megatron or sglang."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "ray", "transformers", "megatron", "sglang", "sglang_router", "nixl", "safetensors")

PROBE = """
import contextlib, io, json, sys
from miles_core.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        status = main(sys.argv[1:])
    except SystemExit as exc:  # argparse's --help exits
        status = exc.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy})
print(json.dumps({{"status": status, "heavy": heavy, "output": out.getvalue()}}))
"""


def run_probe(*args: str) -> dict:
    code = PROBE.format(heavy=repr(set(HEAVY)))
    result = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("args", [["--help"], ["plugins"], ["plugins", "--json"], ["version"]])
def test_listing_commands_import_no_heavy_module(args: list[str]) -> None:
    probe = run_probe(*args)
    assert probe["status"] == 0
    assert probe["output"], "the command printed nothing"
    assert probe["heavy"] == []


def test_probe_detects_heavy_imports() -> None:
    """The probe itself works: a command that does load torch is caught."""
    probe = run_probe("config", "show", "--update-weight-transfer-mode", "sharded-disk")
    assert probe["status"] == 0
    assert "torch" in probe["heavy"]


def test_checking_the_algorithm_when_the_config_is_built_imports_no_heavy_module() -> None:
    """``config show`` validates the estimator's and the policy loss's settings (issue 46) with their classes
    loaded, yet without torch: the estimators import it only when they compute."""
    probe = run_probe(
        "config",
        "show",
        "--train-advantage-estimator",
        "ppo",
        "--train-advantage-estimator-settings",
        '{"gamma": 0.99}',
        "--train-policy-loss",
        "gspo",
    )
    assert probe["status"] == 0 and "advantage_estimator: ppo" in probe["output"]
    assert probe["heavy"] == []
