"""The plugin API is ``miles_core`` itself: the first-party plugins (``miles_plugins_*``) and the examples in
``plugins/`` (their tests too) import nothing deeper, every name they take from it is exported, and every exported
name has a docstring where it is defined (the site's plugin API page renders them)."""

from __future__ import annotations

import ast
import inspect
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


def _assigned_names(node: ast.stmt) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return [e.id for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(e, ast.Name)]


def docstring(name: str, module: str) -> str | None:
    """The docstring of ``name`` where ``module`` defines it (a class's or function's own, or the string after a
    constant's assignment), read from the source: nothing heavy is imported, and a dataclass's generated signature
    never passes for documentation. ``None``: no docstring, or not defined there."""
    path = REPO.joinpath(*module.split("."))
    source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    body = ast.parse(source.read_text()).body
    for index, node in enumerate(body):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return ast.get_docstring(node)
        if name in _assigned_names(node):
            after = body[index + 1] if index + 1 < len(body) else None
            text = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else None
            return inspect.cleandoc(text) if isinstance(text, str) else None
    return None


def test_every_exported_name_has_a_docstring_where_it_is_defined() -> None:
    """What the site's plugin API page (``docs/reference/plugin-api.md``, rendered from the code) shows of each name;
    the eager names too, from the module the package imports them from."""
    lazy = dict(miles_core._LAZY)
    eager = {
        alias.name: node.module
        for node in ast.parse((REPO / "miles_core" / "__init__.py").read_text()).body
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("miles_core.")
        for alias in node.names
    }
    assert set(lazy) | set(eager) | {"__version__"} == set(miles_core.__all__)
    assert sorted(f"{n} ({m})" for n, m in {**eager, **lazy}.items() if not docstring(n, m)) == []


def test_the_docstring_reader_sees_constants_and_refuses_generated_ones() -> None:
    assert docstring("hookimpl", "miles_core.hookspecs")  # an assignment with the string after it
    assert docstring("Sample", "miles_core.rollout.samples")  # a dataclass: its own docstring, not its signature
    assert docstring("Sample", "miles_core.rollout.executor") is None  # imported there, not defined
    assert docstring("ENGINE", "miles_core.workers.specs")  # one name of a tuple assignment
