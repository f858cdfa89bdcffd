"""Where the driver's milliseconds of one RL step go, on the critical path: ``miles train`` (the embedded default
unless told otherwise) runs in this process with timers around the parts of a step (the engine's ``/generate``
round trip, parsing its answer, rewards, batching, forward and backward, the optimizer, each request of the weight
update, the staging copy, metrics and the dashboard's writes). Prints each part's median milliseconds per step
(steps 2 .. N; evals and checkpoints left out), indented under the part it belongs to, then the step's median.

    python benchmarks/step_breakdown.py [--steps 60] [other miles train flags]

The engine runs in its own process, so ``/generate`` is one number here: the engine's share of it is read with
py-spy on the engine (``py-spy record --subprocesses``; see docs/performance.md).
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from miles_core import loop
from miles_core.builtin.dashboard.plugin import DashboardPlugin
from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.cli.main import main as miles
from miles_core.engines.client import EngineClient
from miles_core.engines.generate_types import GenerateOutput
from miles_core.reporting import RunReporter
from miles_core.rollout import executor
from miles_core.rollout.controller import InferenceController
from miles_core.training.batch import TrainBatch
from miles_core.weight_transfer.tensor import TensorProtocol

INSIDE_ENGINE = "inside the engine (meta_info.e2e_latency)"
BEYOND_ENGINE = "beyond it (HTTP, JSON, the client)"

# (label, owner, attribute, depth): what is timed, listed in the order printed; depth indents a part under the one
# before it that it runs inside
PARTS: list[tuple[str, Any, str, int]] = [
    ("rollout", loop, "_rollout", 0),
    ("engine /generate round trip (HTTP, JSON, generation)", EngineClient, "generate", 1),
    (INSIDE_ENGINE, None, "", 2),
    (BEYOND_ENGINE, None, "", 2),
    ("answers parsed (GenerateOutput)", GenerateOutput, "from_sglang", 1),
    ("responses detokenised", executor, "decode_response", 1),
    ("rewards", executor.RolloutExecutor, "_score", 1),
    ("advantages and batch", executor.RolloutExecutor, "rollout_of", 1),
    ("train", TorchTrainer, "train_step", 0),
    ("batch tensors (padding)", TrainBatch, "tensors", 1),
    ("forward, loss and backward", TorchTrainer, "_accumulate", 1),
    ("gradient clipping", torch.nn.utils, "clip_grad_norm_", 1),
    ("optimizer (AdamW)", torch.optim.AdamW, "step", 1),
    ("weight update", InferenceController, "update_weights", 0),
    ("pause generation (HTTP)", EngineClient, "pause_generation", 1),
    ("weights staged (copy into shared memory)", TensorProtocol, "_stage", 1),
    ("engine loads them (HTTP /update_weights_from_staging)", EngineClient, "update_weights_from_staging", 1),
    ("version published (HTTP)", EngineClient, "update_weight_version", 1),
    ("generation continued (HTTP)", EngineClient, "continue_generation", 1),
    ("dashboard: samples", DashboardPlugin, "on_samples", 0),
    ("dashboard: metrics", DashboardPlugin, "on_metrics", 0),
    ("dashboard: phases", DashboardPlugin, "on_phase", 0),
    ("dashboard: weight update", DashboardPlugin, "after_weight_update", 0),
    ("metrics.jsonl and the step line", RunReporter, "step", 0),
]
UNTIMED = ((loop, "_evaluate"), (loop, "save_checkpoint"))


class Tally:
    """Seconds per label within the current step; a step's totals are kept when the reporter records it."""

    def __init__(self) -> None:
        self.current: collections.Counter[str] = collections.Counter()
        self.steps: list[collections.Counter[str]] = []
        self.paused = 0  # inside an eval or a checkpoint: not counted

    def add(self, label: str, seconds: float) -> None:
        if not self.paused:
            self.current[label] += seconds

    def end_step(self) -> None:
        self.steps.append(self.current)
        self.current = collections.Counter()


def timed(tally: Tally, label: str, function: Any) -> Any:
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await function(*args, **kwargs)
            finally:
                tally.add(label, time.perf_counter() - started)

    else:

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                tally.add(label, time.perf_counter() - started)

    return wrapper


def untimed(tally: Tally, function: Any) -> Any:
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            tally.paused += 1
            try:
                return await function(*args, **kwargs)
            finally:
                tally.paused -= 1

        return wrapper

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tally.paused += 1
        try:
            return function(*args, **kwargs)
        finally:
            tally.paused -= 1

    return wrapper


def split_round_trip(tally: Tally) -> None:
    """The ``/generate`` round trip split at the engine's own account of it (``meta_info.e2e_latency``, which the
    local engine and SGLang report): the part inside the engine, and the rest (the transport and both ends' JSON)."""
    generate = EngineClient.generate

    @functools.wraps(generate)
    async def wrapper(self: EngineClient, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        answer = await generate(self, *args, **kwargs)
        elapsed = time.perf_counter() - started
        answers = answer if isinstance(answer, list) else [answer]
        latencies = [a.get("meta_info", {}).get("e2e_latency") for a in answers if isinstance(a, dict)]
        inside = max((x for x in latencies if isinstance(x, float)), default=None)
        if inside is not None:  # one request's prompts are answered together: the longest is the request's
            tally.add(INSIDE_ENGINE, inside)
            tally.add(BEYOND_ENGINE, elapsed - inside)
        return answer

    EngineClient.generate = wrapper


def instrument(tally: Tally) -> None:
    split_round_trip(tally)
    for label, owner, name, _ in PARTS:
        if owner is None:  # filled in by split_round_trip
            continue
        original = inspect.getattr_static(owner, name)
        if isinstance(original, classmethod):
            setattr(owner, name, classmethod(timed(tally, label, original.__func__)))
        elif isinstance(original, staticmethod):
            setattr(owner, name, staticmethod(timed(tally, label, original.__func__)))
        else:
            setattr(owner, name, timed(tally, label, original))
    for owner, name in UNTIMED:
        setattr(owner, name, untimed(tally, getattr(owner, name)))
    step = RunReporter.step

    def step_then_end(self: RunReporter, *args: Any, **kwargs: Any) -> None:
        step(self, *args, **kwargs)
        tally.end_step()

    RunReporter.step = step_then_end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    args, extra = parser.parse_known_args()
    tally = Tally()
    instrument(tally)
    run_dir = Path(tempfile.mkdtemp(prefix="miles-bench-breakdown-"))
    status = miles(
        [
            *("train", "--no-progress", "--num-steps", str(args.steps), "--output-dir", str(run_dir)),
            *("--run-eval-every", "0", "--run-checkpoint-every", "0", *extra),
        ]
    )
    if status != 0:
        raise SystemExit(status)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_seconds = [
        r["time/step"] - r.get("time/eval", 0) - r.get("time/checkpoint", 0) for r in rows if "time/step" in r
    ]
    steps = tally.steps[1:]  # the first step warms up
    print(f"median ms per step over steps 2..{len(tally.steps)} (the engine in its own process):")
    for label, _, _, depth in PARTS:
        values = [step[label] * 1000 for step in steps]
        if any(values):
            print(f"  {'  ' * depth}{label:<{60 - 2 * depth}} {statistics.median(values):7.2f}")
    print(f"  {'whole step (time/step)':<60} {statistics.median(step_seconds[1:]) * 1000:7.2f}")


if __name__ == "__main__":
    main()
