"""Weight updates sent by the Megatron trainer's ranks against the path through the driver, per protocol, in one
run: GB/s of each, the ratio to a memory copy of the same bytes, and the driver's peak memory growth during the
update as a fraction of the model's size.

Usage: ``python benchmarks/weight_plane.py [--hidden 2048] [--layers 3] [--tensor-parallel 2] [--repeats 3]
[--protocols disk,tensor,broadcast,rdt] [--two-raylets] [--ucx-tcp]``. The model is a Llama saved on the spot (the
defaults: about 1 GiB of float32 weights, as ``benchmarks/weight_transfer.py``'s); the trainer's ranks (TP=2) and
one local engine server are workers of the Ray provider (``rdt`` needs Ray actors on both sides). With
``--two-raylets`` they run on two Ray nodes of their own on this machine (``ray.cluster_utils.Cluster``, as
``tests/workers/test_ray_cluster.py``): the ranks on one, the engine on the other, so every byte crosses raylets;
``--ucx-tcp`` also holds NIXL's UCX to TCP, as between two machines without RDMA. For each protocol, alternately:

- **driver**: the ranks gather the weights into rank 0's export, the driver reads it back
  (``MegatronTrainer.weight_iterator``) and the protocol sends its buckets (``transfer``);
- **ranks**: every rank sends its share itself and the driver only coordinates (``transfer_from_holders``).

Each update is timed from the request to the engine's version, export included (the medians of ``--repeats`` after
one warm-up each); the driver's resident memory is sampled every 2 ms during it, and its peak above the level before
the update is reported against the model's bytes (the issue's aim for the ranks' path: under 10 %). The memory copy
is the median of ``--repeats`` copies of the model's tensors into tensors allocated (and touched) once, measured
before the protocols.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import transformers
from miles_plugins_megatron.config import MegatronSection
from miles_plugins_megatron.trainer import MegatronTrainer
from ray_nodes import ray_nodes
from weight_transfer import memcpy_rate  # the baseline of benchmarks/weight_transfer.py

from miles_core.builtin.ray_provider import RayWorkerProvider
from miles_core.config.sections import TrainSection
from miles_core.engines.client import EngineClient
from miles_core.plugin_manager import MilesPluginManager
from miles_core.weight_transfer.protocol import EngineEndpoint
from miles_core.workers.specs import ENGINE, CommandWorkerSpec

TOKEN = "bench-plane"
BUCKET_BYTES = 256 << 20


def save_model(path: Path, *, hidden: int, layers: int, repeats: int) -> tuple[int, float]:
    """A Llama of ``layers`` layers of ``hidden`` (32000-token vocabulary, untied); its bytes and the GB/s of a
    memory copy of its tensors (median of ``repeats``)."""
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values()), memcpy_rate(model, repeats)


class PeakMemory:
    """The driver's resident set sampled in a thread: the peak above the level at start."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.process, self.interval_s = psutil.Process(), interval_s
        self.start = self.peak = self.process.memory_info().rss
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.start


async def one_update(protocol: Any, trainer: MegatronTrainer, path: str, version: int) -> tuple[float, int]:
    """Seconds and driver memory growth of one update by ``path`` ("driver" or "ranks")."""
    trainer._weights = None  # the driver path gathers afresh, as after every training step
    with PeakMemory() as memory:
        started = time.perf_counter()
        if path == "driver":
            await protocol.transfer(iter(trainer.weight_iterator(BUCKET_BYTES)), version=version)
            trainer._weights = None  # the copy the driver path holds until the next step is counted above
        else:
            await protocol.transfer_from_holders(trainer.weight_holders(), version=version)
        seconds = time.perf_counter() - started
    return seconds, memory.growth


def engine_spec(model: Path) -> CommandWorkerSpec:
    argv = [sys.executable, "-m", "miles_core.builtin.local_engine.server", "--model-path", str(model)]
    argv += ["--host", "{host}", "--port", "{port}", "--admin-api-key", "{token}"]
    return CommandWorkerSpec(
        name="engine-0", argv=argv, ports=["port"], health_url="http://{host}:{port}/health", role=ENGINE
    )


async def bench(args: argparse.Namespace, tmp: Path, address: str | None, pins: dict) -> None:
    nbytes, memcpy = save_model(tmp / "model", hidden=args.hidden, layers=args.layers, repeats=args.repeats)
    where = "ranks and engine on two raylets" if pins else "one Ray node"
    print(f"model: Llama, {nbytes / 2**30:.2f} GiB of float32 weights; TP={args.tensor_parallel} ranks, one engine; "
          f"{where}{'; UCX over TCP only' if args.ucx_tcp else ''}; memcpy {memcpy:.2f} GB/s", flush=True)  # fmt: skip
    provider = RayWorkerProvider(token=TOKEN, run_dir=tmp / "run", address=address, role_resources=pins)
    engine = await provider.start(engine_spec(tmp / "model"))
    endpoint = EngineEndpoint(name=engine.name, url=engine.url, admin_key=TOKEN)
    layout = MegatronSection(tensor_parallel=args.tensor_parallel, cpus_per_rank=0.5)
    registries = MilesPluginManager.load().registries
    rows = []
    with MegatronTrainer.launch(
        tmp / "model", train=TrainSection(), layout=layout, seed=0, provider_factory=lambda: provider
    ) as trainer:
        print(f"ranks: {trainer.ranks.describe()}; engine: {provider.workers[engine.name].describe()}", flush=True)
        for name in args.protocols.split(","):
            settings = {
                "disk": {"work_dir": str(tmp / "disk")},
                "rdt": {"staging_bucket_mb": nbytes // 2**20 + 64},  # a staging bucket holds a whole version
            }.get(name, {})
            protocol = registries.weight_transfer_protocols.get_or_raise(name).load()(**settings)
            await protocol.connect([endpoint])
            version = 0
            for path in ("driver", "ranks"):
                results = []
                for _ in range(args.repeats + 1):
                    version += 1
                    results.append(await one_update(protocol, trainer, path, version))
                async with EngineClient(endpoint.url, admin_key=TOKEN) as client:
                    assert await client.weight_version() == str(version)
                seconds = statistics.median(s for s, _ in results[1:])
                growth = max(g for _, g in results[1:])
                rows.append((name, path, seconds, growth))
                print(f"{name} by {path}: {nbytes / seconds / 1e9:.2f} GB/s", flush=True)
            await protocol.close()
    await provider.shutdown()
    report(rows, nbytes, memcpy, args.protocols.split(","))


def report(rows: list[tuple[str, str, float, int]], nbytes: int, memcpy: float, protocols: list[str]) -> None:
    print(
        f"{'protocol':<9} {'sent by':<8} {'seconds':>8} {'GB/s':>7} {'/ memcpy':>9} {'driver peak growth':>19} "
        f"{'/ model':>8}"
    )
    for name, path, seconds, growth in rows:
        rate = nbytes / seconds / 1e9
        print(
            f"{name:<9} {path:<8} {seconds:8.2f} {rate:7.2f} {rate / memcpy:9.3f} {growth / 2**20:15.0f} MiB "
            f"{growth / nbytes:8.1%}"
        )
    for name in protocols:
        driver, ranks = (next(r for r in rows if r[:2] == (name, path)) for path in ("driver", "ranks"))
        print(
            f"ratio {name}: ranks GB/s / driver GB/s = {driver[2] / ranks[2]:.2f}x; driver peak growth "
            f"{ranks[3] / nbytes:.1%} of the model by the ranks' path, {driver[3] / nbytes:.1%} by the driver's"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--protocols", default="disk,tensor,broadcast,rdt")
    parser.add_argument("--two-raylets", action="store_true", help="ranks and engine on two Ray nodes of their own")
    parser.add_argument("--ucx-tcp", action="store_true", help="NIXL's UCX over TCP only, as between machines")
    args = parser.parse_args()
    if args.ucx_tcp:  # before any NIXL agent exists, here or in the Ray workers started below
        os.environ["UCX_TLS"] = "tcp"
    with tempfile.TemporaryDirectory() as tmp, ray_nodes(args.two_raylets) as (address, pins):
        asyncio.run(bench(args, Path(tmp), address, pins))


if __name__ == "__main__":
    main()
