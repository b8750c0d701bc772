"""What the rest of an encode run writes to each disk, and the check that it fits before the first batch.

Each file is rounded up to whole blocks (`DISK_BLOCK`), so a disk of many small parts is not
under-counted; items that land on one file system (the same st_dev) are added up, and a disk
nothing lands on is not charged at all.
"""
from __future__ import annotations

from pathlib import Path

from nblib import budget
from nblib.config import PipelineConfig
from nblib.disk import disk_free, existing_parent
from nblib.encode.layout import RunPlan
from nblib.errors import BudgetExceeded
from nblib.units import fmt_bytes, fmt_bytes_pair

__all__ = ["DISK_BLOCK", "check_disks", "disk_needs"]

DISK_BLOCK = 4096                 # the preflight rounds each file up to whole blocks of this size


def disk_needs(config: PipelineConfig, run_dir: Path, mirror_dir, plan: RunPlan, missing: list[int],
               do_consolidate: bool = True) -> dict[str, tuple[Path, int]]:
    """What the rest of a run writes, by item: name -> (folder it lands in, bytes).

    Each file is rounded up to whole 4 KiB blocks (part.json and headers included), so a disk
    of many small parts is not under-counted.
    """
    per_image = budget.output_bytes_per_image(config)
    outputs = len(config.run.outputs)
    left = sum(plan.part_range(k)[1] - plan.part_range(k)[0] for k in missing)
    parts = left * per_image + len(missing) * (outputs + 1) * DISK_BLOCK
    needs = {"parts still to encode": (run_dir, parts)}
    if do_consolidate:
        needs["consolidated outputs"] = (run_dir, plan.n_samples * per_image + (outputs + 1) * DISK_BLOCK)
    if mirror_dir is not None:
        needs["mirrored parts"] = (Path(mirror_dir), parts)
    return needs


def check_disks(needs: dict[str, tuple[Path, int]]) -> None:
    """BudgetExceeded naming the disk, the items on it, needed and free bytes, when one does not fit.

    Items on one file system (the same st_dev) are added up; a disk nothing lands on is not
    charged at all.
    """
    by_disk: dict[int, list[tuple[str, Path, int]]] = {}
    for item, (folder, nbytes) in needs.items():
        by_disk.setdefault(existing_parent(folder).stat().st_dev, []).append((item, folder, nbytes))
    for items in by_disk.values():
        need, folder = sum(n for _, _, n in items), items[0][1]
        free = disk_free(folder)
        if need > free:
            need_s, free_s = fmt_bytes_pair(need, free)
            what = " + ".join(f"{item} {fmt_bytes(n)} in {f}" for item, f, n in items)
            raise BudgetExceeded(
                f"the encode run needs {need_s} ({need:,} bytes) on the disk of {existing_parent(folder)} "
                f"but only {free_s} ({free:,} bytes) is free there ({what}); free space, put --out or "
                f"--mirror on a larger disk, keep fewer --outputs or use --dtype float16")
