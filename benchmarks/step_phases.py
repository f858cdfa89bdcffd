"""Where one RL step's time goes: rollout, training and weight update, as shares of the whole step, from a short
embedded-default run. Usage: ``python benchmarks/step_phases.py [--steps 30] [other miles train flags]``."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from miles_core.cli.main import main as miles

PHASES = ("time/rollout", "time/train", "time/weight_update")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    args, extra = parser.parse_known_args()
    run_dir = Path(tempfile.mkdtemp(prefix="miles-bench-phases-"))
    status = miles(
        [
            "train",
            "--no-progress",
            "--num-steps",
            str(args.steps),
            "--run-eval-every",
            "0",
            "--run-checkpoint-every",
            "0",
            "--output-dir",
            str(run_dir),
            *extra,
        ]
    )
    if status != 0:
        raise SystemExit(status)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "time/step" in row][1:-1]  # the last step also evaluates and checkpoints
    step_time = statistics.median(row["time/step"] for row in steps)
    print(f"median step {step_time * 1000:.0f} ms over {len(steps)} steps")
    shares = {phase: statistics.median(row[phase] for row in steps) / step_time for phase in PHASES}
    other = 1 - sum(shares.values())
    print(
        "shares of a step: "
        + ", ".join(f"{p.split('/')[1]} {s:.0%}" for p, s in shares.items())
        + f", other {other:.0%}"
    )


if __name__ == "__main__":
    main()
