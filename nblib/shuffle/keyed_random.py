"""Keyed, counter-based randomness shared by every shuffle: BLAKE2b round keys and splitmix64.

The k-th draw is a pure function of (key, k), so a shuffle's state never holds RNG internals: the
buffer's draw counter is its output count. Trade-off: statistically strong (splitmix64's finalizer)
and bit-exact in Python ints, numpy uint64 and TF ops (nblib.tfdata mirrors it), but not cryptographic.
"""
from __future__ import annotations

import hashlib

from nblib.errors import ConfigError

FEISTEL_ROUNDS = 8
MAX_N = 2**62
MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def derive_keys(tag: str, seed: int, epoch: int, *extra: int, count: int = FEISTEL_ROUNDS) -> list[int]:
    """`count` 64-bit keys from (tag, seed, epoch, extra...) via BLAKE2b."""
    text = "/".join(["nblib.shuffle", tag, str(seed), str(epoch), *map(str, extra)])
    digest = hashlib.blake2b(text.encode(), digest_size=8 * count).digest()
    return [int.from_bytes(digest[8 * i:8 * i + 8], "little") for i in range(count)]


def splitmix64(value, key: int):
    """splitmix64's finalizer of (value + key) mod 2^64: works on Python ints and numpy uint64 arrays."""
    z = (value + key) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def draw_below(key: int, counter: int, bound: int) -> int:
    """The counter-th keyed random integer in [0, bound) (multiply-shift of a splitmix64 word)."""
    return (splitmix64((counter * GOLDEN_GAMMA) & MASK64, key) * bound) >> 64


def check_n(n: int) -> None:
    """Refuse an empty source or one larger than the 2^62 indices the uint64 arithmetic covers."""
    if not 1 <= int(n) <= MAX_N:
        raise ConfigError(f"n={n} must be in [1, 2^62]: the number of samples in the source")
