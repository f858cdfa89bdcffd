"""Every weight-transfer protocol moving a ~1 GiB model from this process into a local engine, against a
same-size memory copy into preallocated tensors (the physical limit on this machine), in one run.

Usage: ``python benchmarks/weight_transfer.py [--repeats 3] [--protocols disk,tensor,...]``. Prints GB/s per
protocol (median of the repeats after two warm-up transfers, each including the engine's load into its model)
and, last, the ratios to memcpy.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from miles_core.plugin_manager import MilesPluginManager
from miles_core.training.weight_iterator import ModuleHfWeightIterator
from miles_core.weight_transfer.protocol import EngineEndpoint
from miles_core.workers.local_provider import LocalWorkerProvider
from miles_core.workers.specs import CommandWorkerSpec

TOKEN = "bench-admin"
WARMUP = 2  # an RL run transfers every step: the first transfers (which create staging files) are reported apart
SETTINGS = {"tensor-http": ("tensor", {"shared_memory": False}), "tensor-shm": ("tensor", {"shared_memory": True})}


def one_gib_model(path: Path) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=3,
        num_attention_heads=16,
        num_key_value_heads=16,
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return model


class MemoryCopy:
    """A copy of the model's tensors into tensors allocated once, timed one whole copy at a time."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.sources = [tensor.detach() for tensor in model.state_dict().values()]
        self.targets = [torch.empty_like(tensor) for tensor in self.sources]
        self.nbytes = sum(tensor.numel() * tensor.element_size() for tensor in self.sources)

    def rate(self) -> float:
        """GB/s of one copy of every tensor."""
        start = time.perf_counter()
        for target, source in zip(self.targets, self.sources, strict=True):
            target.copy_(source)
        return self.nbytes / (time.perf_counter() - start) / 1e9


def memcpy_rate(model: torch.nn.Module, repeats: int) -> float:
    copy = MemoryCopy(model)
    return statistics.median(copy.rate() for _ in range(repeats))


async def protocol_rate(name: str, endpoint: EngineEndpoint, model: torch.nn.Module, repeats: int,
                        bucket_bytes: int) -> float:  # fmt: skip
    registry_name, settings = SETTINGS.get(name, (name, {}))
    registries = MilesPluginManager.load().registries
    protocol = registries["weight_transfer_protocols"].get_or_raise(registry_name).load()(**settings)
    await protocol.connect([endpoint])
    rates = []
    try:
        for version in range(1, repeats + WARMUP + 1):
            report = await protocol.transfer(iter(ModuleHfWeightIterator(model, bucket_bytes=bucket_bytes)),
                                             version=version)  # fmt: skip
            rates.append(report.gb_per_s)
    finally:
        await protocol.close()
    print(f"{name:22s} first transfers {', '.join(f'{r:.2f}' for r in rates[:WARMUP])} GB/s (set-up, not counted)")
    return statistics.median(rates[WARMUP:])


async def main(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="miles-bench-transfer-"))
    model = one_gib_model(workdir / "model")
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    provider = LocalWorkerProvider(token=TOKEN, run_dir=workdir)
    argv = [sys.executable, "-m", "miles_core.engines.local_server", "--model-path", str(workdir / "model"),
            "--host", "{host}", "--port", "{port}"]  # fmt: skip
    spec = CommandWorkerSpec(
        name="bench-engine", argv=argv, ports=["port"], health_url="http://{host}:{port}/health", startup_timeout_s=300
    )
    info = await provider.start(spec)
    endpoint = EngineEndpoint(name="bench-engine", url=info.url, admin_key=TOKEN)
    print(f"model: {nbytes / 2**30:.2f} GiB of weights, bucket {args.bucket_mb} MiB, {args.repeats} repeats")
    results = {"memcpy (preallocated)": memcpy_rate(model, args.repeats)}
    try:
        for name in args.protocols.split(","):
            results[name] = await protocol_rate(name, endpoint, model, args.repeats, args.bucket_mb << 20)
            print(f"{name:22s} {results[name]:6.2f} GB/s", flush=True)
    finally:
        await provider.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)  # a GiB-sized model and its staging files
    print(f"{'memcpy (preallocated)':22s} {results['memcpy (preallocated)']:6.2f} GB/s")
    base = results["memcpy (preallocated)"]
    print("ratios to memcpy: " + ", ".join(f"{n} {r / base:.2f}" for n, r in results.items() if n[0] != "m"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--protocols", default="tensor-shm,broadcast,disk,sharded-disk,tensor-http")
    asyncio.run(main(parser.parse_args()))
