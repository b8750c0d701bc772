"""Cache population throughput: render images/s by worker count, shard write MB/s, codec costs.

    python benchmarks/cache_throughput.py                 # 2,000 sample texts at 224 px
    python benchmarks/cache_throughput.py --n 600 --size 64

    python benchmarks/cache_throughput.py --formats-only  # sections 4 and 5 only (64 and 224 px)

Prints five tables, measured figures and ratios side by side:
1. images/s populating a cache with 1 worker and with N workers, and the speed-up;
2. shard write MB/s (ShardWriter, an AtomicWriter: stream, sha256, fsync, rename) against `np.save` of the same
   bytes, plain and followed by fsync (the same durability), and the ratios;
3. per codec: stored bytes per image and decode images/s on one core (a compressed codec must
   decode >= 1,000 images/s per core, faster than a T4 encoder consumes them);
4. formats side by side at 64 and 224 px (nblib raw, zlib, zstd, PNG shards against Parquet+zstd):
   bytes per image, write, in-order and random read images/s, median of repeats run in rotated
   order with the spread (`nblib.lab.cache_formats.compare_formats`, what notebook 02 shows);
5. in-order raw reads with the per-image xxh3 check against unchecked, interleaved, and the ratio
   (target >= 0.8).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from nblib import cache
from nblib.cache import ShardedImageCache
from nblib.lab.cache_formats import compare_formats, format_table
from nblib.lab.cache_population import worker_scaling
from nblib.render import render_params, render_with

MIN_DECODE_PER_CORE = 1000


def render_scaling(texts, size: int, workers: int, folder: Path, shard_mb: float):
    """Populate the same texts with 1 and `workers` processes, 3 interleaved rounds (a lab Scaling)."""
    return worker_scaling(texts, sorted({1, workers}), folder, size, shard_mb, "raw", progress=False)


def write_speed(images: np.ndarray, folder: Path, repeats: int = 3) -> dict[str, float]:
    """Median MB/s: shard writer, np.save, np.save + fsync, over the same uint8 array."""
    blobs = [image.tobytes() for image in images]
    megabytes = images.nbytes / 1e6
    times = {"ShardWriter (sha256+fsync+rename)": [], "np.save": [], "np.save + fsync": []}
    for k in range(repeats):
        start = time.perf_counter()
        cache.write_shard(folder, k, 0, blobs, "raw", images.shape[1:])
        times["ShardWriter (sha256+fsync+rename)"].append(time.perf_counter() - start)
        start = time.perf_counter()
        np.save(folder / f"plain-{k}.npy", images)
        times["np.save"].append(time.perf_counter() - start)
        start = time.perf_counter()
        with open(folder / f"synced-{k}.npy", "wb") as f:
            np.save(f, images)
            f.flush()
            os.fsync(f.fileno())
        times["np.save + fsync"].append(time.perf_counter() - start)
        for path in folder.glob("*"):
            path.unlink()
    data = images.tobytes()
    hashing = []
    for _ in range(repeats):
        start = time.perf_counter()
        hashlib.sha256(data).digest()
        hashing.append(time.perf_counter() - start)
    speeds = {name: megabytes / statistics.median(t) for name, t in times.items()}
    return {**speeds, "sha256 alone (the writer's bound)": megabytes / statistics.median(hashing)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="texts to render (cycled from data/)")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--shard-mb", type=float, default=50.0)
    parser.add_argument("--write-images", type=int, default=600, help="images per timed shard write")
    parser.add_argument("--formats-only", action="store_true", help="only sections 4 and 5")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of sections 4 and 5")
    args = parser.parse_args(argv)
    if args.formats_only:
        return formats_side_by_side(args.repeats)

    texts = cache.sample_texts(args.n)
    params = render_params(args.size)
    cores = len(os.sched_getaffinity(0))
    print(f"machine: {cores} cores available, load average {os.getloadavg()[0]:.1f}; "
          f"{args.n:,} texts at {args.size} px\n")

    with tempfile.TemporaryDirectory(prefix="cache-bench-") as tmp:
        tmp = Path(tmp)
        print("1. render throughput (populate, raw codec)")
        scaling = render_scaling(texts, args.size, args.workers, tmp / "scaling", args.shard_mb)
        print("   " + scaling.table().replace("\n", "\n   "))
        print(f"   verdict: {scaling.verdict}")

        sample = np.stack([render_with(texts[i % len(texts)], params) for i in range(args.write_images)])
        (tmp / "write").mkdir()
        speeds = write_speed(sample, tmp / "write")
        print(f"\n2. shard write, {sample.nbytes / 1e6:,.0f} MB of raw images (median of 3)")
        for name, mbps in speeds.items():
            print(f"   {name:<36} {mbps:9,.0f} MB/s")
        writer = speeds["ShardWriter (sha256+fsync+rename)"]
        print(f"   ratio ShardWriter / np.save + fsync  {writer / speeds['np.save + fsync']:9.2f}"
              f"   (same durability; target >= 0.8)")
        print(f"   ratio ShardWriter / np.save          {writer / speeds['np.save']:9.2f}"
              f"   (np.save leaves the bytes in the page cache, unsynced)")

    stats = cache.measure_codecs(list(sample[:200]), min_seconds=1.0)
    raw_bytes = stats["raw"]["bytes_per_image"]
    print(f"\n3. codecs over {min(200, len(sample))} rendered images at {args.size} px (decode on one core)")
    print(f"   {'codec':<6}{'bytes/image':>13}{'x smaller':>11}{'decode img/s':>15}  >= {MIN_DECODE_PER_CORE:,}/s/core")
    for codec, s in stats.items():
        ok = "yes" if s["decode_images_per_s"] >= MIN_DECODE_PER_CORE else "NO"
        print(f"   {codec:<6}{s['bytes_per_image']:>13,.0f}{raw_bytes / s['bytes_per_image']:>11.1f}"
              f"{s['decode_images_per_s']:>15,.0f}  {ok}")
    full = 1_907_747
    print("\n   at 1,907,747 images: " + ", ".join(
        f"{codec} {full * s['bytes_per_image'] / 1e9:,.1f} GB" for codec, s in stats.items()))
    return formats_side_by_side(args.repeats)


def formats_side_by_side(repeats: int) -> int:
    """Sections 4 and 5: formats at 64 and 224 px; checked against unchecked in-order raw reads."""
    with tempfile.TemporaryDirectory(prefix="cache-formats-") as tmp:
        tmp = Path(tmp)
        for size, n in ((64, 2000), (224, 500)):
            params = render_params(size)
            images = np.stack([render_with(t, params) for t in cache.sample_texts(n)])
            print(f"\n4. formats side by side: {n:,} sample texts at {size} px, {repeats} repeats in rotated "
                  f"order, median (min-max); random reads stop after 0.5 s")
            rows = compare_formats(images, tmp / f"formats-{size}", repeats=repeats, shard_mb=50,
                                   n_random=2000, random_s=0.5)
            print("   " + format_table(rows).replace("\n", "\n   "))
            size_of = {r["format"]: r["bytes_per_image"] for r in rows}
            in_order = {r["format"]: r["in_order_per_s"] for r in rows}
            print(f"   zstd / zlib bytes {size_of['zstd'] / size_of['zlib']:.2f}; parquet+zstd / zstd bytes "
                  f"{size_of['parquet+zstd'] / size_of['zstd']:.2f}; zstd / parquet+zstd in-order "
                  f"{in_order['zstd'] / in_order['parquet+zstd']:.1f}x")
            folder = tmp / f"raw-{size}"
            cache.write_images(images, folder, shard_mb=50, progress=False)
            ratio = checked_read_ratio(folder, repeats=2 * repeats + 1)
            print(f"\n5. in-order raw reads at {size} px, xxh3 per image on / off, {ratio['repeats']} interleaved "
                  f"pairs: {ratio['checked_per_s']:,.0f} / {ratio['unchecked_per_s']:,.0f} images/s, ratio "
                  f"{ratio['ratio']:.2f} (pairs {ratio['ratio_spread'][0]:.2f}-{ratio['ratio_spread'][1]:.2f}; "
                  f"target >= 0.8)")
    return 0


def checked_read_ratio(cache_dir: str | Path, repeats: int = 5, batch_size: int = 64) -> dict:
    """In-order images/s with the per-image xxh3 check ("image") and without ("off"), interleaved.

    Each repeat times both, in alternating order; the ratio is the median of the repeats'
    checked/unchecked ratios (a slow moment of the machine hits both halves of a pair), with
    their spread (min, max).
    """
    rates: dict[str, list[float]] = {"image": [], "off": []}
    for r in range(repeats):
        for check in (("image", "off") if r % 2 == 0 else ("off", "image")):
            cache = ShardedImageCache(cache_dir, check=check)
            n = len(cache)
            start = time.perf_counter()
            for first in range(0, n, batch_size):
                cache.get_batch(first, min(n, first + batch_size))
            rates[check].append(n / (time.perf_counter() - start))
            cache.close()
    pairs = [c / u for c, u in zip(rates["image"], rates["off"])]
    return {"checked_per_s": statistics.median(rates["image"]), "unchecked_per_s": statistics.median(rates["off"]),
            "ratio": statistics.median(pairs), "ratio_spread": (min(pairs), max(pairs)), "repeats": repeats}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
