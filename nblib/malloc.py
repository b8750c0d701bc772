"""glibc malloc tuning: keep freed buffers out of the RSS, so a measured peak is the live buffers.

`pin_malloc_mmap_threshold` stops glibc from raising its mmap threshold (freed activations then
leave the RSS); `release_free_heap` hands freed heap back to the OS before a measurement. Both are
no-ops returning False where glibc is absent (macOS, musl): measured deltas are then upper bounds.
"""
from __future__ import annotations

import ctypes
import sys

M_MMAP_THRESHOLD = -3   # mallopt's parameter number in glibc's malloc.h


def pin_malloc_mmap_threshold(threshold_bytes: int = 256 * 1024) -> bool:
    """Make glibc serve buffers >= threshold with mmap, so freed activations leave the RSS.

    By default glibc raises its mmap threshold (up to 32 MB) each time a large block is freed;
    later blocks below it come from the heap and stay resident after they are freed, which
    inflates a CPU forward pass's peak RSS 1.5-1.7x over its live buffers. Pinning the
    threshold (mallopt M_MMAP_THRESHOLD) stops that. Returns False where glibc is absent.
    """
    return bool(libc_call("mallopt", M_MMAP_THRESHOLD, int(threshold_bytes)))


def release_free_heap() -> bool:
    """Hand freed heap back to the OS (glibc malloc_trim), so RSS deltas measure new memory only."""
    return libc_call("malloc_trim", 0) is not None   # None where glibc is absent: deltas are then lower bounds


def libc_call(function: str, *args) -> int | None:
    """The C library's `function(*args)` on Linux (malloc's here, prctl for nblib.pool); None where there is no
    such library or function.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), function)(*args)
    except (OSError, AttributeError):
        return None
