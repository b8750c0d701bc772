"""The four resources a budget predicts, and the knobs that lower each, in words.

A leaf of `nblib.budget`: `predict` (the verdict) and `advice` (the values that fit) both name
these, so they live below both and neither module imports the other for them.
"""
from __future__ import annotations

__all__ = [
    "KNOBS", "RESOURCES",
]

RESOURCES = ("vram", "ram", "local disk", "drive")

KNOBS = {
    "vram": "lower run.batch_size (see max_batch_size) or run.consolidate_every",
    "ram": "lower run.checkpoint_every, run.batch_size or run.prefetch/workers",
    "local disk": "keep fewer parts locally (keep_local) or lower run.checkpoint_every",
    "drive": "keep fewer run.outputs, a float16 run.out_dtype, a compressed run.codec, "
             "or a bigger drive_quota_gb",
}
