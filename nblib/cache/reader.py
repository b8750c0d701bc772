"""Read a populated cache: `len`, `cache[i]`, `get_batch`, `iter_shards`, and a torch dataset.

Every read is checked: each image's stored bytes are hashed (xxh3) and compared with the
shard's checksum table before the image is served, on every path (random `cache[i]`,
`get_batch`, `iter_shards`, the torch dataset in DataLoader workers). A damaged image raises
a CacheError naming it and the repair; nothing damaged is ever served. Opening checks every
listed shard's stat against the local stat cache (cheap) and hashes only the shards whose stat
changed, so a shard swapped in from another cache is refused before any image is read.

`check="first-touch"` (the torch dataset's default, for training) adds one pass over each shard
the first time a process touches it: its whole-file xxh3 must equal the manifest's, so a shard
rewritten in place with a self-consistent table (another cache's shard of the same size, its mtime
put back) is refused before any of its images is served. Trade-off: one extra read of each shard
per process (per DataLoader worker: per epoch unless `persistent_workers=True`), usually from the
page cache, against catching what the per-image tables cannot. `check="off"` serves unchecked
bytes (the benchmark's baseline only).
Raw shards are memory-mapped, packed ones with `mmap`, each once and lazily. Arrays returned
are copies (writable).
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import xxhash

from nblib.atomic import sha256_json
from nblib.cache.codecs import CodecSpec, codec_for
from nblib.cache.format import (
    STAT_CACHE,
    check_listed_shards,
    corrupt_error,
    damaged_error,
    open_listed_shard,
    open_packed,
    open_raw,
    read_cache_manifest,
    warn_many_files,
)
from nblib.errors import CacheError, ConfigError
from nblib.units import fmt_bytes

CHECKS = ("image", "first-touch", "off")


class ShardedImageCache:
    """A cache folder as an indexable array of uint8 [H, W, 3] images, checked when opened and read as the
    module docstring says (`check`: "image", the default, "first-touch" or "off"). `cache[i]` is one
    image; `get_batch` and `iter_shards` read several (`CacheDataset`: the torch dataset). Picklable: each
    process opens its own maps and checks for itself. CacheError (naming the shard and `cache --verify
    --repair`) when the folder holds no cache, its manifest is damaged or old, or a listed shard is missing
    or changed.
    """

    def __init__(self, cache_dir: str | Path, *, check: str = "image"):
        if check not in CHECKS:
            raise ConfigError(f"check={check!r} is not one of {CHECKS}")
        self.cache_dir = Path(cache_dir)
        self.check = check
        self.manifest = read_cache_manifest(self.cache_dir)
        self.codec = self.manifest["codec"]
        self.spec = CodecSpec.from_record(self.codec, self.manifest.get("codec_options"))
        self.shape = tuple(self.manifest["image_shape"])
        self._image_bytes = int(np.prod(self.shape))
        self._starts = np.array([s["start"] for s in self.manifest["shards"]], dtype=np.int64)
        self._open: dict[int, tuple] = {}
        self._touched: set[str] = set()  # shards whose whole-file xxh3 matched in this process
        warn_many_files(len(self.manifest["shards"]) + 1, self.cache_dir, self.manifest["shard_mb"])
        self._check_shards()

    def __len__(self) -> int:
        shards = self.manifest["shards"]
        return shards[-1]["stop"] if shards else 0

    @property
    def image_size(self) -> int:
        """Pixels per side of every image."""
        return int(self.shape[0])

    @property
    def complete(self) -> bool:
        """True when every source image (text) has its image in the cache."""
        return len(self) == expected_images(self.manifest)

    @property
    def shard_ranges(self) -> list[tuple[int, int]]:
        return [(s["start"], s["stop"]) for s in self.manifest["shards"]]

    @property
    def fingerprint(self) -> str:
        """sha256 over the source fingerprint, renderer params, codec and shard sha256s."""
        m = self.manifest
        payload = {"source": m["source"].get("sha256"), "renderer": m.get("renderer"), "codec": m["codec"],
                   "shards": [s["sha256"] for s in m["shards"]]}
        return sha256_json(payload)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise IndexError("ShardedImageCache slices must be contiguous (step 1)")
            return self.get_batch(start, stop)
        i = int(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"image {index} is out of range for a cache of {len(self):,} images")
        return self.get_batch(i, i + 1)[0]

    def get_batch(self, start: int, stop: int) -> np.ndarray:
        """Images [start, stop) as one uint8 [n, H, W, 3] array (slices of shards, decoded, checked)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"batch [{start}, {stop}) is out of range for {len(self):,} images")
        out = np.empty((stop - start, *self.shape), dtype=np.uint8)
        shard = int(np.searchsorted(self._starts, start, side="right") - 1) if stop > start else 0
        position = start
        while position < stop:
            entry = self.manifest["shards"][shard]
            local_start, local_stop = position - entry["start"], min(stop, entry["stop"]) - entry["start"]
            self._copy_range(shard, local_start, local_stop, out[position - start:])
            position = entry["start"] + local_stop
            shard += 1
        return out

    def iter_shards(self) -> Iterator[np.ndarray]:
        """Each shard's images in order as one array, every image checked (RAM: one shard)."""
        for shard, entry in enumerate(self.manifest["shards"]):
            images = self.get_batch(entry["start"], entry["stop"])
            self.close(shard)
            yield images
            del images  # the caller's reference is the only one left: RAM stays near one shard

    def close(self, shard: int | None = None) -> None:
        """Release opened shard maps (all, or one)."""
        for key in ([shard] if shard is not None else list(self._open)):
            handle = self._open.pop(key, None)
            if handle is not None and not isinstance(handle[0], np.ndarray):  # a packed shard's mmap
                with contextlib.suppress(BufferError):
                    handle[0].close()

    def __getstate__(self):
        return {**self.__dict__, "_open": {}, "_touched": set()}  # each process checks for itself

    def __repr__(self) -> str:
        return (f"ShardedImageCache({str(self.cache_dir)!r}: {len(self):,} images "
                f"{self.shape}, {len(self.manifest['shards'])} {self.codec} shards)")

    # --------------------------------------------------------------------------- internals

    def _check_shards(self) -> None:
        """Refuse a listed shard that is missing, resized, or (stat changed) hashes differently."""
        hashed = check_listed_shards(self.cache_dir, self.manifest["shards"], partial(damaged_error, self.cache_dir))
        if hashed:
            warnings.warn(
                f"{len(hashed)} shard(s) of {self.cache_dir} have another stat than {STAT_CACHE} "
                f"records (copied?); their {fmt_bytes(sum(s['bytes'] for s in hashed))} were hashed "
                f"and match. python -m nblib cache --verify --repair {self.cache_dir} records the new "
                f"stats, so opening skips the hash", stacklevel=3)

    def _handle(self, shard: int) -> tuple:
        """(memory map, ...) of a shard, opened once; with first-touch, its whole file hashed first."""
        handle = self._open.get(shard)
        if handle is None:
            entry = self.manifest["shards"][shard]
            if self.codec == "raw":
                opener = partial(open_raw, count=entry["count"], shape=self.shape)
            else:
                opener = partial(open_packed, count=entry["count"], codec=self.codec, shape=self.shape)
            handle = self._open[shard] = open_listed_shard(
                self.cache_dir, entry, opener, partial(damaged_error, self.cache_dir),
                self._touched if self.check == "first-touch" else None, "images")
        return handle

    def _copy_range(self, shard: int, lo: int, hi: int, out: np.ndarray) -> None:
        """Images [lo, hi) of `shard` into out[:hi - lo] (C-contiguous), each checked against the shard's
        xxh3 table. Raw: one vectorised copy from the map. Packed: each image decoded straight into its
        row (`ImageCodec.decode_into`; zstd with no bytes object in between).
        """
        checked = self.check != "off"
        if self.codec == "raw":
            array, checksums = self._handle(shard)
            rows = out[: hi - lo]
            rows[...] = array[lo:hi]
            if checked:
                self._check_rows(shard, lo, rows, checksums[lo:hi])
            return
        data, offsets, base, checksums = self._handle(shard)
        decode_into, size, digest = codec_for(self.spec).decode_into, self._image_bytes, xxhash.xxh3_64_intdigest
        rows = memoryview(out[: hi - lo]).cast("B")  # TypeError, never a silent copy, if out were strided
        frames = memoryview(data)
        bounds = (offsets[lo:hi + 1] + base).tolist()
        expected = checksums[lo:hi].tolist() if checked else None
        for j in range(hi - lo):
            blob = frames[bounds[j]:bounds[j + 1]]
            if expected is not None and digest(blob) != expected[j]:
                raise self._corrupt(shard, lo + j, "its bytes do not match the shard's xxh3 table")
            try:
                decode_into(blob, self.shape, rows[j * size:(j + 1) * size])
            except ValueError as exc:
                raise self._corrupt(shard, lo + j, str(exc)) from None

    def _check_rows(self, shard: int, lo: int, rows: np.ndarray, expected: np.ndarray) -> None:
        """CacheError naming the first image of `rows` whose xxh3 is not the table's."""
        step, flat, digest = self._image_bytes, memoryview(rows.reshape(-1)), xxhash.xxh3_64_intdigest
        for k, want in enumerate(expected.tolist()):
            if digest(flat[k * step:(k + 1) * step]) != want:
                raise self._corrupt(shard, lo + k, "its bytes do not match the shard's xxh3 table")

    def _corrupt(self, shard: int, local: int, why: str) -> CacheError:
        entry = self.manifest["shards"][shard]
        return corrupt_error(self.cache_dir, "image", entry["start"] + local, local, entry["file"], why)


class CacheDataset:
    """torch map-style dataset over a cache: item i is a uint8 [H, W, 3] tensor (or transform(it)).

    `check` defaults to "first-touch" (training): each worker process hashes each shard once
    before serving its first image, on top of the per-image check. It does not subclass
    torch.utils.data.Dataset so this module stays torch-free; DataLoader takes any object with
    `__len__` and `__getitem__`. Picklable: each worker opens its own maps and checks for itself.
    """

    def __init__(self, cache_dir: str, transform=None, check: str = "first-touch"):
        self.cache = ShardedImageCache(cache_dir, check=check)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, index: int):
        import torch

        image = torch.from_numpy(self.cache[index])
        return self.transform(image) if self.transform is not None else image


def expected_images(manifest: dict) -> int | None:
    """Images a complete cache holds: the source's text count (or image count, when known)."""
    source = manifest["source"]
    return source.get("n_texts", source.get("n_images"))
