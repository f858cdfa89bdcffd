"""Where a real SGLang server can run in the tests, and how they start one through the plugin.

The SGLang environment is the one ``make sglang`` creates (``.venv-sglang``, or ``$MILES_SGLANG_PYTHON``). SGLang's CPU
engine serves on CPUs with AVX512-BF16: measured on these machines' Xeons with AMX (``amx_bf16``) and without it
(``avx512_bf16`` alone), and on an AMD EPYC of family 25 (Zen 4, ``avx512_bf16``); an EPYC without it cannot.
Elsewhere the real-SGLang tests skip with the reason :func:`unavailable_reason` gives.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from miles_plugins_sglang.config import resolve_sglang_python
from miles_plugins_sglang.standalone import cpu_unavailable_reason, engine_server

from miles_core.config.build import build_config
from miles_core.plugin_manager import MilesPluginManager
from miles_core.workers.provider import WorkerInfo

REPOSITORY = Path(__file__).resolve().parents[2]
READY_LINE = "The server is fired up and ready to roll!"
"""SGLang's own start-up line, in the engine's log once it serves."""


def sglang_python() -> str:
    """The SGLang environment's interpreter as the plugin resolves it from the repository root."""
    with contextlib.chdir(REPOSITORY):
        return resolve_sglang_python("auto")


def unavailable_reason() -> str | None:
    """Why a real SGLang server cannot run here, or None when it can."""
    return cpu_unavailable_reason(sglang_python())


requires_real_sglang = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def real_sglang_config(**overrides: Any) -> Any:
    """A run config whose engines are stock SGLang servers from the SGLang environment."""
    settings = {"engine.backend": "sglang", "weight_transfer.mode": "disk", "sglang.python": sglang_python()}
    return build_config(MilesPluginManager.load(), overrides={**settings, **overrides})


def real_sglang_server(
    run_dir: Path, model_path: Path, *, token: str = "sglang-admin", cell_id: str = "engine-0", **overrides: Any
) -> contextlib.AbstractAsyncContextManager[WorkerInfo]:
    """One stock SGLang server started as ``miles train`` starts it (the plugin's :func:`engine_server`), its log in
    ``run_dir/logs/<cell_id>.log``, stopped with its process group on exit."""
    return engine_server(
        real_sglang_config(**overrides), model_path=model_path, run_dir=run_dir, token=token, cell_id=cell_id
    )
