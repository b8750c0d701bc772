"""Retention as pure functions: which parts stay on local disk and which checkpoint versions stay.

Local staging keeps the last `keep_local` parts and every `keep_every`-th one (ranks 0, K, 2K,
... of all parts known on either side); everything else is deleted locally once it is verified
on the mirror. Checkpoints keep the newest `keep_checkpoints` versions on each side. The
trade-off: less local disk, paid for by reading older parts back from the mirror.
"""
from __future__ import annotations


def retained_parts(names: list[str], keep_last: int | None, keep_every: int | None) -> set[str]:
    """Part names retention keeps locally: the last `keep_last`, and ranks 0, K, 2K, ... of `names`."""
    ordered = sorted(names)
    if keep_last is None:
        return set(ordered)
    kept = set(ordered[len(ordered) - keep_last:]) if keep_last > 0 else set()
    if keep_every:
        kept.update(ordered[::keep_every])
    return kept


def local_parts_to_drop(local: list[str], known: set[str], keep_last: int | None,
                        keep_every: int | None) -> list[str]:
    """Local part names outside retention (ranked among every part `known` on either side)."""
    keep = retained_parts(sorted(set(local) | known), keep_last, keep_every)
    return sorted(set(local) - keep)


def checkpoints_to_drop(versions: list[int], keep: int, up_to: int | None = None) -> list[int]:
    """Versions beyond the newest `keep`; with `up_to`, only those not newer than it."""
    old = sorted(set(versions))[:-keep] if keep > 0 else sorted(set(versions))
    return [v for v in old if up_to is None or v <= up_to]


def local_versions_to_drop(versions: list[int], keep: int, queued: int | None = None,
                           coming: int | None = None) -> list[int]:
    """Local versions retention removes: beyond the newest `keep`, never the one `queued` for the mirror. With
    `coming` (a version about to be written): what its prune will remove anyway, removed first so that its
    pages take the memory the old file's free (as accelerate's `total_limit` does; writing into memory nothing
    freed cost 0.3-0.5 s more a 210 MB save here); nothing where one version is kept (the last complete one
    stays until the new one is complete).
    """
    if coming is not None and keep < 2:
        return []
    wanted = [*versions, coming] if coming is not None else versions
    return [v for v in checkpoints_to_drop(wanted, keep) if v not in (queued, coming)]
