"""The ``sglang`` config section: how SGLang engines (and the sglang-router) are launched.

Engines run in an environment of their own (``sglang.python``): SGLang pins its own torch and transformers, which
differ from Miles', so production setups and ``make sglang`` keep it in a separate virtual environment.

``sglang.python: auto`` finds the environment, wherever Miles is run from, in this order (:func:`find_sglang_python`;
``miles config show`` says which one it found and how): ``$MILES_SGLANG_PYTHON``; ``.venv-sglang`` of the working
directory; ``.venv-sglang`` of the checkout this plugin is installed from (an editable install, as ``make setup``
makes); the environment that ``make sglang`` last recorded in ``$XDG_CONFIG_HOME/miles/sglang-python`` (default
``~/.config/miles/sglang-python``); else the interpreter running Miles.

``server_args`` are SGLang server settings by their ``ServerArgs`` field names (``mem_fraction_static: 0.8``). Their
names are checked against the ``ServerArgs`` of the sglang that will serve: the engine environment's (asked once per
run with a short subprocess), this interpreter's when it has sglang, else the table shipped with this plugin. Their
values are checked against that table (``server_args_table.json``: each field's type, choices and the ranges SGLang
documents, generated from sglang 0.5.23's ``ServerArgs`` by ``tools/sglang_server_args_table.py``), so that
``mem_fraction_static: 2`` is refused before any engine starts. ``extra_args`` passes flags through unchecked.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pydantic

from miles_core import Section

TABLE_FILE = Path(__file__).with_name("server_args_table.json")
SET_BY_MILES = {
    "model_path": "the run's checkpoint (--model)",
    "host": "the worker provider",
    "port": "the worker provider",
    "admin_api_key": "the run's token",
    "tp_size": "sglang.tp_size",
    "dp_size": "sglang.dp_size",
    "ep_size": "sglang.ep_size",
    "random_seed": "run.seed (--seed)",
}
"""Server settings Miles sets itself, and where they come from."""
PYTHON = "{python}"
"""Stands for the Python interpreter running Miles in a launch command."""
SGLANG_PYTHON = "{sglang_python}"
"""Stands for the engine environment's interpreter (``sglang.python``) in a launch command."""
SGLANG_PYTHON_ENV = "MILES_SGLANG_PYTHON"
DEFAULT_ENVIRONMENT = Path(".venv-sglang")
"""Where ``make sglang`` puts the SGLang environment (in the checkout)."""
CHECKOUT = Path(__file__).resolve().parents[2]
"""The checkout this plugin is installed from when it is an editable install (else a site-packages directory)."""
RECORD = Path("miles") / "sglang-python"
"""Where ``make sglang`` records its environment's interpreter, under ``$XDG_CONFIG_HOME`` (default ``~/.config``)."""
_FIELDS_SCRIPT = """
import dataclasses, json
from sglang.srt.server_args import ServerArgs
names = getattr(ServerArgs, "__struct_fields__", None) or [f.name for f in dataclasses.fields(ServerArgs)]
print(json.dumps(sorted(names)))
"""


def resolve_sglang_python(setting: str) -> str:
    """The engine environment's interpreter for the setting ``sglang.python``: a path as given, or for ``auto`` the
    one :func:`find_sglang_python` finds."""
    return setting if setting != "auto" else find_sglang_python()[0]


def find_sglang_python(
    *,
    environ: dict[str, str] | None = None,
    cwd: Path | None = None,
    checkout: Path = CHECKOUT,
) -> tuple[str, str]:
    """The SGLang environment's interpreter for ``sglang.python: auto``, and how it was found, in the order of the
    module's docstring; the first that exists wins (``$MILES_SGLANG_PYTHON`` wins as given)."""
    environ = os.environ if environ is None else environ
    if environ.get(SGLANG_PYTHON_ENV):
        return environ[SGLANG_PYTHON_ENV], f"${SGLANG_PYTHON_ENV}"
    here = (cwd or Path.cwd()) / DEFAULT_ENVIRONMENT / "bin" / "python"
    candidates = [
        (here, f"{DEFAULT_ENVIRONMENT} of the working directory"),
        (checkout / DEFAULT_ENVIRONMENT / "bin" / "python", f"{DEFAULT_ENVIRONMENT} of the checkout {checkout}"),
    ]
    record = recorded_environment_file(environ)
    recorded = _read_record(record)
    if recorded is not None:
        candidates.append((Path(recorded), f"recorded by make sglang in {record}"))
    for python, how in candidates:
        if python.is_file():
            return str(python.absolute()), how
    return sys.executable, "the interpreter running Miles (no SGLang environment found)"


def recorded_environment_file(environ: dict[str, str] | None = None) -> Path:
    """The file in which ``make sglang`` records its environment's interpreter."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CONFIG_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".config")
    return Path(base) / RECORD


def _read_record(record: Path) -> str | None:
    try:
        text = record.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:  # none recorded (or unreadable: the other places are still looked at)
        return None
    return text.splitlines()[0] if text else None


def is_this_interpreter(python: str) -> bool:
    """Whether ``python`` is the interpreter running Miles. Paths are compared without following links: a virtual
    environment's ``bin/python`` links to the base interpreter, yet the environment (its packages) differs."""
    return os.path.abspath(python) == os.path.abspath(sys.executable)


def server_arg_fields(python: str | None = None) -> tuple[frozenset[str], str]:
    """SGLang's server settings and where they were read: the ``ServerArgs`` of the environment ``python`` when it
    has sglang, else this interpreter's, else the shipped list."""
    if python is not None and not is_this_interpreter(python):
        found = _environment_fields(os.path.abspath(python))
        if found is not None:
            return found, f"the ServerArgs of sglang in the engine environment ({python})"
    return _local_fields()


@functools.cache
def _environment_fields(python: str) -> frozenset[str] | None:
    """``ServerArgs`` fields of the sglang installed for ``python`` (None when it cannot be asked)."""
    try:
        done = subprocess.run(
            [python, "-c", _FIELDS_SCRIPT],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"},
        )
        names = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None
    return frozenset(name for name in names if not name.startswith("_")) if names else None


@functools.cache
def server_args_table() -> dict[str, dict[str, Any]]:
    """The shipped table of SGLang's server settings: per field its ``type``, ``nullable``, and where SGLang has
    them, ``choices`` and ``range`` (``gt`` / ``ge`` / ``lt`` / ``le`` and SGLang's words, ``doc``)."""
    return json.loads(TABLE_FILE.read_text(encoding="utf-8"))["fields"]


@functools.cache
def _local_fields() -> tuple[frozenset[str], str]:
    try:
        from sglang.srt.server_args import ServerArgs  # deferred: heavy and usually absent (an environment of its own)
    except ImportError:
        source = f"the table shipped with miles-plugins-sglang ({TABLE_FILE.name})"
        return frozenset(server_args_table()), source
    fields = getattr(ServerArgs, "__struct_fields__", None)  # msgspec Struct (sglang >= 0.5.2x)
    if fields is None:
        import dataclasses

        fields = [field.name for field in dataclasses.fields(ServerArgs)]
    return frozenset(name for name in fields if not name.startswith("_")), "the installed sglang's ServerArgs"


MAX_GPUS = 1024
"""The most GPUs (and ranks of one parallel dimension) of one engine."""


class SglangSection(Section):
    """SGLang engines: the launch command, server settings, parallel sizes, and the router in front of them."""

    python: str = pydantic.Field(
        default="auto",
        min_length=1,
        description="Interpreter of the engine environment ({sglang_python} in launch_command): a path, or auto = "
        f"${SGLANG_PYTHON_ENV}, else {DEFAULT_ENVIRONMENT} of the working directory, else the checkout's "
        f"{DEFAULT_ENVIRONMENT}, else the one make sglang recorded (~/.config/{RECORD}), else this interpreter "
        "(`miles config show` says which).",
    )
    launch_command: list[str] = pydantic.Field(
        default=[SGLANG_PYTHON, "-m", "sglang.launch_server"],
        min_length=1,
        description="Command that starts one server speaking SGLang's HTTP API; {sglang_python} is sglang.python, "
        "{python} the interpreter running Miles.",
    )
    env: dict[str, str] = pydantic.Field(
        default_factory=dict, description="Extra environment variables of every engine process."
    )
    cpu_launch: Literal["auto", "on", "off"] = pydantic.Field(
        default="auto",
        description="CPU launch settings (device cpu, torch_native attention, ...) under server_args: "
        "auto = when a stock sglang.launch_server gets no GPU.",
    )
    server_args: dict[str, Any] = pydantic.Field(
        default_factory=dict,
        description="SGLang ServerArgs fields and values (names, types, choices and documented ranges checked).",
    )
    extra_args: list[str] = pydantic.Field(default_factory=list, description="Flags passed through unchecked.")
    tp_size: int = pydantic.Field(
        default=1, ge=1, le=MAX_GPUS, description="Tensor-parallel size of each engine (at most 1024)."
    )
    dp_size: int = pydantic.Field(
        default=1, ge=1, le=MAX_GPUS, description="Data-parallel size of each engine (at most 1024)."
    )
    ep_size: int = pydantic.Field(
        default=1, ge=1, le=MAX_GPUS, description="Expert-parallel size of each engine (at most 1024)."
    )
    gpus_per_engine: float | None = pydantic.Field(
        default=None,
        ge=0,
        le=MAX_GPUS,
        description="GPUs the provider reserves per engine (at most 1024); default tp_size * dp_size with CUDA.",
    )
    router: bool = pydantic.Field(default=False, description="Put an sglang-router in front of the engines.")
    router_command: list[str] = pydantic.Field(
        default=[PYTHON, "-m", "sglang_router.launch_router"], min_length=1, description="Command that starts it."
    )
    router_policy: str = pydantic.Field(
        default="round_robin", pattern="^(random|round_robin|cache_aware|power_of_two)$", description="Routing policy."
    )
    router_health_check_interval_s: int = pydantic.Field(default=5, ge=1, description="Router's worker checks.")
    router_extra_args: list[str] = pydantic.Field(default_factory=list, description="Router flags, unchecked.")

    @pydantic.field_validator("env")
    @classmethod
    def _environment_names(cls, value: dict[str, str]) -> dict[str, str]:
        bad = [name for name in value if not name or "=" in name or "\0" in name or "\0" in value[name]]
        if bad:
            raise ValueError(f"environment variable names {bad!r:.200} are not valid (no '=', no NUL, not empty)")
        return value

    @pydantic.model_validator(mode="after")
    def _known_server_args(self) -> SglangSection:
        if not self.server_args:
            return self
        python = resolve_sglang_python(self.python) if self.runs_stock_sglang() else None
        check_server_args(self.server_args, *server_arg_fields(python))
        return self

    @pydantic.field_validator("server_args")
    @classmethod
    def _server_arg_values(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_server_arg_values(value)
        return value

    def resolved_notes(self) -> dict[str, str]:
        """``python: auto`` as found, and how (shown by ``miles config show``)."""
        if self.python != "auto":
            return {}
        python, how = find_sglang_python()
        return {"python": f"auto = {python} ({how})"}

    def runs_stock_sglang(self) -> bool:
        """Whether ``launch_command`` starts SGLang's own server (not another server speaking its API)."""
        return any("sglang.launch_server" in part for part in self.launch_command)

    def sglang_python(self) -> str:
        """The engine environment's interpreter (``python`` resolved)."""
        return resolve_sglang_python(self.python)


def check_server_args(value: dict[str, Any], fields: frozenset[str], source: str) -> None:
    """Refuse names that are not ``ServerArgs`` fields (with the closest ones) or that Miles sets itself."""
    problems = []
    for name in value:
        if name in SET_BY_MILES:
            problems.append(f"{name!r} is set by Miles from {SET_BY_MILES[name]}")
        elif name not in fields:
            close = difflib.get_close_matches(name, fields, n=3, cutoff=0.6)
            hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            problems.append(f"{name!r} is not an SGLang server setting{hint}")
    if problems:
        raise ValueError(f"{'; '.join(problems)}; checked against {source}; pass other flags through sglang.extra_args")


MAX_SHOWN_CHOICES = 8
_TYPE_CHECKS: dict[str, tuple[Any, str]] = {
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "a whole number"),
    "float": (lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number"),
    # a mapping travels as its JSON text (server_flags), which is what SGLang's JSON settings read
    "str": (lambda v: isinstance(v, str | dict), "a string (quote it)"),
    "dict": (lambda v: isinstance(v, dict), "a mapping"),
    "list": (lambda v: isinstance(v, list), "a list"),
}


def check_server_arg_values(value: dict[str, Any]) -> None:
    """Refuse values that do not fit the field's type, choices or documented range in :func:`server_args_table`
    (``null`` leaves a setting at SGLang's default; a field the table lacks, from another sglang, is not checked)."""
    table = server_args_table()
    problems = [
        f"{name} = {_shown(item)}: {problem}"
        for name, item in value.items()
        if name in table and item is not None
        for problem in [_value_problem(table[name], item)]
        if problem is not None
    ]
    if problems:
        raise ValueError(f"{'; '.join(problems)} (SGLang's ServerArgs, from {TABLE_FILE.name})")


def _value_problem(field: dict[str, Any], value: Any) -> str | None:
    kind = field["type"]
    items = [value]
    if kind.startswith("list"):  # one value is a list of one, as on SGLang's command line
        items, kind = value if isinstance(value, list) else [value], kind[5:-1] if kind.startswith("list[") else "any"
    for item in items:
        check = _TYPE_CHECKS.get(kind)
        if check is not None and not check[0](item):
            return f"expected {check[1]}, got {type(item).__name__}"
        choices = field.get("choices")
        if choices and item not in choices:
            shown = ", ".join(map(repr, choices[:MAX_SHOWN_CHOICES]))
            more = f", ... ({len(choices)} in all)" if len(choices) > MAX_SHOWN_CHOICES else ""
            return f"not one of {shown}{more}"
        problem = _range_problem(field.get("range"), item)
        if problem is not None:
            return problem
    return None


def _range_problem(bounds: dict[str, Any] | None, value: Any) -> str | None:
    if not bounds or not isinstance(value, int | float) or isinstance(value, bool):
        return None
    tests = {"gt": (value > bounds.get("gt", -math.inf), ">"), "ge": (value >= bounds.get("ge", -math.inf), ">=")}
    tests |= {"lt": (value < bounds.get("lt", math.inf), "<"), "le": (value <= bounds.get("le", math.inf), "<=")}
    allowed = " and ".join(f"{sign} {bounds[key]}" for key, (_, sign) in tests.items() if key in bounds)
    if all(ok for ok, _ in tests.values()):
        return None
    return f"out of range: SGLang allows {allowed}"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def server_flags(server_args: dict[str, Any]) -> list[str]:
    """Command-line flags for ``server_args``: ``--name value``; ``True`` is a bare flag, ``False`` and ``None``
    are left out, a list gives its values after one flag, a dict is passed as JSON."""
    import json

    flags: list[str] = []
    for name, value in server_args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list | tuple):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags
