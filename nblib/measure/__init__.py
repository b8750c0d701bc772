"""The measured twins of nblib.budget's predictions: peak RSS and CUDA peaks, an encoder's peak.

One concern per module (docs/layout.md, measure/). Disk and path helpers live in `nblib.disk` and glibc
malloc tuning in `nblib.malloc`; the names below are re-exported here because notebooks and benchmarks
measure with them (`measure.disk_usage`, `measure.pin_malloc_mmap_threshold`). Importing this package never
imports torch.
"""
from __future__ import annotations

from nblib.disk import disk_usage
from nblib.malloc import pin_malloc_mmap_threshold
from nblib.measure.encoder import encoder_peak
from nblib.measure.rss import PeakMemory, synchronize

__all__ = ["PeakMemory", "disk_usage", "encoder_peak", "pin_malloc_mmap_threshold", "synchronize"]
