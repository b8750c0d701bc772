"""A model of PyTorch's CUDA caching allocator (default policy) over a stream of allocations and frees.

The rules, from c10/cuda/CUDACachingAllocator.cpp (native allocator, no PYTORCH_CUDA_ALLOC_CONF: where one asks
for other settings, the budget says so in one warning line, `warn_if_not_native`):
sizes round up to 512 B; requests up to 1 MiB come from a small pool of 2 MiB segments, larger
ones from a large pool, where requests under 10 MiB get a 20 MiB segment and larger ones a segment
rounded up to 2 MiB; a request takes the smallest free block that fits (best fit, then the lowest
address), split when the remainder is >= 512 B (small pool) or > 1 MiB (large pool); a freed
block merges with free neighbours of its segment. Segments are never returned (no empty_cache).
Trade-off: one stream and no OOM retry, so `reserved` is the high-water mark of an unlimited
device: what the run needs, not what a full device would squeeze into.
"""
from __future__ import annotations

import bisect
import functools
import logging
import os
import re
from dataclasses import dataclass

MIN_BLOCK = 512                  # kMinBlockSize
SMALL_SIZE = 1 << 20             # kSmallSize: the small pool takes requests up to 1 MiB
SMALL_SEGMENT = 2 << 20          # kSmallBuffer
LARGE_SEGMENT = 20 << 20         # kLargeBuffer: segment for requests between 1 MiB and 10 MiB
MIN_LARGE_ALLOC = 10 << 20       # kMinLargeAlloc
ROUND_LARGE = 2 << 20            # kRoundLarge
# the variables that configure the allocator (torch reads PYTORCH_ALLOC_CONF too since 2.9), and the settings of
# theirs this model replays: the defaults, which name the native allocator
ALLOC_CONF_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
NATIVE_SETTINGS = {"backend": "native", "expandable_segments": "false"}

log = logging.getLogger("nblib.budget")


def round_size(nbytes: int) -> int:
    """The block size the allocator hands out for a request of `nbytes` (512 B granules)."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(block: int) -> int:
    """The cudaMalloc size for a new segment that must hold a rounded request of `block` bytes."""
    if block <= SMALL_SIZE:
        return SMALL_SEGMENT
    if block < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-block // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)            # a block is itself: list.index/remove find it by identity, not by its fields (fast)
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    allocated: bool = False


class CachingAllocatorModel:
    """Replays allocations and frees; tracks allocated and reserved bytes and their peaks."""

    def __init__(self):
        self.allocated = self.reserved = 0
        self.max_allocated = self.max_reserved = 0
        self.segments: list[int] = []                 # segment id -> bytes
        self._free: dict[bool, list[tuple[int, int, int, _Block]]] = {True: [], False: []}
        self._by_segment: dict[int, list[_Block]] = {}
        self._handles: dict[int, _Block] = {}
        self._next = 0

    def malloc(self, nbytes: int) -> int:
        """Allocate `nbytes`; returns a handle for `free`."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._take_free(size, small) or self._new_segment(size, small)
        if self._should_split(block, size):
            rest = _Block(block.segment, block.offset + size, block.size - size, small)
            block.size = size
            blocks = self._by_segment[block.segment]
            blocks.insert(blocks.index(block) + 1, rest)
            self._insert_free(rest)
        block.allocated = True
        self.allocated += block.size
        self.max_allocated = max(self.max_allocated, self.allocated)
        self._next += 1
        self._handles[self._next] = block
        return self._next

    def free(self, handle: int) -> None:
        """Return a block to its pool, merged with free neighbours of the same segment."""
        block = self._handles.pop(handle)
        block.allocated = False
        self.allocated -= block.size
        blocks = self._by_segment[block.segment]
        i = blocks.index(block)
        for j in (i + 1, i - 1):            # next first, so index i stays valid for prev
            if 0 <= j < len(blocks) and not blocks[j].allocated:
                other = blocks[j]
                self._remove_free(other)
                block.offset, block.size = min(block.offset, other.offset), block.size + other.size
                blocks.remove(other)
        self._insert_free(block)

    # -------------------------------------------------------------- helpers

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        return remaining >= MIN_BLOCK if block.small else remaining > SMALL_SIZE

    def _take_free(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i == len(pool):
            return None
        return pool.pop(i)[3]

    def _new_segment(self, size: int, small: bool) -> _Block:
        seg_bytes = segment_size(size)
        seg = len(self.segments)
        self.segments.append(seg_bytes)
        self.reserved += seg_bytes
        self.max_reserved = max(self.max_reserved, self.reserved)
        block = _Block(seg, 0, seg_bytes, small)
        self._by_segment[seg] = [block]
        return block

    def _insert_free(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.segment, block.offset, block))

    def _remove_free(self, block: _Block) -> None:
        pool = self._free[block.small]
        i = bisect.bisect_left(pool, (block.size, block.segment, block.offset))
        if i >= len(pool) or pool[i][3] is not block:
            raise AssertionError("allocator model: a free block is missing from its pool")
        pool.pop(i)


def unmodelled_settings(environ=None) -> list[str]:
    """The allocator settings of PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) this model does not replay:
    every "key:value" but the native allocator's defaults (expandable_segments:True, max_split_size_mb,
    roundup_power2_divisions, garbage_collection_threshold, backend:cudaMallocAsync, ...).
    """
    environ = os.environ if environ is None else environ
    out = []
    for name in ALLOC_CONF_ENV:
        for item in filter(None, (part.strip() for part in environ.get(name, "").split(","))):
            key, _, value = item.partition(":")
            if NATIVE_SETTINGS.get(key.strip()) != value.strip().lower():
                out.append(f"{name}={item}")
    return out


def warn_if_not_native() -> None:
    """One warning line (logging, once per process and setting) where this process asks the allocator for settings
    the budget does not replay: the budget models PyTorch's native caching allocator.
    """
    settings = unmodelled_settings()
    if settings:
        _warn_once(", ".join(settings))


@functools.lru_cache(maxsize=16)
def _warn_once(settings: str) -> None:
    log.warning("%s: the VRAM budget models PyTorch's native caching allocator (its default settings), not these; "
                "reserved memory on the GPU will differ (expandable segments grow one mapping instead of caching "
                "segments); unset it to run as budgeted, or measure with torch.cuda.max_memory_reserved()", settings)


# ------------------------------------------------------------------ a traced allocation stream, replayed
# A trace (nblib.budget.trace.DeviceTrace) records ("m", handle, bytes), ("f", handle), ("w", handle, bytes) for
# the cuBLAS workspace, and ("k", name) marks. Replaying it needs no torch: the budget's cached traces use this.
WORKSPACE_POSITIONS = ("after the first GEMM's output", "before the first GEMM's output",
                       "first on the device")


def cublas_workspace_bytes(compute_capability: int, config: str | None = None) -> int:
    """The bytes of one cuBLAS workspace under CUBLAS_WORKSPACE_CONFIG=`config` (None: unset), as
    parseChosenWorkspaceSize() reads it.
    """
    default = 4096 * 1024 * 8 if compute_capability == 90 else 4096 * 1024 * 2 + 16 * 1024 * 8
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    return sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs else default


def replay_stats(events, position: str = WORKSPACE_POSITIONS[0]) -> dict:
    """Max allocated, max reserved and the allocated bytes at each mark, with the workspace at `position`."""
    stream = list(events)
    at = next((i for i, e in enumerate(stream) if e[0] == "w"), None)
    if at is not None and position != WORKSPACE_POSITIONS[0]:
        ws = stream.pop(at)
        if position == WORKSPACE_POSITIONS[1]:
            before = max((i for i in range(at) if stream[i][0] == "m"), default=0)
            stream.insert(before, ws)
        else:
            stream.insert(0, ws)
    allocator, handles, marks = CachingAllocatorModel(), {}, {}
    for event in stream:
        if event[0] == "f":
            allocator.free(handles.pop(event[1]))
        elif event[0] == "k":
            marks[event[1]] = allocator.allocated
        else:
            handles[event[1]] = allocator.malloc(event[2])
    return {"max_allocated": allocator.max_allocated, "max_reserved": allocator.max_reserved, "marks": marks}


def affine_stream(traced: dict[int, list]) -> list | None:
    """The allocation stream as a function of the batch, from the streams traced at three or more batches, or None.

    Every storage of a batch-parallel model holds numel x itemsize bytes, affine in the batch (parameters:
    constant): the line through the first two traces (each allocation as (kind, handle, bytes at batch 0, bytes
    per sample)) is kept only when every further trace equals it event for event, to the byte. A model whose
    operators change with the batch (another event sequence, a [B, B] tensor, a branch on the batch size, a size
    not affine in whole bytes) gets None: its batches are traced, never extrapolated. Measured for the TRM
    (seed_t4, fp16): the streams traced at batches 16 and 64 equal this stream's, event for event.
    """
    (b_low, low), (b_high, high), *checks = sorted(traced.items())
    low, high = _frees_sorted(low), _frees_sorted(high)
    if len(low) != len(high):
        return None
    out = []
    for e0, e1 in zip(low, high):
        if tuple(e0[:2]) != tuple(e1[:2]):
            return None
        if e0[0] in ("m", "w"):
            slope, rest = divmod(e1[2] - e0[2], b_high - b_low)
            if rest:
                return None
            out.append((e0[0], e0[1], e0[2] - slope * b_low, slope))
        else:
            out.append(tuple(e0))
    if any(events_at(out, b) != [tuple(e) for e in _frees_sorted(events)] for b, events in checks):
        return None
    return out


def events_at(stream: list, b: int) -> list | None:
    """An affine stream's events at batch `b` (None where a size would be negative: not this model's batch)."""
    out = []
    for e in stream:
        if e[0] in ("m", "w"):
            size = e[2] + e[3] * b
            if size < 0:
                return None
            out.append((e[0], e[1], size))
        else:
            out.append(e)
    return out


def stream_point(stream: list, b: int) -> dict | None:
    """What a trace reports at batch `b`, replayed from its affine stream: max allocated, max reserved at each
    workspace position, the bytes at the "weights" and "resident" marks, and the cuBLAS workspaces held. None
    where the stream's line gives a negative size (that batch must be traced itself).
    """
    events = events_at(stream, b)
    if events is None:
        return None
    stats = {pos: replay_stats(events, pos) for pos in WORKSPACE_POSITIONS}
    first = stats[WORKSPACE_POSITIONS[0]]
    return {"max_allocated": first["max_allocated"], "reserved_pytorch": first["max_reserved"],
            "resident": first["marks"]["resident"], "weights": first["marks"]["weights"],
            "workspace": sum(e[2] for e in events if e[0] == "w"),
            "reserved": {pos: st["max_reserved"] for pos, st in stats.items()}}


def _frees_sorted(events: list) -> list:
    """Each run of consecutive frees sorted by handle: the order a graph's teardown frees in varies
    between runs (finalizers), and a run's end state does not depend on it (free blocks coalesce).
    """
    out, run = [], []
    for e in events:
        if e[0] == "f":
            run.append(tuple(e))
            continue
        out += sorted(run)
        run = []
        out.append(e)
    return out + sorted(run)
