"""What the permutation shuffles share: iterate from a position, random access, state = identity + position.

A positional shuffle maps output position p to a source index by a pure function, so its whole
progress is one integer, covered by the state's checksum. Trade-off against the buffer: O(1)
state and random access to any position, but reads land anywhere, so the source must be random access.
"""
from __future__ import annotations

import operator
from collections.abc import Iterator

import numpy as np

from nblib.errors import ConfigError
from nblib.shuffle.state import int_field, open_state, seal, state_header, verify_checksum

CHUNK = 8192  # positions computed per vectorized call while iterating


class PositionalShuffle:
    """Base of GlobalShuffle and ShardAwareShuffle: subclasses give `index_at` and `indices`."""

    algorithm = ""
    identity_fields: tuple[str, ...] = ()
    n: int
    position: int

    def index_at(self, position: int) -> int:
        """The source index at output position `position` (random access)."""
        raise NotImplementedError

    def indices(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Source indices of output positions [start, stop) as an int64 array."""
        raise NotImplementedError

    def __getitem__(self, position: int) -> int:
        """`shuffle[i]` is `shuffle.index_at(i)`."""
        return self.index_at(position)

    def __iter__(self) -> Iterator[int]:
        """Yield the remaining source indices (vectorized chunks); `position` follows every yield."""
        while self.position < self.n:
            start = self.position
            for offset, index in enumerate(self.indices(start, start + CHUNK).tolist()):
                self.position = start + offset + 1
                yield index

    def __len__(self) -> int:
        """How many indices this epoch still yields (`remaining`), so `list(shuffle)` sizes itself right."""
        return self.remaining

    @property
    def remaining(self) -> int:
        """How many indices this epoch still yields."""
        return self.n - self.position

    def state_dict(self) -> dict:
        """A checksummed manifest record (JSON-serializable): the shuffle's arguments and the position."""
        return seal({**state_header(self), "position": self.position})

    def load_state_dict(self, state: dict | str, *, allow_unchecked: bool = False) -> None:
        """Continue from `state` (a dict or its JSON text); refuse one from another shuffle or edited.

        allow_unchecked: also load a version-1 state, which has no checksum (refused by default).
        """
        state, fields = open_state(self, state, allow_unchecked=allow_unchecked)
        position = int_field(fields, "position", 0, self.n)
        verify_checksum(state, ("position",))
        self.position = position

    def check_range(self, start: int, stop: int | None) -> tuple[int, int]:
        """(start, stop) of an `indices` call as ints clipped to n; ConfigError for a negative or reversed range."""
        start = operator.index(start)
        stop = self.n if stop is None else min(operator.index(stop), self.n)
        if not 0 <= start <= self.n or stop < 0:
            raise ConfigError(f"indices(start={start}, stop={stop}) of a shuffle of n={self.n}: positions run "
                              f"from 0 to n; pass 0 <= start <= stop <= {self.n}")
        return start, max(start, stop)
