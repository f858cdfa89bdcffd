"""One SGLang engine outside a run: started from a run config through the same engine spec and local worker provider
that ``miles train`` uses, for benchmarks, notebooks and checks of a checkpoint. ``cpu_unavailable_reason`` says
why a stock SGLang server cannot serve on this machine's CPU (or None when it can)."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from miles_core import LocalWorkerProvider, WorkerInfo
from miles_plugins_sglang.config import is_this_interpreter
from miles_plugins_sglang.launch import CPU_ENV, check_engine_environment, sglang_engine_spec

CPU_FLAGS = {"amx_bf16", "avx512_bf16"}
"""SGLang's CPU kernels (sgl-kernel) need one of these, whatever the vendor (measured with sglang 0.5.23: Intel Xeons
with AMX and with AVX512-BF16 alone serve, and so does an AMD EPYC of family 25 (Zen 4) with AVX512-BF16; an AMD EPYC
without either cannot)."""


def cpu_flags() -> tuple[str, set[str]]:
    """The CPU's vendor and flags, from ``/proc/cpuinfo`` (empty where it cannot be read)."""
    vendor, flags = "", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id":
                vendor = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    return vendor, flags


@functools.cache
def cpu_unavailable_reason(python: str) -> str | None:
    """Why the SGLang environment ``python`` cannot serve on this machine's CPU, or None when it can: a CPU with
    AVX512-BF16 or AMX (Intel or AMD), an environment of its own, and ``import sglang, sgl_kernel`` succeeding there."""
    vendor, flags = cpu_flags()
    if not flags & CPU_FLAGS:
        return (
            f"SGLang's CPU engine needs a CPU with AVX512-BF16 or AMX (this one: {vendor or 'unknown'}, "
            "amx_bf16/avx512_bf16 absent)"
        )
    if not os.path.isfile(python) or is_this_interpreter(python):
        return f"no SGLang environment ({python}): run `make sglang` (creates .venv-sglang) or set $MILES_SGLANG_PYTHON"
    try:
        probe = subprocess.run(
            [python, "-c", "import sglang, sgl_kernel"],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **CPU_ENV},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the SGLang environment {python} could not be asked whether it has sglang: {exc}"
    if probe.returncode != 0:
        return f"the SGLang environment {python} cannot import sglang and sgl_kernel: {probe.stderr[-300:]}"
    return None


@contextlib.asynccontextmanager
async def engine_server(
    config: Any, *, model_path: str | Path, run_dir: str | Path, token: str, cell_id: str = "engine-0"
) -> AsyncIterator[WorkerInfo]:
    """One engine as ``config`` launches it (``sglang.*``, ``engine.*``, ``run.seed``) serving ``model_path``, with
    ``token`` as its admin key and its log in ``run_dir/logs/<cell_id>.log``; ready when the body starts, stopped
    with its whole process group on exit. The engine environment is checked first, as before a run's engines start
    (a :class:`~miles_core.errors.ConfigError` saying how to get one)."""
    check_engine_environment(config)
    provider = LocalWorkerProvider(token=token, run_dir=run_dir)
    try:
        yield await provider.start(sglang_engine_spec(config, cell_id=cell_id, model_path=str(model_path)))
    finally:
        await provider.shutdown()
