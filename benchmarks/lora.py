"""LoRA against full training, in one run: bytes sent and seconds per weight update (the full weights through the
``tensor`` protocol, the default on one node, against the adapter loaded by path as SGLang's ``/load_lora_adapter``),
and the trainer's peak memory for a step with and without LoRA.

Usage: ``python benchmarks/lora.py [--hidden 768] [--layers 6] [--rank 16] [--repeats 5]``. The model is a Llama saved
on the spot (the defaults: about 90 M parameters, 350 MiB of float32 weights, 32000-token vocabulary, untied); one local
engine server serves it. Each update is timed from the trainer's weights (or adapter) to the engine serving them,
medians of ``--repeats`` after one warm-up each. The peak memory is the resident set of a fresh process that builds the
trainer and takes two steps of 8 samples of 64 tokens (``ru_maxrss``), once per setting; the ratios come last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.sections import TrainSection
from miles_core.engines.client import EngineClient
from miles_core.plugin_manager import MilesPluginManager
from miles_core.testkit.tiny_models import save_from_config
from miles_core.training.batch import TrainBatch, TrainSample
from miles_core.training.weight_iterator import bucketize
from miles_core.weight_transfer.protocol import EngineEndpoint
from miles_core.weight_transfer.routes import LOCAL_ENGINE
from miles_core.workers.local_provider import LocalWorkerProvider
from miles_core.workers.specs import CommandWorkerSpec

TOKEN = "bench-lora"
BUCKET_BYTES = 256 << 20


def save_model(path: Path, *, hidden: int, layers: int) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return save_from_config(config, path, seed=0)


def a_batch(seed: int, *, samples: int = 8, length: int = 64) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(samples):
        response = torch.randint(3, 32000, (length // 2,), generator=generator).tolist()
        prompt = torch.randint(3, 32000, (length // 2,), generator=generator).tolist()
        rows.append(TrainSample(prompt, response, [-5.0] * len(response), float(i % 2) - 0.5, 0.0))
    return TrainBatch(rows)


def settings(rank: int) -> TrainSection:
    return TrainSection(lora_rank=rank, lora_alpha=2.0 * rank, lr=1e-3) if rank else TrainSection(lr=1e-5)


def peak_memory(model: Path, rank: int) -> int:
    """The peak resident bytes of a fresh process that builds the trainer (LoRA rank ``rank``; 0: full) and takes
    two steps."""
    code = (
        "import json, resource, sys; sys.path.insert(0, 'benchmarks'); import lora; "
        f"t = lora.TorchTrainer.from_pretrained({str(model)!r}, lora.settings({rank})); "
        "[t.train_step(lora.a_batch(s)) for s in (1, 2)]; "
        "print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


async def full_updates(trainer: TorchTrainer, endpoint: EngineEndpoint, repeats: int) -> tuple[int, float]:
    """Bytes and median seconds of one full-weight update through the ``tensor`` protocol."""
    registries = MilesPluginManager.load().registries
    protocol = registries.weight_transfer_protocols.get_or_raise("tensor").load()()
    await protocol.connect([endpoint])
    reports = []
    try:
        for version in range(1, repeats + 2):
            started = time.perf_counter()
            report = await protocol.transfer(
                bucketize(trainer.weight_iterator(1 << 62).named_tensors(), BUCKET_BYTES), version=version
            )
            reports.append((report.num_bytes, time.perf_counter() - started))
    finally:
        await protocol.close()
    counted = reports[1:]  # the first sets up the staging file
    return counted[0][0], statistics.median(seconds for _, seconds in counted)


async def adapter_updates(
    trainer: TorchTrainer, client: EngineClient, workdir: Path, repeats: int
) -> tuple[int, float]:
    """Bytes and median seconds of one adapter update: written in peft's format, loaded by path, checked by digest,
    the previous one unloaded (what a LoRA run does after each step)."""
    timings, previous, size = [], None, 0
    for version in range(1, repeats + 2):
        started = time.perf_counter()
        directory = workdir / f"adapter_{version}"
        digest = trainer.save_adapter(directory)
        answer = await client.load_lora_adapter(f"v{version}", str(directory))
        assert answer["digest"] == digest, "the engine serves another adapter"
        if previous is not None:
            await client.unload_lora_adapter(previous)
        timings.append(time.perf_counter() - started)
        previous, size = f"v{version}", sum(f.stat().st_size for f in directory.iterdir())
    return size, statistics.median(timings[1:])


async def measure(args: argparse.Namespace, model: Path, workdir: Path) -> dict[str, float]:
    argv = [sys.executable, "-m", "miles_core.builtin.local_engine.server", "--model-path", str(model)]
    argv += ["--host", "{host}", "--port", "{port}"]
    spec = CommandWorkerSpec(
        name="engine-0", argv=argv, ports=["port"], health_url="http://{host}:{port}/health", startup_timeout_s=300
    )
    provider = LocalWorkerProvider(token=TOKEN, run_dir=workdir / "run")
    info = await provider.start(spec)
    try:
        endpoint = EngineEndpoint("engine-0", info.url, TOKEN, LOCAL_ENGINE)
        full = TorchTrainer.from_pretrained(model, settings(0))
        full_bytes, full_s = await full_updates(full, endpoint, args.repeats)
        del full
        lora = TorchTrainer.from_pretrained(model, settings(args.rank))
        lora.train_step(a_batch(0))  # a trained adapter (B is no longer zero)
        async with EngineClient(info.url, admin_key=TOKEN) as client:
            adapter_bytes, adapter_s = await adapter_updates(lora, client, workdir, args.repeats)
    finally:
        await provider.shutdown()
    return {"full_bytes": full_bytes, "full_s": full_s, "adapter_bytes": adapter_bytes, "adapter_s": adapter_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="miles-bench-lora-"))
    try:
        model = save_model(workdir / "model", hidden=args.hidden, layers=args.layers)
        params = sum(t.numel() for t in transformers.AutoModelForCausalLM.from_pretrained(model).state_dict().values())
        print(
            f"model: Llama hidden {args.hidden}, {args.layers} layers, {params / 1e6:.1f} M parameters "
            f"({params * 4 / 2**20:.0f} MiB float32); LoRA rank {args.rank} on all-linear",
            flush=True,
        )
        updates = asyncio.run(measure(args, model, workdir))
        memory = {rank: peak_memory(model, rank) for rank in (0, args.rank)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for what, key in (("full weights (tensor protocol)", "full"), ("adapter (/load_lora_adapter)", "adapter")):
        print(f"update, {what:30s} {updates[f'{key}_bytes'] / 2**20:9.2f} MiB  {updates[f'{key}_s']:.3f} s")
    print(f"trainer peak memory: full {memory[0] / 2**20:.0f} MiB, LoRA {memory[args.rank] / 2**20:.0f} MiB")
    print(json.dumps({**updates, "peak_full": memory[0], "peak_lora": memory[args.rank]}))
    print(
        f"ratios (adapter / full): bytes {updates['adapter_bytes'] / updates['full_bytes']:.4f}, "
        f"update time {updates['adapter_s'] / updates['full_s']:.3f}, "
        f"peak memory {memory[args.rank] / memory[0]:.3f}"
    )


if __name__ == "__main__":
    main()
