"""Random damage to a valid pickle's bytes (byte flips, inserts, deletes, a cut): the mutation fuzz that
tests/test_pickle_differential.py runs through the readers and tests/test_pickle_fast.py through the C scan.
"""
from __future__ import annotations


def damaged(data: bytes, rng, edits: int) -> bytearray:
    """`data` after `edits` random edits drawn from `rng` (a numpy Generator); stops early once nothing is left."""
    data = bytearray(data)
    for _ in range(edits):
        if not data:
            break
        at, what = int(rng.integers(len(data))), rng.random()
        if what < 0.5:
            data[at] = int(rng.integers(256))
        elif what < 0.7:
            data.insert(at, int(rng.integers(256)))
        elif what < 0.9:
            del data[at]
        else:
            data = data[:at]
    return data
