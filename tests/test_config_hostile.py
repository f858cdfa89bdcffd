"""Hostile and malformed input to the config and the command line, as a user (or an attacker) runs ``miles``.

Every case must end in exit status 2 with a short error (a few lines, no traceback), never a hang or unbounded
memory: each runs in a subprocess with a timeout and an address-space cap.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import resource
import shlex
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from miles_core.config.build import build_config, config_model
from miles_core.errors import ConfigError
from miles_core.plugin_manager import MilesPluginManager
from tests.conftest import MILES, REPO, config_json

MEMORY_CAP = 2 << 30  # `miles config show` runs in under 1 GiB of address space; the alias bomb wanted 3.7 GB
TIMEOUT_S = 120  # generous for a shared 2-core machine: a hang, not a slow start, is what it catches
READMES = sorted(
    path.relative_to(REPO) for path in REPO.glob("**/README.md") if not any(part.startswith(".") for part in path.parts)
)  # not .venv, nor .pytest_cache (which pytest writes a README into)
DOCUMENTS = READMES + sorted(path.relative_to(REPO) for path in (REPO / "docs").glob("**/*.md"))
"""The READMEs and the documentation site's pages (mkdocs.yml), where the root README's long sections now are."""


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def miles(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``miles`` with the memory cap and the timeout (a hang fails the test with TimeoutExpired)."""
    return subprocess.run(
        [str(MILES), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=cwd,
        preexec_fn=_cap_memory,
        check=False,
    )


def refused(*args: str, max_lines: int = 3) -> str:
    """Run ``miles config show ARGS`` expecting a short, clean refusal; return stderr."""
    result = miles("config", "show", *args)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert result.stdout == ""
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.startswith("miles: error: ")
    assert len(result.stderr.splitlines()) <= max_lines, result.stderr[:3000]
    return result.stderr


# -- config files that are not small UTF-8 YAML ----------------------------------------------------------------

NESTED = 10_000
LEVELS = "abcdefghi"
BOMB = "".join(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n" for prev, name in itertools.pairwise(LEVELS))
MERGE_CHAIN = "a0: &a0 {k0: 1}\n" + "".join(f"a{i}: &a{i} {{<<: *a{i - 1}, k{i}: 1}}\n" for i in range(1, 3000))
LOL = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
EXPANDED = "more than 100000 values once its aliases are expanded"
DEEP_32 = "[" * 32 + "{}" + "]" * 32
ALIASES_IN_ALIASES = f"a: &a {DEEP_32.format(1)}\nb: &b {DEEP_32.format('*a')}\nc: {DEEP_32.format('*b')}\n"
INDENTED_BOMB = "".join(f"    {line}" for line in BOMB.splitlines(keepends=True))
HOSTILE_FILES = {
    "utf16_bom": ("rollout:\n  batch_size: 4\n".encode("utf-16"), "not UTF-8 text"),
    "utf16le": ("rollout:\n  batch_size: 4\n".encode("utf-16-le"), "not UTF-8 text"),
    "utf32": ("rollout:\n  batch_size: 4\n".encode("utf-32"), "not UTF-8 text"),
    "latin1": ("rollout:\n  reward: caf\xe9\n".encode("latin-1"), "is not UTF-8 text (byte 0xe9 at line 2)"),
    "binary": (random.Random(0).randbytes(4096), "not UTF-8 text"),
    "control_character": (b"rollout:\n  reward: a\x07b\n", "not valid YAML at line 2: character '\\x07'"),
    "deep_lists": (("a: " + "[" * NESTED + "]" * NESTED).encode(), "nested deeper than 64 levels"),
    "deep_mappings": (("a: " + "{b: " * NESTED + "1" + "}" * NESTED).encode(), "nested deeper than 64 levels"),
    "deep_block": (("- " * NESTED + "1\n").encode(), "nested deeper than 64 levels"),
    "alias_bomb": ((LOL + BOMB).encode(), EXPANDED),
    "alias_bomb_in_settings": (f"weight_transfer:\n  settings:\n    {LOL}{INDENTED_BOMB}".encode(), EXPANDED),
    "aliases_nest_deeper_than_the_text": (ALIASES_IN_ALIASES.encode(), "deeper than 64 levels once aliases are"),
    "merge_chain": (MERGE_CHAIN.encode(), "merge keys ('<<') copy more than 100000 values"),
    "recursive_alias_mapping": (b"weight_transfer:\n  settings: &s {x: *s}\n", "contains itself (a recursive alias)"),
    "recursive_alias_list": (b"weight_transfer:\n  settings: {x: &l [1, *l]}\n", "contains itself (a recursive alias)"),
    "recursive_root": (b"&r {run: *r}\n", "contains itself (a recursive alias)"),
    "huge_integer": (b"run:\n  seed: " + b"9" * 5000 + b"\n", "an integer of more than 64 digits"),
    "binary_tag": (b"weight_transfer:\n  settings: {x: !!binary aGVsbG8=}\n", "the tag 'tag:yaml.org,2002:binary'"),
    "set_tag": (b"weight_transfer:\n  settings: !!set {a, b}\n", "the tag 'tag:yaml.org,2002:set'"),
    "python_tag": (b"run: !!python/object/apply:os.system [echo hi]\n", "is not allowed in a config"),
    "non_string_key": (b"weight_transfer:\n  settings: {1: x}\n", "key 1 of weight_transfer.settings is not a string"),
    "yes_key": (b"weight_transfer:\n  settings: {on: x}\n", "key True of weight_transfer.settings is not a string"),
    "nan_float": (b"train:\n  lr: .nan\n", "train.lr = nan: not a finite number"),
    "inf_in_settings": (b"weight_transfer:\n  settings: {timeout_s: -.inf}\n", "timeout_s = -inf: not a finite"),
    "too_large": (b"# padding\n" * 120_000, "is 1200000 bytes, more than the 1048576 allowed"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_FILES))
def test_hostile_config_file_is_refused_briefly(tmp_path: Path, name: str) -> None:
    content, expected = HOSTILE_FILES[name]
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(content)
    stderr = refused("--config", str(path))
    assert f"config file '{path}'" in stderr
    assert expected in stderr


def test_a_fifo_is_refused_before_it_is_opened(tmp_path: Path) -> None:
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)  # nobody writes to it: opening it for reading would wait forever
    stderr = refused("--config", str(fifo))
    assert f"config file '{fifo}' is not a regular file (a FIFO, device or socket)" in stderr


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_a_device_is_refused(device: str) -> None:
    assert f"config file '{device}' is not a regular file" in refused("--config", device)


def test_a_directory_is_refused(tmp_path: Path) -> None:
    assert f"config file '{tmp_path}' is a directory" in refused("--config", str(tmp_path))


def test_plain_yaml_features_still_work(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(
        "\ufeff# a BOM and comments are fine\nshared: &settings {transport: gloo, sizes: [1, 2]}\n"
        "weight_transfer:\n  settings: {a: *settings, b: *settings, when: 2024-01-01}\n"
    )
    stderr = refused("--config", str(path))  # 'shared' is not a section: the aliases themselves were accepted
    assert "shared: unknown key; allowed sections:" in stderr
    path.write_text(  # auto's settings per protocol, each checked against that protocol's settings model
        "weight_transfer:\n  settings:\n    tensor: {shm_dir: &d 2024-01-01}\n    disk: {work_dir: *d}\n"
        "    broadcast: {<<: {timeout_s: 5, backend: gloo}, timeout_s: 7}\n"
    )
    settings = config_json("--config", str(path))["weight_transfer"]["settings"]
    assert settings == {  # a date is read as its text, an alias as its value, a merged key as a default
        "tensor": {"shm_dir": "2024-01-01"},
        "disk": {"work_dir": "2024-01-01"},
        "broadcast": {"timeout_s": 7, "backend": "gloo"},
    }


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--weight-transfer-settings", "&a [*a]", "the value of --weight-transfer-settings: 0 contains itself"),
        ("--weight-transfer-settings", "{x: " + "[" * NESTED + "]" * NESTED + "}", "nested deeper than 64 levels"),
        ("--weight-transfer-settings", "{x: .inf}", "the value of --weight-transfer-settings: x = inf: not a finite"),
        ("--sglang-server-args", "{mem_fraction_static: .nan}", "mem_fraction_static = nan: not a finite number"),
        ("--sglang-extra-args", "[" + "9" * 5000 + "]", "an integer of more than 64 digits"),
        ("--model-implementations", "{llama: !!binary aGVsbG8=}", "the tag 'tag:yaml.org,2002:binary'"),
    ],
)
def test_structured_flag_values_are_read_within_the_same_bounds(flag: str, value: str, expected: str) -> None:
    assert expected in refused(flag, value)


# -- protocol settings (each protocol's declared model) ---------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--weight-transfer-settings", "{tensr: {zero_copy: false}}"], "auto has no setting 'tensr' (did you mean"),
        (["--weight-transfer-settings", "{broadcast: {timeout_s: -1}}"], "broadcast setting timeout_s = -1: expected"),
        (["--weight-transfer-settings", "{tensor: yes}"], "auto setting tensor = True: expected a mapping"),
        (
            ["--update-weight-transfer-mode", "disk", "--weight-transfer-settings", "{keep_versions: true}"],
            "disk setting keep_versions = True: expected a whole number of at least 1 and of at most 64 (a boolean is "
            "not a number)",
        ),
        (
            ["--update-weight-transfer-mode", "tensor", "--weight-transfer-settings", "{zero_copy: 'no'}"],
            "tensor setting zero_copy = 'no': expected true or false",
        ),
        (
            [
                "--update-weight-transfer-mode",
                "broadcast",
                "--weight-transfer-settings",
                "{bakend: gloo, timeout_s: 0}",
            ],
            "broadcast has no setting 'bakend' (did you mean 'backend'?)",
        ),
    ],
)
def test_protocol_settings_are_refused_by_config_show(args: list[str], expected: str) -> None:
    """Refused when the config is built (``miles config show`` builds it), not first when a run builds the protocol."""
    stderr = refused(*args, max_lines=4)
    assert "do not fit the protocol" in stderr and expected in stderr, stderr


# -- inf and nan ------------------------------------------------------------------------------------------------


def _float_settings() -> list[str]:
    """Every float setting of every section the installed plugins contribute (the core's and the plugins')."""
    model = config_model(MilesPluginManager.load([]))
    return [
        f"{section_name}.{field_name}"
        for section_name, section in model.model_fields.items()
        for field_name, field in section.annotation.model_fields.items()
        if field.annotation is float or (_is_union(field.annotation) and float in typing.get_args(field.annotation))
    ]


def _is_union(annotation: object) -> bool:
    """``float | None`` and the like (a ``dict[str, float]`` is a mapping, checked by its own validator)."""
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def test_every_float_setting_refuses_inf_and_nan() -> None:
    manager = MilesPluginManager.load([])
    settings = _float_settings()
    assert {"train.lr", "rollout.temperature", "train.kl_coef", "engine.startup_timeout_s"} <= set(settings)
    assert {"megatron.startup_timeout_s", "sglang.gpus_per_engine", "dashboard.warn_interval_s"} <= set(settings)
    for path in settings:
        for value in ("inf", "-inf", "nan", "Infinity", "1e999", float("inf"), float("nan")):
            with pytest.raises(ConfigError, match=f"{re.escape(path)} = .*Input should be a finite number"):
                build_config(manager, overrides={path: value})


@pytest.mark.parametrize(
    "args",
    [
        ["--train-lr", "inf"],
        ["--rollout-temperature=-inf"],
        ["--train-kl-coef", "nan"],
        ["--engine-startup-timeout-s", "Infinity"],
        ["--engine-health-check-interval-s", "1e999"],
    ],
)
def test_inf_and_nan_flags_are_refused(args: list[str]) -> None:
    assert "Input should be a finite number" in refused(*args)


# -- strict YAML: a boolean is not a number, a key is given once ------------------------------------------------


def _number_settings() -> list[str]:
    """Every int and float setting of every section the installed plugins contribute."""
    model = config_model(MilesPluginManager.load([]))

    def numeric(annotation: object) -> bool:
        members = [a for a in typing.get_args(annotation) if a is not type(None)] if _is_union(annotation) else []
        return annotation in (int, float) or (bool(members) and all(m in (int, float) for m in members))

    return [
        f"{section_name}.{field_name}"
        for section_name, section in model.model_fields.items()
        for field_name, field in section.annotation.model_fields.items()
        if numeric(field.annotation)
    ]


def test_a_yaml_boolean_is_not_a_number_for_any_setting() -> None:
    manager = MilesPluginManager.load([])
    settings = _number_settings()
    assert {"run.seed", "rollout.batch_size", "train.lr", "sglang.tp_size", "sglang.gpus_per_engine"} <= set(settings)
    for path in settings:
        for value in (True, False):
            with pytest.raises(ConfigError, match=f"{re.escape(path)} = {value}: .*a boolean .* is not a number"):
                build_config(manager, overrides={path: value})
    assert build_config(manager, overrides={"run.seed": 7}).run.seed == 7  # a number still is one
    assert build_config(manager, overrides={"dashboard.record": False}).dashboard.record is False  # a bool is a bool


def test_a_yaml_boolean_for_an_integer_in_a_config_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "seed.yaml"
    path.write_text("run: {seed: true}\n")
    assert "run.seed = True: Value error, a boolean (true) is not a number; give a number" in refused(
        "--config", str(path)
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("run:\n  seed: 1\nrun:\n  seed: 2\n", "at line 3, column 1: duplicate key 'run' (first at line 1)"),
        (
            "rollout:\n  batch_size: 4\n  group_size: 2\n  batch_size: 8\n",
            "at line 4, column 3: duplicate key 'batch_size' (first at line 2); give each key once",
        ),
        ("run: {seed: 1, seed: 2}\n", "at line 1, column 16: duplicate key 'seed' (first at line 1)"),
        (
            "weight_transfer:\n  settings:\n    x: 1\n    'x': 2\n",
            "at line 4, column 5: duplicate key 'x' (first at line 3)",
        ),
    ],
)
def test_a_duplicate_key_is_an_error_naming_the_key_and_its_line(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    assert f"config file {str(path)!r} is not valid YAML {expected}" in refused("--config", str(path))


def test_a_duplicate_key_in_a_structured_flag_value_is_refused_and_a_merge_may_be_overridden(tmp_path: Path) -> None:
    assert "duplicate key 'a' (first at line 1)" in refused("--weight-transfer-settings", "{a: 1, a: 2}")
    path = tmp_path / "merge.yaml"
    path.write_text("run:\n  <<: {seed: 5, num_steps: 3}\n  seed: 6\n")  # a merged key is a default to override
    run = config_json("--config", str(path))["run"]
    assert (run["seed"], run["num_steps"]) == (6, 3)


# -- long errors are summarised ----------------------------------------------------------------------------------


def test_thousands_of_unknown_keys_are_summarised(tmp_path: Path) -> None:
    path = tmp_path / "many.yaml"
    path.write_text("rollout:\n" + "".join(f"  key_{i}: {i}\n" for i in range(5000)))
    stderr = refused("--config", str(path), max_lines=22)
    assert "invalid config (5000 problems):" in stderr
    assert "rollout.key_0: unknown key; allowed keys of 'rollout': batch_size" in stderr
    assert "... and 4980 more problems" in stderr


def test_a_huge_key_or_value_is_cut_in_the_error(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    path.write_text(f"rollout:\n  {'k' * 1000}: 1\n  batch_size: {'x' * 100_000}\n")  # YAML keys: <= 1024
    stderr = refused("--config", str(path))
    assert len(stderr) < 1000
    assert "rollout.kkk" in stderr and "...: unknown key" in stderr
    assert "rollout.batch_size = 'xxx" in stderr and "...: Input should be a valid integer" in stderr


@pytest.mark.parametrize(
    "args",
    [["--model-impl", "l" * 3000 + "=x"], ["--reward", "x" * 50_000], ["--run-seed", "9" * 5000]],
    ids=["model-impl", "reward", "seed"],
)
def test_an_error_quoting_a_huge_value_stays_short(args: list[str]) -> None:
    stderr = refused(*args)
    assert len(stderr) < 1500, len(stderr)
    assert "characters cut" in stderr or "..." in stderr


def test_thousands_of_unknown_flags_are_summarised() -> None:
    stderr = refused(*(f"--unknown-{i}" for i in range(3000)))
    assert "unrecognized arguments: --unknown-0 --unknown-1" in stderr
    assert "... and 2990 more" in stderr


@pytest.mark.parametrize("command", [["config", "show"], ["train"]])
def test_a_flag_without_its_value_is_one_line_and_a_hint(command: list[str]) -> None:
    result = miles(*command, "--num-steps")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == "miles: error: argument --num-steps/--run-num-steps: expected one argument"
    assert len(lines) == 2 and f"miles {' '.join(command)} --help" in lines[1]
    assert "usage:" not in result.stderr


def test_a_negative_value_is_given_with_an_equals_sign() -> None:
    assert "a value that starts with '-' is written --FLAG=-VALUE" in refused("--rollout-temperature", "-inf")
    assert config_json("--rollout-top-k=-1")["rollout"]["top_k"] == -1


# -- --help shows each setting once ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["config", "show"], ["train"]])
def test_help_shows_each_setting_once_with_its_aliases(command: list[str]) -> None:
    result = miles(*command, "--help")
    assert result.returncode == 0, result.stderr
    usage, _, options = result.stdout.partition("\n\n")
    assert "--run-seed" not in usage  # the usage line is short; the options list every flag
    entries = [line.strip() for line in options.splitlines() if line.lstrip().startswith("-")]
    flags = [flag for entry in entries for flag in re.findall(r"(?:^|, )(--[a-z0-9-]+)", entry)]
    assert len(flags) == len(set(flags)), sorted(flag for flag in flags if flags.count(flag) > 1)
    for aliases in (
        "--seed N, --run-seed N",
        "--num-steps N, --run-num-steps N",
        "--model PATH, --model-path PATH",
        "--trainer NAME, --train-backend NAME",
        "--engine NAME, --engine-backend NAME",
        "--output-dir DIR, --run-output-dir DIR",
        "--update-weight-transfer-mode NAME, --weight-transfer-mode NAME",
        "--dashboard [BOOL], --dashboard-serve [BOOL]",
    ):
        assert aliases in entries or any(entry.startswith(aliases) for entry in entries), aliases
    # One setting, one option: every alias sets the same field.
    for flag in ("--num-steps", "--run-num-steps"):
        assert config_json(flag, "7")["run"]["num_steps"] == 7


# -- the removed external router mode ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args", [["--engine-router-url", "http://127.0.0.1:1"], ["--engine-router-url"], ["--engine-router-url="]]
)
def test_engine_router_url_flag_points_to_sglang_router(args: list[str]) -> None:
    stderr = refused(*args)
    assert "engine.router_url: removed:" in stderr and "--sglang-router true" in stderr


def test_engine_router_url_yaml_key_points_to_sglang_router(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("engine:\n  router_url: http://127.0.0.1:1\n")
    stderr = refused("--config", str(path))
    assert "engine.router_url: removed:" in stderr and "--sglang-router true" in stderr


def test_engine_router_url_is_gone_from_the_config_and_the_code() -> None:
    assert "router_url" not in config_json()["engine"]
    for path in ("miles_core/rollout/executor.py", "miles_plugins_sglang/miles_plugins_sglang/plugin.py"):
        assert "router_url" not in (REPO / path).read_text(), path
    assert "--engine-router-url" not in miles("train", "--help").stdout


# -- the run directory -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output_dir", "expected"),
    [
        ("/dev/null", "'/dev/null' exists and is not a directory"),
        ("/dev/null/run", "'/dev/null' is not a directory, so nothing can be under it"),
        ("/dev/null/a/b/c", "'/dev/null' is not a directory, so nothing can be under it"),
        ("FILE", "exists and is not a directory"),
        ("FILE/run", "is not a directory, so nothing can be under it"),
        ("x" * 5000, "File name too long"),
    ],
)
def test_output_dir_that_cannot_be_a_directory(tmp_path: Path, output_dir: str, expected: str) -> None:
    file = tmp_path / "a_file"
    file.write_text("keep me\n")
    output_dir = output_dir.replace("FILE", str(file))
    stderr = refused("--output-dir", output_dir)
    assert "run.output_dir (--output-dir) = " in stderr and expected in stderr
    assert file.read_text() == "keep me\n"  # nothing lost


def test_output_dir_that_does_not_exist_yet_is_fine(tmp_path: Path) -> None:
    assert config_json("--output-dir", str(tmp_path / "new" / "run"))["run"]["output_dir"].endswith("new/run")
    assert not (tmp_path / "new").exists()  # `config show` creates nothing


# -- the sglang plugin's cross-section checks --------------------------------------------------------------------

LOCAL_ENGINE_COMMAND = '["{python}", "-m", "miles_core.builtin.local_engine.server"]'


def test_verify_checksum_needs_engines_that_report_their_weights(tmp_path: Path) -> None:
    """Stock SGLang reports parameters (/get_weights_by_name: read back after each update); another server of SGLang's
    API reports nothing, so the check is refused before any engine starts."""
    verify = ["--weight-transfer-verify-checksum", "true"]
    assert config_json("--engine", "sglang", *verify)["weight_transfer"]["verify_checksum"] is True
    other = json.dumps([str(tmp_path / "my-server")])
    stderr = refused("--engine", "sglang", "--sglang-launch-command", other, "--weight-transfer-mode", "disk", *verify)
    assert "weight_transfer.verify_checksum = true (--weight-transfer-verify-checksum) needs engines that report" in (
        stderr
    )
    assert "serve disk, distributed: leave it false" in stderr


def test_verify_checksum_with_the_local_engine_behind_the_sglang_backend_is_accepted() -> None:
    checksum = ["--weight-transfer-verify-checksum", "true"]
    config = config_json(
        "--engine",
        "sglang",
        "--update-weight-transfer-mode",
        "disk",
        *checksum,
        "--sglang-launch-command",
        LOCAL_ENGINE_COMMAND,
    )
    assert config["weight_transfer"]["verify_checksum"] is True
    assert config_json("--weight-transfer-verify-checksum", "true")["weight_transfer"]["verify_checksum"] is True


# -- the documentation names real flags and commands that work ---------------------------------------------------

OTHER_PROGRAMS = {
    "--admin-api-key": "miles_plugins_sglang/miles_plugins_sglang/launch.py",  # passed to SGLang's server
    "--prometheus-host": "miles_plugins_sglang/miles_plugins_sglang/launch.py",  # passed to the sglang-router
    "--custom-weight-loader": "miles_plugins_sglang/miles_plugins_sglang/launch.py",  # SGLang's, set by the plugin
    "--repeats": "benchmarks/weight_transfer_rdt.py",
    "--across-machines": "benchmarks/weight_transfer_rdt.py",
    "--two-raylets": "benchmarks/weight_transfer_rdt.py",
    "--hosts": "benchmarks/weight_transfer_rdt.py",  # and benchmarks/schedules.py
    "--node-ip-address": "tests/cluster/hosts.py",  # Ray's `ray start`, in docs/how-to/ray-cluster.md
    "--sizes": "benchmarks/weight_transfer_rdt.py",
    "--protocols": "benchmarks/weight_transfer_rdt.py",
    "--ucx-tcp": "benchmarks/weight_plane.py",
    "--split": "benchmarks/schedules.py",
    "--sessions": "benchmarks/session_server.py",
    "--enable-return-routed-experts": "miles_plugins_sglang/miles_plugins_sglang/launch.py",  # SGLang's, for R3
    "--models": "benchmarks/megatron_trainer.py",
    "--no-deps": "tools/sglang-cpu/install.sh",  # pip's: sglang without its CUDA pins
    "--sleep-on-idle": "tests/sglang/test_engine_environment.py",  # SGLang's, among the plugin's CPU launch settings
}
"""Flags the READMEs and the site's pages name in prose that belong to another program, and the file that uses each."""


def _miles_flags() -> set[str]:
    flags: set[str] = set()
    for command in (["--help"], ["train", "--help"], ["config", "show", "--help"], ["dashboard", "--help"]):
        result = miles(*command)
        assert result.returncode == 0, result.stderr
        flags.update(re.findall(r"--[a-z][a-z0-9-]*", result.stdout))
    for server in ("miles_core.builtin.local_engine.server", "miles_core.rollout.sessions.server"):
        # the site documents the flags of the local engine and of the session server too
        answer = subprocess.run([sys.executable, "-m", server, "--help"], capture_output=True, text=True, timeout=120)
        assert answer.returncode == 0, answer.stderr
        flags.update(re.findall(r"--[a-z][a-z0-9-]*", answer.stdout))
    return flags


def _code_spans(markdown: str) -> list[str]:
    """Fenced blocks (a command per line, backslash continuations joined) and inline code spans."""
    spans: list[str] = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", markdown, flags=re.DOTALL):
        spans += block.replace("\\\n", " ").splitlines()
    spans += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", markdown, flags=re.DOTALL))
    return [span.strip().removeprefix("$ ") for span in spans]


def _documented_flags(span: str) -> list[str]:
    """The flags of a miles command line, or of a span that is only flags; others (python ..., pip ...) are not
    miles commands."""
    if not (span.startswith("miles ") or span.startswith("--")):
        return []
    return re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", span.split("#", 1)[0])


def test_every_flag_in_hookspecs_and_readmes_is_a_miles_flag() -> None:
    known = _miles_flags()
    documented = {
        flag: source
        for source in DOCUMENTS
        for span in _code_spans((REPO / source).read_text())
        for flag in _documented_flags(span)
    }
    hookspecs = (REPO / "miles_core/hookspecs.py").read_text()
    documented |= {flag: "miles_core/hookspecs.py" for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", hookspecs)}
    assert {"--trainer", "--run-worker-provider", "--sglang-router", "--megatron-tensor-parallel"} <= set(documented)
    assert any(str(source).startswith("docs/") for source in documented.values())  # the site's pages are read
    for flag, program in OTHER_PROGRAMS.items():
        assert flag in (REPO / program).read_text(), (flag, program)  # the exception itself stays true
    unknown = {flag: source for flag, source in documented.items() if flag not in known | set(OTHER_PROGRAMS)}
    assert unknown == {}
    assert "--worker-provider" not in re.findall(r"--[a-z-]+", hookspecs)
    assert "--task" in known and documented["--task"]  # provide_tasks documents the flag that reads the registry


def _readme_commands() -> list[tuple[str, list[str]]]:
    commands = []
    for source in DOCUMENTS:
        for block in re.findall(r"```bash\n(.*?)```", (REPO / source).read_text(), flags=re.DOTALL):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if any(word.startswith("[") for word in words):
                    continue  # a usage synopsis such as `miles config show [--json]`, not a command
                if words[:2] == ["miles", "train"] or words[:3] == ["miles", "config", "show"]:
                    commands.append((str(source), words[2 if words[1] == "train" else 3 :]))
    return commands


def test_the_sglang_readme_first_command_is_valid() -> None:
    sglang = [flags for source, flags in _readme_commands() if source == "miles_plugins_sglang/README.md"]
    assert sglang and "--engine" in sglang[0] and "sglang" in sglang[0]
    result = miles("config", "show", *sglang[0])
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("source", "flags"), _readme_commands(), ids=lambda value: str(value)[:60])
def test_every_readme_command_has_a_valid_config(source: str, flags: list[str], tmp_path: Path) -> None:
    result = miles("config", "show", *flags, cwd=tmp_path)
    assert result.returncode == 0, (source, flags, result.stderr)


def test_output_into_a_closed_pipe_is_no_traceback() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `miles config show | head -1` once head has exited
    try:
        result = subprocess.run(
            [str(MILES), "config", "show"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
