"""The real sglang-router in front of real SGLang servers (``miles train --engine sglang --sglang-router true`` with
the default launch command): requests spread over both engines, an engine whose whole process group is killed in the
middle of a run loses no sample and comes back registered on the router with the run's current weights. Where real
SGLang cannot run, the test skips saying why (``requires_real_sglang``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import run_miles
from tests.sglang.real_sglang import READY_LINE, requires_real_sglang, sglang_python

pytestmark = [pytest.mark.slow, requires_real_sglang]

KILLED_AT = 3
"""The rollout at whose start engine-1 dies: its share of that rollout's requests fails mid-rollout."""
STEPS = 10
"""Enough for the restart and re-registration to be seen over many steps; learning is test_real_sglang.py's."""
PROBE = """\
import json
import os
import signal

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
    if rollout_id == KILLED_AT:  # SGLang's launcher, its scheduler and detokenizer: the whole process group
        os.killpg(controller.provider.processes["engine-1"].pid, signal.SIGKILL)


@hookimpl
def on_metrics(rollout_id, step, metrics):
    url, headers = ROUTERS[0]
    listed = sorted(w["url"] for w in httpx.get(url + "/workers", headers=headers).json()["workers"])
    cells = CONTROLLER.cells.cells
    running = {cell_id: cell.workers[0].url for cell_id, cell in cells.items() if cell.state.value == "running"}
    versions = {cell_id: httpx.get(url + "/model_info").json()["weight_version"] for cell_id, url in running.items()}
    print("PROBE " + json.dumps({
        "step": step, "version": CONTROLLER.version, "samples": metrics["rollout/samples"], "router": listed,
        "running": running, "versions": versions, "restarts": {i: cell.restarts for i, cell in cells.items()},
    }), flush=True)
""".replace("KILLED_AT", str(KILLED_AT))


def generate_lines(log: str) -> int:
    """``POST /generate`` requests answered, from SGLang's uvicorn access log."""
    return len(re.findall(r'"POST /generate HTTP/1\.1" 200', log))


def test_real_sglang_behind_the_router_spreads_and_survives_an_engine_death(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    run_dir = tmp_path / "run"
    result = run_miles(
        "train",
        "--engine",
        "sglang",
        "--sglang-python",
        sglang_python(),
        "--sglang-router",
        "true",
        "--engine-num-engines",
        "2",
        "--weight-transfer-verify-checksum",  # sampled parameters read back from SGLang after every update
        "true",
        "--num-steps",
        str(STEPS),
        "--run-eval-every",
        "0",
        "--run-checkpoint-every",
        "0",
        "--no-progress",
        "--output-dir",
        str(run_dir),
        "--plugin",
        str(probe),
        timeout_s=1500,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # no protocol flag: auto takes tensor (shared memory) for engines on the trainer's node, and says so
    chosen = "miles: weights to engine-0, engine-1 by tensor (auto: on the trainer's node: shared memory)"
    assert chosen in result.stdout
    probes = [json.loads(line[6:]) for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    assert [p["step"] for p in probes] == list(range(1, STEPS + 1))
    assert all(p["samples"] == 128 for p in probes)  # no sample lost, the death's rollout included
    last = probes[-1]
    assert last["restarts"] == {"engine-0": 0, "engine-1": 1}
    assert probes[KILLED_AT - 1]["running"]["engine-1"] != last["running"]["engine-1"]  # back on a new port
    # The router routes to exactly the running engines, and each of them serves the run's current weights.
    for p in probes:
        assert p["router"] == sorted(p["running"].values()), p
        assert p["versions"] == {cell_id: str(p["version"]) for cell_id in p["running"]}, p
        assert p["version"] == p["step"]
    assert set(last["running"]) == {"engine-0", "engine-1"}
    logs = {name: (run_dir / "logs" / f"{name}.log").read_text() for name in ("engine-0", "engine-1")}
    assert logs["engine-0"].count(READY_LINE) == 1 and logs["engine-1"].count(READY_LINE) == 2
    # stopped at the end without SGLang's 5 s wait before crash diagnostics (the scheduler's SIGTERM is no crash)
    assert not any("before crash diagnostics" in log for log in logs.values()), logs["engine-0"][-2000:]
    second_life = logs["engine-1"].rsplit(READY_LINE, 1)[1]
    served = {"engine-0": generate_lines(logs["engine-0"]), "engine-1 (restarted)": generate_lines(second_life)}
    assert all(count > 0 for count in served.values()), served  # both engines serve, the restarted one too
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "rollout/samples" in row] == list(range(1, STEPS + 1))
