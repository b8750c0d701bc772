"""200,000 small records in one pickled list: nblib's streaming reader beside `pickle.load`, interleaved.

    python benchmarks/record_pickle_speed.py [--records 200000] [--repeats 3]

Each record is `{"x": float32[8], "y": int, "id": str}` (protocol 4). Prints the wall and CPU seconds of
each (CPU time: what a run on an idle machine would take, less sensitive to a busy one), the ratio
nblib / pickle.load per repeat (the goal: <= 2x), and nblib's peak traced Python memory while reading
(tracemalloc, in a separate pass: it slows what it traces) beside the file's size and pickle.load's.
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
            reference = _timed(lambda: len(_load(path)))
            ours = _timed(lambda: sum(1 for _ in pickle_records(path)))
            assert ours[2] == reference[2]
            print(f"repeat {repeat}: {ours[2]:,} records; pickle.load {reference[0]:.2f} s wall, {reference[1]:.2f} "
                  f"CPU-s; nblib {ours[0]:.2f} s wall, {ours[1]:.2f} CPU-s: x{ours[1] / reference[1]:.1f} in CPU time")
        peaks = [_peak(lambda: _load(path)), _peak(lambda: sum(1 for _ in pickle_records(path)))]
        print(f"peak traced memory: pickle.load {peaks[0] / 1e6:.1f} MB, nblib {peaks[1] / 1e6:.1f} MB, for a "
              f"{path.stat().st_size / 1e6:.1f} MB file")


def _load(path: Path) -> list:
    with open(path, "rb") as f:
        return pickle.load(f)


def _timed(read) -> tuple[float, float, int]:
    wall, cpu = time.perf_counter(), time.process_time()
    n = read()
    return time.perf_counter() - wall, time.process_time() - cpu, n


def _peak(read) -> int:
    tracemalloc.start()
    read()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak

if __name__ == "__main__":
    main()
