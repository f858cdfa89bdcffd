"""The ``sglang`` config section: how SGLang engines (and the sglang-router) are launched.

Engines run in an environment of their own (``sglang.python``): SGLang pins its own torch and transformers, which
differ from Miles', so production setups and ``make sglang`` keep it in a separate virtual environment.

``server_args`` are SGLang server settings by their ``ServerArgs`` field names (``mem_fraction_static: 0.8``). They
are checked against the ``ServerArgs`` of the sglang that will serve: the engine environment's (asked once per run
with a short subprocess), this interpreter's when it has sglang, else the field list shipped with this plugin
(``server_args_fields.txt``, read from sglang 0.5.23). ``extra_args`` passes flags through unchecked, explicitly.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pydantic

from miles_core import Section

FIELDS_FILE = Path(__file__).with_name("server_args_fields.txt")
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
"""Where ``make sglang`` puts the SGLang environment (relative to the working directory)."""
_FIELDS_SCRIPT = """
import dataclasses, json
from sglang.srt.server_args import ServerArgs
names = getattr(ServerArgs, "__struct_fields__", None) or [f.name for f in dataclasses.fields(ServerArgs)]
print(json.dumps(sorted(names)))
"""


def resolve_sglang_python(setting: str) -> str:
    """The engine environment's interpreter for the setting ``sglang.python``: a path as given, or for ``auto``
    ``$MILES_SGLANG_PYTHON``, else ``.venv-sglang/bin/python`` of the working directory when it exists, else the
    interpreter running Miles."""
    if setting != "auto":
        return setting
    if os.environ.get(SGLANG_PYTHON_ENV):
        return os.environ[SGLANG_PYTHON_ENV]
    candidate = DEFAULT_ENVIRONMENT / "bin" / "python"
    return str(candidate.absolute()) if candidate.is_file() else sys.executable


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
def _local_fields() -> tuple[frozenset[str], str]:
    try:
        from sglang.srt.server_args import ServerArgs  # deferred: heavy and usually absent (an environment of its own)
    except ImportError:
        names = [line.strip() for line in FIELDS_FILE.read_text().splitlines() if line.strip() and line[0] != "#"]
        return frozenset(names), f"the field list shipped with miles-plugins-sglang ({FIELDS_FILE.name})"
    fields = getattr(ServerArgs, "__struct_fields__", None)  # msgspec Struct (sglang >= 0.5.2x)
    if fields is None:
        import dataclasses

        fields = [field.name for field in dataclasses.fields(ServerArgs)]
    return frozenset(name for name in fields if not name.startswith("_")), "the installed sglang's ServerArgs"


class SglangSection(Section):
    """SGLang engines: the launch command, server settings, parallel sizes, and the router in front of them."""

    python: str = pydantic.Field(
        default="auto",
        min_length=1,
        description="Interpreter of the engine environment ({sglang_python} in launch_command): a path, or auto = "
        f"${SGLANG_PYTHON_ENV}, else {DEFAULT_ENVIRONMENT}/bin/python here (make sglang), else this interpreter.",
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
        default_factory=dict, description="SGLang ServerArgs fields and values (checked against the field names)."
    )
    extra_args: list[str] = pydantic.Field(default_factory=list, description="Flags passed through unchecked.")
    tp_size: int = pydantic.Field(default=1, ge=1, description="Tensor-parallel size of each engine.")
    dp_size: int = pydantic.Field(default=1, ge=1, description="Data-parallel size of each engine.")
    ep_size: int = pydantic.Field(default=1, ge=1, description="Expert-parallel size of each engine.")
    gpus_per_engine: float | None = pydantic.Field(
        default=None, ge=0, description="GPUs the provider reserves per engine; default tp_size * dp_size with CUDA."
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
