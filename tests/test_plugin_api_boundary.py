"""The plugin API is ``miles_core`` itself: the first-party plugins (``miles_plugins_*``) and the examples in
``plugins/`` (their tests too) import nothing deeper, every name they take from it is exported, and every exported
name is documented where it is defined, on the reference page ``docs/plugin-api.md``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import miles_core
from tests.import_graph import REPO

PLUGIN_DIRS = [*sorted(REPO.glob("miles_plugins_*")), REPO / "plugins"]


def core_imports(path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """``(line, module, names)`` of each import of ``miles_core`` or a module under it that ``path`` writes."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, ()) for a in node.names if a.name.split(".")[0] == "miles_core"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "miles_core":
            found.append((node.lineno, node.module or "", tuple(a.name for a in node.names)))
    return found


def deep_imports(directories: list[Path]) -> list[str]:
    """``path:line: module`` of every import of a ``miles_core`` module other than the package itself."""
    return [
        f"{path.relative_to(directory.parent)}:{line}: {module}"
        for directory in directories
        for path in sorted(directory.rglob("*.py"))
        for line, module, _ in core_imports(path)
        if module != "miles_core"
    ]


def test_plugins_import_only_the_plugin_api() -> None:
    assert deep_imports(PLUGIN_DIRS) == []


def test_every_name_plugins_take_is_exported() -> None:
    taken = {
        (f"{path.relative_to(REPO)}:{line}", name)
        for directory in PLUGIN_DIRS
        for path in sorted(directory.rglob("*.py"))
        for line, module, names in core_imports(path)
        for name in names
        if module == "miles_core"
    }
    assert len(taken) > 100  # the walk saw the plugins' imports
    assert sorted(f"{where}: {name}" for where, name in taken if name not in miles_core.__all__) == []


def test_the_boundary_check_finds_a_deep_import(tmp_path: Path) -> None:
    plugin = tmp_path / "miles_plugins_x" / "miles_plugins_x"
    plugin.mkdir(parents=True)
    (plugin / "ok.py").write_text("from miles_core import hookimpl\nimport miles_core\n")
    (plugin / "deep.py").write_text("def f():\n    from miles_core.engines.weights import checksum\n")
    (plugin / "dotted.py").write_text("import miles_core.workers.rpc.server as rpc\n")
    assert deep_imports([tmp_path / "miles_plugins_x"]) == [
        "miles_plugins_x/miles_plugins_x/deep.py:2: miles_core.engines.weights",
        "miles_plugins_x/miles_plugins_x/dotted.py:1: miles_core.workers.rpc.server",
    ]


def test_every_exported_name_has_a_docstring_and_the_reference_page_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "plugin_api_reference.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    page = (REPO / "docs" / "plugin-api.md").read_text()
    assert [name for name in miles_core.__all__ if name != "__version__" and f"**`{name}`**" not in page] == []
