"""A model of PyTorch's CUDA caching allocator (default policy) over a stream of allocations and frees.

The rules, from c10/cuda/CUDACachingAllocator.cpp (native allocator, no PYTORCH_CUDA_ALLOC_CONF):
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
from dataclasses import dataclass

MIN_BLOCK = 512                  # kMinBlockSize
SMALL_SIZE = 1 << 20             # kSmallSize: the small pool takes requests up to 1 MiB
SMALL_SEGMENT = 2 << 20          # kSmallBuffer
LARGE_SEGMENT = 20 << 20         # kLargeBuffer: segment for requests between 1 MiB and 10 MiB
MIN_LARGE_ALLOC = 10 << 20       # kMinLargeAlloc
ROUND_LARGE = 2 << 20            # kRoundLarge


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


@dataclass
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

    @property
    def segment_count(self) -> int:
        return len(self.segments)

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
