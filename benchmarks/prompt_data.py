"""The driver's memory for a large prompt file: a Parquet file of 1,000,000 chat prompts (written by a child process,
so that making it costs this process nothing) is opened as a prompt source, and 200 steps of 64 prompts are drawn,
rendered with a chat template and encoded, as the executor does. Printed: the file's size, the growth of this
process's RSS (psutil; resident pages of the memory-mapped Arrow cache included) and of its anonymous memory (RSS
less file-backed pages), and last the ratio of the RSS growth to the file size (the baseline: a loader that reads
the file into memory grows by at least the file's size, and several times it as Python objects).

Usage: ``python benchmarks/prompt_data.py [--rows 1000000] [--steps 200] [--batch-size 64]``
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


def memory() -> tuple[int, int]:
    """This process's RSS and its anonymous part (RSS less file-backed resident pages), in bytes."""
    info = psutil.Process().memory_info()
    return info.rss, info.rss - info.shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    # Everything imported (and the tokenizer made) before the baseline: only the data's cost is measured.
    from miles_core.rollout.chat_prompts import ChatRenderer
    from miles_core.rollout.prompt_data import open_prompt_source
    from miles_core.rollout.prompt_encoding import PromptEncoder
    from miles_core.rollout.prompt_order import PromptOrder
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
        print(f"RSS growth / file size (baseline 1.0: the file read into memory): {(rss1 - rss0) / size:.2f}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
