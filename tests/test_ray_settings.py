"""The Ray settings of a run (``--run-ray-address``, ``--run-ray-{trainer,engine,router}-resources``) and of the
environment (``RAY_ADDRESS``): accepted forms, and every malformed, hostile or misplaced value refused with the
field, the value and what to do. No Ray starts here (the multi-node tests are tests/workers/test_ray_cluster.py)."""

from __future__ import annotations

import json
import math
import re

import pytest
import ray

from miles_core.builtin.ray_provider import init_ray
from miles_core.workers.errors import WorkerError
from miles_core.workers.provider import WorkerInfo
from miles_core.workers.ray_settings import MAX_RESOURCES, check_ray_address, check_resources, is_loopback_address
from miles_core.workers.specs import ENGINE, TRAINER, CommandWorkerSpec, with_role
from tests.conftest import config_json
from tests.test_config_hostile import refused

RAY = ("--run-worker-provider", "ray")


@pytest.mark.parametrize("address", ["127.0.0.1:6379", "head-0.cluster.local:6379", "[::1]:6380", "10.0.0.7:1", "auto"])
def test_cluster_addresses_miles_can_join(address: str) -> None:
    assert check_ray_address(address) == address


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("ray://head:10001", "Ray Client addresses (ray://) are not supported"),
        ("local", "leave the address unset"),
        ("head", "expected HOST:PORT"),
        ("head:", "expected HOST:PORT"),
        (":6379", "expected HOST:PORT"),
        ("head:0", "not in 1..65535"),
        ("head:65536", "not in 1..65535"),
        ("head:123456", "expected HOST:PORT"),
        ("he ad:6379", "expected HOST:PORT"),
        ("[zz::g]:6379", "expected HOST:PORT"),
        ("x" * 10_000 + ":6379", "expected HOST:PORT"),
        ("", "expected HOST:PORT"),
    ],
)
def test_malformed_addresses_say_what_is_allowed(address: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_ray_address(address)


def test_loopback_addresses() -> None:
    assert all(map(is_loopback_address, ["127.0.0.1:1", "127.0.0.2:1", "localhost:1", "[::1]:1"]))
    assert not any(map(is_loopback_address, ["10.0.0.1:1", "head:1", "auto", "[::2]:1"]))


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({"CPU": 1}, "'CPU' is a built-in Ray resource"),
        ({"GPU": 1}, "'GPU' is a built-in Ray resource"),
        ({"memory": 1}, "'memory' is a built-in Ray resource"),
        ({"trainer_node": -1}, "asks for -1"),
        ({"trainer_node": 0}, "must be within 0.0001"),
        ({"trainer_node": 0.00001}, "must be within 0.0001"),
        ({"trainer_node": 1e12}, "and 1e\\+09"),
        ({"trainer_node": math.nan}, "asks for nan"),
        ({"": 1}, "1 to 128 characters"),
        ({"a b": 1}, "without spaces"),
        ({"x" * 129: 1}, "1 to 128 characters"),
        ({f"r{i}": 1 for i in range(MAX_RESOURCES + 1)}, f"at most {MAX_RESOURCES}"),
    ],
)
def test_bad_resources_are_refused_naming_the_entry(resources: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_resources(resources)


def test_custom_resources_and_node_pins_are_accepted() -> None:
    wanted = {"trainer_node": 0.001, "node:10.0.0.7": 0.01, "TPU": 4}  # node:ADDRESS pins to one node
    assert check_resources(wanted) == wanted


def test_the_flags_set_the_run_section() -> None:
    shown = config_json(
        *RAY,
        *("--run-ray-address", "10.0.0.1:6379", "--run-ray-trainer-resources", '{"trainer_node": 1}'),
        *("--run-ray-engine-resources", "{engine_node: 0.5}", "--run-ray-router-resources", '{"engine_node": 0.01}'),
    )["run"]
    assert shown["ray_address"] == "10.0.0.1:6379"
    assert shown["ray_trainer_resources"] == {"trainer_node": 1.0}
    assert shown["ray_engine_resources"] == {"engine_node": 0.5}
    assert shown["ray_router_resources"] == {"engine_node": 0.01}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--run-ray-address", "10.0.0.1:6379"), "ray_address (--run-ray-address) place workers with Ray; they "),
        (("--run-ray-engine-resources", '{"e": 1}'), "need worker_provider ray (--run-worker-provider ray), not "),
        ((*RAY, "--run-ray-address", "ray://head:1"), "run.ray_address = 'ray://head:1': Value error, Ray Client"),
        ((*RAY, "--run-ray-address", "a" * 100_000), "run.ray_address = 'aaaa"),
        ((*RAY, "--run-ray-trainer-resources", '{"CPU": 2}'), "'CPU' is a built-in Ray resource"),
        ((*RAY, "--run-ray-router-resources", '{"r": -2}'), "run.ray_router_resources = {'r': -2}: Value error"),
        ((*RAY, "--run-ray-engine-resources", '{"e": "many"}'), "run.ray_engine_resources.e = 'many': Input should be"),
        ((*RAY, "--run-ray-engine-resources", "[1, 2]"), "run.ray_engine_resources = [1, 2]: Input should be a valid"),
        ((*RAY, "--run-ray-engine-resources", '{"e": .inf}'), "not a finite number"),
        ((*RAY, "--run-ray-gpu-resources", '{"g": 1}'), "unrecognized arguments: --run-ray-gpu-resources"),
    ],
)
def test_bad_ray_settings_are_refused(args: tuple[str, ...], message: str) -> None:
    assert message in refused(*args)


def test_an_unknown_ray_key_in_a_config_file_is_refused(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"run": {"worker_provider": "ray", "ray_adress": "10.0.0.1:6379"}}))
    assert "run.ray_adress: unknown key" in refused("--config", str(config))
    assert "did you mean 'ray_address'?" in refused("--config", str(config))


@pytest.mark.parametrize(("value", "message"), [("ray://head:10001", "Ray Client"), ("nonsense", "HOST:PORT")])
def test_a_malformed_ray_address_in_the_environment_is_refused_before_ray_starts(
    monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", value)
    with pytest.raises(WorkerError, match=f"RAY_ADDRESS = '{value}': .*{message}"):
        init_ray()
    assert not ray.is_initialized()


def test_roles_given_by_makers_are_kept() -> None:
    spec = CommandWorkerSpec(name="engine-0", argv=["true"])
    assert with_role(spec, ENGINE).role == ENGINE and spec.role is None  # frozen: a copy
    assert with_role(spec.model_copy(update={"role": TRAINER}), ENGINE).role == TRAINER


def test_a_worker_says_where_it_was_placed() -> None:
    local = WorkerInfo(name="engine-0", kind="command", url=None, ports={}, pid=7, node="127.0.0.1", log_file="x")
    assert local.describe() == "engine-0 pid 7"
    placed = WorkerInfo(
        name="engine-0",
        kind="command",
        url=None,
        ports={},
        pid=7,
        node="10.0.0.2",
        log_file="x",
        placement={"node_id": "0123456789abcdef", "bundle_index": 3},
    )
    assert placed.describe() == "engine-0 pid 7 node 10.0.0.2 (id 01234567) bundle 3"
