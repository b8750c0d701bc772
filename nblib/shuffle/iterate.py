"""Using any shuffle: fetch samples in its order, take its whole remaining order, skip ahead, restart.

These work on every shuffle through its common surface (iteration, `remaining`, `state_dict`,
`identity_fields`), vectorized where the shuffle is positional. Trade-off: skipping ahead in a
buffer shuffle replays its index stream (cheap: indices only, no samples), a positional one jumps.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from nblib.shuffle.state import state_fields


def iter_samples(source, shuffle) -> Iterator[Any]:
    """Yield `source[i]` in the shuffle's order; after a restore, continues with the next sample.

    Only indices are ever buffered, so restoring a `ResumableShuffleBuffer` re-fetches its
    buffered samples by index as they come out (see `buffered_indices` to prefetch them).
    """
    for index in shuffle:
        yield source[index]


def full_order(shuffle) -> np.ndarray:
    """The indices the shuffle still yields, as an int64 array (vectorized where possible)."""
    if hasattr(shuffle, "indices") and hasattr(shuffle, "position"):
        return shuffle.indices(shuffle.position, shuffle.n)
    return np.fromiter(iter(shuffle), dtype=np.int64, count=shuffle.remaining)


def fresh_like(shuffle, **changes):
    """A new shuffle with the same arguments (but `changes`), at the start of its epoch.

    A shuffle whose arguments are more than its identity fields (RecordShardShuffle's shard
    counts) builds its own copy through its `fresh(**changes)`.
    """
    if hasattr(shuffle, "fresh"):
        return shuffle.fresh(**changes)
    arguments = {name: getattr(shuffle, name) for name in shuffle.identity_fields}
    return type(shuffle)(**{**arguments, **changes})


def advance(shuffle, steps: int) -> None:
    """Skip `steps` outputs (O(1) for the positional shuffles, replay for the buffer)."""
    if hasattr(shuffle, "position"):
        shuffle.position = min(shuffle.n, shuffle.position + steps)
        return
    iterator = iter(shuffle)
    for _ in range(steps):
        next(iterator)


def outputs_done(state: dict) -> int:
    """How many outputs of the epoch a state has already yielded."""
    fields = state_fields(state)
    return int(fields["emitted"] if "emitted" in fields else fields["position"])
