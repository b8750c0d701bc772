"""200,000 small records in one pickled list: nblib's streaming reader beside `pickle.load`, interleaved.

    python benchmarks/record_pickle_speed.py [--records 200000] [--repeats 3]

Each record is `{"x": float32[8], "y": int, "id": str}` (protocol 4). Prints the seconds of each, the
ratio nblib / pickle.load per repeat (the goal: <= 2x), and nblib's peak traced Python memory while
reading (tracemalloc) beside the file's size.
"""
from __future__ import annotations

import argparse
import pickle
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from nblib.cache.pickle_stream import pickle_records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    records = [{"x": rng.standard_normal(8, dtype=np.float32), "y": i % 10, "id": f"r{i}"} for i in range(args.records)]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "list.pkl"
        path.write_bytes(pickle.dumps(records, protocol=4))
        del records
        for repeat in range(args.repeats):
            started = time.perf_counter()
            with open(path, "rb") as f:
                n_ref = len(pickle.load(f))
            reference = time.perf_counter() - started
            tracemalloc.start()
            started = time.perf_counter()
            n = sum(1 for _ in pickle_records(path))
            ours = time.perf_counter() - started
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert n == n_ref
            print(f"repeat {repeat}: {n:,} records, pickle.load {reference:.2f} s, nblib {ours:.2f} s "
                  f"(x{ours / reference:.1f}; tracemalloc slows nblib's side), nblib peak {peak / 1e6:.1f} MB "
                  f"traced for a {path.stat().st_size / 1e6:.1f} MB file")


if __name__ == "__main__":
    main()
