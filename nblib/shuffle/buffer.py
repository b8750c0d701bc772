"""tf.data's streaming shuffle buffer, re-implemented over sample indices so its state is tiny and exact.

The state is the RNG counter, the source cursor and the buffered *indices*: about 5.3 bytes per
buffered element (base64 of uint32) where tf.data writes the samples themselves (~500 KB each).
Trade-off: quality still depends on the buffer size, exactly as in tf.data; reads stay sequential.
"""
from __future__ import annotations

from collections.abc import Iterator

from nblib.errors import ConfigError, StateError
from nblib.shuffle.keyed_random import check_n, derive_keys, draw_below
from nblib.shuffle.state import (
    as_int,
    decode_indices,
    encode_indices,
    int_field,
    open_state,
    seal,
    state_header,
    verify_checksum,
)


class ResumableShuffleBuffer:
    """tf.data's `shuffle(buffer_size)` over indices 0..n-1, with a small, exact state.

    Algorithm (as ShuffleDatasetOp's iterator, tensorflow/core/kernels/data/shuffle_dataset_op.cc):
    before each output the ring buffer is topped up from the source until it holds
    `buffer_size` elements (or the source ends); then a slot is drawn uniformly among the
    buffered elements, its element is emitted, and the oldest buffered element is moved into
    that slot; the next source element goes to the freed end of the ring. When the source is
    exhausted the buffer drains the same way. Differences from tf.data, documented: the random
    stream is a keyed splitmix64 counter (tf.data uses Philox seeded from its seed pair), and the
    slot is drawn by multiply-shift of a 64-bit word (tf.data: a 32-bit word modulo the count),
    so orders match tf.data in distribution, not element for element. One epoch only (tf.data's
    `reshuffle_each_iteration` with `repeat` spans epochs in one buffer; here make a new object
    with `epoch=e+1`).
    """

    algorithm = "shuffle_buffer"
    identity_fields = ("n", "seed", "epoch", "buffer_size")

    def __init__(self, *, n: int, buffer_size: int, seed: int, epoch: int = 0):
        check_n(n)
        n, buffer_size, seed, epoch = (as_int(k, v) for k, v in
                                       (("n", n), ("buffer_size", buffer_size), ("seed", seed), ("epoch", epoch)))
        if buffer_size < 1:
            raise ConfigError(f"buffer_size={buffer_size} must be >= 1 (1 means no shuffling)")
        self.n, self.buffer_size, self.seed, self.epoch = int(n), int(buffer_size), int(seed), int(epoch)
        self._key = derive_keys("buffer", self.seed, self.epoch, self.n, count=1)[0]
        self._ring = [0] * min(self.buffer_size, max(self.n, 1))
        self.emitted = 0  # outputs so far; also the RNG counter and the ring's start
        self.cursor = 0  # next source index to read; also the ring's end

    def __iter__(self) -> Iterator[int]:
        """Yield the remaining source indices; the object's state follows every yield."""
        ring, size, n, limit = self._ring, len(self._ring), self.n, self.buffer_size
        while True:
            while self.cursor - self.emitted < limit and self.cursor < n:
                ring[self.cursor % size] = self.cursor
                self.cursor += 1
            count = self.cursor - self.emitted
            if count == 0:
                return
            slot = (self.emitted + draw_below(self._key, self.emitted, count)) % size
            start = self.emitted % size
            index = ring[slot]
            ring[slot] = ring[start]
            self.emitted += 1
            yield index

    def __len__(self) -> int:
        """How many indices this epoch still yields (`remaining`), so `list(shuffle)` sizes itself right."""
        return self.remaining

    @property
    def remaining(self) -> int:
        """How many indices this epoch still yields."""
        return self.n - self.emitted

    def buffered_indices(self) -> list[int]:
        """The source indices held in the buffer now, oldest first (what a restore re-fetches)."""
        size = len(self._ring)
        return [self._ring[p % size] for p in range(self.emitted, self.cursor)]

    def state_dict(self) -> dict:
        """A checksummed manifest record (JSON-serializable): RNG counter (= emitted), cursor, buffered indices."""
        progress = {"emitted": self.emitted, "cursor": self.cursor, **encode_indices(self.buffered_indices(), self.n)}
        return seal({**state_header(self), **progress})

    def load_state_dict(self, state: dict | str, *, allow_unchecked: bool = False) -> None:
        """Continue from `state` (a dict or its JSON text); refuse one from another shuffle or edited.

        allow_unchecked: also load a version-1 state, which has no checksum (refused by default).
        """
        state, fields = open_state(self, state, allow_unchecked=allow_unchecked)
        emitted = int_field(fields, "emitted", 0, self.n)
        cursor = int_field(fields, "cursor", 0, self.n)
        expected_cursor = 0 if emitted == 0 else min(self.n, emitted - 1 + self.buffer_size)
        if cursor != expected_cursor:
            raise StateError(f"state field 'cursor' is {cursor}, but after {emitted} outputs with "
                             f"buffer_size={self.buffer_size} it must be {expected_cursor}: the state is corrupt")
        buffered = decode_indices(fields, self.n, expected_len=cursor - emitted)
        if buffered.size and int(buffered.max()) >= cursor:
            raise StateError(f"state field 'buffer' holds index {int(buffered.max())} >= cursor {cursor}: "
                             "the state is corrupt")
        verify_checksum(state, ("emitted", "cursor", "buffer_crc32"))
        size = len(self._ring)
        for offset, index in enumerate(buffered.tolist()):
            self._ring[(emitted + offset) % size] = index
        self.emitted, self.cursor = emitted, cursor
