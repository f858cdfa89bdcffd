"""``module:attribute`` targets that a user gives on the command line (``--reward my_rewards:score``), imported as
``python -m`` would: the working directory first on the import path for that lookup, so a ``my_rewards.py`` next
to the user's prompts is found whether ``miles`` runs as a console script or as ``python -m miles_core.cli.main``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

from miles_core.errors import ConfigError

_TARGET = re.compile(r"(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attribute>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def is_target(text: str) -> bool:
    """Whether ``text`` has the shape ``package.module:attribute`` (dotted names on both sides of one colon)."""
    return _TARGET.fullmatch(text) is not None


def import_target(target: str, *, what: str) -> Any:
    """The object named by ``target`` (``"package.module:attribute.path"``), imported with the working directory
    first on ``sys.path``. Every failure is a :class:`ConfigError` that starts with ``what`` (the flag, such as
    ``"--reward 'my_rewards:score'"``) and says what was looked for where."""
    match = _TARGET.fullmatch(target)
    if match is None:
        raise ConfigError(
            f"{what}: expected module:function (such as my_rewards:score, the module importable or a "
            "file MODULE.py in the working directory)"
        )
    module_name, attribute = match["module"], match["attribute"]
    try:
        with _working_directory_first():
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name != exc.name and not module_name.startswith(f"{exc.name}."):
            raise ConfigError(
                f"{what}: importing module {module_name!r} failed: it imports {exc.name!r}, which is not installed"
            ) from None
        raise ConfigError(
            f"{what}: no module named {module_name!r} in the working directory {os.getcwd()!r} or on "
            f"the import path (write {module_name.replace('.', '/')}.py there, or install the package "
            "that holds it)"
        ) from None
    except Exception as exc:  # the module itself failed: a SyntaxError, a NameError at import time, ...
        raise ConfigError(f"{what}: importing module {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for depth, part in enumerate(attribute.split(".")):
        if not hasattr(obj, part):
            owner = ".".join([module_name, *attribute.split(".")[:depth]])
            public = sorted(name for name in dir(obj) if not name.startswith("_"))[:20]
            raise ConfigError(
                f"{what}: {owner!r} (from {getattr(module, '__file__', None) or module_name}) has no "
                f"attribute {part!r}; it defines: {', '.join(public) or 'nothing public'}"
            )
        obj = getattr(obj, part)
    return obj


def registered_or_target(name: str, registry: Any, *, flag: str, kind: str) -> Any:
    """``name`` from ``registry`` (loaded), else the ``module:function`` it names; anything else is a
    :class:`ConfigError` saying ``flag`` takes a registered ``kind`` (listing them) or module:function."""
    entry = registry.get(name)
    if entry is not None:
        return entry.load()
    if is_target(name):
        return import_target(name, what=f"{flag} {name!r}")
    raise ConfigError(
        f"{flag} {name!r} is neither a registered {kind} (registered: {', '.join(registry) or 'none'}) nor "
        "module:function"
    )


def describe_callable(fn: Any) -> str:
    """``module:qualname`` of a function (or its ``repr`` when it has none), for messages."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else repr(fn)


@contextlib.contextmanager
def _working_directory_first() -> Iterator[None]:
    """The working directory first on ``sys.path`` during the import, as ``python -m`` has it (a console script
    has its own directory there instead); the path is restored afterwards."""
    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    importlib.invalidate_caches()  # a module file written after the last import must be seen
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # the imported module may have changed sys.path itself
            sys.path.remove(cwd)  # the first occurrence: the one inserted above
