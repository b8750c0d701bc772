"""The four resources a budget predicts, and the knobs that lower each, in words.

A leaf of `nblib.budget`: `predict` (the verdict) and `advice` (the values that fit) both name
these, so they live below both and neither module imports the other for them.
"""
from __future__ import annotations

import math

from nblib.units import fmt_size

__all__ = [
    "FIT_MARGIN", "KNOBS", "RESOURCES", "fits", "largest_fitting", "margin_words", "room", "shortfall",
    "shortfall_figure", "shortfall_words",
]

# The one rule for "fits" in every notebook, panel and preflight: a need fits when it stays within
# (1 - FIT_MARGIN) of its limit. The 10% is the room for what a prediction cannot see (allocator
# fragmentation, a library's scratch, another tab's memory), not a measured error.
FIT_MARGIN = 0.1


def fits(need: float, limit: float, margin: float = FIT_MARGIN) -> bool:
    """`need` fits `limit` with `margin` of it kept free."""
    return need <= room(limit, margin)


def room(limit: float, margin: float = FIT_MARGIN) -> float:
    """What a need may fill of `limit`: (1 - margin) of it, the target every check and advice aims at."""
    return limit * (1 - margin)


def shortfall(need: float, limit: float, margin: float = FIT_MARGIN) -> float:
    """How much more `limit` would make `need` fit (0 when it fits): the one "short" and "more" of a refusal."""
    return max(0.0, need / (1 - margin) - limit)


def shortfall_figure(need: float, limit: float, margin: float = FIT_MARGIN) -> str:
    """`shortfall` in words ('0.36 GB', '1.92 MB'), whole bytes rounded up: the "short" and "more" every refusal
    prints.
    """
    return fmt_size(math.ceil(shortfall(need, limit, margin)))


def margin_words(margin: float = FIT_MARGIN) -> str:
    """The rule in words, as every verdict, plan and refusal states it."""
    return f"with a {margin:.0%} margin"


def shortfall_words(need: float, limit: float, unit: str = "free", margin: float = FIT_MARGIN) -> str:
    """'with a 10% margin it may fill 9.90 GB of 11.00 GB of RAM, 0.36 GB short (11.36 GB of RAM would hold it
    with a 10% margin)' (each figure by `fmt_size`: a small disk's shortfall never reads 0.00 GB).

    "short" is `shortfall`: the limit it needs beyond this one, the same figure as the "GB more" a refusal
    offers (`nblib.budget.advice`), never need - limit.
    """
    short = math.ceil(shortfall(need, limit, margin))
    return (f"{margin_words(margin)} it may fill {fmt_size(room(limit, margin))} of {fmt_size(limit)} "
            f"{unit}, {shortfall_figure(need, limit, margin)} short ({fmt_size(limit + short)} {unit} would hold it "
            f"{margin_words(margin)})")


def largest_fitting(fits, cap: int) -> int:
    """The largest b in [1, cap] with fits(b) (fits is monotone), by doubling then bisection; 0 if none."""
    if cap < 1 or not fits(1):
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
    "local disk": "keep fewer run.outputs, a float16 run.out_dtype, or free disk in the run folder",
    "drive": "keep fewer run.outputs, a float16 run.out_dtype, a compressed run.codec, "
             "or a bigger drive_quota_gb",
}
