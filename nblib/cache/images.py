"""Your own images in: any iterable of uint8 arrays into the same resumable, verified, sharded cache.

`write_images(images, out)` takes arrays, PIL images, torch tensors, a torch dataset or an HF `Dataset`
(its Args say how each is read); `nblib.cache.sources` opens what `cache --images PATH` takes (docs/formats.md).
Every image is decoded by the one pixel policy (`nblib.cache.pixels`); with `size` (`--size N`) all are
resized (RESIZE_POLICY, recorded in the manifest), without it a second size is refused.

Shards are written exactly as `populate` writes them (atomic, manifest last, per-image xxh3),
so a killed run resumes to the same bytes. A resume reads the images again from the start: the
images of each shard already written are hashed (xxh3 of the raw pixels, recorded per shard) and
must be the ones written, else the resume is refused; a damaged listed shard is rewritten from
them. Trade-off: a resume reads (decodes) the images already cached once more, but encodes and
writes none of them; it never mixes images of two different inputs in one cache.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import xxhash

from nblib.atomic import atomic_write_bytes, json_bytes, remove_temporaries, sha256_json
from nblib.cache.codecs import DICT_SAMPLES, CodecSpec, check_codec, codec_for
from nblib.cache.format import (
    MANIFEST,
    ShardWriter,
    manifest_or_none,
    read_cache_manifest,
    read_shard_stats,
    record_shard_stats,
    shard_bytes,
    shard_index,
    warn_many_files,
    write_cache_manifest,
)
from nblib.cache.pixels import (
    DECODE_POLICY,
    RESIZE_POLICY,
    EncodedImage,
    check_size,
    decode_image_bytes,
    fit_size,
    pil_pixels,
)
from nblib.cache.populate import (
    PopulateSummary,
    _clear,
    _preflight,
    _progress_bar,
    append_shards,
    cache_bytes_on_disk,
    cache_folder,
    cache_lock,
    fresh_spec,
    mend_shard,
    plan_cache,
    recorded_spec,
)
from nblib.cache.sources import dataset_column, recorded_json
from nblib.errors import CacheError, InputError, NblibError

KEYS_FILE = "source-keys.json"
SIDE_FILE = "source-labels.json"


def write_images(images, out: str | Path, *, shard_mb: float = 400, codec: str = "raw",
                 codec_level: int | None = None, column: str | None = None, n_images: int | None = None,
                 seed: int = 0, overwrite: bool = False, progress: bool = True,
                 keys: Sequence[str] | None = None, side=None, size: int | None = None) -> PopulateSummary:
    """Write `images` into a sharded cache at `out`, resuming whatever is already there.

    Every image must have the size of the first, unless `size` resizes them all (RESIZE_POLICY: the
    shorter side to `size`, then the centre `size` x `size` crop; the manifest's `resize` records it).
    Pass the same images in the same order to resume: the shards already written are checked against
    the images (`source_xxh3`), damaged ones rewritten, other images refused. The folder is locked
    while written. A refused build of a fresh cache leaves nothing behind (not its manifest, nor its
    folder if it made it), so the retry needs no `overwrite`.

    Args:
        images: a list or iterable of images (uint8 [H, W, 3] / [H, W] / [H, W, 4] arrays, PIL
            images, CHW torch tensors), a torch map-style dataset ((image, label) items), or a
            Hugging Face `datasets.Dataset` (`column`).
        out: the cache folder (created; a folder of its own).
        shard_mb: target size of one shard file, in MB.
        codec: "raw", "zlib", "png" or "zstd" (`nblib.cache.CODECS`).
        codec_level: a compressed codec's level (zstd: 1-22, default 3; zlib/png: 0-9).
        column: the image column of a dataset or of dict items (default "image").
        n_images: the number of images, when `images` has no len(): lets the disk preflight run
            first and the cache report itself complete (else the count is known at the end, and a
            raw cache buffers one shard in RAM).
        seed: recorded in the manifest.
        overwrite: delete a cache of other images or settings in `out` instead of refusing.
        progress: show a progress bar.
        keys: one name per image (its file name, say), kept in `source-keys.json` beside the
            manifest; an export carries them in a `key` column (`source_keys` reads them).
        side: a callable giving, once every image has been read, a JSON-able side table (labels
            and class names, or texts, one per image) kept in `source-labels.json`; the class names
            go into the manifest (`nblib.cache.sources`).
        size: resize every image to `size` x `size` pixels (RESIZE_POLICY); None keeps their size.

    Returns:
        A `PopulateSummary` (images and shards in the cache, written, reused, rewritten, speed).

    Raises:
        InputError (no images, images of two sizes without `size`, another dtype or layout, named by
        its index or key), ConfigError (codec, level), CacheError (another cache there, other images
        on resume, a count other than announced), BudgetExceeded (the disk cannot hold it), FolderBusyError.
    """
    started = time.perf_counter()
    check_codec(codec)
    check_size(size)
    total = n_images if n_images is not None else _length(images)
    stream = (_fitted(item, column, k, size) for k, item in enumerate(_items(images, column)))
    head = list(itertools.islice(stream, DICT_SAMPLES if codec == "zstd" else 64))  # dictionary / size sample
    if not head:
        raise InputError("write_images got no images; pass a non-empty list, dataset or folder")
    shape = [int(s) for s in head[0].shape]
    resize = {"size": size, "policy": RESIZE_POLICY, "decode": DECODE_POLICY} if size else None
    layout = {"renderer": None, "codec": codec, "codec_level": check_codec(codec).level(codec_level),
              "shard_mb": shard_mb, "shard_bytes": shard_bytes(shard_mb), "seed": seed, "image_shape": shape,
              "resize": resize}
    created = not Path(out).exists()
    out = cache_folder(out)
    try:
        with cache_lock(out) as lock:
            fresh = not (out / MANIFEST).exists() and not any(out.glob("shard-*"))
            try:
                return _write_locked(itertools.chain(head, stream), head, out, lock, layout, total,
                                     overwrite, progress, keys, side, started)
            except NblibError:
                if fresh:
                    _clear(out)                 # a refused fresh build leaves no manifest nor shard behind
                raise
    except NblibError:
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()                     # only when empty: the folder this call made
        raise


def _write_locked(images: Iterator, head: list, out: Path, lock, layout: dict, total: int | None,
                  overwrite: bool, progress: bool, keys, side, started: float) -> PopulateSummary:
    """write_images' work once the folder is locked: preflight, manifest, shards, side table."""
    shape, codec, shard_mb = layout["image_shape"], layout["codec"], layout["shard_mb"]
    old = _resumable(out, layout, total)
    spec = recorded_spec(old) if old else fresh_spec(codec, layout["codec_level"], lambda: head)
    coder = codec_for(spec)
    if total is not None:
        # measured on images a dictionary was not trained on (train_dictionary holds out every fourth): on its own
        # training images zstd came out 13% smaller than on the rest (newcomer P14)
        sample = head[3::4] if spec.dictionary is not None else head[:64]
        per_image = float(np.mean([len(coder.encode(im)) for im in sample]))
        plan = plan_cache(total, out, shape[0], shard_mb, codec, per_image)
        _preflight(out, plan if old else dataclasses.replace(plan, done_bytes=0))
        warn_many_files(plan.n_shards + 1, out, shard_mb)
    manifest = old or _fresh_manifest(out, layout, spec, total, overwrite)
    remove_temporaries(out)
    checked = _checked(images, shape, keys)
    render_started = time.perf_counter()
    rewritten = _pass_over_done_shards(out, manifest, spec, checked)
    reused = len(manifest["shards"]) - len(rewritten)
    start = manifest["shards"][-1]["stop"] if manifest["shards"] else 0
    with _progress_bar(total, start, progress, "decoding images") as bar:
        blobs = ((coder.encode(image), image) for image in checked)
        written = append_shards(blobs, out, manifest, start, total, layout, spec, bar, lock, source_hash=True)
    done = _close_manifest(out, manifest, total, keys, side)
    return PopulateSummary(
        cache_dir=str(out), codec=codec, n_images=done, n_shards=len(manifest["shards"]),
        shards_written=written + len(rewritten), shards_reused=reused,
        images_rendered=done - start + sum(s["count"] for s in rewritten),
        seconds=time.perf_counter() - started, render_seconds=time.perf_counter() - render_started,
        bytes_on_disk=cache_bytes_on_disk(out), predicted_bytes=plan.predicted_bytes if total else 0,
        shard_bytes=cache_bytes_on_disk(out, shards_only=True),
        workers=1, shards_repaired=len(rewritten), verb="decoded")


def _close_manifest(out: Path, manifest: dict, total: int | None, keys: Sequence[str] | None,
                    side=None) -> int:
    """Check the count against the announced one, record the source's identity (and the images'
    keys, in their own file: the manifest stays small); the images in the cache.
    """
    done = manifest["shards"][-1]["stop"] if manifest["shards"] else 0
    if total is not None and done != total:
        raise CacheError(f"{done:,} images came, {total:,} were announced (n_images or len); pass the "
                         f"right n_images, or overwrite=True to start again")
    manifest["source"] = {"kind": "images", "n_images": done,
                          "sha256": sha256_json([s["source_xxh3"] for s in manifest["shards"]])}
    if keys is not None:
        keys = [str(k) for k in keys]
        if len(keys) != done:
            raise InputError(f"{len(keys):,} keys for {done:,} images: pass one key per image, in order")
        written = atomic_write_bytes(out / KEYS_FILE, json_bytes(keys))
        manifest["source"]["keys"] = {"file": KEYS_FILE, "sha256": written.sha256}
    table = side() if side is not None else None
    if table:
        for name in ("labels", "texts"):
            if name in table and len(table[name]) != done:
                raise InputError(f"{len(table[name]):,} {name} for {done:,} images: one per image, in order")
        classes = table.pop("classes", None)
        written = atomic_write_bytes(out / SIDE_FILE, json_bytes(table))
        manifest["source"]["side"] = {"file": SIDE_FILE, "sha256": written.sha256,
                                      "kind": "labels" if "labels" in table else "texts"}
        if classes is not None:
            manifest["source"]["side"]["classes"] = list(classes)   # the class names, in the manifest
    write_cache_manifest(out, manifest)
    return done


def source_keys(cache_dir: str | Path) -> list[str] | None:
    """The per-image keys `write_images(keys=...)` recorded (file names for `cache --images DIR`), or None."""
    recorded = read_cache_manifest(cache_dir)["source"].get("keys")
    return recorded_json(cache_dir, recorded) if recorded else None


def as_image(item, column: str | None = None, index: int = 0, size: int | None = None) -> np.ndarray:
    """One item as a uint8 [H, W, 3] array: arrays, PIL images and image files' bytes (`EncodedImage`)
    by the one pixel policy (`nblib.cache.pixels`; a JPEG drafted for `size`), torch tensors, dicts, tuples.
    """
    if isinstance(item, dict):
        item = item[column or "image"]
    elif isinstance(item, tuple):
        item = item[0]  # (image, label), as torch datasets give
    if item is None:
        raise InputError(f"image {index:,} (row {index:,} of the input) is missing (None): fill it or drop the row")
    if isinstance(item, EncodedImage):
        return decode_image_bytes(item.data, item.where, size, item.mode)
    if hasattr(item, "convert") and hasattr(item, "mode"):  # a PIL image
        item = pil_pixels(item, f"image {index:,}", size)
    elif type(item).__module__.startswith("torch"):
        item = item.detach().cpu().numpy()
        if item.ndim == 3 and item.shape[0] in (1, 3, 4) and item.shape[-1] not in (1, 3, 4):
            item = item.transpose(1, 2, 0)  # torch's [C, H, W]
    array = np.asarray(item)
    if array.dtype != np.uint8:
        raise InputError(f"image {index:,} has dtype {array.dtype}, not uint8; convert it first "
                         f"(e.g. (x * 255).round().clip(0, 255).astype(np.uint8))")
    if array.ndim == 2:
        array = np.repeat(array[:, :, None], 3, axis=2)
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4):
        raise InputError(f"image {index:,} has shape {array.shape}; the cache takes [H, W, 3] "
                         f"(or [H, W], [H, W, 1], [H, W, 4], [3, H, W] tensors)")
    if array.shape[2] == 1:
        array = np.repeat(array, 3, axis=2)
    elif array.shape[2] == 4:
        array = array[:, :, :3]
    return np.ascontiguousarray(array)


# ====================================================================================== helpers


def _items(images, column: str | None) -> Iterator:
    """Iterate any source: HF datasets by column, torch map-style datasets by index, iterables."""
    if type(images).__module__.startswith("datasets"):
        return iter(dataset_column(images, column or "image"))
    if hasattr(images, "__getitem__") and hasattr(images, "__len__") and not isinstance(images, (list, tuple)) \
            and not isinstance(images, np.ndarray) and not hasattr(images, "__iter__"):
        return (images[k] for k in range(len(images)))
    return iter(images)


def _length(images) -> int | None:
    try:
        return len(images)
    except TypeError:
        return None


def _fitted(item, column: str | None, index: int, size: int | None) -> np.ndarray:
    """One item decoded by the pixel policy (a JPEG drafted for `size`), then resized by RESIZE_POLICY."""
    image = as_image(item, column, index, size)
    return fit_size(image, size, getattr(item, "where", f"image {index:,}"))


def _checked(images: Iterable[np.ndarray], shape: list[int], keys=None) -> Iterator[np.ndarray]:
    """The images, each of the first one's shape; another size is refused naming both (and --size)."""
    def named(k: int) -> str:
        return f"image {k:,}" + (f" ({keys[k]})" if keys is not None and k < len(keys) else "")

    for k, image in enumerate(images):
        if list(image.shape) != shape:
            (h, w), (h0, w0) = image.shape[:2], shape[:2]
            raise InputError(f"{named(k)} is {w}x{h} px, {named(0)} is {w0}x{h0} px (width x height): a cache "
                             f"holds one size; pass --size N (write_images(size=N)) to resize every image "
                             f"({RESIZE_POLICY})")
        yield image


def _resumable(out: Path, layout: dict, total: int | None) -> dict | None:
    """The existing manifest to continue when it is an images cache with these settings, else None."""
    old = manifest_or_none(read_cache_manifest, out)
    if old is None or old["source"].get("kind") != "images" or any(old.get(k) != v for k, v in layout.items()):
        return None
    known = old["source"].get("n_images")
    if known is not None and total is not None and known != total and old["source"].get("sha256"):
        return None  # a finished cache of another number of images
    return old


def _fresh_manifest(out: Path, layout: dict, spec: CodecSpec, total: int | None, overwrite: bool) -> dict:
    if (out / MANIFEST).exists() or any(out.glob("shard-*")):
        if not overwrite:
            raise CacheError(f"the folder {out} holds another cache (other images, codec, shard size, "
                             f"image shape or --size); pass overwrite=True (--overwrite) to rebuild it, or pick "
                             f"another --out")
        _clear(out)
    manifest = {"source": {"kind": "images", "n_images": total, "sha256": None}, **layout,
                "codec_options": spec.record(), "shards": []}
    write_cache_manifest(out, manifest)
    return manifest


def _pass_over_done_shards(out: Path, manifest: dict, spec: CodecSpec, images: Iterator) -> list[dict]:
    """Consume the images of shards already written: check they are the same, rewrite damaged shards."""
    coder, stats, rewritten = codec_for(spec), read_shard_stats(out), []

    def rewrite(entry: dict) -> dict:   # the shard of the current `batch`, from its images
        with ShardWriter(out, shard_index(entry["file"]), entry["start"], spec, manifest["image_shape"],
                         count=entry["count"], source_hash=True) as writer:
            for image in batch:
                writer.add(coder.encode(image), image)
            new = writer.commit(expect_sha256=entry["sha256"])
        record_shard_stats(out, {entry["file"]: writer.stat})
        return new

    for i, entry in enumerate(list(manifest["shards"])):
        batch = list(itertools.islice(images, entry["count"]))
        digest = xxhash.xxh3_64()
        for image in batch:
            digest.update(image)
        if len(batch) != entry["count"] or digest.hexdigest() != entry["source_xxh3"]:
            raise CacheError(f"these images are not the ones {out} was written from (shard {entry['file']}, "
                             f"images {entry['start']:,}-{entry['stop'] - 1:,}, differ): pass the same images "
                             f"in the same order to resume, or overwrite=True (--overwrite) to rebuild")
        if mend_shard(out, manifest, i, stats, rewrite):
            rewritten.append(entry)
    return rewritten
