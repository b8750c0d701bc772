"""Cache shard format: raw `.npy` or packed compressed blobs, each image with an xxh3 checksum.

A cache folder holds `manifest.json` (an `nblib.manifest` record of kind "nblib.cache": source
fingerprint, renderer parameters, codec and its options, and each shard's range, bytes, sha256 and
xxh3), the shards, and `manifest.stat.json`. Shards are cut by a target size:
`shard-00000.npy` for the `raw` codec (uint8 [n, H, W, 3]; `np.load` reads it, memory-mappable)
or `shard-00000.zlib` / `.pngs` / `.zst` for compressed codecs (header, one blob per image, a
uint64 offsets index, so any image reads alone and a shard streams to disk as its images arrive).
Every shard ends with a table of one xxh3-64 per image (of its stored bytes) and a trailer holding
the xxh3 of the header and of the tables: every read, random or in order, checks the bytes of the
image it serves. Codecs live in `nblib.cache.codecs` (the registry `CODECS`).

sha256 is identity (the manifest, each shard, the fingerprint), xxh3 is integrity on read paths,
and each shard's stat lives apart in `manifest.stat.json`, so two identical builds write identical
manifests: docs/formats.md, "Two hashes, two jobs".
"""
from __future__ import annotations

import json
import mmap
import struct
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xxhash

from nblib.atomic import AtomicWriter, npy_header, sha256_file
from nblib.budget.disk import CHECKSUM_BYTES, OFFSET_BYTES  # the record per image: the budget sizes it there
from nblib.cache.codecs import (
    CODECS,
    CodecSpec,
    codec_for,
    codec_spec,
)
from nblib.errors import CacheError, ConfigError, InputError, ManifestDamaged
from nblib.manifest import (
    parse_manifest,
    read_stat_cache,
    record_stats,
    stat_cache_path,
    stat_record,
    stat_vouches,
    write_manifest,
)
from nblib.units import MB

MANIFEST = "manifest.json"
STAT_CACHE = stat_cache_path(MANIFEST).name  # "manifest.stat.json": non-canonical, safe to delete
LEGACY_STAT_CACHE = "local-stat-cache.json"   # its name in caches written before: read, then replaced
MANIFEST_KIND = "nblib.cache"
RECORDS_KIND = "nblib.records"  # record shards' manifest (nblib.cache.record_format): the other folder of shards
MANIFEST_VERSION = 3    # 3: per-image xxh3 tables in shards, shard xxh3, stats moved to STAT_CACHE
OLD_VERSIONS = (2,)     # readable manifests of older layouts: refused with "rebuild"
SHARD_SUFFIX = {name: c.suffix for name, c in CODECS.items()}
DAMAGED = ("missing", "truncated", "corrupt")
WHY_DAMAGED = {"missing": "missing", "truncated": "of another size than the manifest records",   # a reader's words
               "corrupt": "not the shard the manifest records (its xxh3 differs)"}

# Packed shard: header, blobs, uint64 offsets [n + 1] (relative to the first blob), uint64 xxh3 [n],
# trailer. Raw shard: the .npy header, pixels, uint64 xxh3 [n], trailer.
SHARD_MAGIC = b"NBLSHRD3"
HEADER = struct.Struct("<8s4sIII")  # magic, codec, height, width, channels
TRAILER = struct.Struct("<QQQ8s")   # n images, xxh3 of the header, xxh3 of the tables, magic
# the folders of shards nblib reads, by manifest kind: (what such a folder holds, the flag that reads it)
SHARD_FOLDERS = {MANIFEST_KIND: ("images", "--cache"), RECORDS_KIND: ("record shards", "--records")}


# ====================================================================================== codecs


def measure_codecs(sample_images: Sequence[np.ndarray], codecs: Sequence[str] = tuple(CODECS),
                   min_seconds: float = 0.2, rounds: int = 3) -> dict[str, dict[str, float]]:
    """{codec: {"bytes_per_image", "decode_images_per_s"}} over sample images (one core).

    `nblib.budget.choose_codec` takes this dict as its codec_sizes (what `cache --codec auto` measures; elsewhere
    codec sizes travel as an `nblib.codec_sizes.CodecSizes`, which `nblib.budget.codec_stats` reads). Decode
    speed is the time to turn stored bytes back into an array, repeated over the sample for at least `min_seconds`,
    in `rounds` interleaved rounds (every codec once a round), of which each codec's fastest counts:
    a busy moment slows one round, not one codec's only figure, so the codecs' order holds on a
    shared machine. zstd is measured with a dictionary trained on the sample when that pays (as a
    cache would).
    """
    from nblib.cache.codecs import train_dictionary

    if len(sample_images) == 0:
        raise InputError("measure_codecs needs at least one sample image")
    shape = tuple(sample_images[0].shape)
    coders, blobs = {}, {}
    for codec in codecs:
        spec = codec_spec(codec)
        if codec == "zstd":
            spec = CodecSpec("zstd", spec.level, train_dictionary(sample_images, spec.level)[0])
        coders[codec] = codec_for(spec)
        blobs[codec] = [coders[codec].encode(image) for image in sample_images]
    rates = dict.fromkeys(codecs, 0.0)
    for _ in range(max(1, rounds)):
        for codec in codecs:
            decoded, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < min_seconds or decoded == 0:
                for blob in blobs[codec]:
                    np.array(coders[codec].decode(blob, shape))  # a copy, as a reader gets
                decoded += len(blobs[codec])
            rates[codec] = max(rates[codec], decoded / elapsed)
    return {codec: {"bytes_per_image": float(np.mean([len(b) for b in blobs[codec]])),
                    "decode_images_per_s": rates[codec]} for codec in codecs}


def shard_bytes(shard_mb: float) -> int:
    """The target stored bytes per shard; ConfigError unless shard_mb is a finite number > 0."""
    if isinstance(shard_mb, bool) or not isinstance(shard_mb, (int, float)) \
            or not 0 < shard_mb < float("inf"):
        raise ConfigError(f"shard_mb={shard_mb!r} must be a finite number > 0 (target MB per shard, "
                          f"e.g. 400 on Colab, 1 for smoke tests)")
    return int(shard_mb * MB)


def images_per_raw_shard(shard_size: int, shape) -> int:
    """Images in each full raw shard: as many as fit `shard_size` bytes, at least one."""
    return max(1, shard_size // int(np.prod(shape)))


# ====================================================================================== writing


class SealedShard:
    """One shard file (images or records) streamed to a temporary file: an `AtomicWriter` (sha256 as
    written) plus a whole-file xxh3. Its leading bytes, then each stored item (`add`: its xxh3 goes into
    the shard's checksum table), then `seal`: the tables and the trailer, fsync and rename. `discard` (or
    leaving a `with` block unsealed) deletes it. `source`: also hash what each item was stored from
    (the raw pixels, a record's payload: what a resume checks the input against).
    """

    def __init__(self, path: Path, leading: bytes, *, source: bool, **writer_options):
        self.name = path.name
        self.sizes: list[int] = []
        self.checksums: list[int] = []
        self.stored_bytes = 0
        self.stat: dict | None = None
        self._file_xxh3 = xxhash.xxh3_64()
        self._source = xxhash.xxh3_64() if source else None
        self._writer = AtomicWriter(path, **writer_options)
        self._leading = leading
        self._write(leading)

    def add(self, stored: bytes, source=None) -> None:
        """Append one item's stored bytes (and feed the bytes it was stored from to the source hash)."""
        self._write(stored)
        self.sizes.append(len(stored))
        self.checksums.append(xxhash.xxh3_64_intdigest(stored))
        self.stored_bytes += len(stored)
        if self._source is not None:
            self._source.update(source)

    def seal(self, expect_sha256: str | None, why: str, *, offsets: bool = True) -> dict:
        """Write the tables (the offsets index unless a raw shard's, the xxh3 table) and the trailer, fsync
        and rename; the entry's file, count, bytes, sha256 and xxh3 (and source_xxh3). `stat` then holds the
        file's stat for the stat cache. A re-written shard whose sha256 differs from its manifest's is a
        CacheError: `why` says what changed.
        """
        tables = np.array(self.checksums, dtype="<u8").tobytes()
        if offsets:
            ends = np.zeros(len(self.sizes) + 1, dtype="<u8")
            np.cumsum(self.sizes, out=ends[1:])
            tables = ends.tobytes() + tables
        self._write(tables)
        self._write(TRAILER.pack(len(self.sizes), xxhash.xxh3_64_intdigest(self._leading),
                                 xxhash.xxh3_64_intdigest(tables), SHARD_MAGIC))
        try:
            written = self._writer.commit(expect_digest=expect_sha256)
        except ValueError:
            raise CacheError(f"re-written {self.name} does not match its manifest sha256: {why} with "
                             f"overwrite=True (--overwrite)") from None
        self.stat = {"bytes": written.bytes, "mtime_ns": written.mtime_ns, "sha256": written.sha256}
        entry = {"file": self.name, "count": len(self.sizes), "bytes": written.bytes, "sha256": written.sha256,
                 "xxh3": self._file_xxh3.hexdigest()}
        if self._source is not None:
            entry["source_xxh3"] = self._source.hexdigest()
        return entry

    def discard(self) -> None:
        """Delete the temporary file; nothing is renamed (a no-op after seal)."""
        self._writer.discard()

    def _write(self, data) -> None:
        self._writer.write(data)
        self._file_xxh3.update(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.discard()


class ShardWriter(SealedShard):
    """Stream one image shard (a `SealedShard`); `commit` keeps it and returns its manifest entry.

    Raw shards need their image `count` up front (it is in the .npy header); packed shards append
    their offsets index at the end. `source_hash`: also record an xxh3 over the raw pixels passed to
    `add` (what `write_images` checks on resume).
    """

    def __init__(self, cache_dir: str | Path, index: int, start: int, codec: str | CodecSpec, shape,
                 count: int | None = None, *, source_hash: bool = False):
        spec = codec_spec(codec)
        if spec.name == "raw" and count is None:
            raise ValueError("a raw shard needs its image count up front")
        self.codec, self.shape, self.start, self.count = spec.name, tuple(shape), start, count
        super().__init__(Path(cache_dir) / shard_name(index, spec.name), leading_bytes(spec.name, self.shape, count),
                         source=source_hash)

    @property
    def stop(self) -> int:
        return self.start + len(self.sizes)

    def add(self, blob: bytes, pixels: np.ndarray | None = None) -> None:
        """Append one image's stored bytes (and feed its raw `pixels` to the source hash)."""
        super().add(blob, None if self._source is None else np.ascontiguousarray(pixels, dtype=np.uint8))

    def commit(self, expect_sha256: str | None = None) -> dict:
        """Finish, fsync and rename the shard; its manifest entry (range, bytes, sha256, xxh3)."""
        if self.codec == "raw" and len(self.sizes) != self.count:
            self.discard()
            raise CacheError(f"{self.name}: {len(self.sizes)} images written, header says {self.count}")
        entry = self.seal(expect_sha256, "the renderer, Pillow or the images changed since the cache was built; "
                                         "rebuild it", offsets=self.codec != "raw")
        return {**entry, "start": self.start, "stop": self.stop}


def write_shard(cache_dir: str | Path, index: int, start: int, items: Sequence, codec: str | CodecSpec, shape, *,
                source_hash: bool = False) -> tuple[dict, dict]:
    """Write a whole shard of stored images at once (what the benchmark times; with `source_hash`, `items` are
    (stored bytes, pixels) pairs); its manifest entry and {file: stat} for the stat cache.
    """
    with ShardWriter(cache_dir, index, start, codec, shape, count=len(items), source_hash=source_hash) as writer:
        for item in items:
            writer.add(*item) if source_hash else writer.add(item)
        return writer.commit(), {writer.name: writer.stat}


def leading_bytes(codec: str, shape, count: int | None) -> bytes:
    """The bytes before a shard's first image: the .npy header (raw), or the packed header."""
    if codec == "raw":
        return npy_header(np.uint8, (count, *shape))
    return HEADER.pack(SHARD_MAGIC, codec.encode().ljust(4, b"\0"), *shape)


def shard_name(index: int, codec: str) -> str:
    """The file name of shard `index` under `codec`: shard-00042.npy, .zlib, .pngs or .zst."""
    return f"shard-{index:05d}{SHARD_SUFFIX[codec]}"


def shard_index(name: str) -> int:
    """The index in a shard file name (inverse of `shard_name`)."""
    return int(name.split("-")[1].split(".")[0])


# ====================================================================================== checking


def shard_findings(folder: Path, shards: list[dict]) -> tuple[dict[str, list[str]], list[str]]:
    """A full check of every listed shard (stat and hash): {"missing"/"truncated"/"corrupt"/"touched": files},
    and the `shard-*` files the manifest does not list. Image caches and record shards share it.
    """
    found: dict[str, list[str]] = {state: [] for state in (*DAMAGED, "touched")}
    stats = read_shard_stats(folder)
    for entry in shards:
        state = shard_state(folder, entry, full=True, stats=stats)
        if state is not None:
            found[state].append(entry["file"])
    listed = {entry["file"] for entry in shards}
    return found, sorted(p.name for p in folder.glob("shard-*") if p.name not in listed)


def shard_state(cache_dir: Path, entry: dict, *, full: bool = False, stats: dict | None = None,
                digest: str = "sha256") -> str | None:
    """How a listed shard's file compares with its manifest entry.

    None: trusted (stat equal to the one the stat cache recorded for these bytes; with `full`,
    hashed too). "touched": its bytes hash to the recorded ones but its stat is not the recorded
    one (copied, or no stat recorded): record the new stat. "missing", "truncated" (size differs)
    or "corrupt" (hash differs): it must be rewritten. `digest`: "sha256" (identity: verify) or
    "xxh3" (integrity, ~10x faster: a reader's open). `stats`: the stat cache, read when None.
    """
    path = Path(cache_dir) / entry["file"]
    try:
        st = path.stat()
    except FileNotFoundError:
        return "missing"
    if st.st_size != entry["bytes"]:
        return "truncated"
    known = (read_shard_stats(cache_dir) if stats is None else stats).get(entry["file"])
    same_stat = isinstance(known, dict) and "sha256" in known and stat_vouches(known, st, entry["sha256"])
    if same_stat and not full:
        return None
    if not file_matches(path, entry, digest):
        return "corrupt"
    return None if same_stat else "touched"


def file_matches(path: Path, entry: dict, digest: str = "xxh3") -> bool:
    """True when the file's bytes hash to the entry's sha256 or xxh3."""
    if digest == "sha256" or "xxh3" not in entry:
        return sha256_file(path) == entry["sha256"]
    return xxh3_file(path) == entry["xxh3"]


def xxh3_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """xxh3-64 of a file's bytes (hex), read in 4 MiB chunks."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def damaged_error(cache_dir: Path, name: str, why: str, rerun: str = "populate / cache") -> CacheError:
    """The error a reader raises for a shard it cannot trust, with both ways to fix it (`rerun`: the command
    that wrote the folder).
    """
    return CacheError(f"shard {name} of {cache_dir} is {why}; run python -m nblib cache --verify "
                      f"--repair {cache_dir} (or rerun the same {rerun} command with the "
                      f"inputs at hand: it rewrites damaged shards)")


def corrupt_error(folder: Path, item: str, index: int, local: int, name: str, why: str) -> CacheError:
    """The error a reader raises for one image or record (`item`) whose stored bytes it cannot trust."""
    return CacheError(f"{item} {index:,} (number {local} of shard {name}) of {folder} is corrupt: {why}; it was "
                      f"not served. Run python -m nblib cache --verify --repair {folder}")


def check_listed_shards(folder: Path, shards: list[dict], damaged) -> list[dict]:
    """What a reader checks on open: `damaged(name, why)` (its error) for a listed shard that is missing,
    resized, or (stat changed) hashes differently; the shards whose stat changed but whose bytes match.
    """
    touched, stats = [], read_shard_stats(folder)
    for entry in shards:
        state = shard_state(folder, entry, stats=stats, digest="xxh3")
        if state == "touched":
            touched.append(entry)
        elif state is not None:
            raise damaged(entry["file"], WHY_DAMAGED[state])
    return touched


def open_listed_shard(folder: Path, entry: dict, opener, damaged, touched: set | None, items: str):
    """`opener(path)` of a listed shard; first, where `touched` is a set (check="first-touch") not yet holding
    its file, its whole-file xxh3 against the manifest's. `damaged(name, why)` for a malformed or changed
    shard: none of its `items` ("images", "records") is served.
    """
    path = folder / entry["file"]
    if touched is not None and entry["file"] not in touched:
        try:
            same = xxh3_file(path) == entry["xxh3"]
        except OSError as exc:
            raise damaged(entry["file"], f"unreadable ({exc})") from None
        if not same:
            raise damaged(entry["file"], f"not the shard the manifest records: its xxh3 differs (edited in "
                                         f"place, its size and mtime kept); none of its {items} was served")
        touched.add(entry["file"])
    try:
        return opener(path)
    except (OSError, ValueError) as exc:
        raise damaged(entry["file"], f"malformed ({exc})") from None


def open_packed(path: Path, count: int, codec: str, shape) -> tuple[mmap.mmap, np.ndarray, int, np.ndarray]:
    """Map a packed shard: (mapped bytes, offsets [n + 1], start of the blobs, xxh3 [n]).

    ValueError if malformed: header, trailer or tables that do not match their own xxh3.
    """
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        magic, stored_codec, *stored_shape = HEADER.unpack_from(data, 0)
        n, header_xxh3, tables_xxh3, end_magic = TRAILER.unpack_from(data, len(data) - TRAILER.size)
        index_at = len(data) - TRAILER.size - (OFFSET_BYTES + CHECKSUM_BYTES) * n - OFFSET_BYTES
        if (magic, end_magic) != (SHARD_MAGIC, SHARD_MAGIC) or n != count or index_at < HEADER.size \
                or stored_codec.rstrip(b"\0").decode() != codec or tuple(stored_shape) != tuple(shape):
            raise ValueError(f"header/trailer say {stored_codec!r} x{n} {stored_shape}")
        check_tables(data, header_xxh3, tables_xxh3, HEADER.size, index_at)
        offsets = np.frombuffer(data, dtype="<u8", count=n + 1, offset=index_at).copy()
        checksums = np.frombuffer(data, dtype="<u8", count=n, offset=index_at + OFFSET_BYTES * (n + 1)).copy()
        if int(offsets[-1]) != index_at - HEADER.size or np.any(np.diff(offsets.astype(np.int64)) < 0):
            raise ValueError(f"index covers {int(offsets[-1])} bytes, blobs take {index_at - HEADER.size}")
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        data.close()
        raise ValueError(str(exc)) from None
    return data, offsets, HEADER.size, checksums


def open_raw(path: Path, count: int, shape) -> tuple[np.ndarray, np.ndarray]:
    """Map a raw shard: (uint8 [n, H, W, 3] memory map, xxh3 [n]); ValueError if malformed."""
    try:
        array = np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"unreadable ({exc})") from None
    if array.shape != (count, *shape) or array.dtype != np.uint8:
        raise ValueError(f"of shape {array.shape}")
    tables_at = array.offset + array.nbytes
    with open(path, "rb") as f:
        leading = f.read(array.offset)
        f.seek(tables_at)
        tail = f.read()
    if len(tail) != CHECKSUM_BYTES * count + TRAILER.size:
        raise ValueError(f"its checksum table and trailer take {len(tail)} bytes, not "
                         f"{CHECKSUM_BYTES * count + TRAILER.size}")
    n, header_xxh3, tables_xxh3, magic = TRAILER.unpack_from(tail, len(tail) - TRAILER.size)
    if magic != SHARD_MAGIC or n != count or leading != leading_bytes("raw", shape, count):
        raise ValueError(f"its header or trailer is not a v{MANIFEST_VERSION} cache shard of {count} images")
    check_tables(leading + tail, header_xxh3, tables_xxh3, len(leading), len(leading))
    # a plain ndarray view of the map: slicing an np.memmap costs a subclass finalize per read
    return array.view(np.ndarray), np.frombuffer(tail, dtype="<u8", count=count).copy()


def check_tables(data, header_xxh3: int, tables_xxh3: int, header_end: int, tables_at: int) -> None:
    """ValueError unless the header and the tables (offsets, checksums) hash to the trailer's xxh3."""
    end = len(data) - TRAILER.size
    if xxhash.xxh3_64_intdigest(memoryview(data)[:header_end]) != header_xxh3:
        raise ValueError("its header does not match the xxh3 in its trailer")
    if xxhash.xxh3_64_intdigest(memoryview(data)[tables_at:end]) != tables_xxh3:
        raise ValueError("its offsets/checksum tables do not match the xxh3 in its trailer")


def warn_many_files(n_files: int, cache_dir: Path, shard_mb: float) -> None:
    """Warn when a cache folder of `n_files` (shards + the manifest) crosses Google Drive's items-per-folder limit:
    the budget's own check (`nblib.budget.drive.shard_folder_check`, `FOLDER_ITEMS_LIMIT`), no second number.
    """
    from nblib.budget.drive import shard_folder_check

    shards = n_files - 1
    check = shard_folder_check(shards, shards * shard_mb * MB, shard_mb)
    if check.crossed:
        warnings.warn(f"{cache_dir} would hold {n_files:,} files: {check} (limit: {check.source})", stacklevel=3)


# ====================================================================================== stat cache


def read_shard_stats(cache_dir: str | Path) -> dict:
    """{shard file: {"bytes", "mtime_ns", "sha256"}} of the cache's stat cache; {} when absent or unreadable.

    The stat cache is `nblib.manifest`'s (`manifest.stat.json` beside `manifest.json`): a hint,
    never a source of truth; anything wrong with it costs a hash, not an error. A cache written
    before it moved there has `local-stat-cache.json` instead: read while no new one exists.
    """
    stats = read_stat_cache(Path(cache_dir) / MANIFEST)
    return stats or _legacy_stats(Path(cache_dir))


def record_shard_stats(cache_dir: str | Path, stats: dict[str, dict]) -> None:
    """Add shards' stats ({file: {"bytes", "mtime_ns", "sha256"}}) to the cache's stat cache, atomically.

    Best effort: a folder that cannot be written (read-only mount) keeps its old stat cache. A
    legacy `local-stat-cache.json` is carried over into the new file, then removed.
    """
    cache_dir = Path(cache_dir)
    legacy = cache_dir / LEGACY_STAT_CACHE
    if legacy.exists() and not (cache_dir / STAT_CACHE).exists():
        stats = {**_legacy_stats(cache_dir), **stats}
    if record_stats(cache_dir / MANIFEST, stats):
        legacy.unlink(missing_ok=True)


def current_stat(cache_dir: str | Path, entry: dict) -> dict:
    """The stat-cache record of a listed shard as its file is now (after its bytes were checked)."""
    return {entry["file"]: stat_record(Path(cache_dir) / entry["file"], entry["sha256"])}


def _legacy_stats(cache_dir: Path) -> dict:
    """The shard stats of a `local-stat-cache.json` ({"note", "shards"}); {} when absent or unreadable."""
    try:
        shards = json.loads((cache_dir / LEGACY_STAT_CACHE).read_bytes())["shards"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {k: v for k, v in shards.items() if isinstance(v, dict)} if isinstance(shards, dict) else {}


# ====================================================================================== manifest


def read_cache_manifest(cache_dir: str | Path) -> dict:
    """The manifest body of the cache at `cache_dir`; CacheError when missing, damaged or foreign."""
    return read_shards_manifest(cache_dir, MANIFEST_KIND, MANIFEST_VERSION, "this cache",
                                f"it is not an image cache (yet); build one with python -m nblib cache "
                                f"--texts PATH --out {cache_dir}")


def manifest_or_none(read, folder: str | Path) -> dict | None:
    """`read(folder)` (a manifest reader), or None where the folder holds no manifest that reads."""
    try:
        return read(folder)
    except CacheError:
        return None


def read_shards_manifest(folder: str | Path, kind: str, version: int, what: str, missing: str) -> dict:
    """The manifest body of a folder of shards (images or records) with its `shards` and `source`; CacheError
    naming `what` and the fix when it is missing (`missing` says how to build one), damaged or foreign.
    """
    path = Path(folder) / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CacheError(f"no {MANIFEST} in {folder}: {missing}") from None
    except OSError as exc:
        raise CacheError(f"{path} cannot be read ({exc}); check the disk or mount") from None
    try:
        body = parse_manifest(raw, kind, versions=(version,), where=str(path)).body
    except ManifestDamaged as exc:
        raise CacheError(_unusable(folder, raw, kind, what, exc)) from None
    if not isinstance(body.get("shards"), list) or not isinstance(body.get("source"), dict):
        raise CacheError(f"{path} is an {kind} record without shards or source; rebuild it "
                         f"with overwrite=True (--overwrite)")
    return body


def write_cache_manifest(cache_dir: str | Path, body: dict) -> None:
    """Write the manifest atomically; seq is the number of shards listed (a deterministic count)."""
    write_manifest(Path(cache_dir) / MANIFEST, MANIFEST_KIND, body, version=MANIFEST_VERSION,
                   seq=len(body["shards"]))


def _unusable(folder: str | Path, raw: bytes, kind: str, what: str, exc: ManifestDamaged) -> str:
    """The one line for a manifest that is no `kind` record this nblib reads. For a healthy folder of the other
    kind of shards (record shards where an image cache is read, or the other way round): what it holds and which
    flag reads it; never "rebuild it with --overwrite": the folder is fine, and a build with --overwrite into it
    deletes its shards. Else why `what` cannot be trusted (an older nblib's layout, or the damage) and the fix.
    """
    try:
        old = json.loads(raw)
    except ValueError:
        old = None
    found = old.get("kind") if isinstance(old, dict) else None
    if found != kind and found in SHARD_FOLDERS and kind in SHARD_FOLDERS:
        holds, flag = SHARD_FOLDERS[found]
        return f"{folder} holds {holds}, not {SHARD_FOLDERS[kind][0]}: read it with {flag} {folder}"
    if isinstance(old, dict) and old.get("format") == "nblib-image-cache":
        why = (f"{MANIFEST} was written by an older nblib (cache format v{old.get('version')}); "
               f"this nblib reads {MANIFEST_KIND} v{MANIFEST_VERSION}")
    elif found == MANIFEST_KIND and old.get("version") in OLD_VERSIONS:
        why = (f"{MANIFEST} was written by an older nblib ({MANIFEST_KIND} v{old.get('version')}: its "
               f"shards carry no per-image checksums, so no read of them can be checked); this nblib "
               f"reads v{MANIFEST_VERSION}")
    else:
        why = str(exc).split(";")[0]
    return (f"{why}; {what} cannot be trusted as it is: rebuild it with overwrite=True (--overwrite), or point "
            f"at another folder")
