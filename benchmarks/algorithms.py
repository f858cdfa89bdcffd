"""Every registered advantage estimator on the embedded default task, from the same initial weights and prompts (the
same seed), in one run: a ``miles train`` of ``--steps`` steps each, evaluated every ``--eval-every`` steps. One
table: the mean step time (after two warm-up steps, without the steps that evaluate), that time over ``grpo``'s (the
baseline, run first), the first step whose eval reward reached 0.5, and the eval reward at the end.

Usage: ``python benchmarks/algorithms.py [--steps 150] [--eval-every 10] [--estimators grpo,rloo,...] [other miles
train flags]``. The estimators are those ``miles plugins`` lists (a third party's too) unless ``--estimators`` names
some. The runs go one after another on an otherwise quiet machine; the ratio column compares them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASELINE = "grpo"
REACHED = 0.5


def registered_estimators() -> list[str]:
    listing = subprocess.run(
        [sys.executable, "-m", "miles_core.cli.main", "plugins", "--json"], capture_output=True, text=True, check=True
    )
    names = {
        name
        for plugin in json.loads(listing.stdout)["plugins"]
        for name in plugin.get("provides", {}).get("advantage_estimators", [])
    }
    return [BASELINE, *sorted(names - {BASELINE})]


def run(estimator: str, steps: int, eval_every: int, extra: list[str]) -> list[dict]:
    """One run's metrics.jsonl rows."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"miles-bench-{estimator}-"))
    argv = [sys.executable, "-m", "miles_core.cli.main", "train", "--no-progress", "--output-dir", str(run_dir)]
    argv += ["--num-steps", str(steps), "--run-eval-every", str(eval_every), "--run-checkpoint-every", "0"]
    argv += ["--train-advantage-estimator", estimator, *extra]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{estimator} run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    print(f"  {estimator}: {steps} steps in {time.perf_counter() - started:.1f} s (with start-up)", flush=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(run_dir, ignore_errors=True)
    return rows


def summary(rows: list[dict]) -> tuple[float, int | None, float, str]:
    """Mean step time (steps 3 and later, those without an eval), the first step whose eval reached 0.5, the last
    eval reward, and for an estimator with a critic the mean explained variance of its last 20 steps."""
    timed = [
        row["time/step"] for row in rows if "time/step" in row and row["step"] > 2 and "eval/reward_mean" not in row
    ]
    evals = [(row["step"], row["eval/reward_mean"]) for row in rows if "eval/reward_mean" in row]
    reached = next((step for step, reward in evals if reward >= REACHED), None)
    explained = [row["train/critic/explained_variance"] for row in rows if "train/critic/explained_variance" in row]
    critic = f"{sum(explained[-20:]) / len(explained[-20:]):.2f}" if explained else "-"
    return sum(timed) / len(timed), reached, evals[-1][1], critic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--estimators", default=None, help="comma-separated (default: every registered one)")
    args, extra = parser.parse_known_args()
    estimators = args.estimators.split(",") if args.estimators else registered_estimators()
    if BASELINE not in estimators:
        estimators.insert(0, BASELINE)
    results = {name: summary(run(name, args.steps, args.eval_every, extra)) for name in estimators}
    base = results[BASELINE][0]
    print(
        f"\n| estimator | s/step | vs {BASELINE} | first step with eval >= {REACHED} | eval at the end "
        "| critic's explained variance (last 20 steps) |"
    )
    print("|---|---|---|---|---|---|")
    for name, (step_s, reached, final, critic) in results.items():
        first = reached if reached is not None else "never"
        print(f"| {name} | {step_s:.3f} | {step_s / base:.2f}x | {first} | {final:.3f} | {critic} |")


if __name__ == "__main__":
    main()
