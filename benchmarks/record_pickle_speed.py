"""200,000 small records in one pickled list: nblib's two readers beside `pickle.load`, interleaved.

    python benchmarks/record_pickle_speed.py [--records 200000] [--repeats 5] [--pure-repeats 1] [--json FILE]

Each record is `{"x": float32[8], "y": int, "id": str}` (protocol 4). Each repeat times, in turn and in
this process, `pickle.load`, nblib's fast reader (the C scan and CPython's C unpickler,
nblib/cache/pickle_fast.py) and, in the first `--pure-repeats` repeats, its pure-Python reader
(NBLIB_PICKLE_READER=pure): wall and CPU seconds, and the ratio to `pickle.load` in CPU time (less
sensitive to a busy machine; the goal: fast <= 2x). Then each reads the file once more in a fresh
process, which prints its peak RSS (VmHWM) over its RSS once imported: `pickle.load` holds the whole
list, nblib about one chunk of records plus the plan. The load average is printed beside the timings.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHILD = """
import os, pickle, sys
from pathlib import Path
from nblib.cache.pickle_stream import pickle_records
import nblib.cache.pickle_fast
def status(key):
    return int(open('/proc/self/status').read().split(key + ':')[1].split()[0]) * 1024
before = status('VmRSS')
path = Path(sys.argv[2])
if sys.argv[1] == 'pickle.load':
    with open(path, 'rb') as f:
        n = len(pickle.load(f))
else:
    os.environ['NBLIB_PICKLE_READER'] = sys.argv[1]
    n = sum(1 for _ in pickle_records(path))
print(n, before, status('VmHWM'))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--pure-repeats", type=int, default=1)
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args()
    from nblib.cache.pickle_stream import pickle_records

    rng = np.random.default_rng(0)
    records = [{"x": rng.standard_normal(8, dtype=np.float32), "y": i % 10, "id": f"r{i}"} for i in range(args.records)]
    times: dict[str, list] = {"pickle.load": [], "fast": [], "pure": []}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "list.pkl"
        path.write_bytes(pickle.dumps(records, protocol=4))
        del records
        read = {"pickle.load": lambda: len(_load(path)), "fast": lambda: _count(pickle_records, path, "fast"),
                "pure": lambda: _count(pickle_records, path, "pure")}
        for repeat in range(args.repeats):
            line = [f"repeat {repeat} (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs):"]
            for name in ("pickle.load", "fast", "pure"):
                if name == "pure" and repeat >= args.pure_repeats:
                    continue
                wall, cpu, n = _timed(read[name])
                assert n == args.records, (name, n)
                times[name].append((wall, cpu))
                ratio = "" if name == "pickle.load" else f" = x{cpu / times['pickle.load'][-1][1]:.2f}"
                line.append(f"{name} {wall:.2f} s wall, {cpu:.2f} CPU-s{ratio}")
            print(" ".join(line[:1]) + " " + "; ".join(line[1:]), flush=True)
        peaks = {name: _peak(name, path) for name in ("pickle.load", "fast", "pure")}
        size = path.stat().st_size
    ratios = [f[1] / p[1] for f, p in zip(times["fast"], times["pickle.load"])]
    summary = {
        "records": args.records, "pickle_bytes": size,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "load_average_after": os.getloadavg()[0],
        "cpu_seconds": {name: [round(c, 3) for _, c in ts] for name, ts in times.items()},
        "wall_seconds": {name: [round(w, 3) for w, _ in ts] for name, ts in times.items()},
        "fast_over_pickle_load_cpu": {"median": round(statistics.median(ratios), 2), "best": round(min(ratios), 2),
                                      "best_over_best": round(min(c for _, c in times["fast"])
                                                              / min(c for _, c in times["pickle.load"]), 2)},
        "pure_over_pickle_load_cpu": round(min(c for _, c in times["pure"]) / min(c for _, c in times["pickle.load"]),
                                           1) if times["pure"] else None,
        "peak_rss_over_imported_bytes": peaks,
    }
    print(f"fast / pickle.load in CPU time: median x{summary['fast_over_pickle_load_cpu']['median']}, best "
          f"x{summary['fast_over_pickle_load_cpu']['best']} (goal <= 2); pure x{summary['pure_over_pickle_load_cpu']}")
    print("peak RSS over the imported process: " + ", ".join(f"{name} {peak / 1e6:.1f} MB" for name, peak
                                                              in peaks.items()) + f", for a {size / 1e6:.1f} MB file")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")


def _load(path: Path) -> list:
    with open(path, "rb") as f:
        return pickle.load(f)


def _count(pickle_records, path: Path, reader: str) -> int:
    os.environ["NBLIB_PICKLE_READER"] = reader
    try:
        return sum(1 for _ in pickle_records(path))
    finally:
        os.environ.pop("NBLIB_PICKLE_READER")


def _timed(read) -> tuple[float, float, int]:
    wall, cpu = time.perf_counter(), time.process_time()
    n = read()
    return time.perf_counter() - wall, time.process_time() - cpu, n


def _peak(name: str, path: Path) -> int:
    """The peak RSS of a fresh process reading `path` one way, over its RSS once imported (bytes)."""
    done = subprocess.run([sys.executable, "-c", CHILD, name, str(path)], capture_output=True, text=True, check=True)
    _, before, peak = map(int, done.stdout.split())
    return peak - before


if __name__ == "__main__":
    main()
