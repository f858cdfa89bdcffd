"""Rollout throughput through the sglang-router against direct engine calls, in one run.

Usage: ``python benchmarks/router_overhead.py [--engines 2] [--samples 128] [--repeats 3]``. Starts ``--engines``
local-engine servers on the embedded default model and a real sglang-router in front of them (both through the
miles-plugins-sglang worker specs and the local worker provider), then generates ``--samples`` samples of 8 new
tokens (one rollout's worth, per-sample seeds) three ways: direct batches (one ``/generate`` per engine, what the
executor does without a router), direct single requests (one ``/generate`` per sample, spread over the engines by
the client), and single requests through the router. The engines batch continuously (requests join the running
batch between decode steps), so single requests arriving one by one share decode steps as a batch does. Prints
samples/s (median of the repeats) and the ratios, last the one that matters: single requests through the router
against direct batches (the aim: at least 0.9x).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from miles_plugins_sglang.launch import sglang_engine_spec, sglang_router_spec
from miles_plugins_sglang.router import RouterRegistrar

from miles_core.config.build import build_config
from miles_core.engines.client import EngineClient
from miles_core.plugin_manager import MilesPluginManager
from miles_core.run_setup import default_model
from miles_core.workers.local_provider import LocalWorkerProvider

TOKEN = "bench"
LOCAL_ENGINE = ["{python}", "-m", "miles_core.builtin.local_engine.server"]
PARAMS = {"max_new_tokens": 8, "temperature": 1.0}


async def timed(coroutine_factory, repeats: int) -> float:
    await coroutine_factory()  # warm-up
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        await coroutine_factory()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


async def main(engines: int, samples: int, repeats: int) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="miles-router-bench-"))
    model = default_model(run_dir, seed=0)
    manager = MilesPluginManager.load()
    config = build_config(
        manager, overrides={"engine.backend": "sglang", "sglang.router": True, "sglang.launch_command": LOCAL_ENGINE}
    )
    provider = LocalWorkerProvider(token=TOKEN, run_dir=run_dir)
    try:
        infos = await asyncio.gather(
            *(
                provider.start(sglang_engine_spec(config, cell_id=f"engine-{i}", model_path=str(model)))
                for i in range(engines)
            )
        )
        router = await provider.start(sglang_router_spec(config))
        registrar = RouterRegistrar(router.url)
        await asyncio.to_thread(registrar.sync, [info.url for info in infos])
        direct = [EngineClient(info.url, name=info.name) for info in infos]
        routed = EngineClient(router.url, name="router", is_router=True)
        prompts = [[1, 5, 3, 9, 4, 12] for _ in range(samples)]
        seeded = [{**PARAMS, "sampling_seed": index} for index in range(samples)]

        async def batches() -> None:
            share = [list(range(i, samples, engines)) for i in range(engines)]
            await asyncio.gather(
                *(
                    client.generate([prompts[j] for j in part], [seeded[j] for j in part])
                    for client, part in zip(direct, share, strict=True)
                )
            )

        async def singles_direct() -> None:
            await asyncio.gather(*(direct[j % engines].generate(prompts[j], seeded[j]) for j in range(samples)))

        async def singles_routed() -> None:
            await asyncio.gather(*(routed.generate(prompts[j], seeded[j]) for j in range(samples)))

        rates = {}
        for name, run in (
            ("direct batches", batches),
            ("direct single requests", singles_direct),
            ("single requests via the router", singles_routed),
        ):
            rates[name] = samples / await timed(run, repeats)
            print(f"{name:32s} {rates[name]:8.1f} samples/s")
        base = rates["direct single requests"]
        routed_rate = rates["single requests via the router"]
        print(f"router / direct single requests = {routed_rate / base:.2f}x")
        ratio = routed_rate / rates["direct batches"]
        print(f"router single requests / direct batches (continuous batching) = {ratio:.2f}x")
        for client in (*direct, routed):
            await client.aclose()
        registrar.close()
    finally:
        await provider.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.engines, args.samples, args.repeats))
