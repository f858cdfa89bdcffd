"""SGLang's own benchmark client (``python -m sglang.bench_serving``) run from a separate SGLang environment against
any server that speaks SGLang's API: the local engine's test and ``benchmarks/engine_serving.py`` use it.

SGLang does not install beside Miles (it pins its own torch), so it lives in its own environment: the python named by
``$MILES_SGLANG_PYTHON``, else ``.venv-sglang/bin/python`` in the repository root (``make sglang`` creates it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

SGLANG_PYTHON_ENV = "MILES_SGLANG_PYTHON"
DEFAULT_SGLANG_PYTHON = Path(__file__).resolve().parents[2] / ".venv-sglang" / "bin" / "python"


class BenchServingError(RuntimeError):
    """``sglang.bench_serving`` failed, or some of its requests did; the message holds its output's tail."""


def sglang_python() -> tuple[Path, bool]:
    """The SGLang environment's python, and whether ``$MILES_SGLANG_PYTHON`` named it (else it is the default)."""
    named = os.environ.get(SGLANG_PYTHON_ENV)
    return (Path(named), True) if named else (DEFAULT_SGLANG_PYTHON, False)


def bench_client_unavailable_reason(python: Path, timeout_s: float = 300) -> str | None:
    """Why ``sglang.bench_serving`` cannot start in the SGLang environment ``python`` on this machine, or None when it
    can. The client imports SGLang's runtime, which loads the CPU kernel (``sgl_kernel``): a kernel built for
    AVX-512 dies of SIGILL on import on a CPU without it (some AMD machines), whatever server it would talk to."""
    try:
        probe = subprocess.run(
            [str(python), "-c", "import sglang.bench_serving"], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the SGLang environment {python} could not be asked to import sglang.bench_serving: {exc}"
    if probe.returncode < 0:
        name = signal.Signals(-probe.returncode).name
        return (
            f"importing sglang.bench_serving in {python} dies of {name} on this CPU (SGLang's CPU kernel, sgl_kernel, "
            "is built for instructions this CPU lacks, such as AVX-512)"
        )
    if probe.returncode != 0:
        return f"the SGLang environment {python} cannot import sglang.bench_serving: {probe.stderr[-300:]}"
    return None


def run_bench_serving(
    python: Path,
    *,
    base_url: str,
    backend: str,
    tokenizer: Path,
    num_prompts: int,
    input_len: int,
    output_len: int,
    workdir: Path,
    timeout_s: float = 600,
    extra: tuple[str, ...] = (),
) -> dict:
    """Run ``sglang.bench_serving`` once and return its result record (``completed``, ``request_throughput``,
    ``output_throughput``, ``median_e2e_latency_ms``, ``median_ttft_ms``, ...). Prompts are random token ids;
    with ``--backend sglang`` they are sent as ids (``--tokenize-prompt``), otherwise as their decoded text.
    Raises :class:`BenchServingError` unless every request succeeded."""
    output = workdir / f"bench-{backend}-{os.getpid()}.jsonl"
    output.unlink(missing_ok=True)
    argv = [
        str(python),
        "-m",
        "sglang.bench_serving",
        "--backend",
        backend,
        "--base-url",
        base_url,
        "--dataset-name",
        "random-ids",
        "--tokenizer",
        str(tokenizer),
        "--num-prompts",
        str(num_prompts),
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--random-range-ratio",
        "1.0",
        "--output-file",
        str(output),
        "--disable-tqdm",
        "--seed",
        "1",
        *(["--tokenize-prompt"] if backend == "sglang" else []),
        *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # a local tokenizer directory only
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=workdir, env=env)
    tail = (done.stdout + done.stderr)[-3000:]
    if done.returncode != 0 or not output.exists():
        raise BenchServingError(f"{' '.join(argv[:4])} ... exited with {done.returncode}:\n{tail}")
    record = json.loads(output.read_text().splitlines()[-1])
    if record.get("completed") != num_prompts:
        raise BenchServingError(f"{record.get('completed')} of {num_prompts} requests succeeded:\n{tail}")
    return record
