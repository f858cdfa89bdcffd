"""The product's import graph, read from the source files: every module of ``miles_core``, the ``miles_plugins_*``
distributions and the example plugins in ``plugins/``, and an arrow for each import of one of them by another.

An import counts wherever it is written (module level, in a function, under ``TYPE_CHECKING``): a deferred import
still ties the two modules together, and a circle of them is one that a later change to import order can turn into
an ``ImportError``. ``from package import name`` is an arrow to ``package.name`` when that is a module, else to the
package. Tests of the distributions (their ``tests/`` folders) are not part of the product.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

BUILTIN_PACKAGE = "miles_core.builtin"
"""The built-in plugins: implementations registered through the same hooks a third party uses."""


@dataclasses.dataclass(frozen=True)
class Module:
    """One module of the product: its dotted name, its file and the distribution root it lies in."""

    name: str
    path: Path
    root: Path

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement of a module: the module it names, the names it takes and where it is."""

    importer: str
    imported: str
    names: tuple[str, ...]
    line: int

    def where(self, modules: dict[str, Module]) -> str:
        return f"{modules[self.importer].path.relative_to(REPO)}:{self.line}"


def product_modules(repo: Path = REPO) -> dict[str, Module]:
    """Every module of the product by dotted name."""
    roots = [
        repo,
        *sorted(repo.glob("miles_plugins_*")),
        *sorted(p for p in (repo / "plugins").iterdir() if p.is_dir()),
    ]
    modules: dict[str, Module] = {}
    for root in roots:
        packages = (
            [repo / "miles_core"] if root == repo else [p for p in root.iterdir() if (p / "__init__.py").exists()]
        )
        for package in packages:
            for path in sorted(package.rglob("*.py")):
                parts = path.relative_to(root).with_suffix("").parts
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                modules[name] = Module(name, path, root)
    return modules


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    """The module a ``from`` import names, with relative imports resolved against the importing module."""
    if not node.level:
        return node.module or ""
    package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _owner(name: str, modules: dict[str, Module]) -> str | None:
    """The product module that ``name`` is, or the innermost one it lies in (``None``: outside the product)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: Module, modules: dict[str, Module]) -> Iterator[Import]:
    """The imports of product modules that ``module`` writes, anywhere in its file."""
    for node in ast.walk(ast.parse(module.path.read_text(), filename=str(module.path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                owner = _owner(alias.name, modules)
                if owner is not None and owner != module.name:
                    yield Import(module.name, owner, (), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            by_target: dict[str, list[str]] = {}
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                owner = submodule if submodule in modules else _owner(base, modules)
                if owner is not None and owner != module.name:
                    by_target.setdefault(owner, []).append(alias.name)
            for owner, names in by_target.items():
                yield Import(module.name, owner, tuple(names), node.lineno)


def import_graph(modules: dict[str, Module]) -> dict[str, list[Import]]:
    """Each module's imports of other product modules."""
    return {name: list(imports_of(module, modules)) for name, module in modules.items()}


def circles(graph: dict[str, list[Import]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative): each is a set of
    modules that import each other, directly or through the others."""
    successors = {name: sorted({i.imported for i in imports}) for name, imports in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(successors):
        if start in index:
            continue
        work = [(start, iter(successors[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(successors.get(child, []))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def is_builtin(name: str) -> bool:
    """Whether ``name`` is a built-in plugin's module."""
    return name == BUILTIN_PACKAGE or name.startswith(f"{BUILTIN_PACKAGE}.")


def is_kernel(name: str) -> bool:
    """Whether ``name`` is a module of the kernel: ``miles_core`` less its built-in plugins."""
    return (name == "miles_core" or name.startswith("miles_core.")) and not is_builtin(name)
