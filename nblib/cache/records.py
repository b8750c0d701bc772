"""Record shards: records of tensors into size-bounded shards, grouped by a key, written resumably.

`write_records(records, out, shard_mb=400, group_by="layer_id")` streams records into `shard-NNNNN.rec`
files of at most `shard_mb` MB on disk each, in the RAM of about one record (what records are, and the
figures: docs/formats.md). With `group_by`, a shard holds the records of one key only, in input order,
and a key larger than a shard spans several shards of its own (the sharding guide's layer-aware grouping).

Grouping a stream without holding it: one open shard writer per key, each streaming its stored
records straight to its temporary file on disk, so RAM holds one record plus 16 bytes per record
of each open shard's tables, whatever the shard size; a shard closes before the record that would
take it past `shard_mb`. Trade-off against the two-pass alternative (index each key's offsets in a
first pass, write key by key in a second): one pass over the input, which may be a generator
(a file is read again from its start to resume or repair), and no seekable copy needed; but one
open file per key at a time, bounded by
`max_open_groups` (refused past it with the numbers: sort the input by key, or raise the cap), and
the shards of different keys fill the disk's write cache side by side.

Shard numbers are given when a shard opens, in input order, so the layout is a pure function of
the input and the layout settings. A killed run resumes by reading the input again from its
start: records of shards already listed are hashed, not compressed or written (their payloads'
xxh3 must equal the one recorded, else the input is another one and the run is refused), damaged
listed shards are rewritten to their recorded sha256, and the rest is written as in an
uninterrupted run, so the folder ends with the same bytes. Every shard is atomic and the manifest
(`nblib.cache.record_format`) is rewritten after each one; the folder is locked while written.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from nblib.atomic import leftover_temporaries, remove_temporaries, sha256_json
from nblib.cache.codecs import CODECS
from nblib.cache.format import (
    DAMAGED,
    HEADER,
    TRAILER,
    current_stat,
    manifest_or_none,
    read_shard_stats,
    record_shard_stats,
    shard_bytes,
    shard_state,
    warn_many_files,
)
from nblib.cache.pickle_globals import record_fields
from nblib.cache.populate import _clear, cache_bytes_on_disk, cache_folder, cache_lock
from nblib.cache.record_format import (
    MANIFEST,
    RECORD_CODECS,
    RECORD_LAYOUT,
    RecordShardWriter,
    as_field,
    check_schema,
    encode_record,
    field_schema,
    read_record_manifest,
    record_coder,
    write_record_manifest,
)
from nblib.cache.record_sources import RecordSource
from nblib.errors import CacheError, ConfigError, InputError
from nblib.units import fmt_bytes

log = logging.getLogger(__name__)

MAX_OPEN_GROUPS = 256    # open shard writers (one file each) while grouping an unsorted stream
TABLE_BYTES = 16         # a record's offset + xxh3 in its shard's tables
SHARD_FIXED = HEADER.size + TRAILER.size + 8   # a shard's header, trailer and last offset: on disk = these + records


@dataclass(frozen=True)
class RecordSummary:
    """What a `write_records` run did: records, shards and keys in the folder, what it wrote, speed."""

    cache_dir: str
    n_records: int
    n_shards: int
    n_keys: int
    shards_written: int
    shards_reused: int
    shards_repaired: int
    records_read: int
    seconds: float
    bytes_on_disk: int
    raw_bytes: int

    @property
    def records_per_s(self) -> float:
        return self.records_read / self.seconds if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        return (f"records {self.cache_dir}: {self.n_records:,} records in {self.n_shards} shards "
                f"({self.n_keys} key(s); {fmt_bytes(self.bytes_on_disk)} on disk, "
                f"{fmt_bytes(self.raw_bytes)} uncompressed); this run wrote {self.shards_written} "
                f"shards (repaired {self.shards_repaired}) and reused {self.shards_reused}, reading "
                f"{self.records_per_s:,.0f} records/s")


def write_records(records, out: str | Path, *, shard_mb: float = 400, group_by: str | None = None,
                  codec: str = "zstd", codec_level: int | None = None, overwrite: bool = False,
                  max_open_groups: int = MAX_OPEN_GROUPS) -> RecordSummary:
    """Write `records` into record shards at `out`, resuming (or repairing) whatever is there.

    Args:
        records: an iterable of dicts, dataclasses, namedtuples or objects (fields: numpy arrays or torch
            tensors, bf16 included, and int/float/bool/str/None scalars; shapes may differ between
            records, fields and dtypes may not), or a
            `RecordSource` (`record_source(path)`). A resume or repair reads it again from its start.
        out: the folder (created; a folder of its own).
        shard_mb: the most MB (10^6 bytes) a shard takes on disk, header and tables included (one
            larger record gets a shard alone); RAM holds one record and its payload (2-3x the
            record's bytes), whatever the shard size.
        group_by: a scalar field whose records share shards (e.g. "layer_id"); None: input order.
        codec: "zstd" (each record compressed alone) or "raw".
        codec_level: zstd's level (1-22, default 3).
        overwrite: delete other record shards in `out` instead of refusing.
        max_open_groups: the most keys with a shard open at once.

    Returns:
        A `RecordSummary`.

    Raises:
        InputError (no records, a record without the group field or with other fields or dtypes than
        the first), ConfigError (codec, level, shard_mb, too many open keys), CacheError (other
        shards there, another input on resume), BudgetExceeded (the disk), FolderBusyError.
    """
    started = time.perf_counter()
    layout = record_layout(shard_mb, group_by, codec, codec_level)
    source = records.describe() if isinstance(records, RecordSource) else {"kind": "iterable", "path": None,
                                                                           "bytes": None}
    out = cache_folder(out, "record shards need a folder of their own")
    with cache_lock(out) as lock:
        old = _resumable(out, layout, source)
        if old is None and ((out / MANIFEST).exists() or any(out.glob("shard-*")) or leftover_temporaries(out)):
            if not overwrite:
                raise CacheError(f"the folder {out} holds other shards (another input, codec, shard size or "
                                 f"group key); pass overwrite=True (--overwrite) to rebuild it, or pick "
                                 f"another --out")
            _clear(out)
        remove_temporaries(out)
        _preflight(out, source, old)
        run = _ShardRun(out, layout, source, old, lock, max_open_groups)
        count = 0
        try:
            for count, record in enumerate(records, start=1):
                run.add(count - 1, record_fields(record))
            manifest = run.finish(count)
        except BaseException:
            run.abandon()  # the shards still open leave no temporary file; the listed ones stay
            raise
    shards = manifest["shards"]
    warn_many_files(len(shards) + 1, out, shard_mb)
    return RecordSummary(
        cache_dir=str(out), n_records=count, n_shards=len(shards), n_keys=len({repr(s["key"]) for s in shards}),
        shards_written=run.written, shards_reused=run.reused, shards_repaired=run.repaired, records_read=count,
        seconds=time.perf_counter() - started, bytes_on_disk=cache_bytes_on_disk(out),
        raw_bytes=sum(s["raw_bytes"] for s in shards))


def record_layout(shard_mb: float, group_by: str | None, codec: str, codec_level: int | None) -> dict:
    """The settings a resume must share with the run that began the folder (checked)."""
    if codec not in RECORD_CODECS:
        raise ConfigError(f"codec={codec!r} is not one for records; choose one of {RECORD_CODECS}")
    codec_level = CODECS[codec].level(codec_level)
    if group_by is not None and (not isinstance(group_by, str) or not group_by):
        raise ConfigError(f"group_by={group_by!r} must be the name of a scalar field, e.g. 'layer_id'")
    return {"codec": codec, "codec_level": codec_level, "shard_mb": shard_mb, "shard_bytes": shard_bytes(shard_mb),
            "group_by": group_by, "record_layout": RECORD_LAYOUT}


class _Slot:
    """The shard a key is filling: a new one (written), or one already listed (hashed or rewritten)."""

    def __init__(self, index: int, key, mode: str, entry: dict | None, writer: RecordShardWriter | None):
        self.index, self.key, self.mode, self.entry, self.writer = index, key, mode, entry, writer
        self.count = 0
        self.payloads = xxhash.xxh3_64()   # "skip": the payloads' hash, checked against the entry


class _ShardRun:
    """One pass over the input: give shard numbers in input order, write, skip or rewrite each shard."""

    def __init__(self, out: Path, layout: dict, source: dict, old: dict | None, lock, max_open_groups: int):
        self.out, self.layout, self.source, self.lock = out, layout, source, lock
        self.manifest = old
        self.was_complete = bool(old and old.get("complete"))
        self.done = {s["index"]: s for s in old["shards"]} if old else {}
        self.stats = read_shard_stats(out)
        self.max_open = max_open_groups
        self.compress = record_coder(layout["codec"], layout["codec_level"])[0]
        self.slots: dict = {}
        self.next_index = 0
        self.written = self.reused = self.repaired = 0

    def add(self, index: int, record) -> None:
        """Route one record to its key's shard, opening (or closing) shards as they fill."""
        if not isinstance(record, dict):
            encode_record(record, index)  # raises the InputError that names what a record is
        refuse_colliding_names(record, index)
        if self.manifest is None:
            self.manifest = self._fresh_manifest(record, index)
        check_schema(record, self.manifest["fields"], index)
        key = self._key(record, index)
        payload = encode_record(record, index)
        slot = self.slots.get(key)
        stored = None
        if slot is not None and slot.mode == "new":
            stored = self.compress(payload)
            writer = slot.writer
            if writer.count and SHARD_FIXED + writer.stored_bytes + len(stored) + TABLE_BYTES * (writer.count + 1) \
                    > self.layout["shard_bytes"]:
                self._commit(slot)
                slot = None
        if slot is None:
            slot = self.slots[key] = self._open(key)
        if slot.mode == "skip":
            slot.payloads.update(payload)
        else:
            slot.writer.add(self.compress(payload) if stored is None else stored, payload)
        slot.count += 1
        if slot.mode != "new" and slot.count == slot.entry["count"]:
            self._close_listed(slot)
            del self.slots[key]

    def finish(self, count: int) -> dict:
        """Commit the open shards, check the input covered every listed shard, record the source."""
        if self.manifest is None:
            raise InputError("write_records got no records; pass a non-empty iterable or file of records")
        for slot in sorted(self.slots.values(), key=lambda s: s.index):
            if slot.mode != "new":
                raise self._other_input(slot.entry, f"the input ended after {slot.count} of its records")
            self._commit(slot)
        missing = sorted(i for i in self.done if i >= self.next_index)
        if missing:
            raise self._other_input(self.done[missing[0]], "the input ended before it")
        shards = self.manifest["shards"]
        self.manifest["source"] = {**self.source, "n_records": count,
                                   "sha256": sha256_json([s["source_xxh3"] for s in shards])}
        self.manifest["complete"] = True
        self.manifest["n_records"] = count
        write_record_manifest(self.out, self.manifest)
        return self.manifest

    # ------------------------------------------------------------------------------ helpers

    def _fresh_manifest(self, record: dict, index: int) -> dict:
        manifest = {"source": {**self.source, "n_records": None, "sha256": None}, **self.layout,
                    "fields": field_schema(record), "complete": False, "n_records": None, "shards": []}
        if self.layout["group_by"] is not None:
            self._key(record, index)  # refuse a missing group field before writing anything
        write_record_manifest(self.out, manifest)
        return manifest

    def _key(self, record: dict, index: int):
        name = self.layout["group_by"]
        if name is None:
            return None
        if name not in record:
            raise InputError(f"record {index:,} has no field {name!r} to group by (its fields: "
                             f"{sorted(map(str, record))}); pass another --group-by or none")
        value = record[name]
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value.item()
        value = as_field(value, name, index)
        if isinstance(value, np.ndarray) or value is None or isinstance(value, float):
            raise InputError(f"record {index:,} field {name!r} is {type(value).__name__}; a group key "
                             f"is an int, str or bool (such as a layer id)")
        return value

    def _open(self, key) -> _Slot:
        index, self.next_index = self.next_index, self.next_index + 1
        entry = self.done.get(index)
        if entry is None:
            if self.was_complete:
                raise CacheError(f"{self.out} is complete with {len(self.done)} shards, and this input holds "
                                 f"more records: it is another input; pass overwrite=True (--overwrite) "
                                 f"to rebuild, or another --out")
            open_new = sum(1 for s in self.slots.values() if s.mode == "new")
            if open_new >= self.max_open:
                raise ConfigError(f"grouping by {self.layout['group_by']!r} needs more than {self.max_open} "
                                  f"shards open at once ({open_new} keys are filling one); sort the input "
                                  f"by {self.layout['group_by']!r} first (write each key's records together), "
                                  f"or build from Python with nblib.cache.write_records(..., "
                                  f"max_open_groups=N): `cache --records` has no flag for it (each open shard "
                                  f"is one open file)")
            return _Slot(index, key, "new", None, RecordShardWriter(self.out, index, key, self.layout["codec"]))
        if entry["key"] != key:
            raise self._other_input(entry, f"its key is {entry['key']!r}, the input gives {key!r}")
        state = shard_state(self.out, entry, stats=self.stats, digest="xxh3")
        if state in DAMAGED:
            log.info("rewriting %s shard %s from the input", state, entry["file"])
            return _Slot(index, key, "rewrite", entry, RecordShardWriter(self.out, index, key, self.layout["codec"]))
        if state == "touched":
            record_shard_stats(self.out, current_stat(self.out, entry))
        return _Slot(index, key, "skip", entry, None)

    def _commit(self, slot: _Slot) -> None:
        entry = slot.writer.commit()
        self.manifest["shards"].append(entry)
        self.lock.check()
        write_record_manifest(self.out, self.manifest)
        record_shard_stats(self.out, {entry["file"]: slot.writer.stat})
        self.written += 1
        log.info("wrote %s: %d records of key %r, %s", entry["file"], entry["count"], slot.key,
                 fmt_bytes(entry["bytes"]))

    def _close_listed(self, slot: _Slot) -> None:
        """A listed shard's records all came: check they are the ones written; commit a rewrite."""
        if slot.mode == "skip":
            if slot.payloads.hexdigest() != slot.entry["source_xxh3"]:
                raise self._other_input(slot.entry, "its records differ")
            self.reused += 1
            return
        if slot.writer.source_xxh3 != slot.entry["source_xxh3"]:
            slot.writer.discard()
            raise self._other_input(slot.entry, "its records differ")
        slot.writer.commit(expect_sha256=slot.entry["sha256"])
        record_shard_stats(self.out, {slot.entry["file"]: slot.writer.stat})
        self.repaired += 1
        self.written += 1

    def abandon(self) -> None:
        """Delete the temporary files of the shards still open (after an error)."""
        for slot in self.slots.values():
            if slot.writer is not None:
                slot.writer.discard()

    def _other_input(self, entry: dict, why: str) -> CacheError:
        self.abandon()
        return CacheError(f"this input is not the one {self.out} was written from (shard {entry['file']}: "
                          f"{why}): pass the same records in the same order to resume or repair, or "
                          f"overwrite=True (--overwrite) to rebuild")


def _resumable(out: Path, layout: dict, source: dict) -> dict | None:
    """The manifest to continue when it has these settings and this input's kind, path and size."""
    old = manifest_or_none(read_record_manifest, out)
    if old is None:
        return None
    same_source = all(old["source"].get(k) == source.get(k) for k in ("kind", "bytes")) and \
        (source.get("path") is None or old["source"].get("path") == source.get("path"))
    if not same_source or any(old.get(k) != v for k, v in layout.items()):
        return None
    return old


def _preflight(out: Path, source: dict, old: dict | None) -> None:
    """Refuse to start when the input's size (stored records take at most about that) does not fit the disk."""
    if not source.get("bytes"):
        return
    from nblib.budget import check_disk

    done = sum(s["bytes"] for s in old["shards"]) if old else 0
    check_disk(out, max(0, int(source["bytes"]) - done), what=f"record shards of {source['path']}",
               knob="free disk, or write --out on a larger disk")


def refuse_colliding_names(record: dict, index: int) -> None:
    """InputError naming two keys of a record that are one field name in the shards (names are strings: the
    keys 1 and '1' are both field '1'), instead of a field list that shows the name twice.
    """
    seen: dict[str, object] = {}
    for key in record:
        other = seen.setdefault(str(key), key)
        if other is not key:
            raise InputError(f"record {index:,} has the keys {other!r} ({type(other).__name__}) and {key!r} "
                             f"({type(key).__name__}), which are one field name, {str(key)!r}, in the shards "
                             f"(field names are strings): rename one of them in the input")
