"""Shared helpers: run the installed ``miles`` command as a user would, and build throwaway plugin distributions."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# The protocol contract's fixtures (an opt-in plugin: installing miles-core registers no pytest plugin), and the
# guard of CI's time budget (the serial pass fails when a test over a minute is not listed with its reason).
pytest_plugins = ["miles_core.testkit.protocol_contract", "tests.ci_budget"]

MILES = Path(sys.executable).parent / "miles"
REPO = Path(__file__).resolve().parent.parent
SERIAL_TESTS = (
    "tests/sglang/",  # real SGLang servers: each takes both cores
    "tests/engines/test_bench_serving.py",
    "tests/megatron/test_megatron_train.py",  # training runs of several ranks and engines
    "tests/megatron/test_process_group_binding.py",  # reads which sockets a process listens on
    "tests/rdt/",
    "tests/test_train_rdt.py",
    "tests/weight_transfer/test_broadcast_",
    "tests/workers/",  # RPC deadlines and health timeouts of a second or so, and Ray clusters
    "tests/cluster/",  # hosts in network namespaces, a Ray node each, and learning runs across them
    "tests/test_train.py",  # learning runs and engine deaths mid-run
    "tests/test_lifecycle.py",  # runs killed mid-step (local Ray, Megatron ranks)
    "tests/test_train_fully_async.py",
    "tests/test_train_moe.py",  # MoE learning runs
    "tests/test_train_agent.py",  # an agent run that learns, an engine killed mid-session
    "tests/metrics/test_train_exporters.py",
    "tests/metrics/test_train_trackers.py",
    "tests/test_train_eval_at_k.py",
    "tests/test_train_lora.py",  # a LoRA learning run and a resumed one
    "tests/dashboard/test_browser.py",
)
"""Tests marked ``serial`` (by path prefix): ``make test`` runs them after the others, which run on several workers
(pytest-xdist). They are the CPU-heavy ones and those whose deadlines a loaded machine could miss. The Megatron model
tests (a step or a forward of tiny models on two gloo ranks, no deadline under a minute) run with the others: mostly
process start-up, they overlap well, and CI's 40 minutes need the overlap."""
PARALLEL_SAFE = (
    "tests/sglang/test_engine_loader.py",  # no server: the loader's checks on files and tensors
    "tests/sglang/test_server_args_table.py",  # no server: SGLang's argument parser, in its own environment
    "tests/sglang/test_engine_environment.py",  # no server: the engine's environment and command line
    "tests/rdt/test_staging.py",  # no Ray, no NIXL agent: staging files and their bounds
    "tests/workers/test_rpc_wire.py",  # the wire format, no deadline
    "tests/workers/test_node_check.py",  # address checks, no deadline
    "tests/dashboard/test_cli.py",  # a dashboard process per test, stop deadlines of 30 s
)
"""Files under a serial path prefix that run with the others after all: no server start, no deadline, no Ray."""
PAIRED_TESTS = (
    "tests/cluster/test_learning_across_hosts.py",
    "tests/cluster/test_exposure_across_hosts.py",
    "tests/cluster/test_bad_input_across_hosts.py",
    "tests/cluster/test_hosts.py",
    "tests/megatron/test_megatron_train.py",
    "tests/test_train.py",
    "tests/test_train_agent.py",
    "tests/test_train_fully_async.py",
    "tests/test_train_moe.py",
    "tests/test_train_eval_at_k.py",
    "tests/test_train_lora.py",
    "tests/metrics/test_train_exporters.py",
    "tests/metrics/test_train_trackers.py",
    "tests/dashboard/test_browser.py",
)
"""Serial files that may run beside one other serial file (marked ``paired`` too): whole learning runs and runs across
hosts, whose only time limits are minutes-long subprocess timeouts, and which leave much of the machine idle (one at
a time, the serial pass's test processes used 31 CPU-minutes in its 52 minutes on a 2-core AMD EPYC: process and
engine start-ups, Ray, waits on one rank). ``make test`` runs them on 2 workers, a file to a worker, between the
parallel pass and the serial tests that run alone: the RPC, health and heartbeat deadlines, the kill-and-count tests,
real SGLang, and ``tests/test_train_rdt.py`` (it counts NIXL's buffers machine-wide). The multi-host files share one
harness of namespaces (a session fixture), so they go to one worker together (:data:`HARNESS_GROUP`)."""
HARNESS_GROUP = "tests/cluster/"
"""The paired files under this prefix run on one worker, as one group: the session's harness of hosts is built once,
and two harnesses at once could draw the same subnet."""


LONGEST_FILES = (
    "tests/megatron/test_megatron_trainer.py",  # about 500 s: a Megatron launch per layout and algorithm
    "tests/rollout/test_tool_task_learns.py",  # three agent learning runs of 100 to 150 s
    "tests/test_train_algorithms.py",  # about 270 s: a run per estimator
    "tests/rollout/test_prompt_data_train.py",  # the chat math set's learning run, about 100 s
)
"""The parallel pass's longest files, handed out first: a worker given one as the pass ends leaves the other idle
for minutes. A file's tests run on one worker (``--dist loadfile``), and files go out in collection order
(``--no-loadscope-reorder``: by default pytest-xdist hands out the files with the most tests first, which put
``test_tool_task_learns.py``'s three runs at the very end of the pass, alone on one worker, in a CI run)."""


def paired_group(path: str) -> str:
    """The pytest-xdist group of a paired test (``--dist loadgroup``): its file, or the harness's group."""
    return HARNESS_GROUP if path.startswith(HARNESS_GROUP) else path


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (it appends each to the test's node id)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(item.path).relative_to(REPO).as_posix()
        if path.startswith(SERIAL_TESTS) and not path.startswith(PARALLEL_SAFE):
            item.add_marker(pytest.mark.serial)
            if path.startswith(PAIRED_TESTS):
                item.add_marker(pytest.mark.paired)
                item.add_marker(pytest.mark.xdist_group(paired_group(path)))
    items.sort(key=_longest_first)  # stable: the others keep their order


def _longest_first(item: pytest.Item) -> int:
    path = Path(item.path).relative_to(REPO).as_posix()
    return LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)


def run_miles(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout_s: float = 300
) -> subprocess.CompletedProcess:
    """Run the installed ``miles`` console script in a fresh process."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [str(MILES), *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout_s, check=False
    )


def plugins_json(*args: str, env: dict[str, str] | None = None) -> dict:
    """``miles plugins --json`` as a mapping from plugin name to its description (plus ``"blocked"``)."""
    result = run_miles("plugins", "--json", *args, env=env)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    return {"blocked": data["blocked"], **{p["name"]: p for p in data["plugins"]}}


def config_json(*args: str, env: dict[str, str] | None = None) -> dict:
    """``miles config show --json`` parsed."""
    result = run_miles("config", "show", "--json", *args, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def pip_install_distribution(
    target: Path, source: Path, *, name: str, entry_points: str, files: dict[str, str]
) -> None:
    """Write a tiny distribution into ``source`` and ``pip install`` it into the directory ``target``."""
    source.mkdir(parents=True)
    package = name.replace("-", "_")
    (source / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [build-system]
            requires = ["setuptools>=64"]
            build-backend = "setuptools.build_meta"
            [project]
            name = "{name}"
            version = "9.9.9"
            [tool.setuptools]
            packages = ["{package}"]
            """
        )
        + entry_points
    )
    (source / package).mkdir()
    for filename, text in files.items():
        (source / package / filename).write_text(textwrap.dedent(text))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def loop():
    """One event loop for a module whose fixtures hold async resources (a provider, a protocol) across tests."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Path:
    """A directory on PYTHONPATH for plugin modules written by a test."""
    path = tmp_path / "plugin_modules"
    path.mkdir()
    return path


def with_pythonpath(*paths: Path) -> dict[str, str]:
    """An environment overlay putting ``paths`` on PYTHONPATH, before what it already holds (a checkout under test
    may be on it)."""
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return {"PYTHONPATH": os.pathsep.join([*(str(p) for p in paths), *inherited])}
