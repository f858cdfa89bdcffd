"""Round-trip latency and throughput of the worker RPC against a bare HTTP request and a Ray actor call.

Usage: ``python benchmarks/rpc_latency.py [--calls N] [--concurrency C]``. The worker runs in its own process
(started by the local provider). Baselines, in the same run: a bare httpx GET of the same server's trivial
``/rpc/health`` route over the same kind of connection, and a Ray actor method call. Prints medians, p99 and
calls per second, then the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable

import httpx
import ray

from miles_core.builtin.ray_provider import init_ray
from miles_core.testkit.echo_worker import ECHO_GROUPS
from miles_core.workers.local_provider import LocalWorkerProvider
from miles_core.workers.specs import PythonWorkerSpec

TOKEN = "bench-token"


@ray.remote
class PingActor:
    def ping(self) -> str:
        return "pong"


async def latencies(call: Callable[[], Awaitable[object]], count: int) -> list[float]:
    for _ in range(20):  # warm-up
        await call()
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - start)
    return samples


async def throughput(call: Callable[[], Awaitable[object]], count: int, concurrency: int) -> float:
    per_caller = count // concurrency

    async def caller() -> None:
        for _ in range(per_caller):
            await call()

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return per_caller * concurrency / (time.perf_counter() - start)


def p99(samples: list[float]) -> float:
    return sorted(samples)[max(0, int(len(samples) * 0.99) - 1)]


async def main(calls: int, concurrency: int) -> None:
    run_dir = tempfile.mkdtemp(prefix="miles-bench-")
    provider = LocalWorkerProvider(token=TOKEN, run_dir=run_dir)
    spec = PythonWorkerSpec(name="bench", target="miles_core.testkit.echo_worker:EchoWorker", rpc_groups=ECHO_GROUPS)
    info = await provider.start(spec)
    client = provider.client("bench")
    http = httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"})
    init_ray(num_cpus=2)  # a Ray of its own, never one that `ray start` left running
    actor = PingActor.remote()
    await actor.ping.remote()

    async def bare() -> None:
        (await http.get(f"{info.url}/rpc/health")).raise_for_status()

    async def rpc() -> None:
        await client.call("ping")

    async def ray_call() -> None:
        await actor.ping.remote()

    contenders = {"bare HTTP": bare, "Miles RPC": rpc, "Ray actor": ray_call}
    results = {}
    try:
        for name, call in contenders.items():
            samples = await latencies(call, calls)
            rate = await throughput(call, calls, concurrency)
            results[name] = (statistics.median(samples), p99(samples), rate)
            print(
                f"{name:10s} median {results[name][0] * 1e3:6.2f} ms  p99 {results[name][1] * 1e3:6.2f} ms  "
                f"{rate:7.0f} calls/s ({concurrency} concurrent callers)"
            )
    finally:
        await client.aclose()
        await http.aclose()
        await provider.shutdown()
        ray.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)  # the worker's log: nothing to keep
    rpc_median, _, rpc_rate = results["Miles RPC"]
    print(
        f"ratios: RPC/bare HTTP latency {rpc_median / results['bare HTTP'][0]:.2f}x, "
        f"RPC/Ray latency {rpc_median / results['Ray actor'][0]:.2f}x; "
        f"throughput RPC/bare HTTP {rpc_rate / results['bare HTTP'][2]:.2f}x, "
        f"RPC/Ray {rpc_rate / results['Ray actor'][2]:.2f}x"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.concurrency))
