"""Disk a job needs: the image cache per codec, the parts of an encode run, shards; and the check.

`cache_bytes` sizes the image cache (the cache module calls it with its measured bytes per image);
`choose_codec` is the one codec rule (the fastest-decoding codec whose cache fits; `by_decode_speed` is its
order, which the plan and the advice share), `cache_shards` counts its files; `run_writes` is what an encode
run writes, by item (the run's own check, `nblib.encode.disks.disk_needs`, and the plan's `disk_lines` both
itemize it: a plan and its run agree), `uploaded_bytes` what a plan sends to Drive;
`plan_shards` splits a big file so one shard at a time fits in RAM; `check_disk` refuses, with
the numbers, what does not fit a folder's free disk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from nblib.budget._checks import require_positive
from nblib.budget.memory import Line, output_bytes_per_image
from nblib.budget.resources import FIT_MARGIN, fits, room, shortfall_words
from nblib.config import PipelineConfig
from nblib.errors import BudgetExceeded, ConfigError, require_choice
from nblib.units import GB, MB, fmt_bytes, fmt_size

# Each codec of the cache's registry (nblib.cache.codecs.CODECS, nblib.config.CODECS: the same
# names) as stored bytes per image over raw, assumed until the cache measures a sample (measure
# with nblib.cache.measure_codecs and pass bytes_per_image). png 0.14 is the reference analysis
# (1,907,747 images at 224 px in ~40 GB of 287 GB raw); zlib lands a little worse (no row
# filters); zstd level 3 with a dictionary stored the sample texts 0.56x zlib's bytes at 224 px
# (0.09 of raw when scaled to the reference's 0.16).
CODEC_RATIO_ESTIMATE = {"raw": 1.0, "png": 0.14, "zlib": 0.16, "zstd": 0.09}
# Each codec's decode speed, images/s on one core, assumed until a sample is measured (codec_sizes or
# measure_codecs carry measured ones): nblib.cache.measure_codecs on 100 of this suite's sample texts at
# 224 px, on this project's CPU, 2026-11-27 (raw 87,381, zstd 12,090, zlib 4,950, png 1,500). Only their
# order is used: the one codec rule (`choose_codec`) prefers the fastest-decoding codec whose cache fits.
CODEC_DECODE_ESTIMATE = {"raw": 87_000, "zstd": 12_000, "zlib": 5_000, "png": 1_500}
# The codec of no cache at all: images rendered on the fly by the loader's workers
# (nblib.cache.rendered.RenderedImages), 0 bytes on any disk; plan_budget(cacheless=True) tries it.
NO_CACHE = "none"
NPY_HEADER_BYTES = 128
# The cache's record per image (nblib.cache.format writes these; it imports them from here)
OFFSET_BYTES = 8                    # one index entry per image (packed shards)
CHECKSUM_BYTES = 8                  # one xxh3-64 per image (every shard)
DISK_BLOCK = 4096          # an encode run's files are counted one 4 KiB block more each (part.json, headers, tails)


def cache_bytes(n_images: int, image_size: int, codec: str = "raw",
                bytes_per_image: float | None = None, *, shard_mb: int = 400) -> int:
    """Bytes an image cache takes: raw is n x H x W x 3 plus .npy headers per shard (0 for NO_CACHE)."""
    if codec == NO_CACHE:
        return 0
    require_positive("n_images", n_images)
    require_positive("image_size", image_size)
    require_positive("shard_mb", shard_mb)
    require_choice("codec", codec, tuple(CODEC_RATIO_ESTIMATE))
    if bytes_per_image is not None:
        require_positive("bytes_per_image", bytes_per_image, number=True)
        per_image = float(bytes_per_image)
    else:
        per_image = estimated_bytes_per_image(image_size, codec)
    data = n_images * per_image
    shards = max(1, math.ceil(data / (shard_mb * MB)))
    return int(math.ceil(data)) + shards * NPY_HEADER_BYTES


def estimated_bytes_per_image(image_size: int, codec: str) -> float:
    """Bytes per cached image when none was measured: raw's as the cache writes it, else the reference's ratio."""
    if codec == "raw":
        return raw_bytes_per_image(image_size)
    return image_size * image_size * 3 * CODEC_RATIO_ESTIMATE[codec]


def raw_bytes_per_image(image_size: int) -> float:
    """Bytes one image takes in a raw cache, as the cache writes it: H x W x 3 and its checksum
    (`stored_bytes_per_image`); what a measured raw size (CodecSizes) gives too.
    """
    return stored_bytes_per_image("raw", image_size * image_size * 3)


def stored_bytes_per_image(codec: str, blob_bytes: float) -> float:
    """Bytes one image takes in a cache shard (nblib.cache.format): its blob and checksum, plus an offsets entry
    when packed.
    """
    return float(blob_bytes) + CHECKSUM_BYTES + (0 if codec == "raw" else OFFSET_BYTES)


def cache_shards(config: PipelineConfig, *, codec: str | None = None,
                 bytes_per_image: float | None = None) -> int:
    """How many shard files the image cache of `config` is cut into (run.shard_mb each)."""
    r = config.run
    codec = codec or r.codec
    data = cache_bytes(r.n_samples, config.model.image_size, codec, bytes_per_image, shard_mb=r.shard_mb)
    return 0 if codec == NO_CACHE else max(1, math.ceil(data / (r.shard_mb * MB)))


def uploaded_bytes(config: PipelineConfig, *, codec: str | None = None,
                   bytes_per_image: float | None = None) -> int:
    """Bytes a plan uploads to Drive: the image cache and the mirror's copy of every part (`run_writes`); the
    consolidated outputs stay in the run folder. The same bytes as the budget's Drive peak: no temporary of a
    part in flight outlives its rename.
    """
    r = config.run
    cache = cache_bytes(r.n_samples, config.model.image_size, codec or r.codec, bytes_per_image,
                        shard_mb=r.shard_mb)
    return cache + run_writes(config)["mirrored parts"]


def by_decode_speed(codecs, decode_rates: dict[str, float] | None = None) -> list[str]:
    """`codecs`, fastest decoding first: the one codec rule's order (measured rates, else CODEC_DECODE_ESTIMATE).

    `choose_codec`, `plan_budget`, the advice and the refusals all order codecs by this, so the same job
    and the same sizes get one codec: the first of this order whose cache fits.
    """
    rates = {**CODEC_DECODE_ESTIMATE, **(decode_rates or {})}
    return sorted(codecs, key=lambda c: -float(rates.get(c, 0.0)))


def fastest_fitting(cache_sizes: dict[str, float], free_bytes: float, decode_rates: dict[str, float] | None = None,
                    margin: float = FIT_MARGIN) -> str | None:
    """The fastest-decoding codec whose cache (`cache_sizes`: codec -> bytes) fits `free_bytes`; None if none does."""
    return next((c for c in by_decode_speed(cache_sizes, decode_rates)
                 if fits(cache_sizes[c], free_bytes, margin)), None)


def smaller_codecs(codec: str, codec_sizes=None) -> list[str]:
    """The codecs whose cache is smaller than `codec`'s, in the one codec rule's order (`by_decode_speed`), sized
    by `codec_sizes` (an `nblib.codec_sizes.CodecSizes`, measured on the user's texts), else CODEC_RATIO_ESTIMATE.
    """
    stats = codec_stats(codec_sizes) if codec_sizes is not None else {}
    sizes = {c: s["bytes_per_image"] for c, s in stats.items()} or CODEC_RATIO_ESTIMATE
    return by_decode_speed([c for c in sizes if sizes[c] < sizes.get(codec, 0)],
                           {c: s["decode_images_per_s"] for c, s in stats.items()})


def codec_stats(codec_sizes) -> dict[str, dict[str, float]]:
    """{codec: {"bytes_per_image", "decode_images_per_s"}} of an `nblib.codec_sizes.CodecSizes` (the one shape
    codec sizes travel in); decode rates not measured are CODEC_DECODE_ESTIMATE's.
    """
    rates = {**CODEC_DECODE_ESTIMATE, **(codec_sizes.decode_images_per_s or {})}
    return {c: {"bytes_per_image": float(b), "decode_images_per_s": float(rates.get(c, 0.0))}
            for c, b in codec_sizes.bytes_per_image.items()}


def choose_codec(n_images: int, free_bytes: int, codec_sizes, margin: float = FIT_MARGIN) -> str:
    """The one codec rule: the fastest-decoding codec whose cache fits in free_bytes (`resources.fits`).

    `codec_sizes`: an `nblib.codec_sizes.CodecSizes`, or `nblib.cache.measure_codecs`' {codec: {"bytes_per_image",
    "decode_images_per_s"}} (what `cache --codec auto` measures: the cache may not import the CodecSizes above it).
    BudgetExceeded naming the smallest cache when none fits.
    """
    require_positive("n_images", n_images)
    stats = codec_stats(codec_sizes) if hasattr(codec_sizes, "bytes_per_image") else codec_sizes
    if not stats:
        raise ConfigError("codec_stats is empty; measure at least one codec with nblib.cache")
    sizes = {name: n_images * float(s["bytes_per_image"]) for name, s in stats.items()}
    choice = fastest_fitting(sizes, free_bytes, {c: s["decode_images_per_s"] for c, s in stats.items()}, margin)
    if choice is None:
        smallest = min(sizes, key=sizes.get)
        raise BudgetExceeded(
            f"no codec fits: the smallest cache ({smallest}) needs {sizes[smallest] / GB:.1f} GB "
            f"for {n_images:,} images, but {free_bytes / GB:.1f} GB is free "
            f"(room {room(free_bytes, margin) / GB:.1f} GB after a {margin:.0%} margin); render fewer images "
            f"(n_samples), a smaller image_size, or free disk")
    return choice


def size_source(codec: str, codec_sizes=None) -> str:
    """Where `codec`'s cache size comes from, as every plan, advice and refusal line says it (`codec_sizes`: an
    `nblib.codec_sizes.CodecSizes`, or None): "zstd 2,349 B/image measured on 300 texts of my.txt", "raw:
    exact", else the borrowed CODEC_RATIO_ESTIMATE, stated ("zstd at the estimated ratio 0.09 of raw, ...").
    """
    if codec == NO_CACHE:
        return "no image cache: the loader's workers render each image when it is read"
    if codec_sizes is not None and codec_sizes.measured and codec in codec_sizes.bytes_per_image:
        return f"{codec} {codec_sizes.bytes_per_image[codec]:,.0f} B/image {codec_sizes.source}"
    if codec == "raw":
        return "raw: exact"
    return (f"{codec} at the estimated ratio {CODEC_RATIO_ESTIMATE[codec]:.2f} of raw, not measured "
            "(the reference analysis' ratios: give texts to measure yours)")


def check_disk(folder: str | Path, need_bytes: int, *, what: str, knob) -> None:
    """Raise BudgetExceeded when `need_bytes` do not fit the free disk of `folder`'s filesystem
    (`resources.fits`: within 90% of it); the refusal says so, and how much more free disk fits it.

    `knob` is what to turn: words, or a function of the free bytes that computes the knobs with the
    values that fit (`nblib.budget.advice.closing_knobs`), called only when the check refuses.
    """
    from nblib.disk import disk_free, existing_parent

    path, free = existing_parent(folder), disk_free(folder)
    if not fits(need_bytes, free):
        turn = knob(free) if callable(knob) else knob
        raise BudgetExceeded(
            f"{what} needs {fmt_size(need_bytes)} but only {fmt_size(free)} is free on {path}: "
            f"{shortfall_words(need_bytes, free, 'free')}; {turn}")


def run_writes(config: PipelineConfig, *, samples: int | None = None, parts: int | None = None,
               n_samples: int | None = None, per_image: int | None = None, n_outputs: int | None = None,
               do_consolidate: bool = True) -> dict[str, int]:
    """What (the rest of) an encode run writes, by item: "parts still to encode" and "consolidated outputs" in
    the run folder (--out), "mirrored parts" in the mirror (--mirror), each file one `DISK_BLOCK` more.

    `samples` and `parts`: those still to encode (default: the whole run); `n_samples`: the run's, which the
    consolidated outputs hold; `per_image`, `n_outputs`: a model's own (default: the config's TRM outputs).
    The run checks it (`nblib.encode.disks.disk_needs`) and the plan prints it (`disk_lines`).
    """
    r = config.run
    per_image = output_bytes_per_image(config) if per_image is None else per_image
    outputs = len(r.outputs) if n_outputs is None else n_outputs
    n_samples = r.n_samples if n_samples is None else n_samples
    samples = n_samples if samples is None else samples
    parts = -(-r.n_batches // r.checkpoint_every) if parts is None else parts
    part_bytes = samples * per_image + parts * (outputs + 1) * DISK_BLOCK
    writes = {"parts still to encode": part_bytes}
    if do_consolidate:
        writes["consolidated outputs"] = n_samples * per_image + (outputs + 1) * DISK_BLOCK
    writes["mirrored parts"] = part_bytes
    return writes


def disk_lines(config: PipelineConfig, *, codec: str = "raw",
               bytes_per_image: float | None = None) -> tuple[tuple[Line, ...], tuple[Line, ...]]:
    """(local disk lines, Drive lines) of a cache + encode run: the image cache, and `run_writes`' items."""
    r = config.run
    per_image = output_bytes_per_image(config)
    n_parts = -(-r.n_batches // r.checkpoint_every)
    writes = run_writes(config)
    cache = cache_bytes(r.n_samples, config.model.image_size, codec, bytes_per_image,
                        shard_mb=r.shard_mb)
    parts = (f"{n_parts} parts: {r.n_samples:,} x {fmt_bytes(per_image)} ({'+'.join(r.outputs)}, {r.out_dtype}), "
             f"{DISK_BLOCK // 1024} KiB more a file")
    local = (
        Line("parts still to encode", writes["parts still to encode"], f"the run folder keeps every part: {parts}"),
        Line("consolidated outputs", writes["consolidated outputs"],
             "one .npy per output in the run folder at the end, while the parts still exist"),
    )
    drive = (
        Line(f"image cache ({codec})", cache,
             "no cache: the loader's workers render each image when it is read" if codec == NO_CACHE else
             f"{r.n_samples:,} images at {config.model.image_size} px"
             + (f", {bytes_per_image:,.0f} B/image measured" if bytes_per_image else
                f", estimated ratio {CODEC_RATIO_ESTIMATE[codec]:.2f} of raw, not measured" if codec != "raw" else "")),
        Line("mirrored parts", writes["mirrored parts"], f"the mirror's copy of every part: {parts}"),
    )
    return local, drive


@dataclass(frozen=True)
class ShardPlan:
    """How a file of `total_bytes` splits into shards, and the RAM of loading one at a time."""

    total_bytes: int
    target_shard_bytes: int
    n_shards: int
    shard_bytes: int          # size of every shard but possibly the last
    last_shard_bytes: int
    ram_one_at_a_time: int    # one shard resident (plus the next one prefetched)
    ram_all_at_once: int


def plan_shards(total_bytes: int, target_shard_mb: float = 400, prefetch_shards: int = 1) -> ShardPlan:
    """Shard count and sizes for a file, and RAM when loading one shard (+ prefetch) at a time."""
    require_positive("total_bytes", total_bytes)
    require_positive("target_shard_mb", target_shard_mb, number=True)
    require_positive("prefetch_shards", prefetch_shards, minimum=0)
    target = int(target_shard_mb * MB)
    n = max(1, math.ceil(total_bytes / target))
    size = math.ceil(total_bytes / n)
    last = total_bytes - size * (n - 1)
    return ShardPlan(total_bytes, target, n, size, last,
                     ram_one_at_a_time=size * min(n, 1 + prefetch_shards), ram_all_at_once=total_bytes)
