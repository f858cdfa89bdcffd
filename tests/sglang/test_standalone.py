"""``miles_plugins_sglang.standalone``: one engine started from a run config outside a run (as the benchmarks
start theirs), and the reasons a stock SGLang server cannot serve on this machine's CPU."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import httpx
import pytest
from miles_plugins_sglang.standalone import cpu_flags, cpu_unavailable_reason, engine_server

from miles_core.config.build import build_config
from miles_core.errors import ConfigError
from miles_core.plugin_manager import MilesPluginManager
from miles_core.testkit.tiny_models import save_tiny_llama

LOCAL_ENGINE = ["{python}", "-m", "miles_core.builtin.local_engine.server"]


def config(**overrides):
    settings = {"engine.backend": "sglang", "weight_transfer.mode": "disk", **overrides}
    return build_config(MilesPluginManager.load(), overrides=settings)


def test_an_engine_started_from_a_config_serves_and_is_stopped_on_exit(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model")

    async def scenario() -> int:
        async with engine_server(
            config(**{"sglang.launch_command": LOCAL_ENGINE}),
            model_path=model,
            run_dir=tmp_path / "run",
            token="standalone-admin",
        ) as info:
            async with httpx.AsyncClient(timeout=120) as client:
                body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
                answer = (await client.post(f"{info.url}/generate", json=body)).json()
                assert len(answer["output_ids"]) == 3
                refused = await client.post(f"{info.url}/flush_cache")  # the token is its admin key
                assert refused.status_code == 401
                flushed = await client.post(
                    f"{info.url}/flush_cache", headers={"Authorization": "Bearer standalone-admin"}
                )
                assert flushed.status_code == 200
            return info.pid

    pid = asyncio.run(scenario())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "engine-0.log" in os.listdir(tmp_path / "run" / "logs")


def test_a_stock_server_without_an_environment_is_refused_before_it_starts(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-env" / "bin" / "python")

    async def scenario() -> None:
        async with engine_server(
            config(**{"sglang.python": missing}), model_path=tmp_path, run_dir=tmp_path, token="t"
        ):
            raise AssertionError("no engine should start")

    with pytest.raises(ConfigError, match=r"interpreter .*no-env.* does not exist: create one with `make sglang`"):
        asyncio.run(scenario())


def test_reasons_sglang_cannot_serve_on_this_cpu(tmp_path: Path) -> None:
    _, flags = cpu_flags()
    for python in (sys.executable, str(tmp_path / "missing-python")):
        reason = cpu_unavailable_reason(python)
        if not flags & {"amx_bf16", "avx512_bf16"}:
            assert "needs a CPU with AVX512-BF16 or AMX" in reason
        else:
            assert reason.startswith(f"no SGLang environment ({python}): run `make sglang`")
