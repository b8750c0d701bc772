"""Google Drive's limits beyond bytes: items per folder and uploads per day, each with the knob that fits.

Bytes against the quota are the budget's "drive" resource; these are the other walls a long run
hits on Drive (`nblib.reference.DRIVE`, each with its source): a folder that directly holds
thousands of items makes mounts and listings time out (an encode run's folder holds one folder
per part, a cache folder one file per shard), and no new upload starts past 750 GB in a day.
`drive_limit_checks` returns one `DriveLimitCheck` per limit: the number the plan needs, the
limit, and, when crossed, the knob with the value that fits. Trade-off: the items limit is
Colab's warning ("thousands"), not a hard error; the budget treats it as a wall because a mount
that times out stops the run just the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from nblib.budget.disk import cache_bytes, cache_shards, uploaded_bytes
from nblib.budget.memory import output_bytes_per_image
from nblib.config import OUTPUT_CHOICES, PipelineConfig
from nblib.reference import DRIVE
from nblib.units import GB, MB

FOLDER_ITEMS_LIMIT = int(DRIVE["items per folder"].value)
UPLOAD_PER_DAY = float(DRIVE["upload per day"].value)
FREE_QUOTA_GB = DRIVE["free quota"].value / GB
RUN_FOLDER_EXTRA_ITEMS = 4     # the run manifest and its sidecars beside the part folders
CACHE_FOLDER_EXTRA_ITEMS = 1   # the cache manifest beside the shards


@dataclass(frozen=True)
class DriveLimitCheck:
    """One Drive limit against what a plan needs there: the numbers, and the knob when crossed."""

    name: str          # "items in the run folder", "items in the cache folder", "uploads per day"
    need: float
    limit: float
    unit: str          # "items" or "B"
    knob: str          # what to turn, with the value that fits ("" when not crossed)
    source: str

    @property
    def crossed(self) -> bool:
        return self.need > self.limit

    @property
    def numbers(self) -> str:
        """'Drive uploads per day 996.2 GB uploaded > 750 GB a day', or '<=' when within the limit.

        The bytes uploaded are the budget's Drive peak (`uploaded_bytes`: the cache and the mirrored parts).
        """
        op = ">" if self.crossed else "<="
        numbers = (f"{self.need / GB:,.1f} GB uploaded {op} {self.limit / GB:,.0f} GB a day" if self.unit == "B"
                   else f"{self.need:,.0f} {op} {self.limit:,.0f}")
        return f"Drive {self.name} {numbers}"

    def __str__(self) -> str:
        return self.numbers + (f": {self.knob}" if self.crossed else "")


def drive_limit_checks(config: PipelineConfig, *, codec: str | None = None,
                       bytes_per_image: float | None = None) -> tuple[DriveLimitCheck, ...]:
    """Items in the run folder, items in the cache folder, and the plan's uploads against one day's cap."""
    return (run_folder_check(config),
            cache_folder_check(config, codec=codec, bytes_per_image=bytes_per_image),
            upload_check(config, codec=codec, bytes_per_image=bytes_per_image))


def run_folder_check(config: PipelineConfig) -> DriveLimitCheck:
    """Part folders (one per checkpoint) in the run's folder; the knob: the smallest checkpoint_every that fits."""
    r = config.run
    n_parts = -(-r.n_batches // r.checkpoint_every)
    need = n_parts + RUN_FOLDER_EXTRA_ITEMS
    every = smallest_checkpoint_every(config)
    knob = (f"run.checkpoint_every>={every} (now {r.checkpoint_every}; "
            f"{-(-r.n_batches // every):,} parts)" if every else
            f"fewer batches per run: even checkpoint_every={r.n_batches} leaves {need} items")
    return DriveLimitCheck("items in the run folder", need, FOLDER_ITEMS_LIMIT, "items", knob,
                           DRIVE["items per folder"].source)


def cache_folder_check(config: PipelineConfig, *, codec: str | None = None,
                       bytes_per_image: float | None = None) -> DriveLimitCheck:
    """Shards in the image cache's folder; the knob: the smallest shard_mb that fits."""
    r = config.run
    codec = codec or r.codec
    shards = cache_shards(config, codec=codec, bytes_per_image=bytes_per_image)
    data = cache_bytes(r.n_samples, config.model.image_size, codec, bytes_per_image, shard_mb=r.shard_mb)
    return shard_folder_check(shards, data, r.shard_mb, knob="run.shard_mb", of=f" of {codec}")


def shard_folder_check(shards: int, data_bytes: float, shard_mb: float, *, knob: str = "shard_mb",
                       of: str = "") -> DriveLimitCheck:
    """`shards` files of `data_bytes` in all, plus the manifest, in one folder; the knob: the smallest `knob`
    (shard size in MB) that fits. The cache writers and readers warn by it (`nblib.cache.format.warn_many_files`).
    """
    fits_mb = math.ceil(data_bytes / (FOLDER_ITEMS_LIMIT - CACHE_FOLDER_EXTRA_ITEMS) / MB)
    return DriveLimitCheck("items in the cache folder", shards + CACHE_FOLDER_EXTRA_ITEMS, FOLDER_ITEMS_LIMIT,
                           "items", f"{knob}>={fits_mb} (now {shard_mb:g}; {shards:,} shards{of})",
                           DRIVE["items per folder"].source)


def upload_check(config: PipelineConfig, *, codec: str | None = None,
                 bytes_per_image: float | None = None) -> DriveLimitCheck:
    """The plan's uploads (cache, parts, consolidated outputs) against 750 GB a day; the days or outputs that fit."""
    need = uploaded_bytes(config, codec=codec, bytes_per_image=bytes_per_image)
    days = math.ceil(need / UPLOAD_PER_DAY)
    fitting = _outputs_uploading_in_a_day(config, codec, bytes_per_image)
    knob = f"spread the uploads over {days} days (stop after {UPLOAD_PER_DAY / GB:,.0f} GB, resume the next day)"
    if config.run.out_dtype != "float16":
        knob += "; or run.out_dtype='float16'"
    if fitting is not None:
        knob += f"; or run.outputs={fitting!r} (uploads fit in one day)"
    return DriveLimitCheck("uploads per day", need, UPLOAD_PER_DAY, "B", knob, DRIVE["upload per day"].source)


def smallest_checkpoint_every(config: PipelineConfig) -> int | None:
    """The smallest checkpoint_every (a multiple of consolidate_every) whose parts fit one Drive folder."""
    r = config.run
    most_parts = FOLDER_ITEMS_LIMIT - RUN_FOLDER_EXTRA_ITEMS
    every = max(1, -(-r.n_batches // most_parts))
    every = -(-every // r.consolidate_every) * r.consolidate_every
    return every if -(-r.n_batches // every) <= most_parts else None


def _outputs_uploading_in_a_day(config: PipelineConfig, codec, bytes_per_image) -> tuple | None:
    """The largest subset of outputs (other than the current one) whose plan uploads <= one day's cap."""
    current = config.run.outputs
    for outputs in OUTPUT_CHOICES:
        if outputs == current or output_bytes_per_image(config, outputs=outputs) >= output_bytes_per_image(config):
            continue
        trial = config.replace(outputs=outputs)
        if uploaded_bytes(trial, codec=codec, bytes_per_image=bytes_per_image) <= UPLOAD_PER_DAY:
            return outputs
    return None
