"""A keyed bijection of [0, n): an unbalanced Feistel network over 2^bits, cycle-walked into [0, n).

O(1) memory and random access: the image of any position costs 8 rounds of splitmix64 (plus < 2
walks on average), in Python ints or vectorized over numpy uint64. Trade-off: a keyed permutation,
not a uniform draw from all n! orders, but indistinguishable from one in every statistic we measure.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nblib.shuffle.keyed_random import MASK64, check_n, splitmix64


class FeistelPermutation:
    """A keyed bijection of [0, n): an unbalanced Feistel network over 2^bits, cycle-walked.

    The domain is the next power of two >= n (at least 4), split into a high and a low part that
    swap widths every round (an even number of rounds, so the widths end where they began). Each
    round is a bijection, so the network is; cycle-walking (re-encrypt while the value is >= n)
    keeps it a bijection of [0, n) with < 2 rounds of walking on average. `index_at` (Python ints)
    and `indices` (numpy uint64 arrays) share `feistel_pass`.
    """

    def __init__(self, n: int, keys: Sequence[int]):
        check_n(n)
        if len(keys) % 2:
            raise ValueError(f"a Feistel network here needs an even number of round keys, got {len(keys)}")
        self.n = int(n)
        self.keys = tuple(int(k) & MASK64 for k in keys)
        self.bits = max(2, (self.n - 1).bit_length())

    def index_at(self, position: int) -> int:
        """The image of one position (pure Python ints)."""
        position = int(position)
        if not 0 <= position < self.n:
            raise IndexError(f"position {position} is outside [0, {self.n})")
        value = feistel_pass(position, self.bits, self.keys)
        while value >= self.n:
            value = feistel_pass(value, self.bits, self.keys)
        return value

    def indices(self, positions) -> np.ndarray:
        """The images of many positions at once (vectorized, int64)."""
        values = feistel_pass(np.atleast_1d(np.asarray(positions, dtype=np.uint64)), self.bits, self.keys)
        walking = values >= self.n
        while walking.any():
            values[walking] = feistel_pass(values[walking], self.bits, self.keys)
            walking = values >= self.n
        return values.astype(np.int64)


def feistel_pass(value, bits: int, keys: Sequence[int]):
    """One pass of the unbalanced Feistel network over [0, 2^bits) (ints or uint64 arrays)."""
    high_bits, low_bits = bits - bits // 2, bits // 2
    for key in keys:
        high, low = value >> low_bits, value & ((1 << low_bits) - 1)
        mixed = high ^ (splitmix64(low, key) & ((1 << high_bits) - 1))
        value = (low << high_bits) | mixed
        high_bits, low_bits = low_bits, high_bits
    return value
