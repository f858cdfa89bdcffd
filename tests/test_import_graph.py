"""The product's import graph has no circles, and the kernel never imports a built-in plugin: the built-ins build on
the kernel's contracts and are loaded by name through the plugin manager, as a third party's plugins are."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.import_graph import (
    REPO,
    Import,
    circles,
    import_graph,
    is_builtin,
    is_kernel,
    product_modules,
)


def describe_circle(circle: list[str], graph: dict[str, list[Import]], modules) -> str:
    """Each arrow inside the circle, with the names it takes and where it is written."""
    members = set(circle)
    arrows = [
        f"  {i.importer} -> {i.imported} ({', '.join(i.names) or 'module'}; {i.where(modules)})"
        for name in circle
        for i in graph[name]
        if i.imported in members
    ]
    return "\n".join([f"circle of {len(circle)} modules:", *arrows])


def test_the_product_import_graph_has_no_circles() -> None:
    modules = product_modules()
    graph = import_graph(modules)
    found = circles(graph)
    assert not found, "\n".join(describe_circle(circle, graph, modules) for circle in found)


def test_the_kernel_imports_no_builtin_plugin() -> None:
    modules = product_modules()
    arrows = [i for imports in import_graph(modules).values() for i in imports]
    back = [
        f"{i.importer} -> {i.imported} ({', '.join(i.names) or 'module'}; {i.where(modules)})"
        for i in arrows
        if is_kernel(i.importer) and is_builtin(i.imported)
    ]
    assert back == []
    assert any(is_builtin(i.importer) and is_kernel(i.imported) for i in arrows)  # the walk saw the built-ins


def test_the_graph_sees_circles_through_deferred_and_relative_imports(tmp_path: Path) -> None:
    """The reader itself: a circle closed by an import inside a function, or by a relative import, is found."""
    package = tmp_path / "miles_core"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from miles_core.sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from ..c import thing\n",
        "c.py": "import miles_core.a\nthing = 1\n",
        "d.py": "from miles_core import c\n",
    }
    for name, text in files.items():
        (package / name).write_text(textwrap.dedent(text))
    (tmp_path / "plugins").mkdir()
    graph = import_graph(product_modules(tmp_path))
    assert circles(graph) == [["miles_core.a", "miles_core.c", "miles_core.sub.b"]]
    assert [i.imported for i in graph["miles_core.d"]] == ["miles_core.c"]


def test_the_graph_covers_the_whole_product() -> None:
    modules = product_modules()
    assert {"miles_core.hookspecs", "miles_plugins_megatron.plugin", "miles_example_transfer.protocol"} <= set(modules)
    assert not any("tests" in module.path.relative_to(REPO).parts for module in modules.values())
