"""A shuffle for sharded, sequential-read sources: shuffle the shard order, then within windows of shards.

Only `window_shards` shards are open at a time, and the state is a position like GlobalShuffle's.
Trade-off: samples stay within about one window of their shard's new slot, so neighbours share a
shard ~1/window_shards of the time (measured by `shuffle_quality`); window = all shards is a full shuffle.
"""
from __future__ import annotations

import numpy as np

from nblib.errors import ConfigError
from nblib.shuffle.feistel import FeistelPermutation
from nblib.shuffle.keyed_random import check_n, derive_keys
from nblib.shuffle.positional import PositionalShuffle
from nblib.shuffle.state import as_int

MAX_SHARDS = 2**25        # the shard order is held in RAM: ~40 bytes per shard while it is built
BYTES_PER_SHARD = 40


class WindowedShuffle(PositionalShuffle):
    """Shards (runs of indices) in a keyed order, then each window of `window_shards` shards permuted by a
    keyed permutation of its own: what `ShardAwareShuffle` and the record shards' shuffle share.
    """

    def _lay_out(self, counts: np.ndarray, tags: tuple[str, str], *extra: int) -> None:
        """The shard order and the windows over shards of `counts` indices, keyed by (tags, seed, epoch, n, extra)."""
        self._window_key, shards = (tags[1], self.seed, self.epoch, self.n, *extra), len(counts)
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        keys = derive_keys(tags[0], self.seed, self.epoch, self.n, *extra)
        self.shard_order = FeistelPermutation(shards, keys).indices(np.arange(shards, dtype=np.uint64))
        self._ordered_sizes = counts[self.shard_order]
        window_sizes = np.add.reduceat(self._ordered_sizes, np.arange(0, shards, self.window_shards))
        self._window_starts = np.concatenate([[0], np.cumsum(window_sizes)])
        self._window_cache: tuple[int, FeistelPermutation, np.ndarray] | None = None
        self.position = 0

    def index_at(self, position: int) -> int:
        """The source index at output position `position` (random access)."""
        if not 0 <= int(position) < self.n:
            raise IndexError(f"position {position} is outside [0, {self.n})")
        window = int(np.searchsorted(self._window_starts, position, side="right")) - 1
        return int(self._window_indices(window, np.array([position]))[0])

    def indices(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Source indices of output positions [start, stop) as an int64 array, window by window."""
        start, stop = self.check_range(start, stop)
        parts = []
        window = int(np.searchsorted(self._window_starts, start, side="right")) - 1
        while start < stop:
            window_stop = min(stop, int(self._window_starts[window + 1]))
            parts.append(self._window_indices(window, np.arange(start, window_stop)))
            start, window = window_stop, window + 1
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _window_indices(self, window: int, positions: np.ndarray) -> np.ndarray:
        """Source indices of positions that all lie in `window`."""
        if self._window_cache is None or self._window_cache[0] != window:
            start = int(self._window_starts[window])
            size = int(self._window_starts[window + 1]) - start
            permutation = FeistelPermutation(size, derive_keys(*self._window_key, window))
            first = window * self.window_shards
            sizes = self._ordered_sizes[first:first + self.window_shards]
            self._window_cache = (window, permutation, np.concatenate([[0], np.cumsum(sizes)]))
        _, permutation, offsets = self._window_cache
        local = permutation.indices(positions - int(self._window_starts[window]))
        slot = np.searchsorted(offsets, local, side="right") - 1
        shards = self.shard_order[window * self.window_shards + slot]
        return self.starts[shards] + (local - offsets[slot])


class ShardAwareShuffle(WindowedShuffle):
    """Shuffle the shard order, then shuffle within windows of `window_shards` shards.

    Shards are consecutive runs of `shard_size` indices (the last may be shorter). The shard
    order is a keyed permutation; window w covers shards order[w*W:(w+1)*W], and its samples are
    permuted by a keyed permutation of their own. A sequential-read source needs only the W
    shards of the current window open at once. W = number of shards is a full shuffle of every
    sample; W = 1 only shuffles inside each shard.
    """

    algorithm = "shard_window_feistel"
    identity_fields = ("n", "seed", "epoch", "shard_size", "window_shards")

    def __init__(self, *, n: int, seed: int, epoch: int = 0, shard_size: int, window_shards: int):
        check_n(n)
        self.n, self.seed, self.epoch = as_int("n", n), as_int("seed", seed), as_int("epoch", epoch)
        self.shard_size, self.window_shards = as_int("shard_size", shard_size), as_int("window_shards", window_shards)
        if self.shard_size < 1 or self.window_shards < 1:
            raise ConfigError(f"shard_size={shard_size} and window_shards={window_shards} must both be >= 1")
        num_shards = -(-self.n // self.shard_size)
        check_shard_count(self.n, self.shard_size, num_shards)
        sizes = np.full(num_shards, self.shard_size, dtype=np.int64)
        sizes[-1] = self.n - (num_shards - 1) * self.shard_size
        self._lay_out(sizes, ("shards", "window"))


def check_shard_count(n: int, shard_size: int, num_shards: int) -> None:
    """Refuse a layout whose per-shard arrays would not fit in RAM (the shard order is held in full)."""
    if num_shards > MAX_SHARDS:
        need = num_shards * BYTES_PER_SHARD
        raise ConfigError(f"n={n:,} in shards of shard_size={shard_size:,} is {num_shards:,} shards; "
                          f"ShardAwareShuffle holds ~{BYTES_PER_SHARD} bytes per shard in RAM "
                          f"({need / 2**30:,.1f} GiB), more than the {MAX_SHARDS:,} shards it allows: pass "
                          f"shard_size >= {-(-n // MAX_SHARDS):,} (the source's real shard size), or use "
                          "GlobalShuffle, whose state and memory are O(1) at any n")
