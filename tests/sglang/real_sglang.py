"""Where a real SGLang server can run in the tests, and how they start one through the plugin.

The SGLang environment is the one ``make sglang`` creates (``.venv-sglang``, or ``$MILES_SGLANG_PYTHON``). SGLang's CPU
engine serves on Intel Xeon CPUs with AVX512-BF16: measured on these machines' Xeons with AMX (``amx_bf16``) and
without it (``avx512_bf16`` alone); an AMD EPYC machine of the same kind cannot (``../shared/sglang-cpu``). Elsewhere
the real-SGLang tests skip with the reason :func:`unavailable_reason` gives.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from miles_plugins_sglang.config import is_this_interpreter, resolve_sglang_python
from miles_plugins_sglang.launch import sglang_engine_spec

from miles_core.config.build import build_config
from miles_core.plugin_manager import MilesPluginManager
from miles_core.workers.local_provider import LocalWorkerProvider
from miles_core.workers.provider import WorkerInfo

REPOSITORY = Path(__file__).resolve().parents[2]
READY_LINE = "The server is fired up and ready to roll!"
"""SGLang's own start-up line, in the engine's log once it serves."""


def sglang_python() -> str:
    """The SGLang environment's interpreter as the plugin resolves it from the repository root."""
    with contextlib.chdir(REPOSITORY):
        return resolve_sglang_python("auto")


def cpu_flags() -> tuple[str, set[str]]:
    """The CPU's vendor and flags, from ``/proc/cpuinfo``."""
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
def unavailable_reason() -> str | None:
    """Why a real SGLang server cannot run here, or None when it can."""
    vendor, flags = cpu_flags()
    if vendor != "GenuineIntel" or not flags & {"amx_bf16", "avx512_bf16"}:
        return (f"SGLang's CPU engine needs an Intel CPU with AVX512-BF16 or AMX (this one: {vendor or 'unknown'}, "
                f"amx_bf16/avx512_bf16 absent)")  # fmt: skip
    python = sglang_python()
    if not os.path.isfile(python) or is_this_interpreter(python):
        return "no SGLang environment: run `make sglang` (creates .venv-sglang) or set $MILES_SGLANG_PYTHON"
    probe = subprocess.run([python, "-c", "import sglang, sgl_kernel"], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})  # fmt: skip
    if probe.returncode != 0:
        return f"the SGLang environment {python} cannot import sglang and sgl_kernel: {probe.stderr[-300:]}"
    return None


requires_real_sglang = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def real_sglang_config(**overrides: Any) -> Any:
    """A run config whose engines are stock SGLang servers from the SGLang environment."""
    settings = {"engine.backend": "sglang", "weight_transfer.mode": "disk", "sglang.python": sglang_python()}
    return build_config(MilesPluginManager.load(), overrides={**settings, **overrides})


@contextlib.asynccontextmanager
async def real_sglang_server(run_dir: Path, model_path: Path, *, token: str = "sglang-admin",
                             cell_id: str = "engine-0", **overrides: Any) -> AsyncIterator[WorkerInfo]:  # fmt: skip
    """One stock SGLang server started through the plugin's engine spec and the local worker provider (its log in
    ``run_dir/logs/<cell_id>.log``), stopped with its process group on exit."""
    config = real_sglang_config(**overrides)
    provider = LocalWorkerProvider(token=token, run_dir=run_dir)
    try:
        yield await provider.start(sglang_engine_spec(config, cell_id=cell_id, model_path=str(model_path)))
    finally:
        await provider.shutdown()
