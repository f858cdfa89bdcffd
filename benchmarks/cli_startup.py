"""Wall time of ``miles --help`` and ``miles plugins`` against a bare interpreter (``python -c pass``).

Usage: ``python benchmarks/cli_startup.py [--repeats N]``. Runs each command N times, interleaved so that machine
noise hits all of them alike, and prints the medians and, last, the ratios to the bare interpreter.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

MILES = str(Path(sys.executable).parent / "miles")
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "miles --help": [MILES, "--help"],
    "miles plugins": [MILES, "plugins"],
}


def time_once(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    samples: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for argv in COMMANDS.values():  # warm the file cache once
        time_once(argv)
    for _ in range(args.repeats):
        for name, argv in COMMANDS.items():
            samples[name].append(time_once(argv))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    for name, values in samples.items():
        print(f"{name:16s} median {medians[name] * 1000:7.1f} ms  min {min(values) * 1000:7.1f} ms  (n={len(values)})")
    baseline = medians["python -c pass"]
    print(
        "ratios to python -c pass: "
        + ", ".join(f"{name} {medians[name] / baseline:.1f}x" for name in COMMANDS if name != "python -c pass")
    )


if __name__ == "__main__":
    main()
