"""Populate a cache: render texts on a process pool into size-targeted shards, resumably.

Every shard is written atomically and the manifest is rewritten after each one, so a killed run
resumes at the first shard the manifest lacks and ends with the same shard bytes as an
uninterrupted run. Rendering runs in input order, so the bytes never depend on `workers`. A
rerun first checks the shards already listed (a stat each, a sha256 where the stat changed) and
re-renders a damaged one instead of reusing it. The disk a cache takes is predicted by
`nblib.budget.cache_bytes` and checked before anything is written. A run holds the folder's lock
(`nblib.lock`) while it reads and writes it, so a second run is refused instead of mixing shards
or deleting the first one's temporaries.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import time
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nblib.atomic import leftover_temporaries, remove_temporaries
from nblib.budget.disk import stored_bytes_per_image
from nblib.cache.codecs import CodecSpec, check_codec, codec_for, train_dictionary
from nblib.cache.format import (
    DAMAGED,
    LEGACY_STAT_CACHE,
    MANIFEST,
    STAT_CACHE,
    ShardWriter,
    current_stat,
    images_per_raw_shard,
    manifest_or_none,
    read_cache_manifest,
    read_shard_stats,
    record_shard_stats,
    shard_bytes,
    shard_index,
    shard_state,
    warn_many_files,
    write_cache_manifest,
    write_shard,
)
from nblib.cache.texts import TextScan, TextSource, require_texts, scan_texts, text_source
from nblib.disk import disk_free
from nblib.errors import CacheError, ConfigError, InputError
from nblib.lock import FolderLock, run_identity
from nblib.pool import pool_context, watch_owner
from nblib.render import Coverage, RenderFailed, RenderParams, coverage, render_params, render_with
from nblib.units import fmt_bytes

BATCH = 16              # texts per pool task
SAMPLE_TEXTS = 64       # texts rendered to estimate compressed bytes per image
COVERAGE_TEXTS = 10_000  # texts whose characters are checked against the font chain (the first ones)
COVERAGE_WARN = 0.01    # share of characters without a glyph above which populate warns (strict: refuses)


@dataclass(frozen=True)
class PopulateSummary:
    """What a populate run did: images and shards in the cache, what this run wrote, and speed."""

    cache_dir: str
    codec: str
    n_images: int
    n_shards: int
    shards_written: int
    shards_reused: int
    images_rendered: int
    seconds: float         # the whole call: scan, preflight, pool start, render, write
    render_seconds: float  # rendering and writing shards only
    bytes_on_disk: int     # the shards, the manifest (a zstd dictionary's 22 KB too) and its stat cache
    predicted_bytes: int   # the shards' (plan_cache)
    workers: int
    shards_repaired: int = 0  # listed shards found damaged and re-rendered (counted in written)
    coverage: Coverage | None = None  # characters without a glyph in the font chain, per script
    verb: str = "rendered"            # what the run did to each image: rendered (texts), decoded (images)
    shard_bytes: int | None = None    # of bytes_on_disk, the shard files'

    @property
    def images_per_s(self) -> float:
        """Images rendered and written per second of the render loop."""
        return self.images_rendered / self.render_seconds if self.render_seconds > 0 else 0.0

    def __str__(self) -> str:
        repaired = f" (repaired {self.shards_repaired} damaged)" if self.shards_repaired else ""
        return (f"cache {self.cache_dir}: {self.n_images:,} images in {self.n_shards} {self.codec} "
                f"shards ({self.disk_text()}); this run {self.verb} {self.images_rendered:,} "
                f"images into {self.shards_written} shards{repaired} and reused {self.shards_reused}, "
                f"{self.images_per_s:,.0f} images/s with {self.workers} worker(s)")

    def disk_text(self) -> str:
        """The bytes on disk beside the prediction, like for like: the shards', then the manifest's apart."""
        shards = self.bytes_on_disk if self.shard_bytes is None else self.shard_bytes
        manifest = self.bytes_on_disk - shards
        kept = f", and the manifest {fmt_bytes(manifest)}" if manifest else ""
        return (f"{fmt_bytes(self.bytes_on_disk)} on disk: shards {fmt_bytes(shards)}, predicted "
                f"{fmt_bytes(self.predicted_bytes)}{kept}")


def populate(texts, cache_dir: str | Path, image_size: int = 224, shard_mb: float = 400,
             workers: int | None = None, seed: int = 0, codec: str = "raw", overwrite: bool = False,
             progress: bool = True, *, field: str | None = None, errors: str = "strict",
             font_size: int | None = None, strict_fonts: bool = False,
             codec_level: int | None = None) -> PopulateSummary:
    """Render `texts` into a sharded cache at `cache_dir`, resuming whatever is already there.

    A cache of other texts or render settings is refused unless `overwrite`; damaged listed shards
    are re-rendered. The characters of the first COVERAGE_TEXTS texts are checked against the font
    chain: the share without a glyph, per script, goes into the manifest; above COVERAGE_WARN
    populate warns, or with `strict_fonts` refuses before anything is rendered. The folder is
    locked while written. Two identical builds give byte-identical folders apart from the stat
    cache (`STAT_CACHE`, non-canonical). A text the renderer cannot draw raises RenderFailed naming
    its line in the file (or its index in the list).

    Args:
        texts: a path (text file, one text per line; JSONL with `field`) or a sequence of str.
        cache_dir: the cache folder (created; a folder of its own).
        image_size: pixels per side of every image.
        shard_mb: target size of one shard file, in MB (Google Drive prefers few large files).
        workers: render processes; None: all cores; 0 or 1: render in this process.
        seed: recorded in the manifest (the renderer draws no randomness).
        codec: "raw", "zlib", "png", "zstd" (`nblib.cache.CODECS`) or "auto" (measures the codecs
            on a sample and lets `nblib.budget.choose_codec` pick the one that fits the free disk).
        overwrite: delete a cache of other texts or settings in `cache_dir` instead of refusing.
        progress: show a progress bar.
        field: the JSON field holding the text of each line of a JSONL file.
        errors: "strict" (undecodable bytes are refused, naming the line) or "replace" (U+FFFD).
        font_size: font size in pixels; None: scaled with `image_size`.
        strict_fonts: refuse texts whose characters the font chain cannot draw (above COVERAGE_WARN).
        codec_level: a compressed codec's level (zstd: 1-22, default 3, and a dictionary trained on
            the first images, kept when it pays, see `nblib.cache.codecs`; zlib/png: 0-9).

    Returns:
        A `PopulateSummary`: images and shards in the cache, what this run wrote, reused and
        repaired, bytes on disk against the prediction, speed, font coverage.

    Raises:
        InputError (texts missing, empty or undecodable; fonts with `strict_fonts`), ConfigError
        (codec, level, size), CacheError (another cache there, texts changed while rendering),
        BudgetExceeded (the disk cannot hold the cache), FolderBusyError (another run writes it);
        each names the cause and the fix.
    """
    source = text_source(texts, field, errors)
    try:
        return _populate(source, cache_dir, image_size, shard_mb, workers, seed, codec, overwrite, progress,
                         font_size, strict_fonts, codec_level)
    except RenderFailed as exc:
        index = exc.index if exc.index is not None else _index_of(source, getattr(exc, "text", None))
        where = source.where(index) if index is not None else "a text"
        raise RenderFailed(f"{where}: {exc}", index) from None


def _populate(source: TextSource, cache_dir, image_size, shard_mb, workers, seed, codec, overwrite, progress,
              font_size, strict_fonts, codec_level) -> PopulateSummary:
    started = time.perf_counter()
    scan = scan_texts(source, sample_size=SAMPLE_TEXTS, seed=seed)
    require_texts(scan, source)
    params = render_params(image_size, font_size)
    found = check_coverage(itertools.islice(iter(source), COVERAGE_TEXTS), params, strict_fonts)
    cache_dir = cache_folder(cache_dir)
    sample_images = [_render_sample(t, params) for t in scan.sample]
    with cache_lock(cache_dir) as lock:  # everything below reads and writes the folder
        if codec == "auto":
            codec = _resumed_codec(cache_dir, scan) or _auto_codec(scan.n_texts, cache_dir, sample_images)
        layout = _layout(params, codec, shard_mb, seed, codec_level)
        old = _resumable(cache_dir, scan, layout)
        spec = recorded_spec(old) if old else \
            fresh_spec(codec, layout["codec_level"], lambda: _first_images(source, params))
        bytes_per_image = float(np.mean([len(codec_for(spec).encode(im)) for im in sample_images]))
        plan = plan_cache(scan.n_texts, cache_dir, image_size, shard_mb, codec, bytes_per_image)
        if not old:
            plan = dataclasses.replace(plan, done_bytes=0)  # nothing on disk counts toward this cache
        _preflight(cache_dir, plan)  # before anything is written or cleared
        warn_many_files(plan.n_shards + 1, cache_dir, shard_mb)
        manifest = _open_manifest(cache_dir, old, scan, layout, source, overwrite, spec)
        manifest["coverage"] = found.as_dict()
        remove_temporaries(cache_dir)
        workers = resolve_workers(workers)

        render_started = time.perf_counter()
        repaired = _repair_listed_shards(cache_dir, manifest, source, workers)
        reused = len(manifest["shards"]) - len(repaired)
        start = manifest["shards"][-1]["stop"] if manifest["shards"] else 0
        with _progress_bar(scan.n_texts, start, progress) as bar:
            blobs = rendered_blobs(itertools.islice(iter(source), start, None), params, spec, workers, start)
            written = append_shards(blobs, cache_dir, manifest, start, scan.n_texts, layout, spec, bar, lock)
        done = manifest["shards"][-1]["stop"] if manifest["shards"] else 0
        if done != scan.n_texts:
            raise CacheError(f"the texts changed while rendering: {done:,} images written, "
                             f"{scan.n_texts:,} texts counted; rerun with overwrite=True")
        return PopulateSummary(
            cache_dir=str(cache_dir), codec=codec, n_images=done, n_shards=len(manifest["shards"]),
            shards_written=written + len(repaired), shards_reused=reused,
            images_rendered=done - start + sum(s["count"] for s in repaired),
            seconds=time.perf_counter() - started, render_seconds=time.perf_counter() - render_started,
            bytes_on_disk=cache_bytes_on_disk(cache_dir), predicted_bytes=plan.predicted_bytes,
            shard_bytes=cache_bytes_on_disk(cache_dir, shards_only=True),
            workers=workers, shards_repaired=len(repaired), coverage=found)


def check_coverage(texts: Iterable[str], params: RenderParams, strict: bool = False) -> Coverage:
    """The font chain's coverage of `texts`; warns past COVERAGE_WARN missing, or refuses if `strict`."""
    found = coverage(texts, params)
    if found.missing_share > COVERAGE_WARN:
        by_script = ", ".join(f"{script} {found.missing_share_of(script):.0%}" for script in found.characters
                              if found.missing.get(script))
        message = (f"{found.missing_share:.1%} of the characters ({found.total_missing:,} of "
                   f"{found.total_characters:,}) have no glyph in the font chain and would draw as boxes "
                   f"(missing by script: {by_script}); set NBLIB_CJK_FONT to a full CJK font or add a font "
                   f"for the script (data/fonts/README.md)")
        if strict:
            raise InputError(message + ", or drop --strict-fonts to build the cache anyway")
        warnings.warn(message, stacklevel=3)
    return found


def cache_folder(out: str | Path, needs: str = "a cache needs a folder of its own") -> Path:
    """The folder of a cache (or of record shards: `needs`), created; a file in its place is refused."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CacheError(f"{out} is a file, not a folder: {needs}; pass "
                         f"another --out (or move that file away) and rerun")
    out.mkdir(parents=True, exist_ok=True)
    return out


def append_shards(blobs, out: Path, manifest: dict, start: int, total: int | None, layout: dict, spec, bar,
                  lock, *, source_hash: bool = False) -> int:
    """Write the remaining images as shards, recording each in the manifest once it is on disk; how many."""
    written = 0
    for entry, stat in stream_shards(blobs, out, len(manifest["shards"]), start, total, layout, spec, bar,
                                     source_hash=source_hash):
        manifest["shards"].append(entry)
        lock.check()  # still ours: no other run took the folder over
        write_cache_manifest(out, manifest)
        record_shard_stats(out, stat)
        written += 1
    return written


def cache_lock(cache_dir: str | Path) -> FolderLock:
    """The lock a populate or repair holds on a cache folder: a second writer gets FolderBusyError."""
    return FolderLock(cache_dir, identity=run_identity("nblib.cache"), what="cache folder",
                      hint="build into another --out", read_only_ok=True)


# ====================================================================================== plan


@dataclass(frozen=True)
class CachePlan:
    """What a cache will take before it is built: images, shards, bytes, and the free disk."""

    n_images: int
    image_size: int
    codec: str
    shard_mb: float
    bytes_per_image: float
    predicted_bytes: int
    n_shards: int
    free_bytes: int
    done_bytes: int = 0

    @property
    def fits(self) -> bool:
        return self.predicted_bytes - self.done_bytes <= self.free_bytes

    def __str__(self) -> str:
        return (f"{self.n_images:,} images at {self.image_size} px, codec {self.codec}: "
                f"{self.bytes_per_image / 1e3:,.1f} KB/image -> {self.predicted_bytes / 1e9:,.3f} GB "
                f"in {self.n_shards:,} shards of ~{self.shard_mb:g} MB; "
                f"free disk {self.free_bytes / 1e9:,.1f} GB -> {'fits' if self.fits else 'DOES NOT FIT'}")


def plan_cache(n_images: int, cache_dir: str | Path, image_size: int = 224, shard_mb: float = 400,
               codec: str = "raw", bytes_per_image: float | None = None) -> CachePlan:
    """The bytes (`nblib.budget.cache_bytes`) and shards a cache will take, and the free disk.

    Compressed codecs need `bytes_per_image` measured on a sample (`measure_codecs`); the
    shard count follows how `populate` cuts shards.
    """
    from nblib import budget

    check_codec(codec)
    target = shard_bytes(shard_mb)
    raw = image_size * image_size * 3
    if bytes_per_image is None:
        if codec != "raw":
            raise ConfigError(f"plan_cache(codec={codec!r}) needs bytes_per_image; measure it with "
                              f"measure_codecs(sample_images)[{codec!r}]['bytes_per_image']")
        bytes_per_image = raw
    stored = stored_bytes_per_image(codec, bytes_per_image)
    per_shard = float(images_per_raw_shard(target, (image_size, image_size, 3))) if codec == "raw" \
        else max(1.0, target / stored)
    # budget.cache_bytes takes whole MB per shard; the shard count only moves its per-shard header term
    predicted = budget.cache_bytes(n_images, image_size, codec, stored, shard_mb=max(1, math.ceil(shard_mb)))
    return CachePlan(n_images=n_images, image_size=image_size, codec=codec, shard_mb=shard_mb,
                     bytes_per_image=float(bytes_per_image), predicted_bytes=int(predicted),
                     n_shards=math.ceil(n_images / per_shard),
                     free_bytes=disk_free(cache_dir), done_bytes=cache_bytes_on_disk(cache_dir))


def cache_bytes_on_disk(cache_dir: str | Path, shards_only: bool = False) -> int:
    """Bytes of a cache's shard files, manifest and stat cache (0 when the folder does not exist); shards_only:
    the shard files' (what `plan_cache` predicts).
    """
    folder = Path(cache_dir)
    if not folder.is_dir():
        return 0
    listed = () if shards_only else (MANIFEST, STAT_CACHE, LEGACY_STAT_CACHE)
    return sum(p.stat().st_size for p in folder.iterdir()
               if p.is_file() and (p.name.startswith("shard-") or p.name in listed))


# ====================================================================================== rendering


def rerender_shard(cache_dir: Path, manifest: dict, entry: dict, source: TextSource, workers: int) -> dict:
    """Re-render one listed shard; it must come out with the recorded sha256. Its new entry."""
    params = recorded_render_params(manifest)
    spec = recorded_spec(manifest)
    texts = itertools.islice(iter(source), entry["start"], entry["stop"])
    writer = ShardWriter(cache_dir, shard_index(entry["file"]), entry["start"], spec,
                         manifest["image_shape"], count=entry["count"])
    with writer:
        for blob in rendered_blobs(texts, params, spec, workers, entry["start"]):
            writer.add(blob)
        new = writer.commit(expect_sha256=entry["sha256"])
    record_shard_stats(cache_dir, {new["file"]: writer.stat})
    return new


def recorded_spec(manifest: dict) -> CodecSpec:
    """The codec (name, level, dictionary) a cache's manifest records."""
    return CodecSpec.from_record(manifest["codec"], manifest.get("codec_options"))


def fresh_spec(codec: str, level: int | None, first_images) -> CodecSpec:
    """The codec of a new cache: zstd gets a dictionary trained on `first_images()` when it pays."""
    spec = CodecSpec(codec, check_codec(codec).level(level))
    if codec != "zstd":
        return spec
    dictionary, _gain = train_dictionary(first_images(), spec.level)
    return CodecSpec("zstd", spec.level, dictionary)


def recorded_render_params(manifest: dict) -> RenderParams:
    """The installed renderer's params for this cache; CacheError when they draw other pixels."""
    recorded = manifest["renderer"]
    params = render_params(manifest["image_shape"][0], recorded.get("font_size"), recorded.get("margin"))
    if renderer_record(params) != recorded:
        raise CacheError(f"this cache was rendered with other renderer settings "
                         f"({_dict_changes(recorded, renderer_record(params))}); its shards cannot be "
                         f"re-rendered to the same bytes: rebuild it with overwrite=True (--overwrite)")
    return params


def renderer_record(params: RenderParams) -> dict:
    """The renderer's parameters as the manifest stores them (JSON types: tuples become lists)."""
    return json.loads(json.dumps(params.as_dict()))


def rendered_blobs(texts: Iterable[str], params: RenderParams, codec: CodecSpec, workers: int,
                   first: int = 0) -> Iterator[bytes]:
    """Stored bytes of each text's image, in input order, from a bounded process pool.

    `first`: the source index of the first text, so a RenderFailed names the text's index.
    """
    batches = ((batch, params, codec, first + k * BATCH) for k, batch in enumerate(_batched(texts, BATCH)))
    if workers <= 1:
        for task in batches:
            yield from _render_batch(task)
        return
    from concurrent.futures import ProcessPoolExecutor

    window = 4 * workers
    with ProcessPoolExecutor(workers, mp_context=pool_context(), initializer=watch_owner,
                             initargs=(os.getpid(),)) as pool:
        pending: deque = deque()
        try:
            for task in batches:
                pending.append(pool.submit(_render_batch, task))
                if len(pending) >= window:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def resolve_workers(workers: int | None) -> int:
    """Render processes: all cores for None, at least 1; ConfigError for anything else."""
    if workers is None:
        from nblib.env import usable_cores

        return usable_cores()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ConfigError(f"workers={workers!r} must be an integer >= 0 (0 or 1: render in this process)")
    return max(1, workers)


# ====================================================================================== helpers


def _render_batch(task: tuple[list[str], RenderParams, CodecSpec, int]) -> list[bytes]:
    """Worker: render and encode a batch of texts (top-level so the pool can pickle it).

    A text the renderer cannot draw raises RenderFailed carrying its index in the source.
    """
    texts, params, codec, first = task
    coder = codec_for(codec)
    blobs = []
    for i, text in enumerate(texts):
        try:
            blobs.append(coder.encode(render_with(text, params)))
        except RenderFailed as exc:
            raise RenderFailed(str(exc), first + i) from None
    return blobs


def _render_sample(text: str, params: RenderParams) -> np.ndarray:
    """One sample text's image; a RenderFailed carries the text, so populate can find its line."""
    try:
        return render_with(text, params)
    except RenderFailed as exc:
        exc.text = text
        raise


def _index_of(source: TextSource, text: str | None) -> int | None:
    """The index of the first text of `source` equal to `text` (None when absent or not given)."""
    if text is None:
        return None
    return next((i for i, t in enumerate(source) if t == text), None)


def _first_images(source: TextSource, params: RenderParams) -> list[np.ndarray]:
    """The first images of a cache (what a zstd dictionary is trained on), rendered here."""
    from nblib.cache.codecs import DICT_SAMPLES

    return [_render_sample(t, params) for t in itertools.islice(iter(source), DICT_SAMPLES)]


def _batched(items: Iterable, n: int) -> Iterator[list]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, n)):
        yield batch


def stream_shards(blobs: Iterable, cache_dir: Path, index: int, start: int, n_total: int | None,
                  layout: dict, spec: CodecSpec, bar, *, source_hash: bool = False) -> Iterator[tuple[dict, dict]]:
    """Write blobs into consecutive shards as they arrive; yield each committed shard's (entry, stat).

    A shard closes before the blob that would take it past `shard_bytes` (at least one image),
    so raw shards hold shard_bytes // image bytes images each and the cut never depends on time.
    With `source_hash`, `blobs` yields (stored bytes, raw pixels) pairs and each entry records an
    xxh3 of its raw pixels. A raw cache of unknown length (`n_total` None) holds each shard's
    blobs in RAM until the shard is full, since the .npy header needs its count first.
    """
    shape, target = layout["image_shape"], layout["shard_bytes"]
    per_raw_shard = images_per_raw_shard(target, shape)
    pending: list = []   # raw shards of unknown length: the shard's items until it is full
    writer = None
    try:
        for item in blobs:
            blob = item[0] if source_hash else item
            if spec.name == "raw" and n_total is None:
                pending.append(item)
                if len(pending) == per_raw_shard:
                    yield write_shard(cache_dir, index, start, pending, spec, shape, source_hash=source_hash)
                    index, start, pending = index + 1, start + len(pending), []
                bar.update(1)
                continue
            if writer is not None and writer.stored_bytes + len(blob) > target:
                yield writer.commit(), {writer.name: writer.stat}
                writer, index, start = None, index + 1, writer.stop
            if writer is None:
                count = min(per_raw_shard, n_total - start) if spec.name == "raw" else None
                writer = ShardWriter(cache_dir, index, start, spec, shape, count=count,
                                     source_hash=source_hash)
            writer.add(*item) if source_hash else writer.add(blob)
            bar.update(1)
        if pending:
            yield write_shard(cache_dir, index, start, pending, spec, shape, source_hash=source_hash)
        if writer is not None:
            yield writer.commit(), {writer.name: writer.stat}
            writer = None
    finally:
        if writer is not None:
            writer.discard()


def _repair_listed_shards(cache_dir: Path, manifest: dict, source: TextSource, workers: int) -> list[dict]:
    """Re-render listed shards whose file is damaged (`mend_shard`); the entries re-rendered."""
    stats = read_shard_stats(cache_dir)
    return [entry for i, entry in enumerate(list(manifest["shards"])) if mend_shard(
        cache_dir, manifest, i, stats, lambda e: rerender_shard(cache_dir, manifest, e, source, workers))]


def mend_shard(cache_dir: Path, manifest: dict, i: int, stats: dict, rewrite) -> bool:
    """Rewrite listed shard `i` when its file is damaged (stat first, xxh3 where the stat changed), the
    manifest rewritten after; a shard only copied (bytes match, stat changed) gets its new stat recorded.
    True when it was rewritten (`rewrite(entry)` gives its new entry).
    """
    entry = manifest["shards"][i]
    state = shard_state(cache_dir, entry, stats=stats, digest="xxh3")
    if state in DAMAGED:
        manifest["shards"][i] = rewrite(entry)
        write_cache_manifest(cache_dir, manifest)
    elif state == "touched":
        record_shard_stats(cache_dir, current_stat(cache_dir, entry))
    return state in DAMAGED


def _layout(params: RenderParams, codec: str, shard_mb: float, seed: int, codec_level: int | None) -> dict:
    """The settings that decide a cache's bytes; a resume must match them exactly."""
    return {"renderer": renderer_record(params), "codec": codec,
            "codec_level": check_codec(codec).level(codec_level), "shard_mb": shard_mb,
            "shard_bytes": shard_bytes(shard_mb), "seed": seed,
            "image_shape": [params.size, params.size, 3]}


def _open_manifest(cache_dir: Path, old: dict | None, scan: TextScan, layout: dict, source: TextSource,
                   overwrite: bool, spec: CodecSpec) -> dict:
    """The manifest to continue: `old` (the existing one, when it matches), else a fresh (empty) one."""
    fresh = {"source": {"sha256": scan.sha256, "n_texts": scan.n_texts, **source.describe()},
             **layout, "codec_options": spec.record(), "shards": []}
    if old is not None:
        if old["source"] != fresh["source"]:
            old["source"] = fresh["source"]  # the texts moved; their bytes are the same
            write_cache_manifest(cache_dir, old)
        return old
    listed, shards = (cache_dir / MANIFEST).exists(), any(cache_dir.glob("shard-*"))
    if listed and not overwrite:
        problem = _mismatch(read_cache_manifest(cache_dir), fresh)  # a manifest that does not read: its CacheError
        raise CacheError(f"the cache at {cache_dir} was built from other inputs: {problem}; "
                         f"pass overwrite=True (--overwrite) to rebuild it, or pick another --out")
    if shards and not overwrite:
        raise CacheError(f"{cache_dir} holds shard files but no {MANIFEST}; pass "
                         f"overwrite=True (--overwrite) to rebuild, or pick an empty folder")
    if listed or shards:
        _clear(cache_dir)
    write_cache_manifest(cache_dir, fresh)
    return fresh


def _resumable(cache_dir: Path, scan: TextScan, layout: dict) -> dict | None:
    """The manifest of the cache in cache_dir when it is one of these texts and settings (its shards count as
    done), else None.
    """
    old = manifest_or_none(read_cache_manifest, cache_dir)
    source = {"sha256": scan.sha256, "n_texts": scan.n_texts}
    return old if old is not None and _mismatch(old, {"source": source, **layout}) is None else None


def _mismatch(old: dict, new: dict) -> str | None:
    """What differs between an existing manifest and the one this run would write, or None."""
    was, now = old["source"], new["source"]
    if (was.get("sha256"), was.get("n_texts")) != (now["sha256"], now["n_texts"]):
        return (f"source fingerprint {str(was.get('sha256'))[:12]} ({was.get('n_texts', 0):,} texts) "
                f"!= this source's {now['sha256'][:12]} ({now['n_texts']:,} texts)")
    for key in ("renderer", "codec", "codec_level", "shard_bytes", "seed", "image_shape"):
        if old.get(key) != new[key]:
            if key == "renderer":
                return (f"the renderer changed ({_dict_changes(old.get(key) or {}, new[key])}), so "
                        f"its images would differ from the cached ones; images of two renderers "
                        f"are never mixed in one cache")
            return f"{key} was {old.get(key)!r}, now {new[key]!r}"
    return None


def _dict_changes(old: dict, new: dict) -> str:
    keys = sorted(set(old) | set(new))
    return ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k))


def _clear(cache_dir: Path) -> None:
    """Delete a cache's own files (shards, manifest, temporaries); nothing else in the folder."""
    for path in [*cache_dir.glob("shard-*"), *leftover_temporaries(cache_dir), cache_dir / MANIFEST,
                 cache_dir / STAT_CACHE, cache_dir / LEGACY_STAT_CACHE, cache_dir / "source-keys.json",
                 cache_dir / "source-labels.json"]:
        path.unlink(missing_ok=True)


def _preflight(cache_dir: Path, plan: CachePlan) -> None:
    """Refuse to start when the rest of the cache does not fit the free disk (the budget's check)."""
    from nblib.budget import check_disk

    knob = ("a compressed codec (--codec zstd, zlib or png), a smaller --size, fewer texts, or a disk "
            "with more free space")
    check_disk(cache_dir, max(0, plan.predicted_bytes - plan.done_bytes), what="image cache", knob=knob)


def _resumed_codec(cache_dir: Path, scan: TextScan) -> str | None:
    """The codec of an existing cache of the same texts, so codec="auto" resumes what it began."""
    manifest = manifest_or_none(read_cache_manifest, cache_dir) or {"source": {}}
    same = (manifest["source"].get("sha256"), manifest["source"].get("n_texts")) == (scan.sha256, scan.n_texts)
    return manifest.get("codec") if same else None


def _auto_codec(n_images: int, cache_dir: Path, sample_images: list[np.ndarray]) -> str:
    """The codec the budget picks for this many images and the free disk."""
    from nblib import budget
    from nblib.cache.format import measure_codecs

    free = disk_free(cache_dir) + cache_bytes_on_disk(cache_dir)
    choice = budget.choose_codec(n_images, free, measure_codecs(sample_images))
    return getattr(choice, "codec", choice)


def _progress_bar(total: int, initial: int, enabled: bool, what: str = "rendering"):
    from nblib.compare import progress_bar

    return progress_bar(total, what, "img", initial=initial, disable=not enabled, widget=True,
                        smoothing=0.1, dynamic_ncols=True)
