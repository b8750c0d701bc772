"""The full shuffle: a keyed pseudorandom permutation of [0, n) per (seed, epoch), by a Feistel network.

Every sample can land anywhere, so quality is that of a uniform random permutation; the state is
(seed, epoch, position), a few dozen bytes at any n. Trade-off: reads are fully random, so the
source must be random access (an in-memory array, a cache with O(1) lookup), not a sequential stream.
"""
from __future__ import annotations

import numpy as np

from nblib.shuffle.feistel import FeistelPermutation
from nblib.shuffle.keyed_random import derive_keys
from nblib.shuffle.positional import PositionalShuffle
from nblib.shuffle.state import as_int


class GlobalShuffle(PositionalShuffle):
    """A keyed pseudorandom permutation of [0, n) keyed by (seed, epoch): O(1) memory, exact state."""

    algorithm = "global_feistel"
    identity_fields = ("n", "seed", "epoch")

    def __init__(self, *, n: int, seed: int, epoch: int = 0):
        self.n, self.seed, self.epoch = as_int("n", n), as_int("seed", seed), as_int("epoch", epoch)
        self._permutation = FeistelPermutation(self.n, derive_keys("global", self.seed, self.epoch, self.n))
        self.position = 0

    @property
    def permutation(self) -> FeistelPermutation:
        """The keyed Feistel permutation (n, bits, keys) behind this shuffle."""
        return self._permutation

    def index_at(self, position: int) -> int:
        """The source index at output position `position` (random access)."""
        return self._permutation.index_at(position)

    def indices(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Source indices of output positions [start, stop) as an int64 array."""
        start, stop = self.check_range(start, stop)
        return self._permutation.indices(np.arange(start, stop, dtype=np.uint64))
