"""SGLang's benchmark client (``sglang.bench_serving``, random token-id prompts, every request at once, streamed)
against the local engine and, where one can run, a real SGLang server on the same checkpoint: throughput and
latency of both side by side, the ratio last.

Usage: ``python benchmarks/engine_serving.py [--num-prompts 64 --input-len 128 --output-len 64 --repeats 3]``. It
needs an SGLang environment (``$MILES_SGLANG_PYTHON``, else ``.venv-sglang/bin/python``: ``make sglang``). The real
server is started with the command line ``miles train --engine sglang`` uses (the plugin's engine spec, its CPU
settings) but with SGLang's tokenizer on, for the text backends. SGLang's CPU engine needs a CPU with
AVX512-BF16 or AMX; elsewhere (or with ``--no-sglang-server``) the real server is skipped and the reason printed.
Each figure is the median over ``--repeats`` runs of the client.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from miles_plugins_sglang.launch import sglang_engine_spec
from miles_plugins_sglang.standalone import cpu_unavailable_reason

from miles_core.config.build import build_config
from miles_core.plugin_manager import MilesPluginManager
from miles_core.testkit.sglang_bench import (
    SGLANG_PYTHON_ENV,
    bench_client_unavailable_reason,
    run_bench_serving,
    sglang_python,
)
from miles_core.testkit.tiny_models import save_tiny_llama
from miles_core.testkit.tokenizers import ROLE_TAG_CHAT_TEMPLATE, save_char_tokenizer
from miles_core.workers.process import free_ports

BACKENDS = ("sglang", "sglang-oai", "sglang-oai-chat")  # /generate, /v1/completions, /v1/chat/completions; streamed
METRICS = (
    ("request_throughput", "req/s"),
    ("output_throughput", "out tok/s"),
    ("median_e2e_latency_ms", "E2E ms"),
    ("median_ttft_ms", "TTFT ms"),
    ("median_itl_ms", "ITL ms"),
)
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;!?<>"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--no-sglang-server", action="store_true", help="skip the real SGLang server")
    args = parser.parse_args()
    python, _ = sglang_python()
    if not python.exists():
        sys.exit(f"no SGLang environment at {python}: run `make sglang` or set ${SGLANG_PYTHON_ENV}")
    client_reason = bench_client_unavailable_reason(python)
    if client_reason is not None:
        sys.exit(f"SGLang's benchmark client cannot run here: {client_reason}")
    with tempfile.TemporaryDirectory(prefix="miles-engine-serving-") as tmp:
        workdir = Path(tmp)
        model = save_tiny_llama(
            workdir / "model",
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=4096,
        )
        save_char_tokenizer(model, ALPHABET, chat_template=ROLE_TAG_CHAT_TEMPLATE)  # for --backend sglang-oai-chat
        servers = {"local engine": functools.partial(_local_command, model=model)}
        reason = "--no-sglang-server was given" if args.no_sglang_server else cpu_unavailable_reason(str(python))
        if reason is None:
            servers["SGLang"] = functools.partial(_sglang_command, python=python, model=model)
        results = {name: _measure(argv, python, model, workdir, args) for name, argv in servers.items()}
    _report(results, args)
    if "SGLang" not in results:
        print(f"real SGLang server skipped: {reason}")
        print("ratio local engine / SGLang: n/a (no SGLang server measured in this run)")
        return
    for backend in BACKENDS:
        ours, theirs = results["local engine"][backend], results["SGLang"][backend]
        print(
            f"ratio local engine / SGLang, output tokens/s, --backend {backend}: "
            f"{ours['output_throughput'] / theirs['output_throughput']:.2f}x"
        )


def _local_command(port: int, *, model: Path) -> tuple[list[str], dict[str, str]]:
    """The local engine's server command line (no extra environment)."""
    module = "miles_core.builtin.local_engine.server"
    argv = [sys.executable, "-m", module, "--model-path", str(model), "--admin-api-key", "benchmark"]
    return [*argv, "--host", "127.0.0.1", "--port", str(port)], {}


def _sglang_command(port: int, *, python: Path, model: Path) -> tuple[list[str], dict[str, str]]:
    """The real SGLang server's command line and extra environment, from the plugin's engine spec."""
    settings = {"engine.backend": "sglang", "weight_transfer.mode": "disk", "sglang.python": str(python)}
    tokenizer_on = {"sglang.server_args": {"skip_tokenizer_init": False}}
    config = build_config(MilesPluginManager.load(), overrides={**settings, **tokenizer_on})
    spec = sglang_engine_spec(config, cell_id="engine-0", model_path=str(model))
    resolved = spec.resolve({"port": port}, token="benchmark")
    return resolved.argv, resolved.env


ServerCommand = Callable[[int], tuple[list[str], dict[str, str]]]
"""A server's command line and extra environment for a port."""


def _measure(command: ServerCommand, python: Path, model: Path, workdir: Path, args: argparse.Namespace) -> dict:
    """Start the server, run the client ``--repeats`` times per backend (after a warm-up), stop it: the medians."""
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    log_path = workdir / f"server-{port}.log"
    argv, env = command(port)
    with open(log_path, "wb") as log:  # a session of its own: SGLang's launcher has child processes
        server = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
        )
    try:
        _wait_healthy(url, server, log_path)
        medians = {}
        for backend in BACKENDS:
            run = dict(
                base_url=url,
                backend=backend,
                tokenizer=model,
                input_len=args.input_len,
                output_len=args.output_len,
                workdir=workdir,
            )
            run_bench_serving(python, num_prompts=min(8, args.num_prompts), **run)  # warm-up
            records = [run_bench_serving(python, num_prompts=args.num_prompts, **run) for _ in range(args.repeats)]
            medians[backend] = {key: statistics.median(r[key] for r in records) for key, _ in METRICS}
        return medians
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=60)


def _wait_healthy(url: str, server: subprocess.Popen, log_path: Path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"the server exited with {server.returncode}:\n{log_path.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"{url}/health_generate", timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit(f"the server at {url} was not healthy after {timeout_s:.0f} s")


def _report(results: dict[str, dict], args: argparse.Namespace) -> None:
    print(
        f"sglang.bench_serving, random-ids, {args.num_prompts} prompts of {args.input_len} tokens, "
        f"{args.output_len} new tokens each (ignore_eos), all at once, medians of {args.repeats}"
    )
    header = f"{'server':14s} {'--backend':15s} " + " ".join(f"{label:>10s}" for _, label in METRICS)
    print(header)
    for name, per_backend in results.items():
        for backend, values in per_backend.items():
            print(f"{name:14s} {backend:15s} " + " ".join(f"{values[key]:10.1f}" for key, _ in METRICS))


if __name__ == "__main__":
    main()
