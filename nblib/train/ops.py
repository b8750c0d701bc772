"""The TPU storage guide's operations for a training run: what the bucket costs, and disks that fill up.

`PRICES` is a dated, sourced table (data, not code); `bucket_cost` prices a run's backups from it (the bytes
retention keeps, one PUT per file of each backup, the LISTs of starts and audits, the GETs of one resume);
`DiskWatch` warns (logging and a `DiskWarning`) before the local disk or the Drive quota runs out
("Retention and cost" in docs/training.md).
Trade-off: list prices, no free tier, no egress (a resume on a VM in the bucket's region pays none), no taxes.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

from nblib.budget.resources import fits, margin_words
from nblib.budget.training import retained_bytes
from nblib.disk import disk_free, disk_usage
from nblib.units import GB, fmt_bytes

log = logging.getLogger("nblib.train")


@dataclass(frozen=True)
class BucketPrice:
    """List prices of one storage class: USD per GB-month, per 1,000 writes (PUT/LIST), per 1,000 reads."""

    name: str
    storage_gb_month: float
    writes_per_1000: float
    reads_per_1000: float
    source: str
    as_of: str


# List prices as published on the vendors' pricing pages for the first pricing tier; recorded on the
# date below from the pages named (no network at run time: check the page before relying on them).
PRICES = {
    "s3": BucketPrice("Amazon S3 Standard, us-east-1, first 50 TB", 0.023, 0.005, 0.0004,
                      "https://aws.amazon.com/s3/pricing/", "2026-11-23"),
    "gs": BucketPrice("Google Cloud Storage Standard, us-central1 (regional), Class A / Class B operations",
                      0.020, 0.005, 0.0004, "https://cloud.google.com/storage/pricing", "2026-11-23"),
}


class DiskWarning(UserWarning):
    """A disk or the Drive quota will not hold the next checkpoints."""


@dataclass(frozen=True)
class BucketCost:
    storage_usd: float
    requests_usd: float
    stored_bytes: int
    writes: int
    reads: int
    price: BucketPrice

    def line(self) -> str:
        return (f"{self.price.name}: {fmt_bytes(self.stored_bytes)} kept -> ${self.storage_usd:.4f} storage + "
                f"{self.writes:,} writes / {self.reads:,} reads -> ${self.requests_usd:.4f} requests = "
                f"${self.storage_usd + self.requests_usd:.4f} (list prices of {self.price.as_of}, {self.price.source})")


def bucket_cost(state_bytes: int, best_bytes: int, *, steps: int, backup_every: int, keep_last: int,
                months: float = 1.0, provider: str = "s3", restarts: int = 1) -> BucketCost:
    """The bucket's cost for one run's backups, kept `months` after the run."""
    price = PRICES[provider]
    backups = max(1, steps // backup_every)
    stored = retained_bytes(state_bytes, best_bytes, keep_last)   # the one retention rule
    writes = backups * 4 + restarts * 2 + backups           # state + best (.pt + record) each; LISTs
    reads = restarts * 4                                     # one resume: record + file, twice at most
    storage = stored / GB * price.storage_gb_month * months     # GB of 10^9 B (S3 bills GiB-months: 7% more)
    requests = writes / 1000 * price.writes_per_1000 + reads / 1000 * price.reads_per_1000
    return BucketCost(storage, requests, stored, writes, reads, price)


class DiskWatch:
    """Warn once per folder when it could not hold what retention keeps there (`retained_bytes`; locally its peak
    while a save writes) with the suite's margin (`nblib.budget.resources.fits`): the budget's rule, checked live.
    """

    def __init__(self, folders: dict[str, str | Path], keep_last: int, quota_bytes: dict[str, int] | None = None):
        self.folders = {name: Path(folder) for name, folder in folders.items()}
        self.keep_last, self.quota_bytes = keep_last, quota_bytes or {}
        self.warned: set[str] = set()

    def check(self, state_bytes: int, best_bytes: int = 0) -> list[str]:
        """The warnings raised now (each folder warns once); "local disk" is the one a save writes to first."""
        raised = []
        for name, folder in self.folders.items():
            need = retained_bytes(state_bytes, best_bytes, self.keep_last, saving=name == "local disk")
            free = free_bytes(folder, self.quota_bytes.get(name))
            if free is None or name in self.warned or fits(need, room := free + disk_usage(folder)):
                continue
            self.warned.add(name)
            quota = self.quota_bytes.get(name)
            under = "" if quota is None else f" of its {fmt_bytes(quota)} quota (--drive-quota-gb)"
            msg = (f"{name} ({folder}) has room for {fmt_bytes(max(0, room))}{under} (this run's files and the "
                   f"free space), less than the {self.keep_last} states + best weights retention keeps there, "
                   f"{fmt_bytes(need)}, {margin_words()}: free space there, lower --keep-last, or raise "
                   f"--backup-every before it runs out (training continues; a failed save stops it)")
            log.warning(msg)
            warnings.warn(msg, DiskWarning, stacklevel=2)
            raised.append(msg)
        return raised


def free_bytes(folder: Path, quota: int | None = None) -> int | None:
    """Free bytes where `folder` lives (or under a quota: quota minus what the folder holds); None if unknown."""
    try:
        free = disk_free(folder)
    except OSError:
        return None
    return int(free if quota is None else min(free, quota - disk_usage(folder)))
