"""The ``sglang`` config section: how SGLang engines (and the sglang-router) are launched.

``server_args`` are SGLang server settings by their ``ServerArgs`` field names (``mem_fraction_static: 0.8``). They
are checked against the installed sglang's ``ServerArgs`` when sglang is importable, and against the field list
shipped with this plugin (``server_args_fields.txt``, read from sglang 0.5.23) otherwise. ``extra_args`` passes
flags through unchecked, explicitly.
"""

from __future__ import annotations

import difflib
import functools
from pathlib import Path
from typing import Any

import pydantic

from miles_core.config.section import Section

FIELDS_FILE = Path(__file__).with_name("server_args_fields.txt")
SET_BY_MILES = {
    "model_path": "the run's checkpoint (--model)", "host": "the worker provider", "port": "the worker provider",
    "admin_api_key": "the run's token", "tp_size": "sglang.tp_size", "dp_size": "sglang.dp_size",
    "ep_size": "sglang.ep_size", "random_seed": "run.seed (--seed)",
}  # fmt: skip
"""Server settings Miles sets itself, and where they come from."""
PYTHON = "{python}"
"""Stands for the Python interpreter running Miles in a launch command."""


@functools.cache
def server_arg_fields() -> tuple[frozenset[str], str]:
    """SGLang's server settings: the installed ``ServerArgs`` fields, else the shipped list; and their source."""
    try:
        from sglang.srt.server_args import ServerArgs
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

    launch_command: list[str] = pydantic.Field(
        default=[PYTHON, "-m", "sglang.launch_server"], min_length=1,
        description="Command that starts one server speaking SGLang's HTTP API; {python} is this interpreter.",
    )  # fmt: skip
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

    @pydantic.field_validator("server_args")
    @classmethod
    def _known_server_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        fields, source = server_arg_fields()
        problems = []
        for name in value:
            if name in SET_BY_MILES:
                problems.append(f"{name!r} is set by Miles from {SET_BY_MILES[name]}")
            elif name not in fields:
                close = difflib.get_close_matches(name, fields, n=3, cutoff=0.6)
                hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
                problems.append(f"{name!r} is not an SGLang server setting{hint}")
        if problems:
            raise ValueError(f"{'; '.join(problems)}; checked against {source}; "
                             "pass other flags through sglang.extra_args")  # fmt: skip
        return value


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
