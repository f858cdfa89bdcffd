"""Scoring one step's batch off the event loop versus on it: the default reward (``echo_last``) on a 128-sample
batch, scored by the :class:`~miles_core.rollout.rewards.RewardScorer` (worker threads, per-call deadlines) and by
the naive way it was done before (each call in turn on the event loop, its label and metadata copied, its value
checked), in the same process. A third line scores the built-in ``math`` reward (math-verify) the same two ways.

Usage: ``python benchmarks/reward_scoring.py [--samples 128] [--repeats 21] [--workers 2]``. Prints the median time
per batch of each and, last, the ratio scorer / inline for ``echo_last``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

from miles_core.builtin.rewards import math_reward
from miles_core.default.task import echo_last_reward
from miles_core.rollout.prompts import Prompt
from miles_core.rollout.rewards import RewardScorer, checked_reward, single_reward
from miles_core.rollout.samples import Sample


def batch(count: int, *, math: bool) -> list[Sample]:
    """``count`` samples with responses of the size the default task has (8 tokens), or short boxed answers."""
    return [
        Sample(
            index=i,
            prompt=Prompt(f"{i}:", label=f"{i % 10}" if not math else f"\\frac{{{i % 5}}}{{2}}", metadata={"i": i}),
            prompt_ids=[1],
            response=f"{i % 10}" * 8 if not math else f"so \\boxed{{{(i % 5) / 2}}}",
        )
        for i in range(count)
    ]


async def inline(fn: Callable[..., Any], samples: list[Sample]) -> None:
    """The naive baseline: every call in turn on the event loop (how scoring ran before the pool)."""
    for sample in samples:
        sample.reward = checked_reward(
            fn(
                prompt=sample.prompt.text,
                response=sample.response,
                label=copy.deepcopy(sample.prompt.label),
                metadata=copy.deepcopy(sample.prompt.metadata),
            )
        )


def median_ms(score: Callable[[list[Sample]], Any], samples: list[Sample], repeats: int) -> float:
    """The median over ``repeats`` of one batch's scoring, in one event loop (as a run has)."""

    async def timed() -> list[float]:
        times = []
        for _ in range(repeats + 2):
            started = time.perf_counter()
            await score(samples)
            times.append(time.perf_counter() - started)
        return times[2:]  # the first two warm up (thread start, imports, caches)

    return statistics.median(asyncio.run(timed())) * 1000


def compare(name: str, fn: Callable[..., Any], samples: list[Sample], *, repeats: int, workers: int) -> float:
    scorer = RewardScorer(single_reward(fn, name), timeout_s=30, workers=workers, max_consecutive_failures=16)
    wheres = ["sample {index}"] * len(samples)
    pooled = median_ms(lambda s: scorer.score(s, wheres), samples, repeats)
    naive = median_ms(lambda s: inline(fn, s), samples, repeats)
    scorer.close()
    print(f"{name}: {len(samples)} samples: scorer {pooled:.3f} ms, inline {naive:.3f} ms (median of {repeats})")
    return pooled / naive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    options = {"repeats": args.repeats, "workers": args.workers}
    math_ratio = compare("math", math_reward, batch(args.samples, math=True), **options)
    print(f"math: scorer / inline = {math_ratio:.2f}")
    ratio = compare("echo_last", echo_last_reward, batch(args.samples, math=False), **options)
    print(f"echo_last: scorer / inline = {ratio:.2f}")


if __name__ == "__main__":
    main()
