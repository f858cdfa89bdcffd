"""A griffe extension for the site's API pages: the Sphinx roles of the docstrings as Markdown code.

The docstrings of miles_core cross-reference with Sphinx roles (``:class:`~miles_core.registry.Implementation```);
mkdocstrings renders Markdown, where a role would show as ``:class:`` before the code. Each role becomes the code
span of its target (its last part when written with ``~``, as Sphinx shows it).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def as_code(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrites every loaded object's docstring once it is loaded."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        rewrite(obj)

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        rewrite(pkg)  # the top-level package is not passed to on_object


def rewrite(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        obj.docstring.value = ROLE.sub(as_code, obj.docstring.value)
