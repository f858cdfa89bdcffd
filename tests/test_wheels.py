"""The wheel stage (``.ci/wheels``) fails on a file left out of a wheel: both of its checks, the wheel's file list
against the package's files and the import of every module from the installed wheel, name the missing module.

The wheel is built as the stage builds it (``python -m build``: an sdist, then the wheel from the sdist); a module is
then deleted from it, as a ``packages = [...]`` that lists only the top-level package left ``deepseek_v4/`` out.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

WHEELHOUSE_TOOL = REPO / "tools" / "wheelhouse.py"
MEGATRON = REPO / "miles_plugins_megatron"
REMOVED = "miles_plugins_megatron/deepseek_v4/model.py"


def wheelhouse_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("wheelhouse", WHEELHOUSE_TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def megatron_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheelhouse")
    command = [sys.executable, "-m", "build", "--outdir", str(out), str(MEGATRON)]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    return wheelhouse_tool().wheel_path(out, MEGATRON)


def without(wheel: Path, member: str, out: Path) -> Path:
    """A copy of ``wheel`` (same file name, in ``out``) without ``member``, in its RECORD neither."""
    out.mkdir()
    copy = out / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(copy, "w", zipfile.ZIP_DEFLATED) as target:
        assert member in source.namelist()
        for item in source.infolist():
            if item.filename == member:
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True) if not line.startswith(member.encode()))
            target.writestr(item, data)
    return copy


def import_check(wheel: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """The stage's import of every miles-plugins-megatron module, with the package from ``wheel`` (pip-installed
    into a folder first on sys.path; its dependencies are this environment's)."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    modules = "\n".join(wheelhouse_tool().modules_of(MEGATRON))
    return subprocess.run(
        [sys.executable, "-I", str(WHEELHOUSE_TOOL), "imports", "--outside", str(REPO), "--path", str(target)],
        input=modules,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        check=False,
    )


def test_the_wheel_as_built_holds_every_module(megatron_wheel: Path, tmp_path: Path) -> None:
    assert wheelhouse_tool().problems_with(megatron_wheel, MEGATRON) == []
    result = import_check(megatron_wheel, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"imported {len(wheelhouse_tool().modules_of(MEGATRON))} of " in result.stdout


def test_a_module_removed_from_the_wheel_fails_the_file_check(megatron_wheel: Path, tmp_path: Path) -> None:
    broken = without(megatron_wheel, REMOVED, tmp_path / "broken")
    assert wheelhouse_tool().problems_with(broken, MEGATRON) == [f"{broken.name} lacks {REMOVED}"]


def test_a_module_removed_from_the_wheel_fails_the_import_check(megatron_wheel: Path, tmp_path: Path) -> None:
    result = import_check(without(megatron_wheel, REMOVED, tmp_path / "broken"), tmp_path)
    assert result.returncode == 1, result.stdout[-3000:]
    assert (
        "miles_plugins_megatron.deepseek_v4.model: ModuleNotFoundError: "
        "No module named 'miles_plugins_megatron.deepseek_v4.model'"
    ) in result.stdout


def test_a_module_of_the_source_tree_is_no_installed_module(tmp_path: Path) -> None:
    """Run where the editable install puts the source tree on sys.path, the import check refuses every module."""
    result = subprocess.run(
        [sys.executable, "-I", str(WHEELHOUSE_TOOL), "imports", "--outside", str(REPO)],
        input="miles_plugins_megatron.deepseek_v4\n",
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert result.returncode == 1
    assert "miles_plugins_megatron.deepseek_v4: imported from the source tree" in result.stdout
