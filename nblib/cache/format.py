"""Cache shard format: raw `.npy` or packed compressed blobs with an offsets index; the cache manifest.

A cache folder holds `manifest.json` (an `nblib.manifest` record of kind "nblib.cache": source
fingerprint, renderer parameters, codec, and each shard's range, bytes, sha256 and the mtime_ns
it had when written) and shards cut by a target size: `shard-00000.npy` for the `raw` codec
(uint8 [n, H, W, 3], memory-mappable) or `shard-00000.zlib` / `.pngs` for compressed codecs
(header, one blob per image, a uint64 offsets index and a footer, so any image reads alone and a
shard streams to disk as its images arrive). Trade-off: raw is the fastest to read (a slice of an
mmap) but costs H*W*3 bytes per image, 287 GB for 1.9M images at 224 px; zlib and png store text
images 10-30x smaller and cost a decode per image. `measure_codecs` puts numbers on both.

A shard is trusted from a stat (size and mtime_ns equal what the manifest recorded); any other
stat costs a sha256 of the file. A same-size edit that also restores the mtime passes the stat:
only `verify` or a reader's in-order pass, which hash every byte, catch it.
"""
from __future__ import annotations

import io
import json
import mmap
import struct
import time
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nblib.atomic import AtomicWriter, npy_header, sha256_file
from nblib.config import CODECS
from nblib.errors import CacheError, ConfigError, InputError, ManifestDamaged
from nblib.manifest import parse_manifest, write_manifest
from nblib.units import MB

MANIFEST = "manifest.json"
MANIFEST_KIND = "nblib.cache"
MANIFEST_VERSION = 2    # 2: an nblib.manifest record; shards carry mtime_ns
SHARD_SUFFIX = {"raw": ".npy", "zlib": ".zlib", "png": ".pngs"}
ZLIB_LEVEL = 1          # level 1 stores text images within a few % of level 6 and writes faster
PNG_LEVEL = 1
DRIVE_FILES_WARN = 1000  # Google Drive lists and syncs folders with thousands of files badly
DAMAGED = ("missing", "truncated", "corrupt")

# Packed shard layout: header, blobs, uint64 offsets [n + 1] (relative to the first blob), footer.
SHARD_MAGIC = b"NBLSHRD1"
HEADER = struct.Struct("<8s4sIII")  # magic, codec, height, width, channels
FOOTER = struct.Struct("<Q8s")      # n images, magic
OFFSET_BYTES = 8                    # one index entry per image


# ====================================================================================== codecs


def encode_image(image: np.ndarray, codec: str) -> bytes:
    """The stored bytes of one uint8 [H, W, 3] image under `codec`."""
    check_codec(codec)
    if codec == "raw":
        return np.ascontiguousarray(image, dtype=np.uint8).tobytes()
    if codec == "zlib":
        return zlib.compress(np.ascontiguousarray(image, dtype=np.uint8).tobytes(), ZLIB_LEVEL)
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", compress_level=PNG_LEVEL)
    return buffer.getvalue()


def decode_image(blob, codec: str, shape: tuple[int, int, int]) -> np.ndarray:
    """One uint8 [H, W, 3] image from its stored bytes; ValueError when the bytes do not decode."""
    check_codec(codec)
    try:
        if codec == "raw":
            return np.frombuffer(blob, dtype=np.uint8).reshape(shape)
        if codec == "zlib":
            return np.frombuffer(zlib.decompress(blob), dtype=np.uint8).reshape(shape)
        from PIL import Image

        with Image.open(io.BytesIO(blob)) as image:
            array = np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (zlib.error, ValueError, OSError, SyntaxError, EOFError, struct.error) as exc:
        raise ValueError(f"its {codec} bytes do not decode ({type(exc).__name__}: {exc})") from None
    if array.shape != tuple(shape):
        raise ValueError(f"it decodes to shape {array.shape}, not {tuple(shape)}")
    return array


def measure_codecs(sample_images: Sequence[np.ndarray], codecs: Sequence[str] = CODECS,
                   min_seconds: float = 0.2) -> dict[str, dict[str, float]]:
    """{codec: {"bytes_per_image", "decode_images_per_s"}} over sample images (one core).

    This is the `codec_stats` that `nblib.budget.choose_codec` takes. Decode speed is the time
    to turn stored bytes back into an array, repeated over the sample for at least `min_seconds`.
    """
    if len(sample_images) == 0:
        raise InputError("measure_codecs needs at least one sample image")
    shape = tuple(sample_images[0].shape)
    stats = {}
    for codec in codecs:
        blobs = [encode_image(image, codec) for image in sample_images]
        decoded, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_seconds or decoded == 0:
            for blob in blobs:
                np.array(decode_image(blob, codec, shape))  # a copy, as a reader gets
            decoded += len(blobs)
        stats[codec] = {"bytes_per_image": float(np.mean([len(b) for b in blobs])),
                        "decode_images_per_s": decoded / elapsed}
    return stats


def stored_bytes_per_image(codec: str, blob_bytes: float) -> float:
    """Bytes one image takes in a shard: its blob, plus its offsets-index entry when packed."""
    return float(blob_bytes) + (0 if codec == "raw" else OFFSET_BYTES)


def check_codec(codec: str) -> None:
    """Raise ConfigError unless `codec` is one of nblib.config.CODECS."""
    if codec not in CODECS:
        raise ConfigError(f"codec={codec!r} is not supported; choose one of {CODECS} (or 'auto')")


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


class ShardWriter:
    """Stream one shard to a temporary file (an `AtomicWriter`, hashed as written); `commit` keeps it.

    Raw shards need their image `count` up front (it is in the .npy header); packed shards append
    their offsets index at the end. `commit` fsyncs and renames onto shard-NNNNN.ext and returns
    the manifest entry; `discard` (or leaving a `with` block without commit) deletes it.
    """

    def __init__(self, cache_dir: str | Path, index: int, start: int, codec: str, shape,
                 count: int | None = None):
        check_codec(codec)
        if codec == "raw" and count is None:
            raise ValueError("a raw shard needs its image count up front")
        self.name = shard_name(index, codec)
        self.codec, self.shape, self.start, self.count = codec, tuple(shape), start, count
        self.blob_bytes, self.sizes = 0, []
        self._writer = AtomicWriter(Path(cache_dir) / self.name)
        if codec == "raw":
            self._writer.write(npy_header(np.uint8, (count, *self.shape)))
        else:
            self._writer.write(HEADER.pack(SHARD_MAGIC, codec.encode().ljust(4, b"\0"), *self.shape))

    @property
    def stop(self) -> int:
        return self.start + len(self.sizes)

    def add(self, blob: bytes) -> None:
        """Append one image's stored bytes."""
        self._writer.write(blob)
        self.sizes.append(len(blob))
        self.blob_bytes += len(blob)

    def commit(self, expect_sha256: str | None = None) -> dict:
        """Finish, fsync and rename the shard; its manifest entry (range, bytes, sha256, mtime_ns)."""
        if self.codec == "raw" and len(self.sizes) != self.count:
            self.discard()
            raise CacheError(f"{self.name}: {len(self.sizes)} images written, header says {self.count}")
        if self.codec != "raw":
            offsets = np.zeros(len(self.sizes) + 1, dtype="<u8")
            np.cumsum(self.sizes, out=offsets[1:])
            self._writer.write(offsets.tobytes())
            self._writer.write(FOOTER.pack(len(self.sizes), SHARD_MAGIC))
        try:
            written = self._writer.commit(expect_sha256=expect_sha256)
        except ValueError:
            raise CacheError(f"re-rendered {self.name} does not match its manifest sha256: the "
                             f"renderer or Pillow changed since the cache was built; rebuild it "
                             f"with overwrite=True (--overwrite)") from None
        return {"file": self.name, "start": self.start, "stop": self.stop, "count": len(self.sizes),
                "bytes": written.bytes, "sha256": written.sha256, "mtime_ns": written.mtime_ns}

    def discard(self) -> None:
        """Delete the temporary file; nothing is renamed (a no-op after commit)."""
        self._writer.discard()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.discard()


def write_shard(cache_dir: str | Path, index: int, start: int, blobs: Sequence[bytes], codec: str,
                shape) -> dict:
    """Write a whole shard of stored images at once (what the benchmark times); its entry."""
    with ShardWriter(cache_dir, index, start, codec, shape, count=len(blobs)) as writer:
        for blob in blobs:
            writer.add(blob)
        return writer.commit()


def shard_name(index: int, codec: str) -> str:
    """The file name of shard `index` under `codec`: shard-00042.npy, .zlib or .pngs."""
    return f"shard-{index:05d}{SHARD_SUFFIX[codec]}"


def shard_index(name: str) -> int:
    """The index in a shard file name (inverse of `shard_name`)."""
    return int(name.split("-")[1].split(".")[0])


# ====================================================================================== checking


def shard_state(cache_dir: Path, entry: dict, *, full: bool = False) -> str | None:
    """How a listed shard's file compares with its manifest entry.

    None: trusted (stat equal to the recorded one; with `full`, its sha256 too). "touched": its
    bytes hash to the recorded sha256 but its mtime changed (copied): record the new stat.
    "missing", "truncated" (size differs) or "corrupt" (sha256 differs): it must be re-rendered.
    """
    path = Path(cache_dir) / entry["file"]
    try:
        st = path.stat()
    except FileNotFoundError:
        return "missing"
    if st.st_size != entry["bytes"]:
        return "truncated"
    same_stat = st.st_mtime_ns == entry.get("mtime_ns")
    if same_stat and not full:
        return None
    if sha256_file(path) != entry["sha256"]:
        return "corrupt"
    return None if same_stat else "touched"


def restamp(cache_dir: Path, entry: dict) -> dict:
    """The entry with the mtime_ns its file has now (after its bytes were hashed and matched)."""
    return {**entry, "mtime_ns": (Path(cache_dir) / entry["file"]).stat().st_mtime_ns}


def damaged_error(cache_dir: Path, name: str, why: str) -> CacheError:
    """The error a reader raises for a shard it cannot trust, with both ways to fix it."""
    return CacheError(f"shard {name} of {cache_dir} is {why}; run python -m nblib cache --verify "
                      f"--repair {cache_dir} (or rerun the same populate / cache command with the "
                      f"texts at hand: it re-renders damaged shards)")


def open_packed(path: Path, count: int, codec: str, shape) -> tuple[mmap.mmap, np.ndarray, int]:
    """Map a packed shard: (mapped bytes, offsets [n + 1], start of the blob area); ValueError if malformed."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        magic, stored_codec, *stored_shape = HEADER.unpack_from(data, 0)
        n, end_magic = FOOTER.unpack_from(data, len(data) - FOOTER.size)
        index_at = len(data) - FOOTER.size - OFFSET_BYTES * (n + 1)
        if (magic, end_magic) != (SHARD_MAGIC, SHARD_MAGIC) or n != count or index_at < HEADER.size \
                or stored_codec.rstrip(b"\0").decode() != codec or tuple(stored_shape) != tuple(shape):
            raise ValueError(f"header/footer say {stored_codec!r} x{n} {stored_shape}")
        offsets = np.frombuffer(data, dtype="<u8", count=n + 1, offset=index_at).copy()
        if int(offsets[-1]) != index_at - HEADER.size or np.any(np.diff(offsets.astype(np.int64)) < 0):
            raise ValueError(f"index covers {int(offsets[-1])} bytes, blobs take {index_at - HEADER.size}")
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        data.close()
        raise ValueError(str(exc)) from None
    return data, offsets, HEADER.size


def warn_many_files(n_files: int, cache_dir: Path, shard_mb: float) -> None:
    """Warn when a cache folder would hold more files than Google Drive handles well."""
    if n_files > DRIVE_FILES_WARN:
        warnings.warn(
            f"{cache_dir} would hold {n_files:,} files; Google Drive handles folders with more than "
            f"~{DRIVE_FILES_WARN:,} files badly. Raise shard_mb (now {shard_mb:g}) to about "
            f"{shard_mb * n_files / (DRIVE_FILES_WARN / 2):,.0f}", stacklevel=3)


# ====================================================================================== manifest


def read_cache_manifest(cache_dir: str | Path) -> dict:
    """The manifest body of the cache at `cache_dir`; CacheError when missing, damaged or foreign."""
    path = Path(cache_dir) / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CacheError(f"no {MANIFEST} in {cache_dir}: it is not an image cache (yet); build one "
                         f"with python -m nblib cache --texts PATH --out {cache_dir}") from None
    except OSError as exc:
        raise CacheError(f"{path} cannot be read ({exc}); check the disk or mount") from None
    try:
        body = parse_manifest(raw, MANIFEST_KIND, versions=(MANIFEST_VERSION,), where=str(path)).body
    except ManifestDamaged as exc:
        raise CacheError(f"{_why_unusable(raw, exc)}; this cache cannot be trusted as it is: rebuild "
                         f"it with overwrite=True (--overwrite), or point at another folder") from None
    if not isinstance(body.get("shards"), list) or not isinstance(body.get("source"), dict):
        raise CacheError(f"{path} is an nblib.cache record without shards or source; rebuild it "
                         f"with overwrite=True (--overwrite)")
    return body


def write_cache_manifest(cache_dir: str | Path, body: dict) -> None:
    """Write the manifest atomically; seq is the number of shards listed (a deterministic count)."""
    write_manifest(Path(cache_dir) / MANIFEST, MANIFEST_KIND, body, version=MANIFEST_VERSION,
                   seq=len(body["shards"]))


def _why_unusable(raw: bytes, exc: ManifestDamaged) -> str:
    try:
        old = json.loads(raw)
    except ValueError:
        old = None
    if isinstance(old, dict) and old.get("format") == "nblib-image-cache":
        return (f"{MANIFEST} was written by an older nblib (cache format v{old.get('version')}); "
                f"this nblib reads {MANIFEST_KIND} v{MANIFEST_VERSION}")
    return str(exc).split(";")[0]
