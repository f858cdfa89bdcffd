"""The Megatron trainer against the core torch trainer on the same model and batch, and its HF export against a
same-size memory copy, in one run; for a dense Llama and for a small Qwen3-MoE.

Usage: ``python benchmarks/megatron_trainer.py [--steps 6] [--models dense,moe] [--tensor-parallel 1,2]
[--moe-layouts 1x1x1,1x2x1,1x2x2,2x1x1]``.

For each trainer: the median optimizer-step time after one warm-up step (Megatron's
step is measured on the driver: the RPC to every rank, the step, and the reduction of the metrics; the export that
follows each step is reported apart), then the export rate (gather over tensor-parallel ranks, or over each
expert-parallel group's experts, split into HF tensors, write to shared memory, read by the driver) against a memcpy
of the same bytes into preallocated tensors. Ranks run as local worker processes.

The dense model is a 112 MB Llama, run at each ``--tensor-parallel`` size. The MoE model is a Qwen3-MoE made with
the testkit (hidden 256, 4 MoE layers of 8 experts of which each token takes 2, vocabulary 8000), run at each
``TPxDPxEP`` layout of ``--moe-layouts`` (EP must divide DP, so EP=2 needs DP=2; DP=2 x EP=1 shows what the second
rank costs without EP; TP=2 runs with sequence parallelism, as megatron-core trains MoE layers under TP).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from miles_plugins_megatron.config import MegatronSection
from miles_plugins_megatron.trainer import MegatronTrainer
from safetensors.torch import load_file

from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.sections import TrainSection
from miles_core.testkit.tiny_models import save_tiny_qwen3_moe
from miles_core.training.batch import TrainBatch, TrainSample
from miles_core.workers.local_provider import LocalWorkerProvider

SETTINGS = TrainSection(lr=1e-4, micro_batch_size=8)


DENSE_VOCAB = 16000
MOE_VOCAB = 8000
MOE_SHAPE = dict(
    vocab_size=MOE_VOCAB,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=256,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
"""The MoE benchmark model: 4 MoE layers (no dense one), 8 experts of 256, top-2 renormalised, untied embeddings."""


def save_model(path: Path) -> int:
    """The dense benchmark model (a 112 MB Llama); its bytes of float32 weights."""
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


def save_moe_model(path: Path) -> int:
    """The MoE benchmark model (:data:`MOE_SHAPE`); its bytes of float32 weights as transformers saves them."""
    save_tiny_qwen3_moe(path, seed=0, **MOE_SHAPE)
    return sum(t.numel() * t.element_size() for t in load_file(path / "model.safetensors").values())


def batch(samples: int = 16, prompt: int = 16, response: int = 16, vocab: int = DENSE_VOCAB) -> TrainBatch:
    """``samples`` samples of ``prompt`` + ``response`` random tokens, advantages alternating in sign."""
    generator = torch.Generator().manual_seed(0)

    def ids(length: int) -> list[int]:
        return torch.randint(0, vocab, (length,), generator=generator).tolist()

    return TrainBatch(
        [
            TrainSample(ids(prompt), ids(response), [-9.0] * response, 1.0 if i % 2 else -1.0, 0.0)
            for i in range(samples)
        ]
    )


def median_step(trainer: Any, steps: int, vocab: int = DENSE_VOCAB) -> tuple[float, float]:
    """Median step seconds and median seconds of Megatron's export into the driver after each step (0 for the torch
    trainer, whose weights are in the driver)."""
    trainer.train_step(batch(vocab=vocab))  # warm-up
    step_seconds, export_seconds = [], []
    for _ in range(steps):
        started = time.perf_counter()
        trainer.train_step(batch(vocab=vocab))
        step_seconds.append(time.perf_counter() - started)
        trainer.weight_iterator(1 << 30)  # Megatron gathers the weights into the driver here
        export_seconds.append(getattr(trainer, "export_report", {}).get("seconds", 0.0))
    return statistics.median(step_seconds), statistics.median(export_seconds)


def memcpy_seconds(nbytes: int, repeats: int = 5) -> float:
    """Median seconds of torch's copy of an ``nbytes`` buffer into a preallocated one."""
    source, target = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    source.fill_(1)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def dense_benchmark(tmp: str, steps: int, tensor_parallel: list[int]) -> None:
    """The dense Llama: the torch trainer, then Megatron at each tensor-parallel size."""
    path = Path(tmp) / "model"
    nbytes = save_model(path)
    print(f"model: {nbytes / 1e6:.0f} MB of float32 weights; batch: 16 samples of 16 + 16 tokens")
    torch_step, _ = median_step(TorchTrainer.from_pretrained(path, SETTINGS), steps)
    print(f"torch trainer (in process)        step {torch_step * 1e3:8.1f} ms")
    memcpy = nbytes / memcpy_seconds(nbytes) / 1e9
    rows = []
    for tp in tensor_parallel:
        layout = MegatronSection(tensor_parallel=tp)
        with MegatronTrainer.launch(path, train=SETTINGS, layout=layout, seed=0, provider_factory=provider(tmp)) as mt:
            step, export = median_step(mt, steps)
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


def moe_benchmark(tmp: str, steps: int, layouts: list[tuple[int, int, int]]) -> None:
    """The Qwen3-MoE: the torch trainer (transformers' MoE, in process), then Megatron at each TP x DP x EP layout."""
    path = Path(tmp) / "moe"
    nbytes = save_moe_model(path)
    print(
        f"\nMoE model: Qwen3-MoE, {nbytes / 1e6:.0f} MB of float32 weights (hidden 256, 4 layers, 8 experts top-2, "
        f"vocabulary {MOE_VOCAB}); batch: 16 samples of 16 + 16 tokens"
    )
    torch_step, _ = median_step(TorchTrainer.from_pretrained(path, SETTINGS), steps, vocab=MOE_VOCAB)
    memcpy = nbytes / memcpy_seconds(nbytes) / 1e9
    rows = []
    for tensor_parallel, data_parallel, expert_parallel in layouts:
        layout = MegatronSection(
            tensor_parallel=tensor_parallel, data_parallel=data_parallel, expert_parallel=expert_parallel
        )
        with MegatronTrainer.launch(path, train=SETTINGS, layout=layout, seed=0, provider_factory=provider(tmp)) as mt:
            step, export = median_step(mt, steps, vocab=MOE_VOCAB)
        rows.append((f"TP={tensor_parallel} DP={data_parallel} EP={expert_parallel}", layout.world_size, step, export))
    print(f"{'trainer and layout':<46} {'step ms':>9} {'export ms':>10} {'export GB/s':>12}")
    print(f"{'torch trainer (in process, transformers MoE)':<46} {torch_step * 1e3:9.1f} {'-':>10} {'-':>12}")
    for layout_name, ranks, step, export in rows:
        name = f"megatron {layout_name} ({ranks} rank{'s' * (ranks > 1)})"
        print(f"{name:<46} {step * 1e3:9.1f} {export * 1e3:10.1f} {nbytes / export / 1e9:12.2f}")
    print(f"{'memcpy of the same bytes':<46} {'':>9} {'':>10} {memcpy:12.2f}")
    for layout_name, _, step, export in rows:
        print(
            f"ratios MoE {layout_name}: megatron step / torch step = "
            f"{step / torch_step:.2f}x; export GB/s / memcpy GB/s = {nbytes / export / 1e9 / memcpy:.3f}"
        )


def provider(tmp: str) -> Callable[[], LocalWorkerProvider]:
    """A factory of local worker providers whose logs go under ``tmp``."""

    def factory() -> LocalWorkerProvider:
        return LocalWorkerProvider(token="bench", run_dir=tmp)

    return factory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--models", default="dense,moe", help="which benchmarks: dense, moe or both")
    parser.add_argument("--tensor-parallel", default="1,2", help="the dense model's TP sizes")
    parser.add_argument("--moe-layouts", default="1x1x1,1x2x1,1x2x2,2x1x1", help="the MoE model's TPxDPxEP layouts")
    args = parser.parse_args()
    models = args.models.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        if "dense" in models:
            dense_benchmark(tmp, args.steps, [int(value) for value in args.tensor_parallel.split(",")])
        if "moe" in models:
            layouts = [tuple(int(v) for v in value.split("x")) for value in args.moe_layouts.split(",")]
            moe_benchmark(tmp, args.steps, layouts)


if __name__ == "__main__":
    main()
