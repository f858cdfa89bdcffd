"""The Megatron trainer against the core torch trainer on the same model and batch, and its HF export against a
same-size memory copy, in one run.

Usage: ``python benchmarks/megatron_trainer.py [--steps 6] [--tensor-parallel 1,2]``. For each trainer: the median
optimizer-step time after one warm-up step (Megatron's step is measured on the driver: the RPC to every rank, the
step, and the reduction of the metrics; the export that follows each step is reported apart), then the export rate
(gather over tensor-parallel ranks, split into HF tensors, write to shared memory, read by the driver) against a
memcpy of the same bytes into preallocated tensors. Ranks run as local worker processes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from miles_plugins_megatron.config import MegatronSection
from miles_plugins_megatron.trainer import MegatronTrainer

from miles_core.config.sections import TrainSection
from miles_core.training.batch import TrainBatch, TrainSample
from miles_core.training.torch_trainer import TorchTrainer
from miles_core.workers.local_provider import LocalWorkerProvider

SETTINGS = TrainSection(lr=1e-4, micro_batch_size=8)


def save_model(path: Path) -> int:
    config = transformers.LlamaConfig(
        vocab_size=16000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def batch(samples: int = 16, prompt: int = 16, response: int = 16) -> TrainBatch:
    generator = torch.Generator().manual_seed(0)

    def ids(length: int) -> list[int]:
        return torch.randint(0, 16000, (length,), generator=generator).tolist()

    return TrainBatch(
        [
            TrainSample(ids(prompt), ids(response), [-9.0] * response, 1.0 if i % 2 else -1.0, 0.0)
            for i in range(samples)
        ]
    )


def median_step(trainer, steps: int) -> tuple[float, float]:
    """Median step seconds (without Megatron's export) and median export seconds (0 for the torch trainer)."""
    trainer.train_step(batch())  # warm-up
    step_seconds, export_seconds = [], []
    for _ in range(steps):
        started = time.perf_counter()
        metrics = trainer.train_step(batch())
        export = metrics.get("export_seconds", 0.0)
        step_seconds.append(time.perf_counter() - started - export)
        export_seconds.append(export)
    return statistics.median(step_seconds), statistics.median(export_seconds)


def memcpy_seconds(nbytes: int, repeats: int = 5) -> float:
    source, target = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    source.fill_(1)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tensor-parallel", default="1,2")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        nbytes = save_model(path)
        print(f"model: {nbytes / 1e6:.0f} MB of float32 weights; batch: 16 samples of 16 + 16 tokens")
        torch_step, _ = median_step(TorchTrainer.from_pretrained(path, SETTINGS), args.steps)
        print(f"torch trainer (in process)        step {torch_step * 1e3:8.1f} ms")
        memcpy = nbytes / memcpy_seconds(nbytes) / 1e9
        rows = []
        for tp in [int(value) for value in args.tensor_parallel.split(",")]:
            layout = MegatronSection(tensor_parallel=tp)

            def provider() -> LocalWorkerProvider:
                return LocalWorkerProvider(token="bench", run_dir=tmp)

            with MegatronTrainer.launch(path, train=SETTINGS, layout=layout, seed=0, provider_factory=provider) as mt:
                step, export = median_step(mt, args.steps)
            rows.append((tp, step, export))
            print(
                f"megatron trainer TP={tp} (ranks)     step {step * 1e3:8.1f} ms   export {export * 1e3:7.1f} ms "
                f"({nbytes / export / 1e9:.2f} GB/s)"
            )
        print(f"memcpy of the same bytes: {memcpy:.2f} GB/s")
        for tp, step, export in rows:
            print(
                f"ratios TP={tp}: megatron step / torch step = {step / torch_step:.2f}x; "
                f"export GB/s / memcpy GB/s = {nbytes / export / 1e9 / memcpy:.3f}"
            )


if __name__ == "__main__":
    main()
