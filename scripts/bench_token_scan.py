"""What dataset=tokens' check of every token id costs at setup (mpexp/data/tokens.py): one
memory-mapped pass over a generated uint16 file of `--gb` GB of GPT-2-sized ids, timed
`--repeats` times; the first pass after writing it reads it from the page cache, as a second
run on the same files does. A file not in memory is read at the disk's speed.

    python scripts/bench_token_scan.py --gb 1 --repeats 3
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from mpexp.data.tokens import TokenFiles

CHUNK = 1 << 24  # ids written at a time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "train.bin"
        rng = np.random.default_rng(0)
        with path.open("wb") as out:
            for _ in range(round(args.gb * 1e9 / 2 / CHUNK)):
                rng.integers(0, 50257, CHUNK, dtype=np.uint16).tofile(out)
        data = TokenFiles(folder)
        data.vocab = 50257
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        print(f"{path.stat().st_size / 1e9:.2f} GB of uint16 ids")
        for _ in range(args.repeats):
            start = time.perf_counter()
            data._check_ids({path: tokens})
            print(f"every id checked in {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
