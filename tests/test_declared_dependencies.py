"""Every third-party module that a distribution's code imports is declared in that distribution's pyproject.toml.

The imports are read with ``ast`` from every module of each distribution (nothing is imported). Not counted: the
standard library (``sys.stdlib_module_names``), the distribution's own package, imports under ``if TYPE_CHECKING:``
(never run), imports inside a ``try`` that catches ``ImportError`` (optional by construction), and ``pytest`` in the
opt-in pytest plugins of the test kit (:data:`PYTEST_PLUGINS`: only a pytest run that names them loads them).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO

DISTRIBUTION_ROOTS = [
    REPO,
    *sorted(path.parent for path in REPO.glob("miles_plugins_*/pyproject.toml")),
    *sorted(path.parent for path in (REPO / "plugins").glob("*/pyproject.toml")),
]
PYTEST_PLUGINS = {"miles_core.testkit.protocol_contract"}
# Import name -> distribution name, where they differ by more than '_' and '-'.
IMPORT_TO_DISTRIBUTION = {
    "yaml": "pyyaml",
    "megatron": "megatron-core",
    "pydantic_core": "pydantic-core",
}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match is not None, f"unreadable requirement {requirement!r}"
    return normalized(match.group(1))


def catches_import_error(node: ast.Try) -> bool:
    names = []
    for handler in node.handlers:
        types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        names += [t.id for t in types if isinstance(t, ast.Name)]
    return bool({"ImportError", "ModuleNotFoundError"} & set(names))


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def required_imports(tree: ast.AST) -> set[str]:
    """Top-level names of the modules that ``tree`` imports when it runs, optional imports left out."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Try) and catches_import_error(node):
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def undeclared_imports(root: Path) -> dict[str, list[str]]:
    """Undeclared third-party import -> the modules of the distribution at ``root`` that import it."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    package = project["name"].replace("-", "_")
    declared = {requirement_name(requirement) for requirement in project.get("dependencies", [])}
    modules = sorted((root / package).rglob("*.py"))
    assert modules, f"no modules under {root / package}"
    missing: dict[str, list[str]] = {}
    for path in modules:
        module_name = ".".join(path.relative_to(root).with_suffix("").parts)
        for name in required_imports(ast.parse(path.read_text(), filename=str(path))):
            if name in sys.stdlib_module_names or name in ("__future__", package):
                continue
            if name == "pytest" and module_name in PYTEST_PLUGINS:
                continue
            if normalized(IMPORT_TO_DISTRIBUTION.get(name, name)) not in declared:
                missing.setdefault(name, []).append(str(path.relative_to(REPO)))
    return missing


@pytest.mark.parametrize("root", DISTRIBUTION_ROOTS, ids=lambda root: root.name if root != REPO else "miles-core")
def test_every_third_party_import_is_declared(root: Path) -> None:
    missing = undeclared_imports(root)
    assert not missing, f"{root / 'pyproject.toml'}: imported but not in [project] dependencies: {missing}"


def test_every_distribution_is_checked() -> None:
    names = {tomllib.loads((root / "pyproject.toml").read_text())["project"]["name"] for root in DISTRIBUTION_ROOTS}
    assert names == {
        "miles-core",
        "miles-plugins-megatron",
        "miles-plugins-sglang",
        "miles-plugins-rdt",
        "miles-example-transfer",
        "miles-example-hooks",
        "miles-example-estimator",
    }


def test_the_walk_finds_what_a_module_really_imports() -> None:
    tree = ast.parse(
        "import os, numpy.linalg\n"
        "from yaml import safe_load\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n    import typed_only\n"
        "try:\n    import optional_one\nexcept ImportError:\n    import fallback\n"
        "try:\n    import required_anyway\nexcept ValueError:\n    pass\n"
        "def later():\n    import deferred_heavy\n"
    )
    assert required_imports(tree) == {"os", "numpy", "yaml", "fallback", "required_anyway", "deferred_heavy"}
