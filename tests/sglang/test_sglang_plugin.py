"""miles-plugins-sglang: config validated against SGLang's server settings, engines launched through the worker
provider (failures with their log tails), and the real sglang-router in front of local-engine servers that speak
SGLang's API: a full ``miles train --engine sglang`` run learns, requests spread, a killed engine comes back
registered and no sample is lost."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
from pathlib import Path

import pytest
from miles_plugins_sglang.config import find_sglang_python, server_arg_fields, server_flags
from miles_plugins_sglang.launch import sglang_engine_spec
from miles_plugins_sglang.plugin import SglangPlugin

from miles_core.config.build import build_config
from miles_core.errors import ConfigError
from miles_core.events import RouterInfo
from miles_core.plugin_manager import MilesPluginManager
from miles_core.workers.errors import WorkerStartError
from miles_core.workers.local_provider import LocalWorkerProvider
from tests.conftest import run_miles

LOCAL_ENGINE = ["{python}", "-m", "miles_core.builtin.local_engine.server"]


@pytest.fixture(scope="module")
def manager():
    return MilesPluginManager.load()


def sglang_config(manager, **overrides):
    return build_config(manager, overrides={"engine.backend": "sglang", "weight_transfer.mode": "disk", **overrides})


def test_server_args_are_checked_against_sglang_fields(manager) -> None:
    fields, source = server_arg_fields()
    assert len(fields) > 500 and {"mem_fraction_static", "tp_size", "chunked_prefill_size"} <= fields
    assert "shipped with miles-plugins-sglang" in source  # sglang itself is not installed on CPU machines
    config = sglang_config(manager, **{"sglang.server_args": {"mem_fraction_static": 0.8, "enable_metrics": True}})
    assert config.sglang.server_args["mem_fraction_static"] == 0.8
    with pytest.raises(
        ConfigError,
        match=r"'mem_fraction_statc' is not an SGLang server setting \(did you mean "
        r"'mem_fraction_static'",
    ):
        sglang_config(manager, **{"sglang.server_args": {"mem_fraction_statc": 0.8}})
    with pytest.raises(ConfigError, match=r"'tp_size' is set by Miles from sglang.tp_size"):
        sglang_config(manager, **{"sglang.server_args": {"tp_size": 2}})
    with pytest.raises(ConfigError, match=r"sglang.router = true needs engine.backend = 'sglang'"):
        build_config(manager, overrides={"sglang.router": True})
    # stock SGLang takes tensor (Miles' loader in the server); another server of SGLang's API does not
    assert sglang_config(manager, **{"weight_transfer.mode": "tensor"}).weight_transfer.mode == "tensor"
    with pytest.raises(
        ConfigError, match=r"'tensor' cannot reach the engines of engine.backend \(--engine\) = 'sglang'"
    ):
        sglang_config(manager, **{"weight_transfer.mode": "tensor", "sglang.launch_command": ["my-sglang-api-server"]})
    result = run_miles(
        "config",
        "show",
        "--engine",
        "sglang",
        "--update-weight-transfer-mode",
        "disk",
        "--sglang-server-args",
        '{"max_running_request": 8}',
    )
    assert result.returncode != 0 and "did you mean 'max_running_requests'" in result.stderr


def test_engine_command_line(manager) -> None:
    config = sglang_config(
        manager,
        **{
            "sglang.server_args": {
                "enable_metrics": True,
                "disable_radix_cache": False,
                "cuda_graph_bs_decode": [1, 2],
                "json_model_override_args": {"rope": 1},
            },
            "sglang.extra_args": ["--custom-flag", "{not-a-placeholder}"],
            "sglang.tp_size": 2,
            "sglang.cpu_launch": "off",
            "sglang.python": "/envs/sglang/bin/python",
        },
    )
    assert server_flags({"a_b": True, "c": False, "d": [1, 2]}) == ["--a-b", "--d", "1", "2"]
    spec = sglang_engine_spec(config, cell_id="engine-0", model_path="/models/{odd}")
    resolved = spec.resolve({"port": 31000}, token="secret")
    argv = resolved.argv
    assert (
        argv[:3] == ["/envs/sglang/bin/python", "-m", "sglang.launch_server"]
        and argv[argv.index("--model-path") + 1] == "/models/{odd}"
    )
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "31000"
    assert argv[argv.index("--tp-size") + 1] == "2" and "--admin-api-key=secret" in argv  # a value never read as a flag
    assert "--enable-metrics" in argv and "--disable-radix-cache" not in argv
    assert argv[argv.index("--json-model-override-args") + 1] == '{"rope": 1}'
    assert argv[-2:] == ["--custom-flag", "{not-a-placeholder}"]
    assert resolved.health_url == "http://127.0.0.1:31000/health_generate"


def test_routing_replay_starts_sglang_returning_routed_experts(manager) -> None:
    """``--train-routing-replay`` asks every ``/generate`` for ``return_routed_experts``: the server must allow it."""
    flag = "--enable-return-routed-experts"

    def argv(**overrides) -> list[str]:
        config = sglang_config(manager, **{"sglang.cpu_launch": "off", **overrides})
        return sglang_engine_spec(config, cell_id="engine-0", model_path="/m").argv

    assert flag not in argv() and flag in argv(**{"train.routing_replay": True})
    user_says_no = {"train.routing_replay": True, "sglang.server_args": {"enable_return_routed_experts": False}}
    assert flag not in argv(**user_says_no)  # the user's server_args win


def start_engine(manager, tmp_path: Path, **overrides) -> None:
    config = sglang_config(manager, **overrides)
    spec = sglang_engine_spec(config, cell_id="engine-0", model_path=str(tmp_path / "model"))
    provider = LocalWorkerProvider(token="t", run_dir=tmp_path)

    async def scenario() -> None:
        try:
            await provider.start(spec)
        finally:
            await provider.shutdown()

    asyncio.run(scenario())


ARGPARSE_PROBE = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser(exit_on_error=False)
ServerArgs.add_cli_args(parser)
print(json.dumps(vars(parser.parse_args(sys.argv[1:])), default=str))
"""


def test_sglangs_own_parser_reads_the_engine_command_line_whatever_the_token(manager, tmp_path: Path) -> None:
    """The argv of a stock SGLang engine, parsed by SGLang's own ``ServerArgs`` parser in the SGLang environment, with
    a token that begins with ``-`` (a CI run's engine died of one: argparse read it as a flag)."""
    python, how = find_sglang_python()
    if subprocess.run([python, "-c", "import sglang"], capture_output=True, timeout=120, check=False).returncode:
        pytest.skip(f"no SGLang environment to parse with ({python}, {how}): `make sglang` makes one")
    config = sglang_config(manager, **{"sglang.python": python, "sglang.cpu_launch": "off"})
    argv = (
        sglang_engine_spec(config, cell_id="engine-0", model_path=str(tmp_path))
        .resolve({"port": 31000}, token="-starts-like-a-flag")
        .argv
    )
    module = argv.index("sglang.launch_server")
    done = subprocess.run(
        [python, "-c", ARGPARSE_PROBE, *argv[module + 1 :]], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    parsed = json.loads(done.stdout.splitlines()[-1])
    assert parsed["admin_api_key"] == "-starts-like-a-flag" and parsed["port"] == 31000
    assert parsed["custom_weight_loader"] == ["miles_sglang_weights.load_staged"]


def test_a_launch_command_that_exits_at_once_reports_its_log(manager, tmp_path: Path) -> None:
    failing = ["{python}", "-c", "import sys; print('server: error: no GPU found', file=sys.stderr); sys.exit(3)"]
    with pytest.raises(WorkerStartError, match=r"(?s)engine-0.*server: error: no GPU found"):
        start_engine(manager, tmp_path, **{"sglang.launch_command": failing})


def test_a_server_that_never_becomes_healthy_times_out_naming_the_worker(manager, tmp_path: Path) -> None:
    silent = ["{python}", "-c", "import time; time.sleep(120)"]
    with pytest.raises(
        WorkerStartError, match=r"worker engine-0 did not become healthy at .*/health_generate in time"
    ) as error:
        start_engine(manager, tmp_path, **{"sglang.launch_command": silent, "engine.startup_timeout_s": 3})
    assert "--admin-api-key=***" in str(error.value) and "--admin-api-key=t " not in str(error.value)


def test_a_port_already_in_use_is_a_clear_error(manager, tmp_path: Path) -> None:
    from miles_core.run_setup import default_model

    default_model(tmp_path, seed=0).rename(tmp_path / "model")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            WorkerStartError,
            match=rf"(?s)engine-0.*cannot listen on 127.0.0.1:{port}: Address "
            r"already in use",
        ):
            start_engine(
                manager, tmp_path, **{"sglang.launch_command": LOCAL_ENGINE, "sglang.extra_args": ["--port", str(port)]}
            )


def test_each_plugin_manager_has_its_own_sglang_plugin_and_router_registrars() -> None:
    first, second = MilesPluginManager.load(), MilesPluginManager.load()
    plugins = [manager.pm.get_plugin("sglang") for manager in (first, second)]
    assert all(isinstance(plugin, SglangPlugin) for plugin in plugins) and plugins[0] is not plugins[1]
    first.hook.register_router(router=RouterInfo(name="router", url="http://127.0.0.1:9", pid=None))
    assert list(plugins[0].routers) == ["router"] and plugins[1].routers == {}  # no state in the module
    plugins[0].routers.pop("router").close()


ROUTER_PROBE = """\
import json
import httpx
from miles_core import hookimpl

CONTROLLER = None
ROUTERS = []


@hookimpl
def register_router(router):
    ROUTERS.append((router.url, {"Authorization": f"Bearer {router.admin_key}"}))  # its control routes need the key


@hookimpl
def prepare_rollout(rollout_id, controller):
    global CONTROLLER
    CONTROLLER = controller
    if rollout_id == 3:  # engine-1 dies as a rollout starts: its requests fail mid-rollout
        controller.provider.processes["engine-1"].kill()


@hookimpl
def on_metrics(rollout_id, metrics):
    url, headers = ROUTERS[0]
    listed = sorted(w["url"] for w in httpx.get(url + "/workers", headers=headers).json()["workers"])
    engines = {cell_id: cell.workers[0].url for cell_id, cell in CONTROLLER.cells.cells.items()}
    served = {cell_id: httpx.get(url + "/server_info").json()["internal_states"][0]["generate_requests"]
              for cell_id, url in engines.items()}
    restarts = {cell_id: cell.restarts for cell_id, cell in CONTROLLER.cells.cells.items()}
    print("PROBE " + json.dumps({"step": rollout_id, "samples": metrics["rollout/samples"], "router": listed,
                                 "engines": engines, "served": served, "restarts": restarts}), flush=True)
"""


@pytest.mark.slow
def test_train_through_the_real_router_spreads_and_survives_an_engine_death(tmp_path: Path) -> None:
    """Local engines behind the real sglang-router. Learning through the router was measured equal to the direct
    run's (eval 0 -> 0.34 in 60 steps, both); it is ``test_train.py``'s to check, so this run is short."""
    probe = tmp_path / "probe.py"
    probe.write_text(ROUTER_PROBE)
    result = run_miles(
        "train",
        "--engine",
        "sglang",
        "--sglang-launch-command",
        json.dumps(LOCAL_ENGINE),
        "--sglang-router",
        "true",
        "--engine-num-engines",
        "2",
        "--num-steps",
        "12",
        "--run-eval-every",
        "0",
        "--run-checkpoint-every",
        "0",
        "--no-progress",
        "--output-dir",
        str(tmp_path / "run"),
        "--plugin",
        str(probe),
        timeout_s=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    probes = [json.loads(line[6:]) for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    assert [p["step"] for p in probes] == list(range(12)) and all(p["samples"] == 128 for p in probes)
    assert all(p["router"] == sorted(p["engines"].values()) for p in probes)  # routes to exactly the engines
    assert probes[-1]["restarts"] == {"engine-0": 0, "engine-1": 1}
    assert probes[2]["engines"]["engine-1"] != probes[-1]["engines"]["engine-1"]  # came back on a new port
    assert all(count > 0 for count in probes[-1]["served"].values())  # both engines serve through the router
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "rollout/samples" in row] == list(range(1, 13))
