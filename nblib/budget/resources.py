"""The four resources a budget predicts, and the knobs that lower each, in words.

A leaf of `nblib.budget`: `predict` (the verdict) and `advice` (the values that fit) both name
these, so they live below both and neither module imports the other for them.
"""
from __future__ import annotations

__all__ = [
    "FIT_MARGIN", "KNOBS", "RESOURCES", "fits", "largest_fitting",
]

# The one rule for "fits" in every notebook, panel and preflight: a need fits when it stays within
# (1 - FIT_MARGIN) of its limit. The 10% is the room for what a prediction cannot see (allocator
# fragmentation, a library's scratch, another tab's memory), not a measured error.
FIT_MARGIN = 0.1


def fits(need: float, limit: float, margin: float = FIT_MARGIN) -> bool:
    """`need` fits `limit` with `margin` of it kept free."""
    return need <= limit * (1 - margin)


def largest_fitting(fits, cap: int) -> int:
    """The largest b in [1, cap] with fits(b) (fits is monotone), by doubling then bisection; 0 if none."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo

RESOURCES = ("vram", "ram", "local disk", "drive")

KNOBS = {
    "vram": "lower run.batch_size (see max_batch_size) or run.consolidate_every",
    "ram": "lower run.checkpoint_every, run.batch_size or run.prefetch/workers",
    "local disk": "keep fewer parts locally (keep_local) or lower run.checkpoint_every",
    "drive": "keep fewer run.outputs, a float16 run.out_dtype, a compressed run.codec, "
             "or a bigger drive_quota_gb",
}
