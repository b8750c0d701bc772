"""nblib's in-order cache read against a bare pyarrow read of the same images, side by side, interleaved.

    python benchmarks/in_order_read.py                         # 400 sample texts at 224 px, 15 passes
    python benchmarks/in_order_read.py --images photo          # generated smooth images with noise
    python benchmarks/in_order_read.py --n 200 --passes 5 --out ''   # quick, nothing written

Builds the same N images (rendered sample texts, or `--images photo`: generated noisy colour fields that
barely compress; nothing downloaded)
four ways: an nblib cache with `raw` and with `zstd` (level 3, its trained dictionary when it pays:
nblib's default), and one Parquet file each uncompressed and with zstd level 3 (one fixed-size binary
row per image's H*W*3 pixel bytes, one row group: pyarrow's fastest layout, read without a copy).
Then, `--passes` times with the order rotated every pass, each run reads the whole set in order:

  nblib zstd before     the reader as it was: each image decompressed into a new bytes object,
                        then copied into its row (kept here only for this comparison)
  nblib zstd            the reader now: each image decompressed straight into its row of the batch
  nblib zstd, one batch get_batch(0, N): the whole set as one array, as pyarrow reads it
  pyarrow zstd          pq.read_table + np.frombuffer(...).reshape(N, H, W, 3): pyarrow decompresses
                        each page, nothing else (a read-only view of pyarrow's buffer)
  pyarrow zstd, malloc  the same with pyarrow's buffers from malloc (`pa.system_memory_pool()`), fresh
                        memory each pass as numpy's; pyarrow's default pool (mimalloc) keeps the last
                        pass's pages
  nblib raw, nblib raw one batch, pyarrow none: the same without compression
  floor: fill ...       new arrays of the batch size (and one of N) allocated and each byte written
                        once: what any read into fresh memory pays (page faults, the kernel's zeroing)

nblib runs open the cache each pass and read batches of `--batch` (what a training loop does) with
its default check (an xxh3 per image); pyarrow opens the file each pass. Like for like: the same
images, the same codec and level, numpy uint8 [n, H, W, 3] out, files in the page cache. Printed: the
median (min-max) images/s of each, the ratio nblib / pyarrow per pass (>= 1: nblib at least level) and
its median, bytes per image of each store at 64 px and at `--size`, and the load (/proc/loadavg);
written to `--out` as JSON.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PAIRS = {"zstd before / pyarrow zstd": ("nblib zstd before", "pyarrow zstd"),
         "zstd / pyarrow zstd": ("nblib zstd", "pyarrow zstd"),
         "zstd one batch / pyarrow zstd": ("nblib zstd, one batch", "pyarrow zstd"),
         "zstd one batch / pyarrow malloc": ("nblib zstd, one batch", "pyarrow zstd, malloc"),
         "raw / pyarrow none": ("nblib raw", "pyarrow none"),
         "raw one batch / pyarrow none": ("nblib raw, one batch", "pyarrow none")}


def before_cache_class():
    """ShardedImageCache with the packed read as it was before decompressing into the batch."""
    import xxhash
    import zstandard

    from nblib.cache import ShardedImageCache
    from nblib.cache.codecs import codec_for

    class BeforeCache(ShardedImageCache):
        def _copy_range(self, shard, lo, hi, out):
            if self.codec != "zstd":
                return super()._copy_range(shard, lo, hi, out)
            data, offsets, base, checksums = self._handle(shard)
            decompress, size = codec_for(self.spec).zstd_decompressor().decompress, self._image_bytes
            rows = out[: hi - lo].reshape(hi - lo, size)
            bounds = offsets[lo:hi + 1].tolist()
            expected = checksums[lo:hi].tolist() if self.check != "off" else None
            digest = xxhash.xxh3_64_intdigest
            for j in range(hi - lo):
                blob = data[base + bounds[j]: base + bounds[j + 1]]
                if expected is not None and digest(blob) != expected[j]:
                    raise self._corrupt(shard, lo + j, "its bytes do not match the shard's xxh3 table")
                try:
                    raw = decompress(blob, max_output_size=size)
                except zstandard.ZstdError as exc:
                    raise self._corrupt(shard, lo + j, f"its zstd bytes do not decode ({exc})") from None
                if len(raw) != size:
                    raise self._corrupt(shard, lo + j, f"it decodes to {len(raw):,} bytes, not {size:,}")
                rows[j] = memoryview(raw)

    return BeforeCache


def text_images(n: int, size: int, folder: Path) -> np.ndarray:
    """`n` sample texts rendered at `size` px by nblib's renderer (through a raw cache)."""
    from nblib.cache import ShardedImageCache, populate, sample_texts

    texts = folder / f"texts-{size}.txt"
    texts.write_text("".join(t.replace("\n", " ") + "\n" for t in sample_texts(n)))
    populate(texts, folder / f"render-{size}", image_size=size, codec="raw", workers=1, progress=False)
    return ShardedImageCache(folder / f"render-{size}").get_batch(0, n)


def photo_images(n: int, size: int, seed: int = 0) -> np.ndarray:
    """Smooth random colour fields (bilinear from 8x8) with +-6 of pixel noise: zstd barely shrinks
    them (about 1.02x), the worst case for a compressed cache against the text images' ~60x.
    """
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = np.empty((n, size, size, 3), np.uint8)
    for k in range(n):
        small = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
        smooth = np.asarray(small.resize((size, size), Image.BILINEAR), dtype=np.int16)
        out[k] = np.clip(smooth + rng.integers(-6, 7, smooth.shape), 0, 255)
    return out


def write_parquet(images: np.ndarray, path: Path, compression: str | None) -> None:
    """One fixed-size binary row per image (its H*W*3 bytes), plain encoding, one row group; zstd at level 3."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = pa.binary(images[0].nbytes)
    column = pa.FixedSizeBinaryArray.from_buffers(kind, len(images), [None, pa.py_buffer(images)])
    level = 3 if compression == "zstd" else None
    pq.write_table(pa.table({"image": column}), path, compression=compression or "none", compression_level=level,
                   use_dictionary=False, row_group_size=len(images))  # no dictionary: repeated images not folded


def build(images: np.ndarray, folder: Path) -> dict[str, Path]:
    """The four stores of `images` under `folder`."""
    from nblib.cache import write_images

    stores = {"nblib raw": folder / "raw", "nblib zstd": folder / "zstd",
              "parquet none": folder / "none.parquet", "parquet zstd": folder / "zstd.parquet"}
    for codec in ("raw", "zstd"):
        write_images(list(images), stores[f"nblib {codec}"], codec=codec, progress=False)
    write_parquet(images, stores["parquet none"], None)
    write_parquet(images, stores["parquet zstd"], "zstd")
    return stores


def store_bytes(path: Path) -> int:
    """A file's bytes, or a cache folder's (shards and manifest; the local stat cache left out)."""
    from nblib.cache import STAT_CACHE

    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.iterdir() if p.name != STAT_CACHE)


def readers(stores: dict[str, Path], n: int, batch: int) -> dict:
    """Each run: read the whole set in order into numpy uint8 [n, H, W, 3] batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nblib.cache import ShardedImageCache

    before = before_cache_class()

    def nblib(folder, kind=ShardedImageCache, step=batch):
        def run():
            cache = kind(folder)
            for first in range(0, n, step):
                cache.get_batch(first, min(n, first + step))
        return run

    def pyarrow(path, pool=None):
        def run():
            if pool is None:
                return view(pq.read_table(path, columns=["image"]).column(0))
            default = pa.default_memory_pool()
            pa.set_memory_pool(pool)  # read_table takes no pool: swap the default for this run only
            try:
                return view(pq.read_table(path, columns=["image"]).column(0))
            finally:
                pa.set_memory_pool(default)
        return run

    def view(column):  # uint8 [n, H*W*3] over pyarrow's buffer, no copy
        chunk = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        item = chunk.type.byte_width
        flat = np.frombuffer(chunk.buffers()[1], np.uint8, count=(chunk.offset + len(chunk)) * item)
        return flat[chunk.offset * item:].reshape(len(chunk), -1)

    def fill_fresh(step):  # the floor of a read into new arrays: allocate, write every byte once
        def run():
            for first in range(0, n, step):
                np.empty((min(n, first + step) - first, *shape), np.uint8).fill(1)
        return run

    shape = ShardedImageCache(stores["nblib raw"]).shape
    zstd, raw = stores["nblib zstd"], stores["nblib raw"]
    return {"nblib zstd before": nblib(zstd, before), "nblib zstd": nblib(zstd),
            "nblib zstd, one batch": nblib(zstd, step=n), "pyarrow zstd": pyarrow(stores["parquet zstd"]),
            "pyarrow zstd, malloc": pyarrow(stores["parquet zstd"], pa.system_memory_pool()),
            "nblib raw": nblib(raw), "nblib raw, one batch": nblib(raw, step=n),
            "pyarrow none": pyarrow(stores["parquet none"]),
            "floor: fill fresh batches": fill_fresh(batch), "floor: fill one fresh batch": fill_fresh(n)}


def check_same(runs: dict, stores: dict, images: np.ndarray) -> None:
    """Every store reads back the images, byte for byte (before timing anything)."""
    from nblib.cache import ShardedImageCache

    n = len(images)
    for name in ("nblib raw", "nblib zstd"):
        assert np.array_equal(ShardedImageCache(stores[name]).get_batch(0, n), images), name
    for name in ("pyarrow zstd", "pyarrow zstd, malloc", "pyarrow none"):
        assert runs[name]().tobytes() == images.tobytes(), name
    assert np.array_equal(before_cache_class()(stores["nblib zstd"]).get_batch(0, n), images)


def interleaved(runs: dict, passes: int) -> dict[str, list[float]]:
    """Seconds per run, `passes` times, the order rotated every pass."""
    names, seconds = list(runs), {name: [] for name in runs}
    for p in range(passes):
        for name in names[p % len(names):] + names[:p % len(names)]:
            start = time.perf_counter()
            runs[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=400)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--images", choices=("text", "photo"), default="text")
    parser.add_argument("--out", default="benchmarks/results/in_order_read_224.json", help="'' writes nothing")
    args = parser.parse_args()

    import pyarrow
    import zstandard

    root = Path(tempfile.mkdtemp(prefix="nblib-in-order-"))
    atexit.register(shutil.rmtree, root, True)
    load_before = loadavg()
    per_image = {}
    for size in sorted({64, args.size}):
        images = text_images(args.n, size, root) if args.images == "text" else photo_images(args.n, size)
        stores = build(images, root / f"stores-{size}")
        per_image[size] = {name: store_bytes(path) / args.n for name, path in stores.items()}
        per_image[size]["zstd cache / parquet zstd"] = per_image[size]["nblib zstd"] / per_image[size]["parquet zstd"]
    runs = readers(stores, args.n, args.batch)
    check_same(runs, stores, images)
    seconds = interleaved(runs, args.passes)
    load_after = loadavg()

    rates = {name: [args.n / s for s in values] for name, values in seconds.items()}
    ratios = {label: [a / b for a, b in zip(seconds[den], seconds[num])] for label, (num, den) in PAIRS.items()}
    print(f"{args.n} {args.images} images at {args.size} px, {args.passes} interleaved passes (rotated), "
          f"batches of {args.batch}; load before {load_before} / after {load_after}")
    print(f"zstandard {zstandard.__version__}, pyarrow {pyarrow.__version__}, cpus {os.cpu_count()}")
    print(f"{'run':<30}{'images/s median':>16}  (min-max)")
    for name, values in rates.items():
        s = spread(values)
        print(f"{name:<30}{s['median']:>16,.0f}  ({s['min']:,.0f}-{s['max']:,.0f})")
    print("nblib / pyarrow per pass (images/s over images/s, >= 1: nblib at least level):")
    for label, values in ratios.items():
        s = spread(values)
        print(f"  {label:<32} median {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}): "
              + " ".join(f"{v:.2f}" for v in values))
    print("bytes per image: " + "; ".join(
        f"{size} px " + ", ".join(f"{k} {v:,.0f}" if "/" not in k else f"{k} {v:.2f}x" for k, v in row.items())
        for size, row in per_image.items()))
    if args.out:
        record = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "n": args.n, "size": args.size, "images": args.images, "batch": args.batch, "passes": args.passes,
                  "load_before": load_before, "load_after": load_after, "cpus": os.cpu_count(),
                  "zstandard": zstandard.__version__, "pyarrow": pyarrow.__version__,
                  "images_per_s": {k: {**spread(v), "passes": v} for k, v in rates.items()},
                  "nblib_over_pyarrow": {k: {**spread(v), "passes": v} for k, v in ratios.items()},
                  "bytes_per_image": {str(k): v for k, v in per_image.items()}}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
