"""Plugin discovery and loading, through the ``miles`` command as a user runs it."""

from __future__ import annotations

import importlib.metadata
import json
import textwrap
from pathlib import Path

import pytest

from tests.conftest import config_json, pip_install_distribution, plugins_json, run_miles, with_pythonpath

FIRST_PARTY = {"megatron": "miles-plugins-megatron", "sglang": "miles-plugins-sglang", "rdt": "miles-plugins-rdt"}

EXTRA_REWARD_PLUGIN = """\
from miles_core import Implementation, hookimpl

def reward(*, prompt, response, label, metadata):
    return float(len(response))

@hookimpl
def provide_reward_functions():
    return [Implementation(name="{name}", target=reward)]
"""


def write_module(directory: Path, name: str, text: str) -> Path:
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return path


def test_plugins_json_lists_core_first_party_and_examples() -> None:
    plugins = plugins_json()
    assert plugins["core"]["distribution"] == "miles-core"
    assert plugins["core"]["source"] == "builtin"
    for name, distribution in FIRST_PARTY.items():
        assert plugins[name]["distribution"] == distribution
        assert plugins[name]["version"] == importlib.metadata.version(distribution)
        assert plugins[name]["source"] == "entry point"
    hooks = plugins["example-hooks"]
    assert hooks["distribution"] == "miles-example-hooks"
    assert hooks["hooks"] == [
        "provide_engine_backends",
        "provide_model_implementations",
        "provide_reward_functions",
        "provide_training_backends",
    ]
    assert hooks["provides"] == {
        "training_backends": ["example-reinforce"],
        "engine_backends": ["example-local"],
        "model_implementations": ["llama/minimal"],
        "reward_functions": ["example.keyword"],
    }
    transfer = plugins["miles-example-transfer"]
    assert transfer["source"] == "entry point (miles.weight_transfer)"
    assert transfer["provides"] == {"weight_transfer_protocols": ["sharded-disk"]}
    assert "config_sections" in plugins["core"]["hooks"]
    assert plugins["core"]["provides"]["worker_providers"] == ["local", "ray"]


def test_example_distributions_are_really_pip_installed() -> None:
    hooks = importlib.metadata.distribution("miles-example-hooks")
    assert [(ep.group, ep.name) for ep in hooks.entry_points] == [("miles.plugins", "example-hooks")]
    transfer = importlib.metadata.distribution("miles-example-transfer")
    assert [(ep.group, ep.name) for ep in transfer.entry_points] == [("miles.weight_transfer", "sharded-disk")]


def test_plugins_table_is_readable() -> None:
    result = run_miles("plugins")
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["PLUGIN", "DISTRIBUTION", "SOURCE", "PROVIDES", "HOOKS"]
    example = next(row for row in rows if row.startswith("example-hooks "))
    assert "llama/minimal" in example
    # the HOOKS column: the hooks each plugin implements, in the column under its header
    hooks_at = header.index("HOOKS")
    assert example[hooks_at:] == (
        "provide_engine_backends, provide_model_implementations, provide_reward_functions, provide_training_backends"
    )
    core = next(row for row in rows if row.startswith("core "))
    assert "config_sections" in core[hooks_at:].split(", ")


def test_entry_point_only_protocol_is_selectable() -> None:
    config = config_json("--update-weight-transfer-mode", "sharded-disk")
    assert config["weight_transfer"]["mode"] == "sharded-disk"


def test_plugin_given_as_module(plugin_dir: Path) -> None:
    write_module(plugin_dir, "my_reward_plugin", EXTRA_REWARD_PLUGIN.format(name="mine.length"))
    plugins = plugins_json("--plugin", "my_reward_plugin", env=with_pythonpath(plugin_dir))
    assert plugins["my_reward_plugin"]["source"] == "--plugin"
    assert plugins["my_reward_plugin"]["provides"] == {"reward_functions": ["mine.length"]}


def test_plugin_given_as_file_anywhere_on_the_command_line(tmp_path: Path) -> None:
    path = write_module(tmp_path, "file_plugin", EXTRA_REWARD_PLUGIN.format(name="file.length"))
    result = run_miles("plugins", "--json", f"--plugin={path}")
    assert result.returncode == 0, result.stderr
    plugins = plugins_json("--plugin", str(path))
    assert plugins[str(path)]["provides"] == {"reward_functions": ["file.length"]}
    assert plugins[str(path)]["location"] == str(path)


def test_block_a_plugin_with_no_name() -> None:
    plugins = plugins_json("--plugin", "no:example-hooks")
    assert "example-hooks" not in plugins
    assert plugins["blocked"] == ["example-hooks"]
    result = run_miles("config", "show", "--plugin", "no:example-hooks", "--model-impl", "llama=minimal")
    assert result.returncode == 2
    assert "no such implementation of model family 'llama'" in result.stderr


def test_block_an_entry_point_only_distribution() -> None:
    plugins = plugins_json("--plugin", "no:miles-example-transfer")
    assert "miles-example-transfer" not in plugins
    result = run_miles(
        "config", "show", "--plugin", "no:miles-example-transfer", "--update-weight-transfer-mode", "sharded-disk"
    )
    assert result.returncode == 2
    assert "unknown weight transfer protocol 'sharded-disk'" in result.stderr


def test_miles_plugins_env_loads_modules_in_order_before_cli(plugin_dir: Path) -> None:
    write_module(plugin_dir, "env_one", EXTRA_REWARD_PLUGIN.format(name="env.one"))
    write_module(plugin_dir, "env_two", EXTRA_REWARD_PLUGIN.format(name="env.two"))
    write_module(plugin_dir, "cli_three", EXTRA_REWARD_PLUGIN.format(name="cli.three"))
    env = {**with_pythonpath(plugin_dir), "MILES_PLUGINS": "env_one, env_two"}
    plugins = plugins_json("--plugin", "cli_three", env=env)
    names = [name for name in plugins if name != "blocked"]
    assert names[-3:] == ["env_one", "env_two", "cli_three"]
    assert plugins["env_one"]["source"] == "MILES_PLUGINS"
    assert plugins["cli_three"]["source"] == "--plugin"


def test_autoload_disabled_keeps_builtins_and_explicit_plugins(plugin_dir: Path) -> None:
    write_module(plugin_dir, "explicit_one", EXTRA_REWARD_PLUGIN.format(name="explicit.one"))
    env = {**with_pythonpath(plugin_dir), "MILES_DISABLE_PLUGIN_AUTOLOAD": "1"}
    plugins = plugins_json("--plugin", "explicit_one", env=env)
    assert sorted(name for name in plugins if name != "blocked") == [
        "core",
        "dashboard",
        "explicit_one",
        "faults",
        "metrics",
    ]


def test_plugin_module_whose_import_raises(plugin_dir: Path) -> None:
    write_module(plugin_dir, "exploding", "raise RuntimeError('boom at import')\n")
    result = run_miles("plugins", "--plugin", "exploding", env=with_pythonpath(plugin_dir))
    assert result.returncode == 2
    assert "plugin module 'exploding' (from --plugin) failed to import: RuntimeError: boom at import" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_plugin_module_and_file(tmp_path: Path) -> None:
    result = run_miles("plugins", "--plugin", "no_such_module_anywhere")
    assert result.returncode == 2
    assert "'no_such_module_anywhere' (from --plugin) failed to import: ModuleNotFoundError" in result.stderr
    result = run_miles("plugins", "--plugin", str(tmp_path / "absent.py"))
    assert result.returncode == 2
    assert "absent.py' (from --plugin) does not exist" in result.stderr


def test_plugin_with_a_hook_the_specs_do_not_know(plugin_dir: Path) -> None:
    write_module(
        plugin_dir,
        "typo_plugin",
        """\
        from miles_core import hookimpl

        @hookimpl
        def provide_rewards_functions():
            return []
        """,
    )
    result = run_miles("plugins", "--plugin", "typo_plugin", env=with_pythonpath(plugin_dir))
    assert result.returncode == 2
    assert (
        "plugin 'typo_plugin' (--plugin) implements 'provide_rewards_functions', which is not a miles hook"
        in result.stderr
    )
    assert "did you mean 'provide_reward_functions'?" in result.stderr


def test_duplicate_registry_name_names_both_plugins(plugin_dir: Path) -> None:
    write_module(plugin_dir, "dup_reward", EXTRA_REWARD_PLUGIN.format(name="example.keyword"))
    result = run_miles("plugins", "--plugin", "dup_reward", env=with_pythonpath(plugin_dir))
    assert result.returncode == 2
    assert (
        "reward functions: 'example.keyword' is provided twice, by plugin 'example-hooks' and by plugin 'dup_reward'"
        in result.stderr
    )


@pytest.fixture(scope="module")
def broken_distributions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real distributions, pip-installed into their own directories, whose entry points are broken."""
    root = tmp_path_factory.mktemp("broken")
    specs = {
        "miles-broken-import": (
            '[project.entry-points."miles.plugins"]\nbroken-import = "miles_broken_import.plugin"\n',
            {"__init__.py": "", "plugin.py": "raise ImportError('needs a library that is not installed')\n"},
        ),
        "miles-missing-object": (
            '[project.entry-points."miles.plugins"]\nmissing-object = "miles_missing_object.plugin:no_such_object"\n',
            {"__init__.py": "", "plugin.py": "VALUE = 1\n"},
        ),
        "miles-raising-class": (
            '[project.entry-points."miles.plugins"]\nraising-class = "miles_raising_class:Plugin"\n',
            {"__init__.py": "class Plugin:\n    def __init__(self):\n        raise RuntimeError('no licence key')\n"},
        ),
        "miles-missing-protocol": (
            '[project.entry-points."miles.weight_transfer"]\nghost = "miles_missing_protocol:NoSuchProtocol"\n',
            {"__init__.py": ""},
        ),
        "miles-absent-protocol": (
            '[project.entry-points."miles.weight_transfer"]\nabsent = "miles_absent_protocol.protocol:Absent"\n',
            {"__init__.py": ""},
        ),
        "miles-duplicate-protocol": (
            '[project.entry-points."miles.weight_transfer"]\nsharded-disk = "miles_duplicate_protocol:Other"\n',
            {"__init__.py": "class Other: ...\n"},
        ),
    }
    targets = {}
    for name, (entry_points, files) in specs.items():
        targets[name] = root / "site" / name
        pip_install_distribution(targets[name], root / "src" / name, name=name, entry_points=entry_points, files=files)
    return targets


def test_entry_point_whose_import_fails_names_distribution_and_entry_point(broken_distributions) -> None:
    result = run_miles("plugins", env=with_pythonpath(broken_distributions["miles-broken-import"]))
    assert result.returncode == 2
    assert (
        "plugin 'broken-import' (distribution miles-broken-import 9.9.9, entry point miles.plugins: "
        "broken-import = miles_broken_import.plugin) failed to load: ImportError: needs a library that is not installed"
    ) in result.stderr


def test_entry_point_naming_a_missing_object(broken_distributions) -> None:
    result = run_miles("plugins", env=with_pythonpath(broken_distributions["miles-missing-object"]))
    assert result.returncode == 2
    assert "distribution miles-missing-object 9.9.9" in result.stderr
    assert "miles_missing_object.plugin:no_such_object) failed to load: AttributeError" in result.stderr


def test_an_entry_point_naming_a_plugin_class_is_instantiated_and_its_constructor_errors_named(
    broken_distributions,
) -> None:
    result = run_miles("plugins", env=with_pythonpath(broken_distributions["miles-raising-class"]))
    assert result.returncode == 2
    assert (
        "plugin 'raising-class' (distribution miles-raising-class 9.9.9, entry point miles.plugins: "
        "raising-class = miles_raising_class:Plugin) failed to load: RuntimeError: no licence key"
    ) in result.stderr
    sglang_hooks = plugins_json()["sglang"]["hooks"]  # miles_plugins_sglang.plugin:SglangPlugin is such a class
    assert {"provide_engine_backends", "validate_config", "register_router", "register_engines"} <= set(sglang_hooks)


def test_weight_transfer_entry_point_naming_a_missing_object(broken_distributions) -> None:
    """``miles plugins`` imports no protocol code, so a protocol class that is missing from its (installed) module is
    found when a run picks the protocol: that run fails naming the distribution, and no other."""
    env = with_pythonpath(broken_distributions["miles-missing-protocol"])
    assert plugins_json(env=env)["miles-missing-protocol"]["provides"] == {"weight_transfer_protocols": ["ghost"]}
    assert config_json(env=env)["weight_transfer"]["mode"] == "tensor"  # a run with another protocol is unaffected
    result = run_miles("config", "show", "--update-weight-transfer-mode", "ghost", env=env)
    assert result.returncode == 2
    assert "weight_transfer.mode (--update-weight-transfer-mode) = 'ghost'" in result.stderr
    assert "distribution miles-missing-protocol 9.9.9" in result.stderr
    assert "miles.weight_transfer: ghost = miles_missing_protocol:NoSuchProtocol) failed to load" in result.stderr


def test_weight_transfer_entry_point_naming_a_module_not_installed(broken_distributions) -> None:
    """A protocol whose module is not installed (a wheel without it) is listed by ``miles plugins`` as broken."""
    listing = run_miles("plugins", "--json", env=with_pythonpath(broken_distributions["miles-absent-protocol"]))
    assert listing.returncode == 2 and listing.stderr.startswith("miles: error: 1 entry point failed to load")
    data = json.loads(listing.stdout)
    [broken] = data["broken"]
    assert broken["name"] == "miles-absent-protocol" and broken["version"] == "9.9.9"
    assert broken["entry_point"] == "miles.weight_transfer: absent = miles_absent_protocol.protocol:Absent"
    assert "failed to load: ModuleNotFoundError: No module named 'miles_absent_protocol.protocol'" in broken["error"]
    assert "miles-example-transfer" in {p["name"] for p in data["plugins"]}


@pytest.mark.parametrize(
    ("distribution", "name", "cause"),
    [
        ("miles-broken-import", "broken-import", "ImportError: needs a library that is not installed"),
        ("miles-raising-class", "raising-class", "RuntimeError: no licence key"),
        ("miles-absent-protocol", "miles-absent-protocol", "ModuleNotFoundError"),
    ],
)
def test_one_broken_distribution_does_not_hide_the_other_plugins(
    broken_distributions, distribution: str, name: str, cause: str
) -> None:
    """`miles plugins` lists every plugin that loads, the broken one as broken with its distribution, version and
    reason, and fails naming it (status 2)."""
    result = run_miles("plugins", env=with_pythonpath(broken_distributions[distribution]))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("miles: error: 1 entry point failed to load") and cause in result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:] if line.strip()}
    assert {"core", "megatron", "sglang", "rdt", "example-hooks", "miles-example-transfer"} <= set(rows)
    assert f"{distribution} 9.9.9" in rows[name] and "BROKEN" in rows[name]
    assert "\nbroken: plugin '" in result.stdout and f"distribution {distribution} 9.9.9" in result.stdout
    assert cause in result.stdout


def test_duplicate_protocol_from_two_distributions(broken_distributions) -> None:
    result = run_miles("plugins", env=with_pythonpath(broken_distributions["miles-duplicate-protocol"]))
    assert result.returncode == 2
    assert "'sharded-disk' is provided twice" in result.stderr
    assert "miles-duplicate-protocol" in result.stderr and "miles-example-transfer" in result.stderr


def test_version_lists_plugin_distributions() -> None:
    result = run_miles("version")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"miles-core {importlib.metadata.version('miles-core')}"
    assert "miles-plugins-rdt 0.1.0" in lines and "miles-example-transfer 0.1.0" in lines
