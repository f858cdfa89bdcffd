"""Broken plugins, through the ``miles`` command as a user runs it: whatever a plugin's code raises or returns, the
command ends with a clear error naming the plugin, its distribution and the cause, exit status 2, no traceback."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from miles_core.errors import PluginHookError, PluginLoadError, RegistryError
from miles_core.plugin_manager import MilesPluginManager
from miles_core.registry import Implementation
from tests.conftest import config_json, pip_install_distribution, plugins_json, run_miles, with_pythonpath

NO_AUTOLOAD = {"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"}

# Module bodies that end the import in every way plugin code can: each must be reported, none may end the command
# with status 0 and no output (a SystemExit did) or with a traceback (a KeyboardInterrupt did).
IMPORT_FAILURES = {
    "sys.exit()": ("import sys\nsys.exit()\n", "SystemExit(None): the plugin called sys.exit"),
    "sys.exit(0)": ("import sys\nsys.exit(0)\n", "SystemExit(0): the plugin called sys.exit"),
    "sys.exit(text)": ("raise SystemExit('bye')\n", "SystemExit('bye'): the plugin called sys.exit"),
    "KeyboardInterrupt": ("raise KeyboardInterrupt\n", "KeyboardInterrupt: raised by the plugin"),
    "BaseException": ("raise BaseException('odd')\n", "BaseException: odd"),
    "RuntimeError": ("raise RuntimeError('boom')\n", "RuntimeError: boom"),
}


def write_module(directory: Path, name: str, text: str) -> Path:
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return path


def hook_module(body: str) -> str:
    """A plugin module: the imports every test body needs, then ``body``."""
    header = (
        "import sys\n"
        "from miles_core import ConfigError, Implementation, hookimpl, model_implementation\n"
        "from miles_core.config import ConfigFlag\n\n"
    )
    return header + textwrap.dedent(body)


def assert_clean_error(result, *fragments: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("miles: error: "), result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)


@pytest.mark.parametrize("case", list(IMPORT_FAILURES))
def test_plugin_module_ending_its_import(plugin_dir: Path, case: str) -> None:
    body, cause = IMPORT_FAILURES[case]
    write_module(plugin_dir, "ending", body)
    result = run_miles("plugins", "--plugin", "ending", env=with_pythonpath(plugin_dir))
    assert_clean_error(result, f"plugin module 'ending' (from --plugin) failed to import: {cause}")


@pytest.mark.parametrize("case", ["sys.exit(0)", "KeyboardInterrupt"])
def test_plugin_file_and_miles_plugins_module_ending_their_import(tmp_path: Path, plugin_dir: Path, case: str) -> None:
    body, cause = IMPORT_FAILURES[case]
    path = write_module(tmp_path, "ending_file", body)
    assert_clean_error(
        run_miles("plugins", "--plugin", str(path)),
        f"plugin file {str(path)!r} (from --plugin) failed to import: {cause}",
    )
    write_module(plugin_dir, "ending_env", body)
    env = {**with_pythonpath(plugin_dir), "MILES_PLUGINS": "ending_env"}
    assert_clean_error(
        run_miles("config", "show", env=env),
        f"plugin module 'ending_env' (from MILES_PLUGINS) failed to import: {cause}",
    )


def test_plugin_path_that_is_a_directory(tmp_path: Path) -> None:
    assert_clean_error(run_miles("plugins", "--plugin", f"{tmp_path}/"), "is a directory, not a .py file")


# A hook body per failure; the command that calls the hook; what the message says. Every hook call is guarded.
HOOK_FAILURES = {
    "config_sections raises": (
        "@hookimpl\ndef config_sections():\n    raise RuntimeError('no sections today')\n",
        "config",
        "failed in hook config_sections: RuntimeError: no sections today",
    ),
    "config_sections exits": (
        "@hookimpl\ndef config_sections():\n    sys.exit(0)\n",
        "config",
        "failed in hook config_sections: SystemExit(0): the plugin called sys.exit",
    ),
    "validate_config raises": (
        "@hookimpl\ndef validate_config(config):\n    raise ValueError(config.run.seed)\n",
        "config",
        "failed in hook validate_config: ValueError: 1234",
    ),
    "validate_config interrupts": (
        "@hookimpl\ndef validate_config(config, registries):\n    raise KeyboardInterrupt\n",
        "config",
        "failed in hook validate_config: KeyboardInterrupt",
    ),
    "config_flags raises": (
        "@hookimpl\ndef config_flags():\n    return [ConfigFlag(flag='--x', path='run.seed')][5]\n",
        "config",
        "failed in hook config_flags: IndexError: list index out of range",
    ),
    "a registry hook raises": (
        "@hookimpl\ndef provide_reward_functions():\n    raise RuntimeError('registry down')\n",
        "plugins",
        "failed in hook provide_reward_functions: RuntimeError: registry down",
    ),
    "a registry hook exits": (
        "@hookimpl\ndef provide_tasks():\n    sys.exit(7)\n",
        "plugins",
        "failed in hook provide_tasks: SystemExit(7)",
    ),
}


@pytest.mark.parametrize("case", list(HOOK_FAILURES))
def test_hook_that_fails(plugin_dir: Path, case: str) -> None:
    body, command, message = HOOK_FAILURES[case]
    write_module(plugin_dir, "failing_hooks", hook_module(body))
    args = ("config", "show") if command == "config" else ("plugins",)
    result = run_miles(*args, "--plugin", "failing_hooks", env=with_pythonpath(plugin_dir))
    assert_clean_error(result, f"plugin 'failing_hooks' (from --plugin) {message}")


def test_a_config_error_raised_on_purpose_is_passed_unchanged(plugin_dir: Path) -> None:
    body = "@hookimpl\ndef validate_config(config):\n    raise ConfigError('run.seed = 1234: not on Tuesdays')\n"
    write_module(plugin_dir, "strict", hook_module(body))
    result = run_miles("config", "show", "--plugin", "strict", env=with_pythonpath(plugin_dir))
    assert_clean_error(result)
    assert result.stderr == "miles: error: run.seed = 1234: not on Tuesdays\n"


# Results that a hook's spec does not allow: each is named with the plugin and the hook, before the core trips on it.
BAD_RESULTS = {
    "registry: an int": ("provide_reward_functions", "42", "returned 42 (int); expected a list of"),
    "registry: a string": ("provide_tasks", "'echo'", "returned 'echo' (str); expected a list"),
    "registry: a dict": ("provide_engine_backends", "{'x': 1}", "returned {'x': 1} (dict); expected a list"),
    "registry: a bare Implementation": (
        "provide_worker_providers",
        "Implementation('w', 'a.b:C')",
        "; expected a list of miles_core.Implementation",
    ),
    "registry: a non-entry item": (
        "provide_reward_functions",
        "['mine.reward']",
        "returned 'mine.reward' (str) in its list; expected",
    ),
    "registry: an empty name": (
        "provide_reward_functions",
        "[Implementation('', 'a:b')]",
        "the entry '' with a malformed name",
    ),
    "registry: a name with spaces": (
        "provide_tasks",
        "[Implementation('my task', 'a:b')]",
        "the entry 'my task' with a malformed name",
    ),
    "registry: a malformed target": (
        "provide_reward_functions",
        "[Implementation('r', 'not a target!')]",
        "the entry 'r' with target 'not a target!' (allowed: 'package.module:attribute'",
    ),
    "registry: no target": (
        "provide_reward_functions",
        "[Implementation('r', None)]",
        "the entry 'r' with target None",
    ),
    "model registry: no family": (
        "provide_model_implementations",
        "[Implementation('minimal', 'a:b')]",
        "the entry 'minimal' with a malformed name (allowed: 'FAMILY/IMPL'",
    ),
    "sections: a list": ("config_sections", "[]", "returned [] (list); expected {section_name: Section subclass}"),
    "sections: a bad name": ("config_sections", "{'My-Section': object}", "the section name 'My-Section' (str)"),
    "sections: not a Section": (
        "config_sections",
        "{'mine': dict}",
        "the section 'mine' as <class 'dict'> (type); expected a subclass of",
    ),
    "sections: an instance": ("config_sections", "{'mine': 5}", "the section 'mine' as 5 (int); expected a subclass"),
    "flags: not a list": ("config_flags", "ConfigFlag(flag='--x', path='run.seed')", "expected a list of"),
    "flags: a string item": ("config_flags", "['--x']", "returned '--x' (str) in its list; expected"),
    "flags: no dashes": (
        "config_flags",
        "[ConfigFlag(flag='seed', path='run.seed')]",
        "the flag 'seed' with a malformed flag",
    ),
    "flags: --config": (
        "config_flags",
        "[ConfigFlag(flag='--config', path='run.seed')]",
        "the flag '--config' with a flag of the miles command itself (taken: --config, --help, --json,",
    ),
    "flags: --plugin": (
        "config_flags",
        "[ConfigFlag(flag='--plugin', path='run.seed')]",
        "the flag '--plugin' with a flag of the",
    ),
    "flags: --json": ("config_flags", "[ConfigFlag(flag='--json', path='run.seed')]", "the flag '--json' with a flag"),
    "flags: --help": ("config_flags", "[ConfigFlag(flag='--help', path='run.seed')]", "the flag '--help' with a flag"),
    "flags: a bad path": (
        "config_flags",
        "[ConfigFlag(flag='--my-seed', path='seed')]",
        "the flag '--my-seed' with path 'seed'",
    ),
    "flags: a non-text path": (
        "config_flags",
        "[ConfigFlag(flag='--my-seed', path=None)]",
        "the flag '--my-seed' with path None",
    ),
    "flags: mapping not a bool": (
        "config_flags",
        "[ConfigFlag(flag='--my-seed', path='run.seed', mapping='yes')]",
        "mapping = 'yes'",
    ),
    "flags: mapping and const": (
        "config_flags",
        "[ConfigFlag(flag='--my-impl', path='model.implementations', mapping=True, const='x')]",
        "both mapping=True and a const",
    ),
    "validate_config returns False": (
        "validate_config",
        "False",
        "returned False (bool); validate_config returns None (it raises",
    ),
}


@pytest.mark.parametrize("case", list(BAD_RESULTS))
def test_hook_returning_what_its_spec_does_not_allow(plugin_dir: Path, case: str) -> None:
    hook, value, message = BAD_RESULTS[case]
    arguments = "config" if hook == "validate_config" else ""
    write_module(plugin_dir, "bad_results", hook_module(f"@hookimpl\ndef {hook}({arguments}):\n    return {value}\n"))
    args = ("plugins",) if hook.startswith("provide_") else ("config", "show")
    result = run_miles(*args, "--plugin", "bad_results", env=with_pythonpath(plugin_dir))
    assert_clean_error(result, "plugin 'bad_results' (from --plugin) ", message, f" from hook {hook}")


def test_well_formed_results_pass(plugin_dir: Path) -> None:
    write_module(
        plugin_dir,
        "good_results",
        hook_module("""\
        @hookimpl
        def config_flags():
            return [ConfigFlag(flag="--my-seed", path="run.seed", metavar="N")]

        @hookimpl
        def provide_reward_functions():
            return (Implementation("mine.length", "os.path:getsize"),)
        """),
    )
    env = with_pythonpath(plugin_dir)
    assert config_json("--plugin", "good_results", "--my-seed", "7", env=env)["run"]["seed"] == 7
    assert plugins_json("--plugin", "good_results", env=env)["good_results"]["provides"] == {
        "reward_functions": ["mine.length"]
    }


def test_run_time_hooks_are_guarded_too(tmp_path: Path) -> None:
    path = write_module(
        tmp_path,
        "runtime_plugin",
        hook_module("""\
        @hookimpl
        def on_phase(rollout_id, phase, started, ended):
            raise KeyError(phase)

        @hookimpl
        def weight_update_wrapper(version, protocol):
            return "not a context manager"
        """),
    )
    manager = MilesPluginManager.load([str(path)], environ=NO_AUTOLOAD)
    label = f"plugin {str(path)!r} (from --plugin)"
    with pytest.raises(PluginHookError) as failure:
        manager.hook.on_phase(rollout_id=3, phase="train", started=0.0, ended=1.0)
    assert str(failure.value) == f"{label} failed in hook on_phase: KeyError: 'train'"
    with pytest.raises(PluginHookError, match=r"returned 'not a context manager' \(str\); expected a context manager"):
        manager.hook.weight_update_wrapper(version=1, protocol=None)


def test_hook_with_an_argument_its_spec_lacks(tmp_path: Path) -> None:
    path = write_module(
        tmp_path,
        "bad_signature",
        hook_module("""\
        @hookimpl
        def on_metrics(rollout_id, metrics, extra):
            pass
        """),
    )
    result = run_miles("plugins", "--plugin", str(path))
    assert_clean_error(result, f"plugin {str(path)!r} (from --plugin) is invalid: ", "{'extra'} are declared")


def test_a_pluggy_wrapper_is_refused(tmp_path: Path) -> None:
    path = write_module(
        tmp_path,
        "wrapping",
        hook_module("""\
        @hookimpl(wrapper=True)
        def on_metrics(rollout_id, metrics):
            return (yield)
        """),
    )
    with pytest.raises(PluginLoadError, match="implements on_metrics as a pluggy wrapper; Miles hooks are plain"):
        MilesPluginManager.load([str(path)], environ=NO_AUTOLOAD)


@pytest.mark.parametrize("case", ["sys.exit(0)", "KeyboardInterrupt", "RuntimeError"])
def test_registry_target_whose_import_ends(plugin_dir: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    write_module(plugin_dir, "ending_target", IMPORT_FAILURES[case][0])
    monkeypatch.syspath_prepend(str(plugin_dir))
    entry = Implementation("r", "ending_target:reward", provider="mine")
    with pytest.raises(RegistryError) as failure:
        entry.load()
    prefix = "cannot load 'r' (target 'ending_target:reward', from plugin 'mine'): "
    assert str(failure.value).startswith(prefix + IMPORT_FAILURES[case][1])


def test_a_file_given_twice_is_executed_once(tmp_path: Path) -> None:
    marker = tmp_path / "imports.log"
    path = write_module(tmp_path, "counted", f"open({str(marker)!r}, 'a').write('imported\\n')\n")
    plugins = plugins_json("--plugin", str(path), "--plugin", str(tmp_path / "." / "counted.py"))
    assert str(path) in plugins
    assert marker.read_text() == "imported\n"


# -- blocking ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["example_hooks", "sglan", "no_such_plugin"])
def test_blocking_a_name_no_plugin_has(name: str) -> None:
    result = run_miles("plugins", "--plugin", f"no:{name}")
    assert_clean_error(
        result,
        f"--plugin no:{name}: no plugin is named {name!r}, so this blocks nothing; "
        "plugins that can be blocked: dashboard, example-estimator, example-hooks, faults, megatron",
    )
    assert "sglang" in result.stderr and "miles-example-transfer" in result.stderr


def test_blocking_an_entry_point_plugin_while_autoload_is_off_is_no_typo() -> None:
    plugins = plugins_json("--plugin", "no:sglang", env=NO_AUTOLOAD)
    assert plugins["blocked"] == ["sglang"]


@pytest.mark.parametrize("command", [("plugins",), ("config", "show"), ("train", "--num-steps", "1")])
def test_the_core_plugin_cannot_be_blocked(command: tuple[str, ...]) -> None:
    result = run_miles(*command, "--plugin", "no:core", "--plugin", "no:sglang")
    assert_clean_error(
        result,
        "--plugin no:core: the core plugin cannot be blocked: every command needs its config "
        "sections (run, model, train, ...) and its registries",
    )


def test_blocking_a_file_plugin_by_the_path_it_was_given_with(tmp_path: Path) -> None:
    write_module(tmp_path, "blocked_file", "raise RuntimeError('must not be imported')\n")
    args = ("--plugin", "blocked_file.py", "--plugin", "no:blocked_file.py")
    result = run_miles("plugins", "--json", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert str(tmp_path / "blocked_file.py") in result.stdout  # listed as blocked, under its absolute path


def test_blocking_with_no_name() -> None:
    assert_clean_error(run_miles("plugins", "--plugin", "no:"), "--plugin no: needs the name of the plugin to block")


def test_the_dashboard_plugin_can_be_blocked() -> None:
    config = config_json("--plugin", "no:dashboard")
    assert "dashboard" not in config and config["run"]["seed"] == 1234


# -- entry points --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def entry_point_distributions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real distributions, pip-installed into their own directories, whose entry points misbehave."""
    root = tmp_path_factory.mktemp("entry_points")
    plugin = '[project.entry-points."miles.plugins"]\n{name} = "{package}.plugin"\n'
    specs = {
        "miles-exits": ("exits", "import sys\nsys.exit(0)\n"),
        "miles-interrupts": ("interrupts", "raise KeyboardInterrupt\n"),
        "miles-named-core": ("core", "from miles_core import hookimpl\n"),
        "miles-named-dashboard": ("dashboard", "from miles_core import hookimpl\n"),
        "miles-same-name-a": ("same-name", "VALUE = 'a'\n"),
        "miles-same-name-b": ("same-name", "VALUE = 'b'\n"),
        "miles-bad-validate": (
            "bad-validate",
            "from miles_core import hookimpl\n\n@hookimpl\ndef validate_config(config):\n    raise TypeError('oops')\n",
        ),
    }
    targets = {}
    for name, (ep_name, code) in specs.items():
        package = name.replace("-", "_")
        targets[name] = root / "site" / name
        pip_install_distribution(
            targets[name],
            root / "src" / name,
            name=name,
            entry_points=plugin.format(name=ep_name, package=package),
            files={"__init__.py": "", "plugin.py": code},
        )
    return targets


@pytest.mark.parametrize(
    ("distribution", "cause"),
    [("miles-exits", "SystemExit(0): the plugin called sys.exit"), ("miles-interrupts", "KeyboardInterrupt: raised")],
)
def test_entry_point_ending_its_import(entry_point_distributions, distribution: str, cause: str) -> None:
    result = run_miles("plugins", env=with_pythonpath(entry_point_distributions[distribution]))
    package = distribution.replace("-", "_")
    name = distribution.removeprefix("miles-")
    assert_clean_error(
        result,
        f"plugin {name!r} (distribution {distribution} 9.9.9, entry point miles.plugins: "
        f"{name} = {package}.plugin) failed to load: {cause}",
    )


@pytest.mark.parametrize("builtin", ["core", "dashboard"])
def test_entry_point_named_like_a_builtin_plugin(entry_point_distributions, builtin: str) -> None:
    result = run_miles("plugins", env=with_pythonpath(entry_point_distributions[f"miles-named-{builtin}"]))
    assert_clean_error(
        result,
        f"plugin {builtin!r} (distribution miles-named-{builtin} 9.9.9, entry point "
        f"miles.plugins: {builtin} = miles_named_{builtin}.plugin) is named like the built-in "
        f"plugin {builtin!r}; rename the entry point",
    )


def test_two_entry_points_with_one_name(entry_point_distributions) -> None:
    env = with_pythonpath(
        entry_point_distributions["miles-same-name-a"], entry_point_distributions["miles-same-name-b"]
    )
    result = run_miles("plugins", env=env)
    assert_clean_error(
        result,
        "two plugins are named 'same-name': plugin 'same-name' (distribution miles-same-name-",
        "and plugin 'same-name' (distribution miles-same-name-",
    )
    assert "miles-same-name-a 9.9.9" in result.stderr and "miles-same-name-b 9.9.9" in result.stderr


def test_entry_point_whose_hook_fails_names_its_distribution(entry_point_distributions) -> None:
    result = run_miles("config", "show", env=with_pythonpath(entry_point_distributions["miles-bad-validate"]))
    assert_clean_error(
        result,
        "plugin 'bad-validate' (distribution miles-bad-validate 9.9.9, from entry point) "
        "failed in hook validate_config: TypeError: oops",
    )
