"""Local-engine sampling (``generate_batch``, KV cache) against transformers' ``generate()`` on the same model,
batch and lengths, in one process. Usage: ``python benchmarks/engine_generation.py [--batch 32 --new 64]``.
Prints tokens/s of each (median of repeats) and the ratio last."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from miles_core.engines.sampling import GenerationRequest, SamplingParams, generate_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                      pad_token_id=0, eos_token_id=None)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    prompts = torch.randint(3, 4096, (args.batch, args.prompt))
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0, ignore_eos=True)
    requests = [GenerationRequest(row.tolist(), params) for row in prompts]

    def ours() -> int:
        return sum(len(r.output_ids) for r in generate_batch(model, requests))

    def reference() -> int:
        with torch.inference_mode():
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                                 max_new_tokens=args.new, min_new_tokens=args.new, pad_token_id=0, top_k=0)  # fmt: skip
        return (out.shape[1] - args.prompt) * args.batch

    rates: dict[str, list[float]] = {"local engine": [], "transformers generate()": []}
    ours(), reference()  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("local engine", ours), ("transformers generate()", reference)):
            start = time.perf_counter()
            tokens = fn()
            rates[name].append(tokens / (time.perf_counter() - start))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    for name, value in medians.items():
        print(f"{name:24s} {value:9.0f} tokens/s (batch {args.batch}, prompt {args.prompt}, new {args.new})")
    print(f"ratio local engine / generate(): {medians['local engine'] / medians['transformers generate()']:.2f}x")


if __name__ == "__main__":
    main()
