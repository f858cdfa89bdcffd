"""Write the table of SGLang's server settings that the sglang plugin checks ``sglang.server_args`` against.

    .venv-sglang/bin/python tools/sglang_server_args_table.py --write   # rewrite the plugin's server_args_table.json
    .venv-sglang/bin/python tools/sglang_server_args_table.py           # print it

Run it with the SGLang environment's interpreter (``make sglang``): it reads ``ServerArgs`` of the installed sglang,
each field's type from its annotation (``int``, ``float``, ``bool``, ``str``, a list of one of them, a mapping, or
``any`` for what a flag's text cannot be checked against), whether it may be null, its choices (a ``Literal``, or
the ``choices`` of its command-line flag), and the ranges that SGLang documents in its help texts and checks
(:data:`DOCUMENTED_RANGES`, each with SGLang's own words). The table is checked in, so that the plugin checks values
in Miles' environment, where sglang is not installed; ``tests/sglang/test_server_args_table.py`` checks that it
matches the SGLang environment whenever one exists. Only the standard library and sglang are imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

TABLE = Path(__file__).resolve().parents[1] / "miles_plugins_sglang" / "miles_plugins_sglang" / "server_args_table.json"

DOCUMENTED_RANGES: dict[str, dict[str, Any]] = {
    "mem_fraction_static": {
        "gt": 0,
        "le": 1,
        "doc": "The fraction of the memory used for static allocation (model weights and KV cache memory pool).",
    },
    "swa_full_tokens_ratio": {
        "ge": 0,
        "le": 1,
        "doc": "The ratio of SWA layer KV tokens / full layer KV tokens ... It should be between 0 and 1.",
    },
    "eplb_min_rebalancing_utilization_threshold": {
        "ge": 0,
        "le": 1,
        "doc": "Minimum threshold for GPU average utilization to trigger EPLB rebalancing. Must be in the range "
        "[0.0, 1.0].",
    },
    "disaggregation_decode_host_receive_threshold": {
        "ge": 0,
        "le": 1,
        "doc": "Device token usage fraction at which incoming KV is received ... Range [0, 1].",
    },
    "hicache_host_memory_fraction": {"gt": 0, "le": 1, "doc": "Fraction of the available host memory ..."},
    "pp_size": {"ge": 1, "doc": "The pipeline parallelism size."},
    "nnodes": {"ge": 1, "doc": "The number of nodes."},
    "node_rank": {"ge": 0, "doc": "The node rank."},
    "max_running_requests": {"ge": 1, "doc": "The maximum number of running requests."},
    "max_total_tokens": {"ge": 1, "doc": "The maximum number of tokens in the memory pool."},
}
"""Ranges SGLang states for a setting (its help text, quoted in ``doc``; its validation refuses values outside)."""

_SCALARS = {bool: "bool", int: "int", float: "float", str: "str"}


def describe(annotation: Any) -> dict[str, Any]:
    """``{"type": ..., "nullable": ...}`` (and ``"choices"`` for a ``Literal``) for one field's annotation."""
    nullable = False
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        nullable = len(members) < len(typing.get_args(annotation))
        if len(members) != 1:
            return {"type": "any", "nullable": nullable}
        annotation = members[0]
    if typing.get_origin(annotation) is typing.Literal:
        choices = list(typing.get_args(annotation))
        nullable = nullable or None in choices
        return {"type": "any", "nullable": nullable, "choices": [c for c in choices if c is not None]}
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation], "nullable": nullable}
    if typing.get_origin(annotation) in (list, typing.List):  # noqa: UP006 (sglang writes typing.List)
        (item,) = typing.get_args(annotation) or (Any,)
        return {"type": f"list[{_SCALARS[item]}]" if item in _SCALARS else "list", "nullable": nullable}
    if annotation is dict or typing.get_origin(annotation) in (dict, typing.Dict):  # noqa: UP006
        return {"type": "dict", "nullable": nullable}
    return {"type": "any", "nullable": nullable}


def flag_choices() -> dict[str, list[Any]]:
    """The ``choices`` of each server flag, by field name, as ``sglang.launch_server`` parses them."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return {action.dest: _listed(action.choices) for action in parser._actions if action.choices}


def _listed(choices: Any) -> list[Any]:
    """``choices`` as a list; a set (some flags' choices are) sorted, so that the table is the same on every run."""
    return sorted(choices, key=repr) if isinstance(choices, set | frozenset) else list(choices)


def table() -> dict[str, Any]:
    """The whole table: the sglang version and one entry per public ``ServerArgs`` field, by name."""
    import sglang
    from sglang.srt.server_args import ServerArgs

    names = getattr(ServerArgs, "__struct_fields__", None)
    if names is None:  # a dataclass (sglang before the msgspec Struct)
        import dataclasses

        names = [field.name for field in dataclasses.fields(ServerArgs)]
    hints = typing.get_type_hints(ServerArgs, include_extras=True)
    choices = flag_choices()
    fields: dict[str, Any] = {}
    for name in sorted(n for n in names if not n.startswith("_")):
        entry = describe(hints.get(name, Any))
        if name in choices and "choices" not in entry:
            entry["choices"] = choices[name]
        if name in DOCUMENTED_RANGES:
            entry["range"] = DOCUMENTED_RANGES[name]
        fields[name] = entry
    return {
        "source": f"sglang {sglang.__version__}: sglang.srt.server_args.ServerArgs, by {Path(__file__).name}",
        "fields": fields,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {TABLE.name} instead of printing it")
    args = parser.parse_args()
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # import on a machine without a GPU
    text = json.dumps(table(), indent=1, sort_keys=True) + "\n"
    if args.write:
        TABLE.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
