"""Read record shards one shard at a time: `RecordShards`, and `RecordShardShuffle`, exact at any cut.

`RecordShards(folder)` is the records of a complete folder as one indexable sequence (shards in
their index order, records in input order within each). One shard is open at a time: a read in
another shard closes the open one first, so the RAM a reader holds is one shard's mapped file plus
the record it decodes (`iter_shards` / `shard_records` decode a whole shard at once: the guide's
"load a shard, train on it", RAM about one decoded shard). Every read checks its record's xxh3
against the shard's table before decoding; opening checks each shard's stat (a hash where it
changed), and `check="first-touch"` also hashes each shard's whole file once per process.

`RecordShardShuffle` is `nblib.shuffle`'s shard-aware shuffle for shards of different sizes (a
group key's last shard is short): the shard order is a keyed permutation and the records of each
window of `window_shards` shards are permuted together, so a window's shards are the only ones a
reader touches while it is served (window 1: one shard resident). Its state is a position (an
`nblib.shuffle` state record), so a run cut at any record resumes with exactly the next one.
Trade-off, as for ShardAwareShuffle: a record stays within its window, neighbours share a shard.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import xxhash

from nblib.cache.format import check_listed_shards, corrupt_error, damaged_error, open_listed_shard, open_packed
from nblib.cache.record_format import RECORD_SHAPE, decode_record, read_record_manifest, record_coder
from nblib.errors import CacheError, ConfigError
from nblib.shuffle.keyed_random import check_n
from nblib.shuffle.positional import PositionalShuffle
from nblib.shuffle.shard_aware import WindowedShuffle
from nblib.shuffle.state import as_int

CHECKS = ("record", "first-touch", "off")


class RecordShards:
    """A folder of record shards as a sequence of records (dicts of arrays and scalars), one shard open.

    Args:
        folder: a complete folder `write_records` (or `cache --records`) wrote.
        check: "record" (each record's xxh3 before it is decoded), "first-touch" (also each shard's
            whole-file xxh3 once per process) or "off".

    Raises:
        CacheError: no record shards there, an incomplete folder (rerun the command to finish it), or a
            listed shard missing, resized or hashing differently (the message says how to repair it).
    """

    def __init__(self, folder: str | Path, *, check: str = "record"):
        if check not in CHECKS:
            raise ConfigError(f"check={check!r} is not one of {CHECKS}")
        self.folder, self.check = Path(folder), check
        self.manifest = read_record_manifest(self.folder)
        if not self.manifest.get("complete"):
            raise CacheError(f"{self.folder} is not complete ({len(self.manifest['shards'])} shards written "
                             f"so far): rerun the same cache --records (write_records) call to finish it")
        self.shards = self.manifest["shards"]
        self.counts = np.array([s["count"] for s in self.shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)])
        self._open: tuple | None = None   # (shard number, mapped bytes, offsets, base, checksums)
        self._touched: set[str] = set()
        check_listed_shards(self.folder, self.shards, self._damaged)

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def keys(self) -> list:
        """The group key of each shard (None everywhere without grouping)."""
        return [s["key"] for s in self.shards]

    def locate(self, index: int) -> tuple[int, int]:
        """(shard number, record number inside it) of record `index`."""
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} is out of range for {len(self):,} records")
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        return shard, index - int(self.starts[shard])

    def __getitem__(self, index: int) -> dict:
        return self.record(*self.locate(index))

    def record(self, shard: int, local: int) -> dict:
        """Record `local` of shard `shard`, its xxh3 checked, decoded (the open shard changes if needed)."""
        _n, data, offsets, base, checksums = self._handle(shard)
        with memoryview(data)[base + int(offsets[local]): base + int(offsets[local + 1])] as blob:  # no copy
            if self.check != "off" and xxhash.xxh3_64_intdigest(blob) != int(checksums[local]):
                raise self._corrupt(shard, local, "its bytes do not match the shard's xxh3 table")
            try:
                decompress = record_coder(self.manifest["codec"], self.manifest["codec_level"])[1]  # cached
                return decode_record(decompress(blob))
            except Exception as exc:  # zstd errors and malformed payloads: both mean the bytes are wrong
                raise self._corrupt(shard, local, f"it does not decode ({exc})") from None

    def shard_records(self, shard: int) -> list[dict]:
        """Every record of one shard, decoded (RAM: that shard decoded)."""
        return [self.record(shard, k) for k in range(int(self.counts[shard]))]

    def iter_shards(self) -> Iterator[tuple[dict, list[dict]]]:
        """(manifest entry, records) of each shard in turn; one decoded shard in RAM at a time."""
        for shard, entry in enumerate(self.shards):
            records = self.shard_records(shard)
            self.close()
            yield entry, records
            del records

    def iter_records(self, shuffle: PositionalShuffle | None = None) -> Iterator[dict]:
        """Every record in order, or in `shuffle`'s order from its position (its state follows)."""
        if shuffle is None:
            for shard in range(len(self.shards)):
                for local in range(int(self.counts[shard])):
                    yield self.record(shard, local)
            return
        for index in shuffle:
            yield self[index]

    def shuffle(self, *, seed: int, epoch: int = 0, window_shards: int = 1) -> RecordShardShuffle:
        """A `RecordShardShuffle` over these shards."""
        return RecordShardShuffle(counts=self.counts.tolist(), seed=seed, epoch=epoch, window_shards=window_shards)

    def close(self) -> None:
        """Release the open shard's map."""
        if self._open is not None:
            with contextlib.suppress(BufferError):
                self._open[1].close()
            self._open = None

    def __getstate__(self):
        return {**self.__dict__, "_open": None, "_touched": set()}  # each process opens and checks for itself

    def __repr__(self) -> str:
        return (f"RecordShards({str(self.folder)!r}: {len(self):,} records in {len(self.shards)} shards, "
                f"group_by={self.manifest['group_by']!r})")

    # ------------------------------------------------------------------------------ internals

    def _handle(self, shard: int) -> tuple:
        if self._open is not None and self._open[0] == shard:
            return self._open
        self.close()  # one shard resident at a time
        entry = self.shards[shard]
        opened = open_listed_shard(self.folder, entry, partial(open_packed, count=entry["count"],
                                                               codec=self.manifest["codec"], shape=RECORD_SHAPE),
                                   self._damaged, self._touched if self.check == "first-touch" else None, "records")
        self._open = (shard, *opened)
        return self._open

    def _damaged(self, name: str, why: str) -> CacheError:
        return damaged_error(self.folder, name, why, rerun="cache --records")

    def _corrupt(self, shard: int, local: int, why: str) -> CacheError:
        name = self.shards[shard]["file"]
        return corrupt_error(self.folder, "record", int(self.starts[shard]) + local, local, name, why)


class RecordShardShuffle(WindowedShuffle):
    """Shuffle the shard order, then the records within each window of `window_shards` shards.

    Shards may hold different numbers of records (`counts`). Constructor arguments are keyword-only;
    the state's identity is (n, seed, epoch, window_shards, layout), layout being an xxh3 of the
    counts, so a state of another folder's shards is refused.
    """

    algorithm = "record_shard_window_feistel"
    identity_fields = ("n", "seed", "epoch", "window_shards", "layout")

    def __init__(self, *, counts, seed: int, epoch: int = 0, window_shards: int = 1):
        self.counts = np.asarray([as_int("counts", c) for c in counts], dtype=np.int64)
        if self.counts.size == 0 or (self.counts < 1).any():
            raise ConfigError(f"counts={list(counts)[:8]} must be one count >= 1 per shard")
        self.n = int(self.counts.sum())
        check_n(self.n)
        self.seed, self.epoch = as_int("seed", seed), as_int("epoch", epoch)
        self.window_shards = as_int("window_shards", window_shards)
        if self.window_shards < 1:
            raise ConfigError(f"window_shards={window_shards} must be >= 1 (1: one shard resident)")
        self.layout = xxhash.xxh3_64_intdigest(self.counts.astype("<i8").tobytes())
        self._lay_out(self.counts, ("record-shards", "record-window"), self.layout)

    def fresh(self, **changes) -> RecordShardShuffle:
        """The same shuffle at the start of its epoch (with `changes`, e.g. epoch=2)."""
        arguments = {"counts": self.counts.tolist(), "seed": self.seed, "epoch": self.epoch,
                     "window_shards": self.window_shards, **changes}
        arguments.pop("n", None)
        arguments.pop("layout", None)
        return RecordShardShuffle(**arguments)
