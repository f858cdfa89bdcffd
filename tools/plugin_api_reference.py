"""The reference page of the plugin API (``docs/plugin-api.md``): every name ``miles_core`` exports, grouped as its
``_LAZY`` table groups them, each with the docstring written where it is defined.

    python tools/plugin_api_reference.py > docs/plugin-api.md  # write the page
    python tools/plugin_api_reference.py --check  # exit 1: the page is stale, or a name lacks a docstring

Docstrings are read from the source (a class's or function's own, or the string literal after a constant's
assignment), so nothing heavy is imported and a dataclass's generated signature never passes for documentation.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "miles_core"
PAGE = REPO / "docs" / "plugin-api.md"
EAGER_GROUP = "hooks, registries, events and errors"


def _source_path(module: str) -> Path:
    relative = Path(*module.split("."))
    package = REPO / relative / "__init__.py"
    return package if package.is_file() else (REPO / relative).with_suffix(".py")


def _assigned_names(node: ast.stmt) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    names: list[str] = []
    for target in targets:
        elements = target.elts if isinstance(target, ast.Tuple) else [target]
        names += [element.id for element in elements if isinstance(element, ast.Name)]
    return names


def docstring(name: str, module: str) -> str | None:
    """The docstring of ``name`` where ``module`` defines it, or ``None`` (no docstring, or not defined there)."""
    body = ast.parse(_source_path(module).read_text()).body
    for index, node in enumerate(body):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return ast.get_docstring(node)
        if name in _assigned_names(node):
            after = body[index + 1] if index + 1 < len(body) else None
            text = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else None
            if isinstance(text, str):
                return inspect.cleandoc(text)
            return None
    return None


def exported() -> dict[str, list[tuple[str, str]]]:
    """``{group: [(name, defining module), ...]}`` from ``miles_core/__init__.py``: its eager imports, then its
    ``_LAZY`` table under the comments that head each group."""
    init = PACKAGE / "__init__.py"
    tree = ast.parse(init.read_text())
    groups: dict[str, list[tuple[str, str]]] = {EAGER_GROUP: []}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("miles_core."):
            groups[EAGER_GROUP] += [(alias.name, node.module) for alias in node.names]
        if isinstance(node, ast.Assign) and _assigned_names(node) == ["_LAZY"]:
            lazy = node.value
    assert isinstance(lazy, ast.Dict)
    comments = {
        number: line.strip().removeprefix("#").strip()
        for number, line in enumerate(init.read_text().splitlines(), start=1)
        if line.strip().startswith("#")
    }
    group = "other"
    for key, value in zip(lazy.keys, lazy.values, strict=True):
        heading = [comments[n] for n in comments if lazy.lineno < n < key.lineno]
        if heading:
            group = heading[-1]
            comments = {n: c for n, c in comments.items() if n > key.lineno}
        groups.setdefault(group, []).append((key.value, value.value))
    return groups


def undocumented() -> list[str]:
    """``name (module)`` of every exported name without a docstring where it is defined."""
    return [
        f"{name} ({module})" for names in exported().values() for name, module in names if not docstring(name, module)
    ]


def page() -> str:
    """The reference page, as Markdown."""
    lines = [
        "# The plugin API",
        "",
        "Every name a plugin imports from `miles_core` (and nothing deeper: `tests/test_plugin_api_boundary.py`",
        "holds the first-party plugins and the examples to it), with its docstring. The hooks themselves are",
        "documented in `miles_core/hookspecs.py`. Written by `python tools/plugin_api_reference.py`; do not edit.",
    ]
    for group, names in exported().items():
        lines += ["", f"## {group[0].upper()}{group[1:]}", ""]
        for name, module in names:
            text = " ".join((docstring(name, module) or "").split())
            lines += [f"- **`{name}`** (`{module}`): {text}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/plugin-api.md instead of printing")
    args = parser.parse_args()
    missing = undocumented()
    if missing:
        print(f"exported without a docstring: {', '.join(missing)}", file=sys.stderr)
        return 1
    if not args.check:
        sys.stdout.write(page())
        return 0
    if not PAGE.is_file() or PAGE.read_text() != page():
        print(f"{PAGE.relative_to(REPO)} is stale: run python tools/plugin_api_reference.py > {PAGE}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
