"""What the rest of an encode run writes to each disk, and the check that it fits before the first batch.

Each file is rounded up to whole blocks (`DISK_BLOCK`), so a disk of many small parts is not
under-counted; items that land on one file system (the same st_dev) are added up, and a disk
nothing lands on is not charged at all.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nblib.budget.disk import DISK_BLOCK, run_writes
from nblib.budget.resources import fits, shortfall_words
from nblib.config import PipelineConfig
from nblib.disk import disk_free, existing_parent
from nblib.encode.layout import RunPlan
from nblib.errors import BudgetExceeded
from nblib.store.deadline import MirrorStalled, Stall, mirror_deadline
from nblib.store.mirror import MirrorWarning
from nblib.units import fmt_bytes, fmt_bytes_pair

__all__ = ["DISK_BLOCK", "check_disks", "disk_needs", "disk_of", "on_mirror"]


def disk_needs(config: PipelineConfig, run_dir: Path, mirror_dir, plan: RunPlan, missing: list[int],
               do_consolidate: bool = True, *, per_image: int | None = None,
               n_outputs: int | None = None) -> dict[str, tuple[Path, int]]:
    """What the rest of a run writes, by item: name -> (folder it lands in, bytes).

    The items and bytes are `nblib.budget.disk.run_writes`' (the plan's `disk_lines` prints the same), for the
    parts still `missing`, each file rounded up to whole blocks (the module docstring). `per_image` and
    `n_outputs` are a model's own (default: the config's TRM outputs).
    """
    writes = run_writes(config, samples=plan.samples_in(missing), parts=len(missing), n_samples=plan.n_samples,
                        per_image=per_image, n_outputs=n_outputs, do_consolidate=do_consolidate)
    folders = {"parts still to encode": run_dir, "consolidated outputs": run_dir,
               "mirrored parts": None if mirror_dir is None else Path(mirror_dir)}
    return {item: (folders[item], n) for item, n in writes.items() if folders[item] is not None}


def disk_of(folder: Path) -> tuple[int, int]:
    """(st_dev, free bytes) of the file system holding `folder` (or its nearest existing parent)."""
    return existing_parent(folder).stat().st_dev, disk_free(folder)


def on_mirror(mirror: Path, what: str, fn: Callable[[], Any], default: Any = None) -> Any:
    """fn() on the mirror within its deadline; a frozen mount gives `default` and a MirrorWarning.

    A frozen FUSE mount hangs stat() and statvfs() as it hangs open(): the check runs on a daemon
    thread (nblib.store.deadline), and past NBLIB_MIRROR_DEADLINE_S the run goes on without it;
    the store then finds the mirror stalled and works from local staging.
    """
    try:
        return Stall(Path(mirror), mirror_deadline()).call(what, fn)
    except MirrorStalled as exc:
        warnings.warn(f"{exc}; {what} was skipped", MirrorWarning, stacklevel=2)
        return default


def check_disks(needs: dict[str, tuple[Path, int]], mirror: Path | None = None) -> None:
    """BudgetExceeded naming the disk, the items on it, needed and free bytes, when one does not fit
    (`resources.fits`, the one rule: within 90% of its free bytes).

    Items are added up per file system (the module docstring). The `mirror`'s disk is probed within the mirror's
    deadline (`on_mirror`): a frozen mount is left unchecked, with a warning, instead of hanging the run.
    """
    by_disk: dict[int, list[tuple[str, Path, int]]] = {}
    free_of: dict[int, int] = {}
    for item, (folder, nbytes) in needs.items():
        if mirror is not None and Path(folder) == Path(mirror):
            found = on_mirror(mirror, "checking the mirror disk's free space", lambda f=folder: disk_of(f))
        else:
            found = disk_of(folder)
        if found is None:
            continue
        dev, free_of[dev] = found
        by_disk.setdefault(dev, []).append((item, folder, nbytes))
    for dev, items in by_disk.items():
        need, folder, free = sum(n for _, _, n in items), items[0][1], free_of[dev]
        if not fits(need, free):
            need_s, free_s = fmt_bytes_pair(need, free)
            what = " + ".join(f"{item} {fmt_bytes(n)} in {f}" for item, f, n in items)
            raise BudgetExceeded(
                f"the encode run needs {need_s} ({need:,} bytes) on the disk of {existing_parent(folder)} "
                f"but only {free_s} ({free:,} bytes) is free there ({what}): {shortfall_words(need, free, 'free')}; "
                f"free that much more, put --out or --mirror on a larger disk, keep fewer --outputs or use "
                f"--dtype float16")
