"""Notebook 02's side-by-side of storage formats: nblib raw, zlib, zstd and PNG shards against Parquet+zstd.

`compare_formats` writes the same in-memory images in each format, then reads them back in
order and at random, `repeats` times with the order of the formats rotated every repeat (so
a slow minute of a shared machine does not land on one format), and reports the median and the
spread (min-max) of each rate; `formats_verdict` judges each format against a reference on the
runs of the same repeat, in pairs (`nblib.verdict`). Like for like: the same images, the same batch size, arrays in and
arrays out (Parquet rows are decoded to uint8 arrays, as a training loop needs them), every file
fsynced. Parquet gets its fastest layout (raw pixel bytes per row, zstd across the column chunk).
`benchmarks/cache_throughput.py` prints the table, and the cost of the per-image xxh3 check.
"""
from __future__ import annotations

import functools
import os
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from nblib.cache import ShardedImageCache, write_images
from nblib.compare import rounds
from nblib.verdict import MAX_PAIRS, MIN_PAIRS, verdict_of_pairs

NBLIB_CODECS = ("raw", "zlib", "zstd", "png")
PARQUET = "parquet+zstd"
MIN_READ_S = 0.1          # a write or an in-order read is timed over passes that last this long at least


def compare_formats(images: np.ndarray, folder: str | Path, *, formats: Sequence[str] = (*NBLIB_CODECS, PARQUET),
                    repeats: int = MIN_PAIRS, shard_mb: float = 8.0, batch_size: int = 64, n_random: int = 200,
                    random_s: float = 0.5, seed: int = 0, reference: str | None = None,
                    budget_s: float | None = None, max_repeats: int = MAX_PAIRS,
                    min_read_s: float = MIN_READ_S, progress: bool = True) -> list[dict]:
    """One row per format: bytes/image, and the median and spread of write, in-order and random images/s.

    Random reads stop after `n_random` images or `random_s` seconds, whichever comes first (a
    Parquet random read decodes a whole row group). A write and an in-order read are each timed
    over as many passes as last `min_read_s` (a pass over a small cache takes milliseconds: one
    time slice of a busy CPU would be the whole measurement). With `reference` and `budget_s`, more repeats
    run after the first `repeats` while a rate of some format against the reference is undecided
    (`PairedVerdict.undecided`), for at most `budget_s` seconds and `max_repeats` repeats: what the
    budget cannot decide stays "not distinguishable here". `progress` shows the suite's bar over the first repeats'
    runs, then a second bar, with no total (the verdicts decide how many), over the added repeats' runs.
    """
    images = np.ascontiguousarray(images, dtype=np.uint8)
    folder = Path(folder)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(images), size=min(n_random, 4 * len(images)))
    samples: dict[str, dict[str, list[float]]] = {f: {"write": [], "in_order": [], "random": []} for f in formats}
    sizes: dict[str, int] = {}

    def undecided() -> bool:
        """A rate of some format against `reference` is undecided: more repeats could change its call."""
        base = samples.get(reference)
        return base is not None and any(verdict_of_pairs(base[key], runs[key]).undecided
                                        for fmt, runs in samples.items() if fmt != reference for key in runs)

    rounds(functools.partial(_one_repeat, samples, sizes, images, folder, formats, picks, shard_mb, batch_size,
                             random_s, min_read_s), repeats, len(formats), "formats", undecided,
           budget_s=budget_s, max_repeats=max_repeats, progress=progress)
    rows = []
    for fmt in formats:
        row = {"format": fmt, "bytes_per_image": sizes[fmt] / len(images)}
        for key, values in samples[fmt].items():
            row[f"{key}_per_s"] = statistics.median(values)
            row[f"{key}_spread"] = (min(values), max(values))
            row[f"{key}_runs"] = tuple(values)       # in repeat order: the i-th runs of two formats are a pair
        rows.append(row)
    return rows


def _one_repeat(samples: dict, sizes: dict, images: np.ndarray, folder: Path, formats: Sequence[str],
                picks: np.ndarray, shard_mb: float, batch_size: int, random_s: float, min_read_s: float, r: int,
                bar) -> None:
    """Repeat `r` of `compare_formats`: every format written, read in order and at random, rotated by `r`."""
    order = list(formats[r % len(formats):]) + list(formats[:r % len(formats)])
    for fmt in order:
        target = folder / f"{fmt}-{r}"
        shutil.rmtree(target, ignore_errors=True)
        samples[fmt]["write"].append(_write_rate(fmt, images, target, shard_mb, batch_size, min_read_s))
        _, read_in_order, read_at = _functions(fmt, images, target, shard_mb, batch_size)
        sizes[fmt] = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
        samples[fmt]["in_order"].append(_rate(read_in_order, len(images), min_read_s))
        read_one = read_at()  # opened before the clock starts, as a loader opens once
        start_random = time.perf_counter()
        done = _until(start_random + random_s, picks, read_one)
        samples[fmt]["random"].append(done / (time.perf_counter() - start_random))
        shutil.rmtree(target, ignore_errors=True)
        bar.update(1)


def format_table(rows: list[dict]) -> str:
    """The side-by-side as text: bytes/image, x smaller than raw, and each rate with its spread."""
    raw = next((r["bytes_per_image"] for r in rows if r["format"] == "raw"), None)
    lines = [f"{'format':<13}{'bytes/img':>10}{'vs raw':>8}  {'write img/s':>22}  {'in-order img/s':>22}  "
             f"{'random img/s':>22}"]
    for r in rows:
        cells = [f"{r[k + '_per_s']:>8,.0f} ({r[k + '_spread'][0]:,.0f}-{r[k + '_spread'][1]:,.0f})"
                 for k in ("write", "in_order", "random")]
        ratio = f"{raw / r['bytes_per_image']:>7.1f}x" if raw else ""
        lines.append(f"{r['format']:<13}{r['bytes_per_image']:>10,.0f}{ratio:>8}  " +
                     "  ".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def formats_verdict(rows: list[dict], reference: str = "zlib") -> list[str]:
    """One line per format against `reference`: bytes ratio, and each rate faster, slower or not distinguishable.

    The rates of one repeat are a pair (the formats ran back to back, in rotated order), judged by
    `nblib.verdict.verdict_of_pairs`: faster or slower only when the 95% interval of
    the median pair ratio lies wholly beyond the minimum effect (1.15x either way).
    """
    by = {r["format"]: r for r in rows}
    base = by[reference]
    lines = []
    for fmt, row in by.items():
        if fmt == reference:
            continue
        parts = [f"{fmt}: {row['bytes_per_image'] / base['bytes_per_image']:.2f}x the bytes of {reference}"]
        for key, label in (("write", "writes"), ("in_order", "reads in order"), ("random", "reads at random")):
            v = verdict_of_pairs(base[f"{key}_runs"], row[f"{key}_runs"], (reference, fmt))
            parts.append(f"{label} {v.short('faster', 'slower')}")
        lines.append("\n    ".join(parts))
    return lines


# ====================================================================================== helpers


def _rate(fn: Callable[[], object], n: int, min_s: float) -> float:
    """`n` items per call of `fn`, timed over as many calls (at least one) as last `min_s` seconds."""
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return n * calls / elapsed


def _write_rate(fmt: str, images: np.ndarray, target: Path, shard_mb: float, batch_size: int,
                min_s: float) -> float:
    """Images/s writing `images` to `target`, then to fresh sibling folders (removed) until `min_s` of writing."""
    calls, elapsed = 0, 0.0
    while True:
        where = target if calls == 0 else target.with_name(f"{target.name}-w{calls}")
        shutil.rmtree(where, ignore_errors=True)
        elapsed += _seconds(_functions(fmt, images, where, shard_mb, batch_size)[0])
        if calls:
            shutil.rmtree(where, ignore_errors=True)
        calls += 1
        if elapsed >= min_s:
            return len(images) * calls / elapsed


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _until(deadline: float, indexes, read) -> int:
    """Read images at `indexes` until the deadline (at least one); how many were read."""
    done = 0
    for i in indexes:
        read(int(i))
        done += 1
        if time.perf_counter() > deadline:
            break
    return done


def _functions(fmt: str, images: np.ndarray, target: Path, shard_mb: float, batch_size: int):
    """(write, read in order, open for random reads -> read one) for one format over `target`."""
    if fmt == PARQUET:
        return _parquet_functions(images, target, shard_mb, batch_size)

    def write():
        write_images(images, target, shard_mb=shard_mb, codec=fmt, progress=False)

    def in_order():
        cache = ShardedImageCache(target)
        for first in range(0, len(cache), batch_size):
            cache.get_batch(first, min(len(cache), first + batch_size))

    def read_at():
        cache = ShardedImageCache(target)
        return cache.__getitem__

    return write, in_order, read_at


def _parquet_functions(images: np.ndarray, target: Path, shard_mb: float, batch_size: int):
    """Parquet with zstd, one row group per ~shard_mb: each row an image's raw pixel bytes.

    The fastest Parquet layout we found for images (a fixed-size binary column, built and read
    without copies; `nblib.export` writes the datasets-friendly Array3D instead, slower to build).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = len(images)
    item = images[0].nbytes
    per_group = max(1, int(shard_mb * 1e6) // item)
    path = target / "images.parquet"
    kind = pa.binary(item)

    def write():
        target.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            writer = pq.ParquetWriter(f, pa.schema([("image", kind)]), compression="zstd")
            for start in range(0, n, per_group):
                chunk = images[start:start + per_group]
                column = pa.FixedSizeBinaryArray.from_buffers(kind, len(chunk), [None, pa.py_buffer(chunk)])
                writer.write_table(pa.table({"image": column}), row_group_size=len(chunk))
            writer.close()
            f.flush()
            os.fsync(f.fileno())

    def as_images(column) -> np.ndarray:
        column = column.combine_chunks() if hasattr(column, "combine_chunks") else column
        flat = np.frombuffer(column.buffers()[1], dtype=np.uint8, count=(column.offset + len(column)) * item)
        return flat[column.offset * item:].reshape(len(column), *images.shape[1:]).copy()

    def in_order():
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size, columns=["image"]):
            as_images(batch.column(0))

    def read_at():
        parquet = pq.ParquetFile(path)

        def one(i):
            group, row = divmod(i, per_group)
            return as_images(parquet.read_row_group(group, columns=["image"]).column(0).slice(row, 1))[0]

        return one

    return write, in_order, read_at
