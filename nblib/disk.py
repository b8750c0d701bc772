"""Disk and path helpers: bytes under a folder, free space of the filesystem holding a path, and the one check
that a verb never writes into, or removes, a folder it reads (`refuse_overlap`).

Budgets (`nblib.budget`), preflights and runs read free space here; the measured twin of a disk
prediction is `DiskPeak`. A job's folder may not exist yet, so free space is read on its nearest
existing parent. Trade-off: `disk_usage` walks the tree (O(files)), exact but not free on huge folders.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import threading
from pathlib import Path

from nblib.errors import ConfigError


def disk_usage(folder: str | Path) -> int:
    """Bytes of all regular files under `folder` (0 if it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(FileNotFoundError):   # removed while walking (a temporary renamed away)
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def existing_parent(folder: str | Path) -> Path:
    """`folder` if it exists, else its nearest existing parent (a job's folder may not exist yet)."""
    path = Path(folder).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_space(folder: str | Path) -> tuple[int, int]:
    """(total, free) bytes of the filesystem holding `folder` (or its nearest existing parent)."""
    usage = shutil.disk_usage(existing_parent(folder))
    return usage.total, usage.free


def disk_free(folder: str | Path) -> int:
    """Free bytes on the filesystem holding `folder` (or its nearest existing parent)."""
    return disk_space(folder)[1]


class DiskPeak:
    """Context manager: sample a folder's size in a thread while a block runs; keep the peak.

    Samples on entry, every `every_s` seconds, and once more on exit. A save's temporary files
    that live shorter than one interval can be missed: the peak is a lower bound.
    """

    def __init__(self, folder: str | Path, every_s: float = 0.002):
        self.folder, self.every_s, self.peak = Path(folder), every_s, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> DiskPeak:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="DiskPeak", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        """Read the folder's size now (a caller that knows the peak's moment calls this at it)."""
        self.peak = max(self.peak, disk_usage(self.folder))


# ====================================================================================== what a verb reads and writes
# Every verb that writes a folder (cache, encode, export, train, predict) asks `refuse_overlap` before it touches
# anything: its --out may not be one of its inputs, hold one, or sit inside one. `--overwrite` is never the advice:
# a build with it into the folder it read deleted the input's shards, then failed reading them (red team R5-4).
# Paths are compared resolved (symlinks followed), so a link to the input counts as the input.


def overlap(out: str | Path, source: str | Path) -> str | None:
    """How the path `out` meets the path `source`: "is", "holds", "sits inside", or None when they are apart."""
    a, b = Path(out).expanduser().resolve(), Path(source).expanduser().resolve()
    if a == b:
        return "is"
    if b.is_relative_to(a):
        return "holds"
    return "sits inside" if a.is_relative_to(b) else None


def beside(source: str | Path, suffix: str) -> Path:
    """A path next to `source` named after it: D -> D-SUFFIX (a file x.jsonl -> x-SUFFIX)."""
    path = Path(source)
    if not path.name or path.name in (".", ".."):
        path = path.expanduser().resolve()
    stem = path.stem if path.is_file() else path.name
    return path.with_name(f"{stem}-{suffix}")


def refuse_overlap(verb: str, out: str | Path | None, inputs: dict, *, out_flag: str = "--out",
                   suffix: str = "out") -> None:
    """ConfigError when `out` is, holds or sits inside one of `inputs` ({flag: path or None}: what `verb` reads).

    Called before anything is written or removed; `suffix` names the suggested --out beside the input
    (D -> D-SUFFIX).
    """
    if out is None or not str(out) or "://" in str(out):       # none, or a bucket: no local folder to compare
        return
    for flag, source in inputs.items():
        if source is None or not str(source) or "://" in str(source):
            continue
        how = overlap(out, source)
        if how is None:
            continue
        itself = " itself" if how == "is" else ""
        raise ConfigError(f"{out_flag} {out} {how} {flag} {source}{itself}: {verb} would write into a folder it "
                          f"reads; pass another {out_flag} outside it, e.g. {out_flag} {beside(source, suffix)}")
