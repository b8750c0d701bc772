"""Read a populated cache: `len`, `cache[i]`, `get_batch`, `iter_shards`, and a torch dataset.

Opening checks every listed shard's stat against the one its manifest recorded (cheap) and
hashes only the shards whose stat changed, so a shard swapped in from another cache or rewritten
in place is refused before any image is read. A read that runs through a shard in order (a full
pass, `iter_shards`) hashes the bytes as it reads them and raises when they are not the recorded
ones; random access is not hashed. Trade-off: a stat per shard keeps opening instant, at the
price that a same-size edit which also restored the mtime is caught only by an in-order pass or
`verify`. Raw shards are memory-mapped (`np.load(mmap_mode="r")`), packed ones with `mmap`, each
once and lazily. Arrays returned are copies (writable).
"""
from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from nblib.atomic import sha256_json
from nblib.cache.format import (
    damaged_error,
    decode_image,
    open_packed,
    read_cache_manifest,
    shard_state,
    warn_many_files,
)
from nblib.errors import CacheError
from nblib.units import fmt_bytes


class ShardedImageCache:
    """A cache folder as an indexable array of uint8 [H, W, 3] images, checked when opened."""

    def __init__(self, cache_dir: str | Path):
        self.cache_dir = Path(cache_dir)
        self.manifest = read_cache_manifest(self.cache_dir)
        self.codec = self.manifest["codec"]
        self.shape = tuple(self.manifest["image_shape"])
        self._starts = np.array([s["start"] for s in self.manifest["shards"]], dtype=np.int64)
        self._open: dict[int, object] = {}
        self._hashes: dict[int, tuple] = {}  # shard -> (running sha256, next image) of an in-order read
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
        """True when every source text has its image in the cache."""
        return len(self) == self.manifest["source"]["n_texts"]

    @property
    def shard_ranges(self) -> list[tuple[int, int]]:
        return [(s["start"], s["stop"]) for s in self.manifest["shards"]]

    @property
    def fingerprint(self) -> str:
        """sha256 over the source fingerprint, renderer params, codec and shard sha256s."""
        m = self.manifest
        payload = {"source": m["source"]["sha256"], "renderer": m["renderer"], "codec": m["codec"],
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
        """Images [start, stop) as one uint8 [n, H, W, 3] array (slices of shards, decoded)."""
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
        """Each shard's images in order as one array, hashed while read: a shard is yielded only
        once its bytes matched the manifest's sha256 (RAM: one shard).
        """
        for shard, entry in enumerate(self.manifest["shards"]):
            images = self.get_batch(entry["start"], entry["stop"])
            self.close(shard)
            yield images
            del images  # the caller's reference is the only one left: RAM stays near one shard

    def torch_dataset(self, transform=None) -> CacheDataset:
        """A map-style dataset for torch's DataLoader (torch is imported only when items are read)."""
        return CacheDataset(str(self.cache_dir), transform)

    def close(self, shard: int | None = None) -> None:
        """Release opened shard maps (all, or one) and their in-order hashes."""
        for key in ([shard] if shard is not None else list(self._open)):
            handle = self._open.pop(key, None)
            self._hashes.pop(key, None)
            if isinstance(handle, tuple):
                handle[0].close()

    def __getstate__(self):
        return {**self.__dict__, "_open": {}, "_hashes": {}}

    def __repr__(self) -> str:
        return (f"ShardedImageCache({str(self.cache_dir)!r}: {len(self):,} images "
                f"{self.shape}, {len(self.manifest['shards'])} {self.codec} shards)")

    # --------------------------------------------------------------------------- internals

    def _check_shards(self) -> None:
        """Refuse a listed shard that is missing, resized, or (stat changed) hashes differently."""
        hashed = []
        for entry in self.manifest["shards"]:
            state = shard_state(self.cache_dir, entry)
            if state == "touched":
                hashed.append(entry)
            elif state is not None:
                why = {"missing": "missing", "truncated": "of another size than the manifest records",
                       "corrupt": "not the shard the manifest records (its sha256 differs)"}[state]
                raise damaged_error(self.cache_dir, entry["file"], why)
        if hashed:
            warnings.warn(
                f"{len(hashed)} shard(s) of {self.cache_dir} have another mtime than when written "
                f"(copied?); their {fmt_bytes(sum(s['bytes'] for s in hashed))} were hashed and "
                f"match. python -m nblib cache --verify --repair {self.cache_dir} records the new "
                f"times, so opening skips the hash", stacklevel=3)

    def _path(self, shard: int) -> Path:
        return self.cache_dir / self.manifest["shards"][shard]["file"]

    def _raw(self, shard: int) -> np.ndarray:
        array = self._open.get(shard)
        if array is None:
            entry = self.manifest["shards"][shard]
            try:
                array = np.load(self._path(shard), mmap_mode="r")
            except (OSError, ValueError) as exc:
                raise damaged_error(self.cache_dir, entry["file"], f"unreadable ({exc})") from None
            if array.shape != (entry["count"], *self.shape):
                raise damaged_error(self.cache_dir, entry["file"], f"of shape {array.shape}")
            self._open[shard] = array
        return array

    def _packed(self, shard: int) -> tuple:
        handle = self._open.get(shard)
        if handle is None:
            entry = self.manifest["shards"][shard]
            try:
                handle = open_packed(self._path(shard), entry["count"], self.codec, self.shape)
            except (OSError, ValueError) as exc:
                raise damaged_error(self.cache_dir, entry["file"], f"malformed ({exc})") from None
            self._open[shard] = handle
        return handle

    def _copy_range(self, shard: int, lo: int, hi: int, out: np.ndarray) -> None:
        """Images [lo, hi) of `shard` into out[:hi - lo], fed to the shard's in-order hash."""
        sha = self._continue_hash(shard, lo)
        if self.codec == "raw":
            images = self._raw(shard)[lo:hi]
            out[: hi - lo] = images
            if sha is not None:
                sha.update(images)
        else:
            data, offsets, base = self._packed(shard)
            for k in range(lo, hi):
                blob = data[base + int(offsets[k]): base + int(offsets[k + 1])]
                if sha is not None:
                    sha.update(blob)
                out[k - lo] = self._decode(shard, k, blob)
        if sha is not None:
            self._end_hash(shard, sha, hi)

    def _decode(self, shard: int, local: int, blob: bytes) -> np.ndarray:
        try:
            return decode_image(blob, self.codec, self.shape)
        except ValueError as exc:
            entry = self.manifest["shards"][shard]
            raise CacheError(
                f"image {entry['start'] + local:,} (number {local} of shard {entry['file']}) of "
                f"{self.cache_dir} is corrupt: {exc}; run python -m nblib cache --verify --repair "
                f"{self.cache_dir}") from None

    def _continue_hash(self, shard: int, lo: int):
        """The shard's running sha256 when a read of image `lo` continues an in-order pass, else None."""
        if lo == 0:
            sha = hashlib.sha256(self._leading_bytes(shard))
            self._hashes[shard] = (sha, 0)
        running = self._hashes.get(shard)
        if running is None or running[1] != lo:
            self._hashes.pop(shard, None)  # out of order: this pass is no longer hashed
            return None
        return running[0]

    def _end_hash(self, shard: int, sha, hi: int) -> None:
        entry = self.manifest["shards"][shard]
        if hi < entry["count"]:
            self._hashes[shard] = (sha, hi)
            return
        del self._hashes[shard]
        sha.update(self._trailing_bytes(shard))
        if sha.hexdigest() != entry["sha256"]:
            raise damaged_error(self.cache_dir, entry["file"],
                                "corrupt: the bytes just read hash differently from the manifest's "
                                "sha256 (edited in place with its size and mtime kept)")

    def _leading_bytes(self, shard: int) -> bytes:
        """The bytes before the first image: the .npy header, or the packed header."""
        if self.codec == "raw":
            array = self._raw(shard)
            with open(self._path(shard), "rb") as f:
                return f.read(array.offset)
        data, _, base = self._packed(shard)
        return data[:base]

    def _trailing_bytes(self, shard: int) -> bytes:
        """The bytes after the last image: nothing for raw, the offsets index and footer when packed."""
        if self.codec == "raw":
            return b""
        data, offsets, base = self._packed(shard)
        return data[base + int(offsets[-1]):]


class CacheDataset:
    """torch map-style dataset over a cache: item i is a uint8 [H, W, 3] tensor (or transform(it)).

    It does not subclass torch.utils.data.Dataset so this module stays torch-free; DataLoader
    takes any object with `__len__` and `__getitem__`. Picklable: each worker opens its own maps.
    """

    def __init__(self, cache_dir: str, transform=None):
        self.cache = ShardedImageCache(cache_dir)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, index: int):
        import torch

        image = torch.from_numpy(self.cache[index])
        return self.transform(image) if self.transform is not None else image
