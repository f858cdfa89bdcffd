"""``miles``: the command line.

``--plugin`` is global and may appear anywhere; it is taken out of the arguments first, because plugins
contribute the config flags that the rest of the command line is parsed with. Only the commands that need plugins
load them, so ``miles --help`` stays fast.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys
import typing
from collections.abc import Callable, Sequence

from miles_core.cli.exit_codes import FAILED, INTERRUPTED, USAGE_ERROR
from miles_core.default.threads import omp_wait_policy
from miles_core.errors import MilesError

PLUGIN_HELP = (
    "load a plugin: a module name or a path to a .py file; 'no:NAME' blocks the plugin NAME (repeatable, "
    "allowed anywhere on the command line)"
)


def split_plugin_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate ``--plugin X`` / ``--plugin=X`` from the other arguments, keeping the order of each."""
    plugins: list[str] = []
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--plugin":
            value = next(args, None)
            if value is None:
                raise MilesError("--plugin needs a value: a module, a path to a .py file, or no:NAME")
            plugins.append(value)
        elif arg.startswith("--plugin="):
            plugins.append(arg.split("=", 1)[1])
        elif arg == "--":
            rest.append(arg)
            rest.extend(args)
        else:
            rest.append(arg)
    return plugins, rest


SHOW_USAGE = "[--json] [--config FILE.yaml] [CONFIG FLAGS]"
TRAIN_USAGE = "[--no-progress] [--config FILE.yaml] [CONFIG FLAGS]"
"""The usage lines of the config commands: their --help lists every config flag once, the usage line none."""
BUILTIN_COMMANDS = {"dashboard": "miles_core.builtin.dashboard.command:serve_dashboard"}
"""The commands a built-in plugin implements, by target, imported when run (as the plugin manager names the built-in
plugins: the kernel imports no built-in)."""
MAX_LISTED_UNKNOWN = 10
"""Unknown arguments named in an error; the rest are counted."""


class CommandLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and a hint, not the usage of every config flag: it raises a
    :class:`MilesError`, which ``main`` prints."""

    def error(self, message: str) -> typing.NoReturn:
        hint = f"`{self.prog} --help` lists what is allowed"
        if "expected one argument" in message:
            hint += "; a value that starts with '-' is written --FLAG=-VALUE"
        raise MilesError(f"{message}\n  ({hint})")


def build_parser(command: str | None, plugin_args: list[str]) -> tuple[argparse.ArgumentParser, Callable | None]:
    """The parser; config flags are added only to the command about to run (they need the plugins)."""
    parser = CommandLineParser(
        prog="miles", description="Miles: plugin-based RL post-training of large language models."
    )
    parser.add_argument("--plugin", action="append", metavar="MODULE|FILE|no:NAME", help=PLUGIN_HELP)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    plugins = commands.add_parser("plugins", help="list the loaded plugins and what they provide")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")

    config = commands.add_parser("config", help="inspect the resolved config")
    config_commands = config.add_subparsers(dest="config_command", metavar="SUBCOMMAND", required=True)
    show = config_commands.add_parser(
        "show", help="print the resolved config (defaults < --config < flags)", usage=f"miles config show {SHOW_USAGE}"
    )
    show.add_argument("--json", action="store_true", help="print JSON instead of YAML")

    commands.add_parser("version", help="print the versions of miles-core and of every plugin distribution")
    train_help = "run RL post-training (no arguments: the embedded default on CPU)"
    train = commands.add_parser("train", help=train_help, usage=f"miles train {TRAIN_USAGE}")
    train.add_argument("--no-progress", action="store_true", help="no progress bar (the per-step lines remain)")

    dashboard = commands.add_parser("dashboard", help="serve the dashboard of a run directory (127.0.0.1 by default)")
    dashboard.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (its --output-dir)")
    dashboard.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: 127.0.0.1; 0.0.0.0 for every interface, on purpose)",
    )
    dashboard.add_argument("--port", type=_port, default=0, help="port to bind (default: 0, a free port)")

    finish = None
    if command in ("config", "train"):
        from miles_core.cli import config_command  # deferred: needs the plugins, pydantic and the config model

        finish = config_command.prepare(show if command == "config" else train, plugin_args, command=command)
    return parser, finish


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``miles`` command line; returns the exit status."""
    os.environ.update(omp_wait_policy())  # before torch is imported (its OpenMP reads it once), inherited by workers
    try:
        return _run(list(sys.argv[1:] if argv is None else argv))
    except MilesError as exc:
        print(f"miles: error: {_bounded(str(exc))}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:  # Ctrl-C (or SIGINT) outside plugin code: stop without a traceback
        print("miles: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:  # `miles config show | head`: the reader has gone, which is no error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else Python reports it again at exit
        return FAILED


def _bounded(message: str, *, max_lines: int = 40, max_line: int = 600) -> str:
    """An error message of bounded size: a user's value may be megabytes long, and errors quote values. Long lines
    lose their middle (the start names the field, the end says what to do); extra lines are counted."""
    lines = message.splitlines()
    kept = [
        line
        if len(line) <= max_line
        else f"{line[: max_line // 2]} ... ({len(line) - max_line} characters cut) ... {line[-max_line // 2 :]}"
        for line in lines[:max_lines]
    ]
    if len(lines) > max_lines:
        kept.append(f"... and {len(lines) - max_lines} more lines")
    return "\n".join(kept)


def _run(argv: list[str]) -> int:
    plugin_args, rest = split_plugin_args(argv)
    command = next((arg for arg in rest if not arg.startswith("-")), None)
    parser, finish = build_parser(command, plugin_args)
    args, unknown = parser.parse_known_args(rest)
    if unknown:
        prog = " ".join(["miles", *(name for name in (args.command, getattr(args, "config_command", None)) if name)])
        raise MilesError(f"{_unknown_arguments_message(parser, unknown)}\n  (`{prog} --help` lists what is allowed)")
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "version":
        from miles_core.cli.plugins_command import print_versions

        return print_versions(plugin_args)
    if args.command == "plugins":
        from miles_core.cli.plugins_command import list_plugins

        return list_plugins(plugin_args, as_json=args.json)
    if args.command == "dashboard":
        serve_dashboard = _builtin_command("dashboard")
        return serve_dashboard(args.run_dir, host=args.host, port=args.port)
    assert finish is not None
    return finish(args)


def _builtin_command(name: str) -> Callable[..., int]:
    module, _, attribute = BUILTIN_COMMANDS[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


def _port(text: str) -> int:
    if not re.fullmatch(r"[0-9]{1,5}", text) or int(text) > 65535:  # ASCII: isdigit() takes "١٢" and "²" too
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0..65535; 0 picks a free one)")
    return int(text)


def _unknown_arguments_message(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """Name the unknown arguments and, for a mistyped flag, the closest known flags."""
    known = sorted(_all_option_strings(parser))
    listed = [arg if len(arg) <= 100 else f"{arg[:97]}..." for arg in unknown[:MAX_LISTED_UNKNOWN]]
    more = len(unknown) - len(listed)
    hints = []
    for arg in listed:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=3)
            if close:
                hints.append(f"{arg}: did you mean {' or '.join(close)}?")
    message = f"unrecognized arguments: {' '.join(listed)}" + (f" ... and {more} more" if more else "")
    return message + "".join(f"\n  {hint}" for hint in hints)


def _all_option_strings(parser: argparse.ArgumentParser) -> set[str]:
    options: set[str] = set()
    for action in parser._actions:  # argparse has no public API for walking sub-parsers
        options.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options |= _all_option_strings(sub)
    return options


if __name__ == "__main__":
    sys.exit(main())
