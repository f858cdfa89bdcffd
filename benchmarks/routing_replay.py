"""The train/inference logprob mismatch on a Mixture-of-Experts model with and without routing replay (R3).

A tiny Qwen3-MoE (random, every weight perturbed so tokens spread over the experts) generates a batch in the local
engine (continuous batching, ``return_routed_experts``); the torch trainer's model then computes the logprobs of the
same tokens, once routing by itself (the baseline) and once replaying the engine's experts. Two realistic sources
of mismatch, each measured in the same run:

- ``one_step_off``: the engine's weights are one update behind the trainer's (one AdamW step of the trainer on this
  very batch, as under ``--run-schedule one_step_off``);
- ``bf16_engine``: the engine serves the same weights in bfloat16, the trainer computes in float32.

(On the CPU in float32 with identical weights both sides route alike and the mismatch is ~0: nothing to replay.)
Reported per source: mean |trainer logprob - engine logprob| over the response tokens without and with replay, the
fraction of (token, layer) routings where the trainer's own top-k differs from the engine's, and the ratio
with / without replay last.

    python benchmarks/routing_replay.py [--prompts 32 --new-tokens 32 --layers 4 --experts 16 --top-k 4]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import torch

from miles_core.builtin.local_engine.engine import LocalEngine
from miles_core.builtin.local_engine.sampling import GenerationRequest, SamplingParams
from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.sections import TrainSection
from miles_core.engines.routed_experts import RoutingShape
from miles_core.models.moe_routing import RoutingCapture, replay_routing
from miles_core.testkit.tiny_models import save_tiny_qwen3_moe
from miles_core.training.batch import TrainBatch, TrainSample
from miles_core.training.losses import token_logprobs


def generate(model_dir: Path, staging: Path, prompts: list[list[int]], new_tokens: int, *, bf16: bool) -> TrainBatch:
    """The engine's samples (its logprobs, its routed experts), advantages alternating in sign."""
    engine = LocalEngine(model_dir, staging_dir=staging, max_batch_size=len(prompts))
    if bf16:
        engine.model.to(torch.bfloat16)

    async def run():
        engine.start()
        params = [
            SamplingParams(max_new_tokens=new_tokens, sampling_seed=i, ignore_eos=True) for i in range(len(prompts))
        ]
        return await engine.generate(
            [GenerationRequest(p, q, return_routed_experts=True) for p, q in zip(prompts, params, strict=True)]
        )

    results = asyncio.run(run())
    return TrainBatch(
        [
            TrainSample(
                p, r.output_ids, r.logprobs, 1.0 if i % 2 else -1.0, 0.0, routed_experts=r.routed_experts.tolist()
            )
            for i, (p, r) in enumerate(zip(prompts, results, strict=True))
        ]
    )


def measure(trainer: TorchTrainer, batch: TrainBatch) -> dict[str, float]:
    """Mean |Δlogprob| without and with replay, and the fraction of recorded (token, layer) routings the trainer's
    own top-k changes."""
    tensors = batch.tensors()
    ids, mask, engine = tensors["input_ids"], tensors["response_mask"], tensors["rollout_logprobs"]
    experts = tensors["routed_experts"]
    shape = trainer.model.model.config
    capture = RoutingCapture(trainer.model, RoutingShape.of_config(shape))
    trainer.model.eval()
    with torch.no_grad():
        plain = token_logprobs(trainer.model(ids)[:, :-1], ids[:, 1:])
        own = capture.experts(ids.shape[0], ids.shape[1])
        with replay_routing(trainer.model, experts):
            replayed = token_logprobs(trainer.model(ids)[:, :-1], ids[:, 1:])
    capture.close()
    recorded = (experts >= 0).all(-1)
    differs = ((own.long().sort(-1).values != experts.sort(-1).values).any(-1) & recorded).sum() / recorded.sum()
    tokens = mask.sum()
    return {
        "without": float(((plain - engine).abs() * mask).sum() / tokens),
        "with": float(((replayed - engine).abs() * mask).sum() / tokens),
        "routing_differs": float(differs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-5, help="the trainer's AdamW step (one_step_off)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="routing-replay-"))
    staging = root / "staging"
    staging.mkdir(mode=0o700)
    model_dir = save_tiny_qwen3_moe(
        root / "model",
        scale=0.1,
        norm_topk_prob=True,
        intermediate_size=128,
        num_hidden_layers=args.layers,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        hidden_size=128,
        vocab_size=256,
    )
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (4 + i % 5,), generator=generator).tolist() for i in range(args.prompts)]

    results = {}
    batch = generate(model_dir, staging, prompts, args.new_tokens, bf16=False)
    trainer = TorchTrainer.from_pretrained(model_dir, TrainSection(lr=args.lr, routing_replay=True))
    trainer.train_step(batch)  # the trainer is now one update ahead of the engine that generated the batch
    results["one_step_off"] = measure(trainer, batch)
    batch = generate(model_dir, staging, prompts, args.new_tokens, bf16=True)
    results["bf16_engine"] = measure(TorchTrainer.from_pretrained(model_dir, TrainSection()), batch)

    tokens = sum(len(s.response_ids) for s in batch.samples)
    print(
        f"Qwen3-MoE {args.layers} layers, {args.experts} experts top-{args.top_k}, hidden 128; {args.prompts} prompts "
        f"x {args.new_tokens} new tokens ({tokens} response tokens)"
    )
    print(f"{'source':<14} {'mean |dlogprob| without':>24} {'with replay':>12} {'routing differs':>16}")
    for name, r in results.items():
        print(f"{name:<14} {r['without']:>24.6f} {r['with']:>12.6f} {r['routing_differs']:>15.2%}")
    for name, r in results.items():
        print(f"{name}: with / without replay = {r['with'] / r['without']:.3f}x")


if __name__ == "__main__":
    main()
