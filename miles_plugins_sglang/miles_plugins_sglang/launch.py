"""Worker specs for SGLang engines and the sglang-router: command lines, ports, health URLs, reservations, and the
settings an engine needs on CPU."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import psutil

from miles_core import (
    DISK,
    DISTRIBUTED,
    LOCAL_ENGINE,
    SGLANG_HTTP_API,
    STAGING_COPY,
    STAGING_DIR_ENV,
    WEIGHTS_BY_NAME,
    CommandWorkerSpec,
    ConfigError,
    EngineCapabilities,
    WorkerSpec,
    read_model_config,
    weight_staging_dir,
)
from miles_plugins_sglang.config import PYTHON, SGLANG_PYTHON, SGLANG_PYTHON_ENV, is_this_interpreter, server_flags

STOCK_SERVER_ARGS: dict[str, Any] = {
    # Miles sends and reads token ids; SGLang's own tokenizer would only be loaded (and its warm-up run on text
    # that a small checkpoint's tokenizer may not cover).
    "skip_tokenizer_init": True,
}
"""What a stock ``sglang.launch_server`` runs with unless ``server_args`` says otherwise."""
CPU_SERVER_ARGS: dict[str, Any] = {
    "device": "cpu",
    # SGLang's default CPU attention (intel_amx) needs a kernel build that matches its sglang release exactly.
    "attention_backend": "torch_native",
    "disable_overlap_schedule": True,
    "cuda_graph_backend_decode": "disabled",
    "cuda_graph_backend_prefill": "disabled",
    # An idle scheduler otherwise busy-polls a whole core, which the trainer needs on a small machine.
    "sleep_on_idle": True,
}
"""What a CPU engine runs with unless ``server_args`` says otherwise (measured with sglang 0.5.23 on CPU)."""
CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
    "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
}
"""SGLang takes its CUDA paths unless the first selects its CPU platform. The other two: a server is stopped by
SIGTERM to its process group, and SGLang takes its scheduler's exit for a crash and sleeps 5 s before its crash
diagnostics (CUDA core dumps, which a CPU has not, and py-spy stacks), so every stop took 5 s more (``sglang.env``
turns them on again for a user who wants the stacks)."""
ENGINE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_path")
"""The directory put on a stock SGLang server's ``PYTHONPATH``: Miles' weight loader (``miles_sglang_weights``), a
module of its own that imports only torch (the server's environment has no Miles)."""
STAGING_LOADER = "miles_sglang_weights.load_staged"
"""The ``load_format`` (and ``--custom-weight-loader``) of Miles' loader: SGLang copies a staged version in."""
LOCAL_ENGINE_MODULE = "miles_core.builtin.local_engine.server"
KV_MEMORY_FRACTION = 0.1
"""Of the machine's available memory, what a CPU engine's KV pool may take (the trainer needs the rest)."""
KV_TOKENS_RANGE = (4096, 131072)


class SglangEngineBackend:
    """The ``sglang`` engine backend (a ``miles_core.EngineBackend``): each cell is a server from
    ``sglang.launch_command`` (stock ``sglang.launch_server`` by default, its environment checked before the first
    engine starts), with the sglang-router in front when ``sglang.router`` is true."""

    def engine_specs(self, config: Any, *, cell_id: str, model_path: str) -> list[WorkerSpec]:
        check_engine_environment(config)
        return [sglang_engine_spec(config, cell_id=cell_id, model_path=model_path)]

    def weight_capabilities(self, config: Any) -> EngineCapabilities:
        """A stock SGLang server: disk, a broadcast group, staged versions through Miles' loader (one payload per TP
        rank) and ``/get_weights_by_name``; Miles' local engine behind ``launch_command``: its own routes; any other
        server of SGLang's API: disk and a broadcast group."""
        return sglang_capabilities(config)

    def router_spec(self, config: Any) -> WorkerSpec | None:
        return sglang_router_spec(config) if config.sglang.router else None


def sglang_engine_spec(config: Any, *, cell_id: str, model_path: str) -> CommandWorkerSpec:
    """One engine: ``sglang.launch_command`` with the checkpoint, loopback (or node) host, an allocated port, the
    parallel sizes, the run's seed and token as admin key, then the server settings (for a stock SGLang server
    :data:`STOCK_SERVER_ARGS`, and :func:`cpu_server_args` when it gets no GPU, each overridden by ``server_args``)
    and ``extra_args``. Ready once ``/health_generate`` answers 200."""
    sglang = config.sglang
    num_gpus = _gpus_per_engine(sglang)
    on_cpu = sglang.cpu_launch == "on" or (sglang.cpu_launch == "auto" and num_gpus == 0 and sglang.runs_stock_sglang())
    defaults = STOCK_SERVER_ARGS if sglang.runs_stock_sglang() else {}
    if on_cpu:
        check_cpu_servable(model_path)
    cpu = cpu_server_args(config, model_path) if on_cpu else {}
    loader = staging_loader_server_args(sglang) if sglang.runs_stock_sglang() else {}
    server_args = {**defaults, **cpu, **routing_replay_server_args(config), **sglang.server_args, **loader}
    argv = [
        *_command(sglang.launch_command, sglang_python=sglang.sglang_python()),
        *("--model-path", _literal(model_path), "--host", "{host}", "--port", "{port}"),
        *("--tp-size", str(sglang.tp_size), "--dp-size", str(sglang.dp_size), "--ep-size", str(sglang.ep_size)),
        *("--random-seed", str(config.run.seed), "--admin-api-key={token}"),  # attached: a value never read as a flag
        *map(_literal, server_flags(server_args)),
        *map(_literal, sglang.extra_args),
    ]
    env = {**(CPU_ENV if on_cpu else {}), **sglang.env, **(staging_loader_env(sglang) if loader else {})}
    return CommandWorkerSpec(
        name=cell_id,
        argv=argv,
        env={name: _literal(value) for name, value in env.items()},
        ports=["port"],
        health_url="http://{host}:{port}/health_generate",
        startup_timeout_s=config.engine.startup_timeout_s,
        num_cpus=0,
        num_gpus=num_gpus,
    )


def sglang_capabilities(config: Any) -> EngineCapabilities:
    """What the engines that ``sglang.launch_command`` starts serve for weights (see ``weight_capabilities``)."""
    sglang = config.sglang
    if sglang.runs_stock_sglang():
        routes = frozenset({DISK, DISTRIBUTED, STAGING_COPY, WEIGHTS_BY_NAME})
        return EngineCapabilities(routes, staging_loader=STAGING_LOADER, tp_size=sglang.tp_size)
    if any(LOCAL_ENGINE_MODULE in part for part in sglang.launch_command):
        return LOCAL_ENGINE
    return SGLANG_HTTP_API


def staging_loader_server_args(sglang: Any) -> dict[str, Any]:
    """``custom_weight_loader`` with Miles' loader added to any the user names."""
    named = sglang.server_args.get("custom_weight_loader") or []
    named = [named] if isinstance(named, str) else list(named)
    return {"custom_weight_loader": [*named, *([STAGING_LOADER] if STAGING_LOADER not in named else [])]}


def staging_loader_env(sglang: Any) -> dict[str, str]:
    """The loader's directory first on ``PYTHONPATH`` (after none of Miles' packages), and the staging directory the
    loader accepts files from (this user's, as the senders on the engine's node resolve it)."""
    python_path = [ENGINE_PATH, *filter(None, [sglang.env.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(python_path), STAGING_DIR_ENV: str(weight_staging_dir())}


CPU_MISSING_KERNELS = {
    "deepseek_v4": (
        "SGLang's DeepSeek-V4 (sglang/srt/models/deepseek_v4.py) calls kernels that exist for CUDA and NPU only: its "
        "sparse attention (sglang.kernels.ops.attention.dsv4: fused_q_norm_rope, fused_norm_rope_inplace, the "
        "compressed and indexed attention; flash_mla_sm120), the grouped output projection "
        "(sglang.kernels.ops.gemm.dsv4_wo_a, fused_rope_wo_a_bf16) and FP8 group quantisation "
        "(sglang_per_token_group_quant_fp8); sgl-kernel's CPU build has none of them"
    ),
}
"""Model families whose SGLang implementation has no CPU kernels, with what is missing."""


def check_cpu_servable(model_path: str) -> None:
    """Refuse, before any engine starts, a model family that SGLang cannot serve on a CPU, naming the missing
    kernels and what would work."""
    family = read_model_config(model_path).get("model_type")
    missing = CPU_MISSING_KERNELS.get(family)
    if missing is not None:
        raise ConfigError(
            f"engine.backend = 'sglang' on CPU cannot serve the {family} model {model_path!r}: {missing}; serve it "
            "with SGLang on GPUs (sglang.gpus_per_engine) or with the local engine (--engine local)"
        )


def routing_replay_server_args(config: Any) -> dict[str, Any]:
    """With ``--train-routing-replay`` the rollout asks every ``/generate`` for ``return_routed_experts``, which SGLang
    answers only when started with ``--enable-return-routed-experts``."""
    return {"enable_return_routed_experts": True} if config.train.routing_replay else {}


def cpu_server_args(config: Any, model_path: str) -> dict[str, Any]:
    """:data:`CPU_SERVER_ARGS`, a KV pool sized for this machine and the model, at most ``engine.max_batch_size``
    requests at once, and ``dtype: bfloat16`` where SGLang's CPU float16 matmul is wrong on this machine
    (:func:`cpu_float16_is_wrong`; ``dtype: auto`` would serve a float32 checkpoint in float16)."""
    bfloat16 = {"dtype": "bfloat16"} if cpu_float16_is_wrong(config.sglang.sglang_python()) else {}
    return {
        **CPU_SERVER_ARGS,
        **bfloat16,
        "max_total_tokens": kv_token_budget(model_path),
        "max_running_requests": config.engine.max_batch_size,
    }


FLOAT16_PROBE = """
import torch, sgl_kernel
torch.manual_seed(0)
x, w = torch.randn(8, 64), torch.randn(128, 64) * 0.1
out = torch.ops.sgl_kernel.weight_packed_linear(
    x.half(), torch.ops.sgl_kernel.convert_weight_packed(w.half()), None, True
)
print((out.float() - x.half().float() @ w.half().float().t()).abs().max().item())
"""
"""SGLang's CPU linear kernel (packed weights) in float16 against the same product in float32: float16 rounding
leaves about 1e-3 here; the broken kernel is off by as much as the values (measured 3.9 on a Xeon with AMX-BF16 and
AVX512-FP16 but no AMX-FP16, where the bfloat16 kernel is off by 0.008)."""


@functools.cache  # asked once per interpreter
def cpu_float16_is_wrong(python: str) -> bool:
    """Whether SGLang's CPU float16 matmul in the environment ``python`` is wrong on this machine (see
    :data:`FLOAT16_PROBE`); ``False`` where it cannot be asked (the server's own start-up then reports why)."""
    import subprocess  # deferred: only before engines start

    try:
        done = subprocess.run(
            [python, "-c", FLOAT16_PROBE], capture_output=True, text=True, timeout=300, env={**os.environ, **CPU_ENV}
        )
        return done.returncode == 0 and float(done.stdout.strip().splitlines()[-1]) > 0.1
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return False


def kv_token_budget(model_path: str) -> int:
    """KV-cache tokens that fit in :data:`KV_MEMORY_FRACTION` of the available memory for this model (bf16 keys and
    values of every layer), within :data:`KV_TOKENS_RANGE`."""
    hf = read_model_config(model_path)
    text = hf.get("text_config") or hf
    heads = text.get("num_attention_heads") or 1
    head_dim = text.get("head_dim") or (text.get("hidden_size") or 0) // heads
    kv_heads = text.get("num_key_value_heads") or heads
    layers = text.get("num_hidden_layers") or 1
    bytes_per_token = max(1, 2 * layers * kv_heads * head_dim * 2)
    fitting = int(psutil.virtual_memory().available * KV_MEMORY_FRACTION) // bytes_per_token
    low, high = KV_TOKENS_RANGE
    return max(low, min(high, fitting))


def check_engine_environment(config: Any) -> None:
    """Before any engine starts: the interpreter of a stock ``sglang.launch_server`` command exists and has sglang;
    otherwise a :class:`ConfigError` saying how to get one."""
    sglang = config.sglang
    if not any(SGLANG_PYTHON in part for part in sglang.launch_command):
        return
    python = sglang.sglang_python()
    fix = (
        f"create one with `make sglang` (the repository's .venv-sglang), or point sglang.python "
        f"(--sglang-python, ${SGLANG_PYTHON_ENV}) at the python of an environment that has sglang"
    )
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ConfigError(f"the SGLang engine environment's interpreter {python!r} does not exist: {fix}")
    if not _has_sglang(python):
        raise ConfigError(f"the SGLang engine environment {python!r} has no sglang (import sglang fails): {fix}")


@functools.cache  # asked once per interpreter: every engine start and restart checks the environment
def _has_sglang(python: str) -> bool:
    import subprocess  # deferred: only before engines start

    if is_this_interpreter(python):
        import importlib.util

        return importlib.util.find_spec("sglang") is not None
    done = subprocess.run(
        [python, "-c", "import importlib.util as u; exit(u.find_spec('sglang') is None)"],
        capture_output=True,
        timeout=60,
    )
    return done.returncode == 0


def sglang_router_spec(config: Any) -> CommandWorkerSpec:
    """The sglang-router, with its server and its Prometheus endpoint on the worker's node address (never 0.0.0.0),
    its control routes keyed with the run's token."""
    sglang = config.sglang
    argv = [
        *_command(sglang.router_command, sglang_python=sglang.sglang_python()),
        *("--host", "{host}", "--port", "{port}", "--prometheus-host", "{host}", "--prometheus-port", "{prometheus}"),
        *("--policy", sglang.router_policy, "--health-check-interval-secs", str(sglang.router_health_check_interval_s)),
        *("--log-level", "warn"),
        # worker registration and the router's other control routes take the run's token (401 without it)
        *("--control-plane-api-keys", "miles:miles-run:admin:{token}"),
        *map(_literal, sglang.router_extra_args),
    ]
    return CommandWorkerSpec(
        name="router",
        argv=argv,
        ports=["port", "prometheus"],
        health_url="http://{host}:{port}/health",
        startup_timeout_s=60.0,
        num_cpus=0,
    )


def _command(command: list[str], *, sglang_python: str) -> list[str]:
    interpreters = {PYTHON: sys.executable, SGLANG_PYTHON: sglang_python}
    return [_literal(interpreters.get(part, part)) for part in command]


def _literal(text: str) -> str:
    """Escape braces, so that a user's value (JSON, say) is not read as a placeholder."""
    return text.replace("{", "{{").replace("}", "}}")


def _gpus_per_engine(sglang: Any) -> float:
    if sglang.gpus_per_engine is not None:
        return sglang.gpus_per_engine
    import torch  # deferred: only to see whether engines will find GPUs

    return float(sglang.tp_size * sglang.dp_size) if torch.cuda.is_available() else 0.0
