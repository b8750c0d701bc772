"""Disk a job needs: the image cache per codec, the parts of an encode run, shards; and the check.

`cache_bytes` and `choose_codec` size the image cache (the cache module calls them with its
measured bytes per image), `cache_shards` counts its files; `disk_lines` itemizes local staging
and the durable (Drive) copy of an encode run, `uploaded_bytes` what a plan sends to Drive;
`plan_shards` splits a big file so one shard at a time fits in RAM; `check_disk` refuses, with
the numbers, what does not fit a folder's free disk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from nblib.budget._checks import require_positive
from nblib.budget.memory import Line, output_bytes_per_image
from nblib.budget.resources import FIT_MARGIN
from nblib.config import PipelineConfig
from nblib.errors import BudgetExceeded, ConfigError
from nblib.units import GB, MB, fmt_bytes

# Each codec of the cache's registry (nblib.cache.codecs.CODECS, nblib.config.CODECS: the same
# names) as stored bytes per image over raw, assumed until the cache measures a sample (measure
# with nblib.cache.measure_codecs and pass bytes_per_image). png 0.14 is the reference analysis
# (1,907,747 images at 224 px in ~40 GB of 287 GB raw); zlib lands a little worse (no row
# filters); zstd level 3 with a dictionary stored the sample texts 0.56x zlib's bytes at 224 px
# (0.09 of raw when scaled to the reference's 0.16).
CODEC_RATIO_ESTIMATE = {"raw": 1.0, "png": 0.14, "zlib": 0.16, "zstd": 0.09}
# The codec of no cache at all: images rendered on the fly by the loader's workers
# (nblib.cache.rendered.RenderedImages), 0 bytes on any disk; plan_budget(cacheless=True) tries it.
NO_CACHE = "none"
NPY_HEADER_BYTES = 128


def cache_bytes(n_images: int, image_size: int, codec: str = "raw",
                bytes_per_image: float | None = None, *, shard_mb: int = 400) -> int:
    """Bytes an image cache takes: raw is n x H x W x 3 plus .npy headers per shard (0 for NO_CACHE)."""
    if codec == NO_CACHE:
        return 0
    require_positive("n_images", n_images)
    require_positive("image_size", image_size)
    require_positive("shard_mb", shard_mb)
    if codec not in CODEC_RATIO_ESTIMATE:
        raise ConfigError(f"codec={codec!r} is unknown; choose one of {tuple(CODEC_RATIO_ESTIMATE)}")
    raw = image_size * image_size * 3
    if bytes_per_image is not None:
        require_positive("bytes_per_image", bytes_per_image, number=True)
        per_image = float(bytes_per_image)
    else:
        per_image = raw * CODEC_RATIO_ESTIMATE[codec]
    data = n_images * per_image
    shards = max(1, math.ceil(data / (shard_mb * MB)))
    return int(math.ceil(data)) + shards * NPY_HEADER_BYTES


def cache_shards(config: PipelineConfig, *, codec: str | None = None,
                 bytes_per_image: float | None = None) -> int:
    """How many shard files the image cache of `config` is cut into (run.shard_mb each)."""
    r = config.run
    codec = codec or r.codec
    data = cache_bytes(r.n_samples, config.model.image_size, codec, bytes_per_image, shard_mb=r.shard_mb)
    return 0 if codec == NO_CACHE else max(1, math.ceil(data / (r.shard_mb * MB)))


def uploaded_bytes(config: PipelineConfig, *, codec: str | None = None,
                   bytes_per_image: float | None = None) -> int:
    """Bytes a plan uploads to Drive: the image cache, every part, and the consolidated outputs."""
    r = config.run
    outputs = r.n_samples * output_bytes_per_image(config)
    cache = cache_bytes(r.n_samples, config.model.image_size, codec or r.codec, bytes_per_image,
                        shard_mb=r.shard_mb)
    return cache + 2 * outputs


def choose_codec(n_images: int, free_bytes: int, codec_stats: dict[str, dict],
                 margin: float = FIT_MARGIN) -> str:
    """The fastest-decoding codec whose cache fits in free_bytes x (1 - margin)."""
    require_positive("n_images", n_images)
    if not codec_stats:
        raise ConfigError("codec_stats is empty; measure at least one codec with nblib.cache")
    room = free_bytes * (1 - margin)
    sizes = {name: n_images * float(s["bytes_per_image"]) for name, s in codec_stats.items()}
    fitting = [name for name in codec_stats if sizes[name] <= room]
    if not fitting:
        smallest = min(sizes, key=sizes.get)
        raise BudgetExceeded(
            f"no codec fits: the smallest cache ({smallest}) needs {sizes[smallest] / GB:.1f} GB "
            f"for {n_images:,} images, but {free_bytes / GB:.1f} GB is free "
            f"(room {room / GB:.1f} GB after a {margin:.0%} margin); render fewer images "
            f"(n_samples), a smaller image_size, or free disk")
    return max(fitting, key=lambda name: float(codec_stats[name]["decode_images_per_s"]))


def check_disk(folder: str | Path, need_bytes: int, *, what: str, knob) -> None:
    """Raise BudgetExceeded when `need_bytes` exceed the free disk of `folder`'s filesystem.

    `knob` is what to turn: words, or a function of the free bytes that computes the knobs with the
    values that fit (`nblib.budget.advice.closing_knobs`), called only when the check refuses.
    """
    from nblib.disk import disk_free, existing_parent

    path, free = existing_parent(folder), disk_free(folder)
    if need_bytes > free:
        turn = knob(free) if callable(knob) else knob
        raise BudgetExceeded(
            f"{what} needs {need_bytes / GB:.2f} GB but only {free / GB:.2f} GB is free on "
            f"{path} ({(need_bytes - free) / GB:,.2f} GB short); {turn}")


def disk_lines(config: PipelineConfig, *, codec: str = "raw", bytes_per_image: float | None = None,
               keep_local: int = 2) -> tuple[tuple[Line, ...], tuple[Line, ...]]:
    """(local disk lines, Drive lines) of a cache + encode run, from the output shapes."""
    r = config.run
    per_image = output_bytes_per_image(config)
    total_outputs = r.n_samples * per_image
    part = min(r.checkpoint_every * r.batch_size, r.n_samples) * per_image
    n_parts = -(-r.n_batches // r.checkpoint_every)
    cache = cache_bytes(r.n_samples, config.model.image_size, codec, bytes_per_image,
                        shard_mb=r.shard_mb)
    local = (
        Line("staged parts kept locally", min(keep_local, n_parts) * part,
             f"keep_local={keep_local} parts of {fmt_bytes(part)} after mirroring"),
        Line("part being written", part, "temporary file of the next part (atomic write)"),
    )
    drive = (
        Line(f"image cache ({codec})", cache,
             "no cache: the loader's workers render each image when it is read" if codec == NO_CACHE else
             f"{r.n_samples:,} images at {config.model.image_size} px"
             + (f", {bytes_per_image:,.0f} B/image measured" if bytes_per_image else
                f", {CODEC_RATIO_ESTIMATE[codec]:.2f} of raw (estimate)" if codec != "raw" else "")),
        Line("durable parts", total_outputs,
             f"{n_parts} parts: {r.n_samples:,} x {fmt_bytes(per_image)} "
             f"({'+'.join(r.outputs)}, {r.out_dtype})"),
        Line("mirror copy in flight", part, "temporary of the part being mirrored"),
        Line("consolidated outputs", total_outputs,
             "one .npy per output at the end, while the parts still exist"),
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
