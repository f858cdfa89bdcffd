"""``rdt`` (NIXL and gloo) against ``broadcast``, ``tensor`` (shared memory) and ``disk``, and a same-size memory
copy, at 256 MiB and 1 GiB, in one run. The engine is a local engine hosted by the Ray provider (rdt needs that;
the other protocols do not care), in another process than the trainer: every protocol crosses processes; with
``--engine sglang`` a real SGLang server (bf16) started as ``miles train --engine sglang`` starts it (rdt then
reads into the receiver beside it and SGLang copies the version in through Miles' loader).

Usage: ``python benchmarks/weight_transfer_rdt.py [--repeats 3] [--sizes 256,1024]``. Prints GB/s per protocol
(median of the repeats after two warm-up transfers, one into each buffer of the protocols that alternate two, each
including the engine's load into its model) and, last, the ratios to memcpy, two ways: to the memcpy measured once
before the protocols, and the median over the repeats of each transfer's rate over the rate of a memcpy of the same
tensors timed just before it. On a shared 2-core machine the memcpy rate itself drifts (6.1 to 11.9 GB/s between
runs), so only the second compares a protocol with a copy made at the same time.

``--across-machines`` runs every protocol the way it moves weights between two machines, still on this one: rdt over
NIXL with UCX held to its TCP transport (no cross-memory attach, no shared memory), ``tensor`` with the weights in
the request body instead of a shared-memory file; ``broadcast`` and rdt over gloo already use TCP, and ``disk`` still
writes a local directory (across machines it needs a filesystem both can see).

``--hosts`` puts the engine on another host: two network namespaces on a bridge, each its own network stack and a
Ray node of its own (``tests/cluster/hosts.py``; as root), the benchmark itself on host A and the engine on host B, so
that every protocol crosses a veth link (with ``--across-machines``, as between machines: UCX over TCP).

``--two-raylets`` puts the engine on a Ray node of its own (a raylet on this machine, ``benchmarks/ray_nodes.py``)
while the trainer (this process) joins from the head node: rdt then moves the weights between two raylets, the
comparison with ``broadcast`` and memcpy that the cluster tests need (with ``--across-machines``, over TCP).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray
import torch
import transformers
from ray_nodes import HOST_PINS, namespace_hosts, ray_nodes, run_on_first_host
from weight_transfer import (  # the same baseline and warm-up as benchmarks/weight_transfer.py
    WARMUP,
    MemoryCopy,
    memcpy_rate,
)

from miles_core.builtin.ray_provider import RayWorkerProvider, init_ray
from miles_core.config.build import build_config
from miles_core.plugin_manager import MilesPluginManager
from miles_core.training.weight_iterator import ModuleHfWeightIterator
from miles_core.weight_transfer.protocol import EngineEndpoint
from miles_core.weight_transfer.routes import LOCAL_ENGINE
from miles_core.workers.specs import ENGINE, CommandWorkerSpec, with_role

TOKEN = "bench-admin"
BUCKET = 256 << 20
PROTOCOLS = {
    "rdt-nixl": ("rdt", {"transport": "nixl"}),
    "rdt-gloo": ("rdt", {"transport": "gloo"}),
    "broadcast": ("broadcast", {}),
    "tensor": ("tensor", {"shared_memory": True}),
    "disk": ("disk", {}),
}
SHAPES = {
    256: dict(
        vocab_size=16000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=3,
        num_attention_heads=16,
        num_key_value_heads=16,
    ),
    1024: dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=3,
        num_attention_heads=16,
        num_key_value_heads=16,
    ),
}


def make_model(path: Path, size_mb: int) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(tie_word_embeddings=False, **SHAPES[size_mb])
    )
    model.save_pretrained(path)
    return model


async def protocol_rate(
    name: str, endpoint: EngineEndpoint, model: torch.nn.Module, repeats: int, memcpy: MemoryCopy, across_machines: bool
) -> tuple[float, float]:
    """The median rate of ``name``'s transfers, and the median of each one's ratio to the memcpy timed before it."""
    registry_name, settings = PROTOCOLS[name]
    if across_machines and registry_name == "tensor":
        settings = {**settings, "shared_memory": False}
    if registry_name == "rdt":  # a staging bucket holds one whole version of the weights
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        settings = {**settings, "staging_bucket_mb": (nbytes >> 20) + 16}
    registries = MilesPluginManager.load().registries
    protocol = registries.weight_transfer_protocols.get_or_raise(registry_name).load()(**settings)
    await protocol.connect([endpoint])
    rates, ratios = [], []
    try:
        for version in range(1, repeats + WARMUP + 1):
            copy_rate = memcpy.rate()
            report = await protocol.transfer(iter(ModuleHfWeightIterator(model, bucket_bytes=BUCKET)), version=version)
            rates.append(report.gb_per_s)
            ratios.append(report.gb_per_s / copy_rate)
    finally:
        await protocol.close()
    return statistics.median(rates[WARMUP:]), statistics.median(ratios[WARMUP:])


def sglang_engine(model_path: Path, name: str, python: str) -> tuple[CommandWorkerSpec, Any]:
    """A stock SGLang server as ``miles train --engine sglang`` starts it (bf16: its CPU kernels' dtype), and the
    weight routes the sglang backend declares for it."""
    from miles_plugins_sglang.launch import sglang_capabilities, sglang_engine_spec  # deferred: the sglang plugin

    overrides = {
        "engine.backend": "sglang",
        "engine.startup_timeout_s": 900,
        "sglang.python": python,
        "sglang.server_args": {"dtype": "bfloat16"},
    }
    config = build_config(MilesPluginManager.load(), overrides=overrides)
    spec = with_role(sglang_engine_spec(config, cell_id=name, model_path=str(model_path)), ENGINE)
    return spec, sglang_capabilities(config)


async def one_size(size_mb: int, provider: RayWorkerProvider, workdir: Path, args: argparse.Namespace) -> dict:
    model = make_model(workdir / f"model-{size_mb}", size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if args.engine == "sglang":
        spec, capabilities = sglang_engine(workdir / f"model-{size_mb}", f"bench-engine-{size_mb}", args.sglang_python)
        return await measure(model, nbytes, provider, spec, capabilities, args)
    argv = [
        sys.executable,
        "-m",
        "miles_core.builtin.local_engine.server",
        "--model-path",
        str(workdir / f"model-{size_mb}"),
        "--host",
        "{host}",
        "--port",
        "{port}",
    ]
    spec = CommandWorkerSpec(
        name=f"bench-engine-{size_mb}",
        argv=argv,
        ports=["port"],
        num_cpus=0,
        health_url="http://{host}:{port}/health",
        startup_timeout_s=300,
        role=ENGINE,
    )
    return await measure(model, nbytes, provider, spec, LOCAL_ENGINE, args)


async def measure(
    model: torch.nn.Module, nbytes: int, provider: RayWorkerProvider, spec: Any, capabilities: Any, args: Any
) -> dict:
    """Every protocol of ``args.protocols`` into the engine ``spec`` starts, against memcpy."""
    info = await provider.start(spec)
    endpoint = EngineEndpoint(spec.name, info.url, TOKEN, capabilities)
    print(f"-- {nbytes / 2**20:.0f} MiB of weights, {args.repeats} repeats after {WARMUP} warm-ups", flush=True)
    results = {"memcpy": memcpy_rate(model, args.repeats)}
    ratios = {}
    memcpy = MemoryCopy(model)
    memcpy.rate()  # the targets get their pages before any timing
    try:
        for name in args.protocols.split(","):
            results[name], ratios[name] = await protocol_rate(
                name, endpoint, model, args.repeats, memcpy, args.across_machines
            )
            print(
                f"{name:10s} {results[name]:6.2f} GB/s  ({ratios[name]:.2f} of the memcpy beside each transfer)",
                flush=True,
            )
    finally:
        await provider.stop(spec.name)
    print(f"{'memcpy':10s} {results['memcpy']:6.2f} GB/s", flush=True)
    return {"rates": results, "ratios beside": ratios}


async def main(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="miles-bench-rdt-"))
    if args.across_machines:  # before any NIXL agent exists, here or in the Ray workers started below
        os.environ["UCX_TLS"] = "tcp"
        print("-- across machines: UCX over TCP only, tensor without shared memory", flush=True)
    if args.join is not None:  # on host A of --hosts: the engine pinned to host B
        print(f"-- host A joined {args.join}; the engine on host B (network namespaces, veth)", flush=True)
        await run_sizes(args, workdir, args.join, HOST_PINS)
        return
    with ray_nodes(args.two_raylets) as (address, pins):
        if address is None:
            init_ray(num_cpus=4)  # a Ray of its own, never one that `ray start` left running
        await run_sizes(args, workdir, address, pins)


async def run_sizes(args: argparse.Namespace, workdir: Path, address: str | None, pins: dict) -> None:
    provider = RayWorkerProvider(token=TOKEN, run_dir=workdir, address=address, role_resources=pins)
    print(f"-- engine on {'a raylet of its own' if pins else 'the same Ray node'}", flush=True)
    table = {}
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            table[size] = await one_size(size, provider, workdir, args)
    finally:
        await provider.shutdown()
        ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)  # models of 272 MiB and 1 GiB
    for size, results in table.items():
        rates = results["rates"]
        base = rates["memcpy"]
        ratios = ", ".join(f"{n} {r / base:.2f}" for n, r in rates.items() if n != "memcpy")
        print(f"{size} MiB, ratios to memcpy measured first ({base:.2f} GB/s): {ratios}")
        beside = ", ".join(f"{n} {r:.2f}" for n, r in results["ratios beside"].items())
        print(f"{size} MiB, median ratios to the memcpy beside each transfer: {beside}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="256,1024")
    parser.add_argument("--protocols", default="rdt-nixl,rdt-gloo,broadcast,tensor,disk")
    parser.add_argument(
        "--across-machines",
        action="store_true",
        help="every protocol as it runs between two machines (see the module docstring)",
    )
    parser.add_argument("--two-raylets", action="store_true", help="the engine on a Ray node of its own")
    parser.add_argument("--engine", choices=["local", "sglang"], default="local", help="the engine measured into")
    parser.add_argument("--sglang-python", default="auto", help="the SGLang environment's interpreter (sglang.python)")
    parser.add_argument(
        "--hosts", action="store_true", help="the engine on another host: two network namespaces (root, iproute2)"
    )
    parser.add_argument("--join", default=None, help=argparse.SUPPRESS)  # set by --hosts for its run on host A
    parsed = parser.parse_args()
    if parsed.hosts:
        with namespace_hosts() as hosts:
            rest = [arg for arg in sys.argv[1:] if arg != "--hosts"]
            sys.exit(run_on_first_host(hosts, [sys.executable, __file__, *rest, "--join", hosts.ray_address]))
    asyncio.run(main(parsed))
