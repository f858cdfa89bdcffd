"""The one guard around plugin code: importing a plugin and calling any of its hook implementations.

Whatever plugin code raises (an exception, ``sys.exit``, a ``KeyboardInterrupt``) becomes a
:class:`~miles_core.errors.MilesError` that names the plugin, its distribution and what it was doing, so a broken
plugin never ends a command with a traceback, nor silently with exit status 0 (``SystemExit`` would). The choices:

* A ``KeyboardInterrupt`` raised while plugin code runs is reported like any other failure: at import and in the
  start-up hooks it is almost always the plugin's own defect (a real Ctrl-C there lands in the same place, and the
  message says so), and the command stops with a non-zero status either way.
* A :class:`~miles_core.errors.MilesError` passes unchanged: the plugin raised it on purpose (``validate_config``
  raises ``ConfigError``) and its message already says what to do.
* ``asyncio.CancelledError`` and ``GeneratorExit`` pass unchanged: they are the caller's control flow.

:func:`guard_hook_calls` puts every hook implementation of a registered plugin behind the guard, and checks what it
returns with a function given by the plugin manager (:mod:`miles_core.hook_results`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pluggy

from miles_core.errors import MilesError, PluginHookError, PluginLoadError

_PASS_THROUGH = (MilesError, asyncio.CancelledError, GeneratorExit)

ResultCheck = Callable[[str, Any], "str | None"]
"""``check(hook_name, result)``: a description of what is wrong with ``result``, or ``None`` when it is fine."""


def describe_exception(exc: BaseException) -> str:
    """``Type: message``, with what a ``SystemExit`` or ``KeyboardInterrupt`` from plugin code means."""
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r}): the plugin called sys.exit"
    if isinstance(exc, KeyboardInterrupt):
        return "KeyboardInterrupt: raised by the plugin (or Ctrl-C was pressed while its code ran)"
    return f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def plugin_code(what: str, error: type[MilesError] = PluginHookError) -> Iterator[None]:
    """Run plugin code; anything it raises, ``SystemExit`` and ``KeyboardInterrupt`` included, becomes ``error``
    with the message ``"{what}: {the exception}"``."""
    try:
        yield
    except _PASS_THROUGH:
        raise
    except BaseException as exc:
        raise error(f"{what}: {describe_exception(exc)}") from exc


def guard_hook_calls(pm: pluggy.PluginManager, plugin: object, *, label: str, check: ResultCheck) -> None:
    """Route every call of ``plugin``'s hook implementations (through pluggy or one by one) through the guard.

    ``label`` names the plugin in messages (``"plugin 'x' (distribution x 1.0, ...)"``). A failure is a
    :class:`PluginHookError` naming the hook; a result that ``check`` refuses is one too. Wrapper implementations are
    refused: Miles hooks are plain calls (``weight_update_wrapper`` returns a context manager instead).
    """
    for caller in pm.get_hookcallers(plugin) or []:
        for impl in caller.get_hookimpls():
            if impl.plugin is not plugin:
                continue
            if impl.wrapper or impl.hookwrapper:
                raise PluginLoadError(
                    f"{label} implements {caller.name} as a pluggy wrapper; Miles hooks are plain functions "
                    "(drop wrapper=True / hookwrapper=True)"
                )
            # pluggy reads the signature once, at registration; swapping the function keeps its argument names.
            impl.function = _guarded(impl.function, hook=caller.name, label=label, check=check)  # type: ignore[misc]


def _guarded(function: Callable[..., Any], *, hook: str, label: str, check: ResultCheck) -> Callable[..., Any]:
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        with plugin_code(f"{label} failed in hook {hook}"):
            result = function(*args, **kwargs)
        problem = check(hook, result)
        if problem is not None:
            raise PluginHookError(f"{label} returned {problem} from hook {hook}")
        return result

    return call
