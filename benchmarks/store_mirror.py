"""How long does the caller wait on Drive? DurableStore's background mirror against a synchronous one.

A loop of "compute a part, write it" (the shape of an encode run) is timed three ways:
  local only     write_part with no mirror (the floor)
  sync mirror    write_part, then flush() each time: the caller waits for every copy
  async mirror   write_part only; the mirror thread copies while the next part computes
The mirror target is a real folder behind a throttle (MB/s and per-call latency, like a Drive
FUSE mount), or a real Drive folder with --mirror DIR --no-throttle in Colab. It also prints
write_part's cost over a bare np.save (sha256 while writing + part.json + fsync).

    python benchmarks/store_mirror.py [--parts 12] [--part-mb 16] [--compute-s 0.3]
                                      [--mirror-mbps 60] [--latency-ms 5] [--mirror DIR]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nblib.store import DurableStore, FileOps  # noqa: E402


class ThrottledOps(FileOps):
    """Real mirror calls slowed to `mbps` for writes (4x for reads) plus `latency_s` per call."""

    def __init__(self, mbps: float, latency_s: float):
        self.rate, self.latency_s = mbps * 1e6, latency_s

    def open(self, path, mode="rb"):
        time.sleep(self.latency_s)
        return _ThrottledFile(super().open(path, mode), self.rate if "b" in mode and "r" not in mode else 4 * self.rate)

    def write_atomic(self, path, blocks, expect_digest=None, **options):
        time.sleep(self.latency_s)
        return super().write_atomic(path, self._throttled(blocks), expect_digest, **options)

    def _throttled(self, blocks):
        for block in blocks:
            time.sleep(memoryview(block).nbytes / self.rate)
            yield block

    def replace(self, src, dst):
        time.sleep(self.latency_s)
        super().replace(src, dst)

    def stat(self, path):
        time.sleep(self.latency_s)
        return super().stat(path)

    def listdir(self, path):
        time.sleep(self.latency_s)
        return super().listdir(path)


class _ThrottledFile:
    def __init__(self, f, rate: float):
        self.f, self.rate = f, rate

    def write(self, data):
        time.sleep(len(data) / self.rate)
        return self.f.write(data)

    def read(self, *args):
        data = self.f.read(*args)
        time.sleep(len(data) / self.rate)
        return data

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def run_loop(store: DurableStore, parts: list[dict], compute_s: float, sync: bool) -> dict:
    """Time the caller's loop: compute (sleep), write_part, and flush() each part when `sync`."""
    waits, lags = [], []
    start = time.perf_counter()
    for i, arrays in enumerate(parts):
        time.sleep(compute_s)                    # the GPU computing the next part
        t = time.perf_counter()
        store.write_part(f"part-{i:06d}", arrays)
        if sync:
            store.flush()
        waits.append(time.perf_counter() - t)
        lags.append(store.mirror_lag)
    loop_s = time.perf_counter() - start
    store.flush()
    return {"wait_s": float(np.mean(waits)), "loop_s": loop_s,
            "end_to_end_s": time.perf_counter() - start, "max_lag": max(lags)}


def bare_np_save_s(folder: Path, parts: list[dict]) -> float:
    """Seconds per part for np.save + fsync of the same arrays (durable, but no sha256, no record)."""
    start = time.perf_counter()
    for i, arrays in enumerate(parts):
        (folder / f"p{i}").mkdir(parents=True)
        for key, arr in arrays.items():
            with open(folder / f"p{i}" / f"{key}.npy", "wb") as f:
                np.save(f, arr)
                f.flush()
                os.fsync(f.fileno())
    return (time.perf_counter() - start) / len(parts)


def sha256_s(parts: list[dict]) -> float:
    """Seconds per part to sha256 the arrays' bytes in memory (write_part hashes while writing)."""
    start = time.perf_counter()
    for arrays in parts:
        for arr in arrays.values():
            hashlib.sha256(arr.data).hexdigest()
    return (time.perf_counter() - start) / len(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=int, default=12)
    ap.add_argument("--part-mb", type=float, default=16.0)
    ap.add_argument("--compute-s", type=float, default=0.3)
    ap.add_argument("--mirror-mbps", type=float, default=60.0)
    ap.add_argument("--latency-ms", type=float, default=5.0)
    ap.add_argument("--mirror", type=Path, default=None, help="a real mirror folder (e.g. on Drive)")
    ap.add_argument("--no-throttle", action="store_true")
    args = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    n = int(args.part_mb * 1e6 / 2)
    parts = [{"sketches": rng.standard_normal(n, dtype=np.float32).astype(np.float16)} for _ in range(args.parts)]
    mb = parts[0]["sketches"].nbytes / 1e6
    ops = FileOps() if args.no_throttle else ThrottledOps(args.mirror_mbps, args.latency_ms / 1e3)
    target = ("real folder" if args.no_throttle
              else f"throttled to {args.mirror_mbps:g} MB/s, {args.latency_ms:g} ms/call")
    print(f"{args.parts} parts x {mb:.1f} MB, {args.compute_s:g} s compute per part, mirror {target}")

    root = Path(tempfile.mkdtemp(prefix="store-bench-"))
    mirror_root = args.mirror if args.mirror is not None else root / "mirror"
    try:
        bare = bare_np_save_s(root / "bare", parts)
        hashing = sha256_s(parts)
        results = {}
        for label, mirrored, sync in (("local only", False, False), ("sync mirror", True, True),
                                      ("async mirror", True, False)):
            mirror = mirror_root / label.replace(" ", "-") if mirrored else None
            with DurableStore(root / label.replace(" ", "-"), mirror, _ops=ops) as store:
                results[label] = run_loop(store, parts, args.compute_s, sync)
        local_write = results["local only"]["wait_s"]
        print(f"\nwrite_part         {local_write * 1e3:7.1f} ms/part ({mb / local_write:5.0f} MB/s)\n"
              f"np.save + fsync    {bare * 1e3:7.1f} ms/part ({mb / bare:5.0f} MB/s)   "
              f"write_part / this = x{local_write / bare:.2f}\n"
              f"sha256 alone       {hashing * 1e3:7.1f} ms/part ({mb / hashing:5.0f} MB/s)   "
              f"(write_part - np.save+fsync) / sha256 = {(local_write - bare) / hashing:.2f}")
        sync_wait = results["sync mirror"]["wait_s"]
        print(f"\n{'strategy':<14}{'caller wait/part':>18}{'loop':>10}{'end to end':>12}{'max lag':>9}"
              f"{'wait vs sync':>14}")
        for label, r in results.items():
            print(f"{label:<14}{r['wait_s'] * 1e3:>15.1f} ms{r['loop_s']:>9.2f}s{r['end_to_end_s']:>11.2f}s"
                  f"{r['max_lag']:>9d}{r['wait_s'] / sync_wait:>13.2f}x")
        compute = args.parts * args.compute_s
        print(f"\npure compute {compute:.2f} s; async loop overhead over compute: "
              f"x{results['async mirror']['loop_s'] / compute:.2f}, "
              f"sync: x{results['sync mirror']['loop_s'] / compute:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if args.mirror is not None:
            for label in ("sync-mirror", "async-mirror"):
                shutil.rmtree(args.mirror / label, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
