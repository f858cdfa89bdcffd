"""Sampling speed on one model, batch and lengths: in this process, the local engine (``generate_batch``, KV cache)
against transformers' ``generate()``; over HTTP, the local engine's server against a real SGLang server, both
started through the sglang plugin's engine spec and the local worker provider (as ``miles train`` starts engines)
and sent the same token-id batch to ``/generate`` (temperature 1, ``ignore_eos``).

Usage: ``python benchmarks/engine_generation.py [--batch 32 --new 64 --repeats 5]``. The SGLang environment is
``sglang.python`` (``$MILES_SGLANG_PYTHON``, else ``./.venv-sglang``; ``make sglang``); where SGLang cannot serve
(no environment, a CPU without AVX512-BF16 or AMX) its row says why and the others still run. Prints tokens/s of
each (median of the repeats after a warm-up) and the ratios last.

The servers load the model saved as a bf16 checkpoint: SGLang serves it in bf16 (its CPU kernels' dtype), the local
engine in float32 (its only dtype), as do the in-process rows (the same weights before rounding to bf16)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch
import transformers
from miles_plugins_sglang.standalone import cpu_unavailable_reason, engine_server

from miles_core.builtin.local_engine.batch_generation import generate_batch
from miles_core.builtin.local_engine.sampling import GenerationRequest, SamplingParams
from miles_core.config.build import build_config
from miles_core.plugin_manager import MilesPluginManager

TOKEN = "bench-admin"
LOCAL_HTTP, SGLANG_HTTP = "local engine (HTTP)", "real SGLang (HTTP)"
LOCAL_SERVER = ["{python}", "-m", "miles_core.builtin.local_engine.server"]


def in_process_rates(model: torch.nn.Module, prompts: torch.Tensor, args: argparse.Namespace) -> dict[str, float]:
    """tokens/s of ``generate_batch`` and of ``generate()``, interleaved, median of the repeats after a warm-up."""
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0, ignore_eos=True)
    requests = [GenerationRequest(row.tolist(), params) for row in prompts]

    def ours() -> int:
        return sum(len(r.output_ids) for r in generate_batch(model, requests))

    def reference() -> int:
        with torch.inference_mode():
            out = model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=True,
                temperature=1.0,
                max_new_tokens=args.new,
                min_new_tokens=args.new,
                pad_token_id=0,
                top_k=0,
            )
        return (out.shape[1] - prompts.shape[1]) * prompts.shape[0]

    runs: dict[str, Callable[[], int]] = {"local engine": ours, "transformers generate()": reference}
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            tokens = fn()
            rates[name].append(tokens / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in rates.items()}


def server_configs(args: argparse.Namespace) -> tuple[dict[str, Any], str | None]:
    """The run configs of the two servers, and why real SGLang cannot run here (None when it can)."""
    manager = MilesPluginManager.load()
    common = {"engine.backend": "sglang", "weight_transfer.mode": "disk", "engine.startup_timeout_s": 600}
    local = build_config(manager, overrides={**common, "sglang.launch_command": LOCAL_SERVER})
    sglang = build_config(manager, overrides={**common, "sglang.python": args.sglang_python})
    reason = cpu_unavailable_reason(sglang.sglang.sglang_python())
    return {LOCAL_HTTP: local, **({} if reason else {SGLANG_HTTP: sglang})}, reason


async def generated_tokens(client: httpx.AsyncClient, url: str, prompts: list[list[int]], new: int) -> int:
    """One ``/generate`` of the whole batch; the tokens it returned (every prompt must get ``new``)."""
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True}}
    response = await client.post(f"{url}/generate", json=body)
    response.raise_for_status()
    counts = [len(item["output_ids"]) for item in response.json()]
    if counts != [new] * len(prompts):
        raise RuntimeError(f"{url}/generate returned {counts} tokens per prompt, expected {new} each")
    return sum(counts)


async def http_rates(workdir: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, float]:
    """tokens/s of each server (both up at once, requests interleaved), median of the repeats after a warm-up."""
    configs, reason = server_configs(args)
    if reason:
        print(f"{SGLANG_HTTP}: skipped: {reason}", flush=True)
    async with contextlib.AsyncExitStack() as stack:
        urls = {}
        for index, (name, config) in enumerate(configs.items()):
            started = time.perf_counter()
            server = engine_server(
                config, model_path=workdir / "model", run_dir=workdir / "run", token=TOKEN, cell_id=f"engine-{index}"
            )
            info = await stack.enter_async_context(server)
            urls[name] = info.url
            print(f"{name}: ready in {time.perf_counter() - started:.1f} s at {info.url}", flush=True)
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=600))
        rates: dict[str, list[float]] = {name: [] for name in urls}
        for round_ in range(args.repeats + 1):  # round 0 is the warm-up
            for name, url in urls.items():
                start = time.perf_counter()
                tokens = await generated_tokens(client, url, prompts, args.new)
                if round_:
                    rates[name].append(tokens / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sglang-python", default="auto", help="the SGLang environment's interpreter (sglang.python)")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        pad_token_id=0,
        eos_token_id=None,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    prompts = torch.randint(3, 4096, (args.batch, args.prompt))
    results = in_process_rates(model, prompts, args)
    with tempfile.TemporaryDirectory(prefix="miles-bench-generation-") as workdir:
        model.to(torch.bfloat16).save_pretrained(Path(workdir) / "model")
        results.update(asyncio.run(http_rates(Path(workdir), prompts.tolist(), args)))
    shape = f"batch {args.batch}, prompt {args.prompt}, new {args.new}, median of {args.repeats}"
    for name, value in results.items():
        print(f"{name:24s} {value:9.0f} tokens/s ({shape})")
    print(f"ratio local engine / generate(): {results['local engine'] / results['transformers generate()']:.2f}x")
    print(f"ratio local engine (HTTP) / in process: {results[LOCAL_HTTP] / results['local engine']:.2f}x")
    if SGLANG_HTTP in results:
        print(f"ratio real SGLang / local engine (HTTP): {results[SGLANG_HTTP] / results[LOCAL_HTTP]:.2f}x")
    else:
        print("ratio real SGLang / local engine (HTTP): skipped (real SGLang cannot serve here: see above)")


if __name__ == "__main__":
    main()
