"""Why pyarrow reads the Parquet export faster in order than nblib's zstd cache reads itself, measured.

    python benchmarks/export_read_gap.py                  # 4,000 sample texts at 64 px
    python benchmarks/export_read_gap.py --n 2000 --size 224 --rounds 5

Builds a zstd cache (nblib's default: level 3, a 16 KB trained dictionary, one zstd frame per
image, an xxh3 per image) and its Parquet export (one zstd column chunk per shard), then runs,
interleaved in rotated order for `--rounds` rounds, and prints the median and spread of each:

  cache in order     ShardedImageCache.iter_shards (per image: xxh3 check, dictionary decompress)
  parquet in order   pq.read_table per file, pixels taken zero-copy from the blob column
  per-image parts    over the cache's own blobs: the xxh3 loop alone; the decompress loop alone
                     (with the dictionary); the same images as dictionary-less frames; all of a
                     shard's images as one zstd frame (what Parquet decompresses)
  random reads       one image at a random index: cache get_batch(i, i+1) against pyarrow reading
                     the row group that holds it (Parquet has no per-row access inside a group)

and bytes per image of each. The gap is the sum of per-image costs (a Python-level call per
image, a frame header and a dictionary reference per frame, an xxh3 per image) against one call
per 12 KB x images-per-shard; see the printed breakdown.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4000)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--shard-mb", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--random", type=int, default=300, help="random reads per round")
    args = parser.parse_args()

    import pyarrow.parquet as pq
    import xxhash
    import zstandard

    from nblib.cache import ShardedImageCache, populate, sample_texts
    from nblib.cache.codecs import codec_for
    from nblib.export import export_cache

    root = Path(tempfile.mkdtemp(prefix="nblib-gap-"))
    texts = root / "texts.txt"
    texts.write_text("".join(t.replace("\n", " ") + "\n" for t in sample_texts(args.n)))
    populate(texts, root / "cache", image_size=args.size, shard_mb=args.shard_mb, codec="zstd", progress=False)
    export_cache(root / "cache", root / "parquet")
    cache = ShardedImageCache(root / "cache")
    n, shards = len(cache), cache.manifest["shards"]
    files = sorted((root / "parquet").glob("*.parquet"))
    shape = cache.shape
    coder = codec_for(cache.spec)

    blobs = []  # the cache's stored frames, per shard
    for k, entry in enumerate(shards):
        data, offsets, base, _ = cache._handle(k)
        blobs.append([bytes(data[base + int(offsets[i]): base + int(offsets[i + 1])]) for i in range(entry["count"])])
        cache.close(k)
    images = [cache.get_batch(e["start"], e["stop"]) for e in shards]
    plain = zstandard.ZstdCompressor(level=3)
    no_dict = [[plain.compress(im.tobytes()) for im in shard] for shard in images]
    one_frame = [plain.compress(shard.tobytes()) for shard in images]
    plain_d = zstandard.ZstdDecompressor()
    image_bytes = int(np.prod(shape))

    def cache_in_order():
        c = ShardedImageCache(root / "cache")
        for _ in c.iter_shards():
            pass

    def parquet_in_order():
        for f in files:
            t = pq.read_table(f, columns=["image"])
            col = t.column(0).combine_chunks()
            np.frombuffer(col.buffers()[1], np.uint8).reshape(len(col), *shape)

    def xxh3_loop():
        for shard in blobs:
            for b in shard:
                xxhash.xxh3_64_intdigest(b)

    def dict_decompress_loop():
        for shard in blobs:
            for b in shard:
                coder.decode(b, shape)

    def old_loop():  # the reader's per-image path before the zstd fast path: xxh3, decode, 3-d assign
        for shard, im in zip(blobs, images):
            out = np.empty_like(im)
            for k, b in enumerate(shard):
                xxhash.xxh3_64_intdigest(b)
                out[k] = coder.decode(b, shape)

    def bytes_loop():  # the reader until 2026-12: xxh3, decompress into a new bytes object, memcpy into the row
        decompress = coder.zstd_decompressor().decompress
        for shard, im in zip(blobs, images):
            rows = np.empty_like(im).reshape(len(im), -1)
            for k, b in enumerate(shard):
                xxhash.xxh3_64_intdigest(b)
                rows[k] = memoryview(decompress(b, max_output_size=image_bytes))

    def into_loop():  # the reader now: xxh3, decompress straight into the row (ImageCodec.decode_into)
        for shard, im in zip(blobs, images):
            rows = memoryview(np.empty_like(im)).cast("B")
            for k, b in enumerate(shard):
                xxhash.xxh3_64_intdigest(b)
                coder.decode_into(b, shape, rows[k * image_bytes:(k + 1) * image_bytes])

    def plain_frames_loop():
        for shard in no_dict:
            for b in shard:
                np.frombuffer(plain_d.decompress(b, max_output_size=image_bytes), np.uint8).reshape(shape)

    def one_frame_per_shard():
        for frame, shard in zip(one_frame, images):
            np.frombuffer(plain_d.decompress(frame, max_output_size=shard.nbytes), np.uint8)

    rng = np.random.default_rng(0)
    starts = np.array([e["start"] for e in shards])

    def cache_random():
        c = ShardedImageCache(root / "cache")
        for i in rng.integers(0, n, args.random):
            c.get_batch(int(i), int(i) + 1)

    parquet_files = [pq.ParquetFile(f) for f in files]

    def parquet_random():
        for i in rng.integers(0, n, max(1, args.random // 10)):  # a whole row group per read: slow
            k = int(np.searchsorted(starts, i, side="right") - 1)
            col = parquet_files[k].read_row_group(0, columns=["image"]).column(0).combine_chunks()
            np.frombuffer(col.buffers()[1], np.uint8).reshape(len(col), *shape)[int(i) - int(starts[k])]

    runs = {"cache in order": cache_in_order, "parquet in order": parquet_in_order,
            "  old per-image loop (numpy)": old_loop, "  bytes per-image loop (before)": bytes_loop,
            "  into-the-row loop (reader now)": into_loop,
            "  xxh3 per image": xxh3_loop, "  decompress per image (dict)": dict_decompress_loop,
            "  decompress per image (no dict)": plain_frames_loop, "  one frame per shard": one_frame_per_shard,
            "cache random": cache_random, "parquet random": parquet_random}
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(args.rounds):  # interleaved, rotated so no run always goes first
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(timed(runs[name]))

    cache_bytes = sum((root / "cache" / e["file"]).stat().st_size for e in shards)
    parquet_bytes = sum(f.stat().st_size for f in files)
    print(f"{n:,} images at {args.size} px in {len(shards)} shards; {args.rounds} interleaved rounds; "
          f"median (min-max) images/s")
    print(f"bytes/image: cache zstd {cache_bytes / n:,.0f}, parquet zstd {parquet_bytes / n:,.0f}, "
          f"raw {image_bytes:,}")
    for name in names:
        count = (max(1, args.random // 10) if name == "parquet random" else args.random) if "random" in name else n
        rates = [count / t for t in times[name]]
        print(f"{name:<34}{statistics.median(rates):>12,.0f}  ({min(rates):,.0f}-{max(rates):,.0f})")
    ratio = statistics.median(times["cache in order"]) / statistics.median(times["parquet in order"])
    print(f"parquet in order / cache in order: {ratio:.2f}x")
    per = {name: statistics.median(times[name]) / n * 1e6 for name in names if "random" not in name}
    print("per image, microseconds: " + ", ".join(f"{k.strip()} {v:.1f}" for k, v in per.items()))


if __name__ == "__main__":
    main()
