"""Token authentication of the local Rays that Miles starts: set up explicitly, so Ray prints no warning about it,
with one token per driver process that every local Ray of the process shares (Ray keeps the first token it loads
for the whole process), refusing a driver with another token, and a cluster given its own token later still
joined. Each scenario runs in a fresh process with no Ray settings of the machine's (no ``RAY_AUTH_*``, a ``HOME``
of its own): what a user's first ``miles train`` sees."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import MILES

pytestmark = pytest.mark.slow

RAY_WARNING = "Token authentication"
"""The start of both of Ray's warnings about it (turned on by default, or off)."""

TWO_LOCAL_RAYS = """
import os, subprocess, sys
import ray
from ray._raylet import AuthenticationTokenLoader
from miles_core.builtin.ray_provider import init_ray

WRONG_TOKEN_JOIN = "import sys; from miles_core.builtin.ray_provider import init_ray; init_ray(sys.argv[1])"


@ray.remote(num_cpus=0)
def seen(x):
    return x * 2, os.environ.get("RAY_AUTH_MODE"), os.environ.get("RAY_AUTH_TOKEN")


tokens = []
for start in (1, 2):
    init_ray(num_cpus=1)
    doubled, mode, token = ray.get(seen.remote(start))
    token = token or ""
    tokens.append(token)
    loaded = AuthenticationTokenLoader.instance().get_raw_token()
    print("RAY", start, doubled, mode, len(token), token == loaded, token == tokens[0], flush=True)
    if start == 2:
        # Ray retries a refused connection once a second, 20 times by default; the GCS is up, so 3 will do
        env = {**os.environ, "RAY_AUTH_TOKEN": "0" * 64, "RAY_gcs_server_port_wait_time_s": "3"}
        joined = subprocess.run(
            [sys.executable, "-c", WRONG_TOKEN_JOIN, ray.get_runtime_context().gcs_address],
            env=env, capture_output=True, text=True, timeout=120,
        )
        print("WRONG TOKEN", joined.returncode, "refused this driver's authentication token" in joined.stderr)
    ray.shutdown()
"""


def clean_env(home: Path) -> dict[str, str]:
    """This process's environment without Ray's settings, and ``home`` as ``HOME`` (no token file of an earlier
    Ray; Ray would write its own there)."""
    unset = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")
    return {**{key: value for key, value in os.environ.items() if key not in unset}, "HOME": str(home)}


def run_script(script: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=clean_env(home), timeout=300, check=False
    )


def test_two_local_rays_of_one_process_share_one_token_and_ray_prints_no_warning(tmp_path: Path) -> None:
    """Started one after the other in one process, both work; their workers have the driver's token (the same for
    both), a driver with another token is refused, and Ray neither warns nor writes ``~/.ray/auth_token``."""
    done = run_script(TWO_LOCAL_RAYS, tmp_path)
    assert RAY_WARNING not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RAY 1 2 token 64 True True" in done.stdout, done.stdout
    assert "RAY 2 4 token 64 True True" in done.stdout, done.stdout
    assert "WRONG TOKEN 1 True" in done.stdout, done.stdout
    assert not (tmp_path / ".ray").exists()


JOIN_AFTER_LOCAL = """
import os, subprocess, sys
import ray
from miles_core.builtin.ray_provider import init_ray

CLUSTER_TOKEN = "c" * 64
HEAD = "import sys, ray; from miles_core.builtin.ray_provider import init_ray; init_ray(num_cpus=1); " \\
    "print(ray.get_runtime_context().gcs_address, flush=True); sys.stdin.read(); ray.shutdown()"


@ray.remote(num_cpus=0)
def seen(x):
    return x * 2, os.environ.get("RAY_AUTH_TOKEN") == CLUSTER_TOKEN


head = subprocess.Popen(
    [sys.executable, "-c", HEAD], env={**os.environ, "RAY_AUTH_TOKEN": CLUSTER_TOKEN},
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
)
try:
    address = head.stdout.readline().strip()
    init_ray(num_cpus=1)
    print("LOCAL", ray.get(seen.remote(1)), flush=True)
    ray.shutdown()
    os.environ["RAY_AUTH_TOKEN"] = CLUSTER_TOKEN  # the cluster's token, given after the local Ray
    init_ray(address)
    print("JOINED", ray.get(seen.remote(2)), flush=True)
    ray.shutdown()
finally:
    head.stdin.close()
    head.wait(timeout=60)
"""


def test_a_process_that_started_a_local_ray_joins_a_cluster_with_the_token_given_for_it(tmp_path: Path) -> None:
    """Ray keeps the token it loaded first for the whole process: after a local Ray (the process's own token), a
    cluster's token given in ``RAY_AUTH_TOKEN`` is the one the join sends (the cluster here: another process's
    local Ray, started with that token)."""
    done = run_script(JOIN_AFTER_LOCAL, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LOCAL (2, False)" in done.stdout, done.stdout
    assert "JOINED (4, True)" in done.stdout, done.stdout
    assert RAY_WARNING not in done.stderr, done.stderr[-3000:]


def test_a_local_ray_run_prints_no_token_warning(tmp_path: Path) -> None:
    """A two-step ``miles train`` on a local Ray: it learns, and Ray's token warning is not among its output."""
    argv = [str(MILES), "train", "--output-dir", str(tmp_path / "run"), "--no-progress", "--num-steps", "2"]
    argv += ["--run-worker-provider", "ray"]
    result = subprocess.run(argv, capture_output=True, text=True, env=clean_env(tmp_path), timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Started a local Ray instance" in result.stderr  # the run did start a Ray
    assert RAY_WARNING not in result.stderr, result.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("train/loss") == 2
    assert not (tmp_path / ".ray").exists()
