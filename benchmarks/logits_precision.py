"""Peak memory of the policy logprob and entropy math on a bfloat16 model's logits, by ``--train-logits-dtype``.

``float32`` (the default, the baseline: the logits upcast) against ``model`` (the math in the logits' own bfloat16),
on logits ``[batch, seq, vocab]`` (default 8 x 512 x 32000: 262 MB in bf16). Two computations, as the trainers do
them:

- ``train``: token logprobs and entropy with gradient, a masked-mean loss and its backward to the logits (the
  step's ``_accumulate``);
- ``no_grad``: token logprobs without gradient (the TIS old logprobs and the KL reference's).

Each setting runs in a fresh subprocess (``--repeats`` times, interleaved; medians): the peak resident set size above
the one just before the computation (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``), so what was
allocated before (the logits, torch itself) does not count. The logits' own size is printed as the floor. The ratio
``model / float32`` is printed last.

    python benchmarks/logits_precision.py [--batch 8 --seq 512 --vocab 32000 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20
SETTINGS = ("float32", "model")
MODES = ("train", "no_grad")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}: this benchmark needs Linux")


def child(*, setting: str, mode: str, batch: int, seq: int, vocab: int, threads: int) -> dict[str, float]:
    """One measurement in this process: peak RSS above the RSS before the computation, in MiB."""
    import torch  # deferred: the parent process only starts children

    from miles_core.training.losses import entropy, logits_dtype, masked_mean, token_logprobs

    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(batch, seq, vocab, generator=generator) * 3).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (batch, seq), generator=generator)
    mask = torch.ones(batch, seq)
    dtype = logits_dtype(setting)
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the current RSS
    before = _status_kib("VmRSS")
    if mode == "train":
        logits.requires_grad_(True)
        loss = -masked_mean(token_logprobs(logits, targets, dtype=dtype), mask)
        loss = loss - 0.01 * masked_mean(entropy(logits, dtype=dtype), mask)
        loss.backward()
    else:
        with torch.no_grad():
            token_logprobs(logits, targets, dtype=dtype)
    peak = _status_kib("VmHWM")
    return {"peak_mib": (peak - before) / 1024, "logits_mib": logits.numel() * logits.element_size() / MIB}


def measure(setting: str, mode: str, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", setting, "--mode", mode]
    command += ["--batch", str(args.batch), "--seq", str(args.seq), "--vocab", str(args.vocab)]
    command += ["--threads", str(args.threads)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"the measurement {setting}/{mode} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each measurement (memory only)")
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, default="train", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        shape = {"batch": args.batch, "seq": args.seq, "vocab": args.vocab, "threads": args.threads}
        print(json.dumps(child(setting=args.child, mode=args.mode, **shape)))
        return
    peaks: dict[tuple[str, str], list[float]] = {(s, m): [] for s in SETTINGS for m in MODES}
    logits_mib = 0.0
    for _ in range(args.repeats):
        for mode in MODES:
            for setting in SETTINGS:
                result = measure(setting, mode, args)
                peaks[setting, mode].append(result["peak_mib"])
                logits_mib = result["logits_mib"]
    print(f"logits [{args.batch}, {args.seq}, {args.vocab}] bfloat16: {logits_mib:.0f} MiB (the floor)")
    print("peak MiB above the logits, median of", args.repeats)
    print(f"{'logits_dtype':<14}" + "".join(f"{mode:>10}" for mode in MODES))
    medians = {key: statistics.median(values) for key, values in peaks.items()}
    for setting in SETTINGS:
        print(f"{setting:<14}" + "".join(f"{medians[setting, mode]:>10.0f}" for mode in MODES))
    for mode in MODES:
        print(f"{mode}: model / float32 = {medians['model', mode] / medians['float32', mode]:.2f}x")


if __name__ == "__main__":
    main()
