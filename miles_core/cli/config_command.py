"""``miles config show`` (the resolved config) and ``miles train`` (the RL loop), which share the config flags."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from miles_core.cli.config_args import ConfigArguments
from miles_core.cli.stop_signals import StopSignals
from miles_core.config.build import build_config
from miles_core.plugin_manager import MilesPluginManager
from miles_core.training.algorithms import resolve_entropy_coef, resolve_kl_coef

if TYPE_CHECKING:
    from miles_core.config.build import MilesConfig
    from miles_core.registry import Registries


def prepare(
    parser: argparse.ArgumentParser, plugin_args: list[str], *, command: str
) -> Callable[[argparse.Namespace], int]:
    """Load the plugins, add the config flags to ``parser``, and return the function that runs the command."""
    manager = MilesPluginManager.load(plugin_args)
    arguments = ConfigArguments(manager)
    arguments.add_to(parser)

    def show(args: argparse.Namespace) -> int:
        config = build_config(manager, config_file=args.config, overrides=arguments.overrides(args))
        data = config.model_dump(mode="json")
        print(json.dumps(data, indent=2) if args.json else yaml.safe_dump(data, sort_keys=False).rstrip("\n"))
        notes = resolved_notes(config) + estimator_default_notes(config, manager.registries)
        if notes:  # comments after the YAML (it stays a config file); with --json on stderr, leaving stdout JSON
            print("\n".join(f"# {line}" for line in notes), file=sys.stderr if args.json else sys.stdout)
        return 0

    def train(args: argparse.Namespace) -> int:
        from miles_core.loop import run_training  # deferred: imports torch and transformers

        config = build_config(manager, config_file=args.config, overrides=arguments.overrides(args))
        stop = StopSignals()
        try:
            with stop:
                reporter = asyncio.run(run_training(config, manager, progress=not args.no_progress))
        except KeyboardInterrupt:  # the run's workers are stopped by then (the loop's finally blocks)
            print(f"miles: {stop.name}; {_where_the_run_is(config.run.output_dir)}", file=sys.stderr, flush=True)
            return stop.exit_status
        print(reporter.final_table())
        print(f"metrics: {reporter.metrics_file}")
        return 0

    return show if command == "config" else train


def resolved_notes(config: MilesConfig) -> list[str]:
    """``SECTION.FIELD: what it resolves to here``, from each section's ``resolved_notes``."""
    return [
        f"{section_name}.{field}: {note}"
        for section_name in type(config).model_fields
        for field, note in getattr(config, section_name).resolved_notes().items()
    ]


def estimator_default_notes(config: MilesConfig, registries: Registries) -> list[str]:
    """``train.kl_coef: ...`` and ``train.entropy_coef: ...`` where one is unset and the estimator's default weight
    is not 0 (unset reads as off otherwise): the value the run takes."""
    estimator = registries.advantage_estimators.get_or_raise(config.train.advantage_estimator).load()
    notes = []
    for field, resolve in (("kl_coef", resolve_kl_coef), ("entropy_coef", resolve_entropy_coef)):
        value = resolve(config.train, estimator)
        if getattr(config.train, field) is None and value:
            notes.append(f"train.{field}: unset, so {config.train.advantage_estimator}'s default, {value:g}")
    return notes


def _where_the_run_is(output_dir: str) -> str:
    """Where an interrupted run is, and how to continue it."""
    from miles_core.run_setup import latest_checkpoint  # deferred: imports torch and transformers (loaded by now)

    latest = latest_checkpoint(Path(output_dir))
    if latest is None:
        return f"the run is in {output_dir}, with no checkpoint yet (a new run there moves it aside)"
    return f"the run is in {output_dir}; --run-resume true continues it from {latest}"
