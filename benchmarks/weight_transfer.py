"""Every weight-transfer protocol moving a ~1 GiB model from this process into a local engine, and ``tensor``,
``disk`` and ``broadcast`` into a real SGLang server, against a same-size memory copy into preallocated tensors (the
physical limit on this machine), in one run. Both engines are started through the sglang plugin's engine spec and the
local worker provider, as ``miles train`` starts them, one at a time.

Usage: ``python benchmarks/weight_transfer.py [--repeats 3] [--protocols disk,tensor,...] [--sglang-protocols
disk,broadcast]``. The SGLang environment is ``sglang.python`` (``$MILES_SGLANG_PYTHON``, else ``./.venv-sglang``;
``make sglang``); where SGLang cannot serve (no environment, a CPU without AVX512-BF16 or AMX) it says why and the
local engine's rows still run. Prints GB/s and seconds per update (medians of the repeats after two warm-up
transfers, each including the engine's load into its model), each beside the GB/s of a memcpy of the same tensors
timed just before each of its transfers and the ratio to it, and, last, real SGLang's ratios to the local engine.
The trainer's weights are float32; SGLang serves them in bf16 (its CPU kernels' dtype). GB/s count the trainer's
float32 bytes, as the memcpy does: ``tensor`` into SGLang stages the matrices already rounded to bf16 (see
``TensorSettings.held_dtype``), so its staging file holds half of them.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from miles_plugins_sglang.launch import sglang_capabilities
from miles_plugins_sglang.standalone import cpu_unavailable_reason, engine_server

from miles_core.config.build import build_config
from miles_core.plugin_manager import MilesPluginManager
from miles_core.training.weight_iterator import ModuleHfWeightIterator
from miles_core.weight_transfer.protocol import EngineEndpoint

TOKEN = "bench-admin"
WARMUP = 2  # an RL run transfers every step: the first transfers (which create staging files) are reported apart
LOCAL, SGLANG = "local engine", "real SGLang"
LOCAL_SERVER = ["{python}", "-m", "miles_core.builtin.local_engine.server"]
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
    copy.rate()  # the first copy faults the targets' pages in: "preallocated" means touched already
    return statistics.median(copy.rate() for _ in range(repeats))


async def protocol_rate(
    name: str, endpoint: EngineEndpoint, model: torch.nn.Module, repeats: int, bucket_bytes: int, copy: MemoryCopy
) -> tuple[float, float, float]:
    """GB/s and seconds of one update (medians of ``repeats`` after the warm-up transfers) into one engine, and the
    GB/s of a memcpy of the same tensors timed just before each counted transfer (the machine's bandwidth drifts
    between rows: each row's ratio is to the copies beside it)."""
    registry_name, settings = SETTINGS.get(name, (name, {}))
    registries = MilesPluginManager.load().registries
    protocol = registries.weight_transfer_protocols.get_or_raise(registry_name).load()(**settings)
    await protocol.connect([endpoint])
    reports, copies = [], []
    try:
        for version in range(1, repeats + WARMUP + 1):
            if version > WARMUP:
                copies.append(copy.rate())
            reports.append(
                await protocol.transfer(iter(ModuleHfWeightIterator(model, bucket_bytes=bucket_bytes)), version=version)
            )
    finally:
        await protocol.close()
    first = ", ".join(f"{r.gb_per_s:.2f}" for r in reports[:WARMUP])
    print(f"{name:22s} {endpoint.name}: first transfers {first} GB/s (set-up, not counted)", flush=True)
    counted = reports[WARMUP:]
    return (
        statistics.median(r.gb_per_s for r in counted),
        statistics.median(r.seconds for r in counted),
        statistics.median(copies),
    )


def engine_configs(args: argparse.Namespace) -> dict[str, tuple[Any, list[str]]]:
    """Per engine: its run config and the protocols measured into it; where real SGLang cannot serve here its row
    says why and is left out."""
    manager = MilesPluginManager.load()
    common = {"engine.backend": "sglang", "weight_transfer.mode": "disk", "engine.startup_timeout_s": 600}
    local = build_config(manager, overrides={**common, "sglang.launch_command": LOCAL_SERVER})
    engines = {LOCAL: (local, args.protocols.split(","))} if args.protocols else {}
    if args.sglang_protocols:
        # the checkpoint is float32 (the trainer's weights); SGLang's CPU kernels serve bf16
        sglang = build_config(
            manager,
            overrides={**common, "sglang.python": args.sglang_python, "sglang.server_args": {"dtype": "bfloat16"}},
        )
        reason = cpu_unavailable_reason(sglang.sglang.sglang_python())
        if reason:
            print(f"{SGLANG}: skipped: {reason}", flush=True)
        else:
            engines[SGLANG] = (sglang, args.sglang_protocols.split(","))
    return engines


async def main(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="miles-bench-transfer-"))
    model = one_gib_model(workdir / "model")
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"model: {nbytes / 2**30:.2f} GiB of weights, bucket {args.bucket_mb} MiB, {args.repeats} repeats")
    memcpy = memcpy_rate(model, args.repeats)
    copy = MemoryCopy(model)
    copy.rate()  # faults the targets' pages in
    results: dict[tuple[str, str], tuple[float, float, float]] = {}
    try:
        for index, (engine, (config, protocols)) in enumerate(engine_configs(args).items()):
            server = engine_server(
                config, model_path=workdir / "model", run_dir=workdir / "run", token=TOKEN, cell_id=f"engine-{index}"
            )
            async with server as info:  # one engine at a time: each holds the model (a GiB) on a small machine
                capabilities = sglang_capabilities(config)  # the local engine's routes when it runs the local server
                endpoint = EngineEndpoint(f"engine-{index}", info.url, TOKEN, capabilities)
                for name in protocols:
                    results[name, engine] = await protocol_rate(
                        name, endpoint, model, args.repeats, args.bucket_mb << 20, copy
                    )
                    print(f"{name:22s} {engine:14s} {results[name, engine][0]:6.2f} GB/s", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # a GiB-sized model and its staging files
    report(results, memcpy)


def report(results: dict[tuple[str, str], tuple[float, float, float]], memcpy: float) -> None:
    """The table (each row with the memcpy timed beside its transfers and the ratio to it), then real SGLang's ratio
    to the local engine per protocol."""
    print(f"{'protocol':22s} {'engine':14s} {'GB/s':>6s} {'s/update':>9s} {'memcpy GB/s':>12s} {'/ memcpy':>9s}")
    for (name, engine), (rate, seconds, beside) in results.items():
        print(f"{name:22s} {engine:14s} {rate:6.2f} {seconds:9.2f} {beside:12.2f} {rate / beside:9.2f}")
    print(f"{'memcpy (preallocated, before the rows)':37s} {memcpy:6.2f}")
    pairs = [
        (name, rate, results[name, LOCAL][0])
        for (name, engine), (rate, _, _) in results.items()
        if engine == SGLANG and (name, LOCAL) in results
    ]
    if pairs:
        print("ratios real SGLang / local engine: " + ", ".join(f"{n} {s / lo:.2f}x" for n, s, lo in pairs))
    else:
        print("ratios real SGLang / local engine: none (real SGLang skipped, or no protocol measured into both)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument(
        "--protocols", default="tensor-shm,broadcast,disk,sharded-disk,tensor-http", help="into the local engine"
    )
    parser.add_argument("--sglang-protocols", default="tensor,disk,broadcast", help="into real SGLang ('' for none)")
    parser.add_argument("--sglang-python", default="auto", help="the SGLang environment's interpreter (sglang.python)")
    asyncio.run(main(parser.parse_args()))
