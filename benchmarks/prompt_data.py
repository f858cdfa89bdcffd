"""The driver's memory for a large prompt file: a Parquet file of 1,000,000 chat prompts (written by a child process,
so that making it costs this process nothing).

1. In process: the file is opened as a prompt source, and 200 steps of 64 prompts are drawn, rendered with a chat
   template and encoded, as the executor does. Printed: the growth of this process's RSS (psutil; resident pages of
   the memory-mapped Arrow cache included) and of its anonymous memory (RSS less file-backed pages).
2. The baseline, in a child process: the naive loader, the file read into Python objects (``pyarrow`` to a list of
   rows, as a loader without Arrow would hold it): its RSS growth.
3. Whole runs: ``miles train`` on that file and on a 64-row file of the same prompts (a tiny chat model, 4 steps of
   64 prompts x 2 samples); the driver's peak RSS (psutil, polled every 50 ms over the run) for each, and their
   difference: what the million rows cost the driver while the run starts and samples.

Printed last: the driver's growth against the naive loader's, the ratio.

Usage: ``python benchmarks/prompt_data.py [--rows 1000000] [--steps 200] [--batch-size 64] [--no-runs]``
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq

MAKE = """
import sys
import pyarrow as pa, pyarrow.parquet as pq
path, rows = sys.argv[1], int(sys.argv[2])
schema = pa.schema([("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                    ("label", pa.string())])
with pq.ParquetWriter(path, schema) as writer:
    for start in range(0, rows, 100_000):
        numbers = range(start, min(rows, start + 100_000))
        prompts = [[{"role": "system", "content": "add the digits"}, {"role": "user", "content": f"{n}:"}]
                   for n in numbers]
        writer.write_table(pa.table({"prompt": prompts, "label": [str(sum(map(int, str(n)))) for n in numbers]},
                                    schema=schema))
"""


BOUND_BYTES_PER_ROW = 64
BOUND_FIXED_BYTES = 32 << 20
"""The stated bound of the driver's growth (docs/how-to/prompt-data.md): the mapped Arrow table's pages; per row the
epoch's order (4 bytes; 8 while the permutation is made) and the Arrow buffers of the column checks, with room for
allocator slack; and a fixed part (the conversion into the datasets cache: 200,000 rows grew the driver by 40 MiB,
17 above the other two terms)."""

NAIVE = """
import gc, sys, psutil
import pyarrow.parquet as pq
gc.collect()
before = psutil.Process().memory_info().rss
rows = pq.read_table(sys.argv[1]).to_pylist()
gc.collect()
print(psutil.Process().memory_info().rss - before, len(rows))
"""


def naive_loader_growth(path: Path) -> int:
    """The baseline: the RSS growth of a child process that reads the file into Python objects."""
    out = subprocess.run([sys.executable, "-c", NAIVE, str(path)], check=True, capture_output=True, text=True).stdout
    return int(out.split()[0])


def driver_peak_rss(prompts: Path, work: Path, model: Path) -> int:
    """``miles train`` on ``prompts``: the driver process's peak RSS over the run (polled), in bytes."""
    miles = Path(sys.executable).parent / "miles"
    command = [
        str(miles), "train", "--output-dir", str(work / f"run-{prompts.stem}"), "--no-progress", "--model", str(model),
        "--prompts", str(prompts), "--rollout-label-key", "label", "--reward", "exact", "--rollout-max-new-tokens",
        "2", "--rollout-batch-size", "64", "--rollout-group-size", "2", "--num-steps", "4", "--run-eval-every", "0",
        "--run-checkpoint-every", "0",
    ]  # fmt: skip
    env = {**os.environ, "HF_DATASETS_CACHE": str(work / "datasets-cache")}
    with open(work / f"{prompts.stem}.log", "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=log)
    driver, peak = psutil.Process(process.pid), 0
    while process.poll() is None:
        try:
            peak = max(peak, driver.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    if process.wait() != 0:
        raise SystemExit(f"miles train on {prompts} failed: {(work / f'{prompts.stem}.log').read_text()[-2000:]}")
    return peak


def memory() -> tuple[int, int]:
    """This process's RSS and its anonymous part (RSS less file-backed resident pages), in bytes."""
    info = psutil.Process().memory_info()
    return info.rss, info.rss - info.shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--no-runs", action="store_true", help="skip the two miles train runs")
    args = parser.parse_args()

    # Everything imported (and the tokenizer made) before the baseline: only the data's cost is measured.
    from miles_core.rollout.chat_prompts import ChatRenderer
    from miles_core.rollout.prompt_data import open_prompt_source
    from miles_core.rollout.prompt_encoding import PromptEncoder
    from miles_core.rollout.prompt_order import PromptOrder
    from miles_core.testkit.tiny_models import save_tiny_llama
    from miles_core.testkit.tokenizers import ROLE_TAG_CHAT_TEMPLATE, save_char_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chats.parquet"
        subprocess.run([sys.executable, "-c", MAKE, str(path), str(args.rows)], check=True)
        tokenizer = save_char_tokenizer(
            Path(tmp) / "tok", "adghiestu <>:0123456789", chat_template=ROLE_TAG_CHAT_TEMPLATE
        )
        encoder = PromptEncoder(tokenizer)
        gc.collect()
        rss0, anon0 = memory()
        start = time.perf_counter()
        source = open_prompt_source(str(path), renderer=ChatRenderer(tokenizer), cache_dir=str(Path(tmp) / "cache"))
        opened = time.perf_counter() - start
        order = PromptOrder(len(source), seed=0, batch_size=args.batch_size)
        start = time.perf_counter()
        tokens = 0
        for step in range(args.steps):
            for index in order.indices(step):
                tokens += len(encoder.ids(source[index], where=f"prompt {index}"))
        drawn = time.perf_counter() - start
        gc.collect()
        rss1, anon1 = memory()
        size = path.stat().st_size
        print(f"rows                 {len(source):>12,}")
        print(f"parquet file         {size / 2**20:>12.1f} MiB")
        print(f"Arrow table          {source.files[0].dataset.data.nbytes / 2**20:>12.1f} MiB (uncompressed, mapped)")
        print(f"open (Arrow cache)   {opened:>12.2f} s")
        print(f"draw {args.steps} x {args.batch_size:<10} {drawn:>9.2f} s  ({tokens:,} prompt tokens)")
        print(f"RSS growth           {(rss1 - rss0) / 2**20:>12.1f} MiB")
        print(f"anonymous growth     {(anon1 - anon0) / 2**20:>12.1f} MiB")
        naive = naive_loader_growth(path)
        print(f"naive loader growth  {naive / 2**20:>12.1f} MiB (the rows as Python objects, a child process)")
        if args.no_runs:
            print(f"in-process RSS growth / naive loader's: {(rss1 - rss0) / naive:.2f}")
            return
        alphabet = "adghiestu <>:0123456789"
        model = save_tiny_llama(Path(tmp) / "model", vocab_size=3 + len(alphabet))
        save_char_tokenizer(model, alphabet, chat_template=ROLE_TAG_CHAT_TEMPLATE)
        small = Path(tmp) / "small.parquet"
        pq.write_table(pq.ParquetFile(path).read_row_group(0).slice(0, 64), small)  # not the whole file again
        big_peak = driver_peak_rss(path, Path(tmp), model)
        small_peak = driver_peak_rss(small, Path(tmp), model)
        growth = big_peak - small_peak
        print(f"driver peak RSS      {big_peak / 2**20:>12.1f} MiB ({len(source):,} rows)")
        print(f"driver peak RSS      {small_peak / 2**20:>12.1f} MiB (64 rows)")
        print(f"driver growth        {growth / 2**20:>12.1f} MiB for the rows (the file: {size / 2**20:.1f} MiB)")
        bound = source.files[0].dataset.data.nbytes + BOUND_BYTES_PER_ROW * len(source) + BOUND_FIXED_BYTES
        verdict = "within" if growth <= bound else "OVER"
        per_row = f"the Arrow table + {BOUND_BYTES_PER_ROW} bytes a row + {BOUND_FIXED_BYTES >> 20} MiB"
        print(f"bound                {bound / 2**20:>12.1f} MiB ({per_row}): {verdict}")
        print(f"driver growth / naive loader's growth: {growth / naive:.2f}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
