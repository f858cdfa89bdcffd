"""The three run schedules on the same config, in one run: ``sync`` (the baseline), ``one_step_off`` and
``fully_async``, each a short embedded-default ``miles train``. For each: steps/s, samples/s and how much of a step
the trainer and the engines sit idle; and the limit of overlapping, measured in the ``sync`` run: generation alone
(its rollout phase) and training alone (its train and weight-update phases) per step. A fourth run, ``sync`` with
the overlapping schedules' thread split, measures those two phases with the threads each gets when they overlap:
on a small machine that limit, not the first, is what overlapping can reach (a phase that uses every core alone
gets only its share when both run at once).

Usage: ``python benchmarks/schedules.py [--steps 40] [--split 1,1] [other miles train flags]``. ``--split T,E`` gives
the overlapping schedules T torch threads in the trainer and E in each engine (``--train-cpu-threads``,
``--engine-cpu-threads``): on a 2-core machine two processes of two threads each would fight over the cores. ``sync``
keeps torch's default (every core to whichever phase runs). The last lines print ``fully_async / sync throughput``
and ``fully_async step / limit``. ``--hosts`` runs each schedule twice with the Ray provider, on one host and with
the engine on another host (two network namespaces, each its own network stack; as root), and prints the step time
across hosts over the step time on one host.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HOST_FLAGS = ["--run-ray-engine-resources", '{"engine_node": 1}']
"""With ``--hosts``: the engines on host B (the trainer runs in the driver, on host A)."""

SCHEDULES = ("sync", "one_step_off", "fully_async")


def run(schedule: str, steps: int, extra: list[str], threads: list[str], hosts: Any = None) -> list[dict]:
    """One run's per-step metrics, without the first two steps (warm-up) and the last (eval, checkpoint); with
    ``hosts`` (``--hosts``), run on host A and joined to their cluster."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"miles-bench-{schedule}-"))
    argv = [sys.executable, "-m", "miles_core.cli.main", "train", "--no-progress", "--output-dir", str(run_dir)]
    argv += ["--num-steps", str(steps), "--run-eval-every", "0", "--run-checkpoint-every", "0"]
    argv += ["--run-schedule", schedule, *threads, *extra]
    env = None
    if hosts is not None:
        argv = hosts.head.command([*argv, "--run-ray-address", hosts.ray_address, *HOST_FLAGS])
        env = hosts.env()
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{schedule} run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    print(f"  {schedule}: {steps} steps in {time.perf_counter() - started:.1f} s (with start-up)", flush=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(run_dir, ignore_errors=True)
    return [row for row in rows if "time/step" in row][2:-1]


def total(rows: list[dict], key: str) -> float:
    return sum(row.get(key, 0.0) for row in rows)


def mean_step(rows: list[dict]) -> float:
    return total(rows, "time/step") / len(rows)


def phases_alone(rows: list[dict]) -> tuple[float, float]:
    """A sync run's median generation (rollout phase) and training (train and weight update) per step: nothing
    overlaps in it, so each is that phase alone."""
    generation = statistics.median(row["time/rollout"] for row in rows)
    training = statistics.median(row["time/train"] + row["time/weight_update"] for row in rows)
    return generation, training


def across_hosts(steps: int, extra: list[str], split: list[str]) -> None:
    """Each schedule with the Ray provider on one host (a local Ray) and with its engine on another host (network
    namespaces, ``benchmarks/ray_nodes.py``), one after the other: step times and the ratio across / one host."""
    from ray_nodes import namespace_hosts  # deferred: only --hosts builds namespaces

    extra = [*extra, "--run-worker-provider", "ray"]
    with namespace_hosts() as hosts:
        rows = []
        for schedule in SCHEDULES:
            threads = [] if schedule == "sync" else split
            one_host = run(schedule, steps, extra, threads)
            two_hosts = run(schedule, steps, extra, threads, hosts)
            rows.append((schedule, mean_step(one_host), mean_step(two_hosts)))
    print(f"{'schedule':<14}{'one host ms':>13}{'across ms':>11}{'across / one':>14}")
    for schedule, one, two in rows:
        print(f"{schedule:<14}{one * 1000:>13.0f}{two * 1000:>11.0f}{two / one:>13.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--split", default="1,1", help="trainer,engine torch threads of the overlapping schedules")
    parser.add_argument(
        "--hosts", action="store_true", help="each schedule on one host and with its engine on another (namespaces)"
    )
    args, extra = parser.parse_known_args()
    trainer_threads, engine_threads = (int(n) for n in args.split.split(","))
    split = ["--train-cpu-threads", str(trainer_threads), "--engine-cpu-threads", str(engine_threads)]
    if args.hosts:
        across_hosts(args.steps, extra, split)
        return
    print(
        f"schedules over {args.steps} steps each; overlapping ones with {trainer_threads} trainer / "
        f"{engine_threads} engine thread(s)",
        flush=True,
    )
    results = {s: run(s, args.steps, extra, [] if s == "sync" else split) for s in SCHEDULES}
    split_sync = run("sync", args.steps, extra, split)
    samples_per_step = results["sync"][0]["rollout/samples"]
    generation, training = phases_alone(results["sync"])
    limit = max(generation, training)
    print(
        f"\nlimit (from sync): generation alone {generation * 1000:.0f} ms/step, training alone "
        f"{training * 1000:.0f} ms/step -> {limit * 1000:.0f} ms/step"
    )
    split_generation, split_training = phases_alone(split_sync)
    split_limit = max(split_generation, split_training)
    print(
        f"limit at the split (from sync with {args.split} threads): generation alone {split_generation * 1000:.0f} "
        f"ms/step, training alone {split_training * 1000:.0f} ms/step -> {split_limit * 1000:.0f} ms/step"
    )
    print(f"{'schedule':<14}{'step ms':>9}{'steps/s':>9}{'samples/s':>11}{'trainer idle':>14}{'engine idle':>13}")
    step_of = {}
    for schedule, rows in results.items():
        step_time = total(rows, "time/step") / len(rows)
        step_of[schedule] = step_time
        trainer_idle = 1 - total(rows, "time/train") / total(rows, "time/step")
        if schedule == "fully_async":  # measured: no group generating
            engine_idle = total(rows, "rollout/generation_idle_s") / total(rows, "time/step")
        else:  # the engines work for about as long as generation alone takes
            engine_idle = max(0.0, 1 - generation / step_time)
        print(
            f"{schedule:<14}{step_time * 1000:>9.0f}{1 / step_time:>9.2f}{samples_per_step / step_time:>11.0f}"
            f"{trainer_idle:>14.0%}{engine_idle:>13.0%}"
        )
    print(f"one_step_off / sync throughput: {step_of['sync'] / step_of['one_step_off']:.2f}x")
    print(f"fully_async step / limit at the split: {step_of['fully_async'] / split_limit:.2f}x")
    print(f"fully_async / sync throughput: {step_of['sync'] / step_of['fully_async']:.2f}x")
    print(f"fully_async step / limit: {step_of['fully_async'] / limit:.2f}x")


if __name__ == "__main__":
    main()
