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

from nblib.atomic import leftover_temporaries
from nblib.cache.format import (
    DAMAGED,
    MANIFEST,
    ShardWriter,
    check_codec,
    encode_image,
    images_per_raw_shard,
    read_cache_manifest,
    restamp,
    shard_bytes,
    shard_index,
    shard_state,
    stored_bytes_per_image,
    warn_many_files,
    write_cache_manifest,
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
    bytes_on_disk: int
    predicted_bytes: int
    workers: int
    shards_repaired: int = 0  # listed shards found damaged and re-rendered (counted in written)
    coverage: Coverage | None = None  # characters without a glyph in the font chain, per script

    @property
    def images_per_s(self) -> float:
        """Images rendered and written per second of the render loop."""
        return self.images_rendered / self.render_seconds if self.render_seconds > 0 else 0.0

    def __str__(self) -> str:
        repaired = f" (repaired {self.shards_repaired} damaged)" if self.shards_repaired else ""
        return (f"cache {self.cache_dir}: {self.n_images:,} images in {self.n_shards} {self.codec} "
                f"shards ({fmt_bytes(self.bytes_on_disk)} on disk, predicted "
                f"{fmt_bytes(self.predicted_bytes)}); this run rendered {self.images_rendered:,} "
                f"images into {self.shards_written} shards{repaired} and reused {self.shards_reused}, "
                f"{self.images_per_s:,.0f} images/s with {self.workers} worker(s)")


def populate(texts, cache_dir: str | Path, image_size: int = 224, shard_mb: float = 400,
             workers: int | None = None, seed: int = 0, codec: str = "raw", overwrite: bool = False,
             progress: bool = True, *, field: str | None = None, errors: str = "strict",
             font_size: int | None = None, strict_fonts: bool = False) -> PopulateSummary:
    """Render `texts` into a sharded cache at `cache_dir`, resuming whatever is already there.

    `texts` is a path (text file, one per line; JSONL with `field`) or a sequence of str.
    `workers=None` uses all cores; 0 or 1 renders in this process. `seed` is recorded in the
    manifest (the renderer draws no randomness). `codec="auto"` measures the codecs on a sample
    and lets `nblib.budget.choose_codec` pick the one that fits the free disk. A cache of other
    texts or render settings is refused unless `overwrite`; damaged listed shards are re-rendered.
    The characters of the first COVERAGE_TEXTS texts are checked against the font chain: the share
    without a glyph, per script, goes into the manifest; above COVERAGE_WARN populate warns, or
    with `strict_fonts` refuses (InputError) before anything is rendered. A text the renderer
    cannot draw raises RenderFailed naming its line in the file (or its index in the list).
    """
    source = text_source(texts, field, errors)
    try:
        return _populate(source, cache_dir, image_size, shard_mb, workers, seed, codec, overwrite, progress,
                         font_size, strict_fonts)
    except RenderFailed as exc:
        index = exc.index if exc.index is not None else _index_of(source, getattr(exc, "text", None))
        where = source.where(index) if index is not None else "a text"
        raise RenderFailed(f"{where}: {exc}", index) from None


def _populate(source: TextSource, cache_dir, image_size, shard_mb, workers, seed, codec, overwrite, progress,
              font_size, strict_fonts) -> PopulateSummary:
    started = time.perf_counter()
    scan = scan_texts(source, sample_size=SAMPLE_TEXTS, seed=seed)
    require_texts(scan, source)
    params = render_params(image_size, font_size)
    found = check_coverage(itertools.islice(iter(source), COVERAGE_TEXTS), params, strict_fonts)
    cache_dir = Path(cache_dir)
    if cache_dir.exists() and not cache_dir.is_dir():
        raise CacheError(f"{cache_dir} is a file, not a folder: a cache needs a folder of its own; pass "
                         f"another --out (or move that file away) and rerun")
    cache_dir.mkdir(parents=True, exist_ok=True)
    sample_images = [_render_sample(t, params) for t in scan.sample]
    with cache_lock(cache_dir) as lock:  # everything below reads and writes the folder
        if codec == "auto":
            codec = _resumed_codec(cache_dir, scan) or _auto_codec(scan.n_texts, cache_dir, sample_images)
        check_codec(codec)
        layout = _layout(params, codec, shard_mb, seed)
        bytes_per_image = float(np.mean([len(encode_image(im, codec)) for im in sample_images]))
        plan = plan_cache(scan.n_texts, cache_dir, image_size, shard_mb, codec, bytes_per_image)
        if not _resumable(cache_dir, scan, layout):
            plan = dataclasses.replace(plan, done_bytes=0)  # nothing on disk counts toward this cache
        _preflight(cache_dir, plan)  # before anything is written or cleared
        warn_many_files(plan.n_shards + 1, cache_dir, shard_mb)
        manifest = _open_manifest(cache_dir, scan, layout, source, overwrite)
        manifest["coverage"] = found.as_dict()
        _remove_temporaries(cache_dir)
        workers = resolve_workers(workers)

        render_started = time.perf_counter()
        repaired = _repair_listed_shards(cache_dir, manifest, source, workers)
        reused = len(manifest["shards"]) - len(repaired)
        start = manifest["shards"][-1]["stop"] if manifest["shards"] else 0
        written = 0
        with _progress_bar(scan.n_texts, start, progress) as bar:
            blobs = rendered_blobs(itertools.islice(iter(source), start, None), params, codec, workers, start)
            for entry in _stream_shards(blobs, cache_dir, len(manifest["shards"]), start, scan.n_texts,
                                        layout, bar):
                manifest["shards"].append(entry)
                lock.check()  # still ours: no other run took the folder over
                write_cache_manifest(cache_dir, manifest)
                written += 1
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
    images_per_shard: float
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
    predicted = budget.cache_bytes(n_images, image_size, codec, None if codec == "raw" else stored,
                                   shard_mb=max(1, math.ceil(shard_mb)))
    return CachePlan(n_images=n_images, image_size=image_size, codec=codec, shard_mb=shard_mb,
                     bytes_per_image=float(bytes_per_image), predicted_bytes=int(predicted),
                     images_per_shard=per_shard, n_shards=math.ceil(n_images / per_shard),
                     free_bytes=disk_free(cache_dir), done_bytes=cache_bytes_on_disk(cache_dir))


def cache_bytes_on_disk(cache_dir: str | Path) -> int:
    """Bytes of a cache's shard files and manifest (0 when the folder does not exist)."""
    folder = Path(cache_dir)
    if not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.iterdir()
               if p.is_file() and (p.name.startswith("shard-") or p.name == MANIFEST))


# ====================================================================================== rendering


def rerender_shard(cache_dir: Path, manifest: dict, entry: dict, source: TextSource, workers: int) -> dict:
    """Re-render one listed shard; it must come out with the recorded sha256. Its new entry."""
    params = recorded_render_params(manifest)
    texts = itertools.islice(iter(source), entry["start"], entry["stop"])
    writer = ShardWriter(cache_dir, shard_index(entry["file"]), entry["start"], manifest["codec"],
                         manifest["image_shape"], count=entry["count"])
    with writer:
        for blob in rendered_blobs(texts, params, manifest["codec"], workers, entry["start"]):
            writer.add(blob)
        return writer.commit(expect_sha256=entry["sha256"])


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


def rendered_blobs(texts: Iterable[str], params: RenderParams, codec: str, workers: int,
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
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:
            return max(1, os.cpu_count() or 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ConfigError(f"workers={workers!r} must be an integer >= 0 (0 or 1: render in this process)")
    return max(1, workers)


# ====================================================================================== helpers


def _render_batch(task: tuple[list[str], RenderParams, str, int]) -> list[bytes]:
    """Worker: render and encode a batch of texts (top-level so the pool can pickle it).

    A text the renderer cannot draw raises RenderFailed carrying its index in the source.
    """
    texts, params, codec, first = task
    blobs = []
    for i, text in enumerate(texts):
        try:
            blobs.append(encode_image(render_with(text, params), codec))
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


def _batched(items: Iterable, n: int) -> Iterator[list]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, n)):
        yield batch


def _stream_shards(blobs: Iterable[bytes], cache_dir: Path, index: int, start: int, n_total: int,
                   layout: dict, bar) -> Iterator[dict]:
    """Write blobs into consecutive shards as they arrive; yield each committed shard's entry.

    A shard closes before the blob that would take it past `shard_bytes` (at least one image),
    so raw shards hold shard_bytes // image bytes images each and the cut never depends on time.
    """
    codec, shape, target = layout["codec"], layout["image_shape"], layout["shard_bytes"]
    per_raw_shard = images_per_raw_shard(target, shape)
    writer = None
    try:
        for blob in blobs:
            if writer is not None and writer.blob_bytes + len(blob) > target:
                yield writer.commit()
                writer, index, start = None, index + 1, writer.stop
            if writer is None:
                count = min(per_raw_shard, n_total - start) if codec == "raw" else None
                writer = ShardWriter(cache_dir, index, start, codec, shape, count=count)
            writer.add(blob)
            bar.update(1)
        if writer is not None:
            yield writer.commit()
            writer = None
    finally:
        if writer is not None:
            writer.discard()


def _repair_listed_shards(cache_dir: Path, manifest: dict, source: TextSource, workers: int) -> list[dict]:
    """Re-render listed shards whose file is damaged (stat first, sha256 where the stat changed).

    A shard whose bytes still match but whose mtime changed (a copy) gets its new stat recorded.
    The manifest is rewritten after each change. Returns the entries re-rendered.
    """
    repaired = []
    for i, entry in enumerate(manifest["shards"]):
        state = shard_state(cache_dir, entry)
        if state in DAMAGED:
            manifest["shards"][i] = rerender_shard(cache_dir, manifest, entry, source, workers)
            repaired.append(entry)
        elif state == "touched":
            manifest["shards"][i] = restamp(cache_dir, entry)
        if state is not None:
            write_cache_manifest(cache_dir, manifest)
    return repaired


def _layout(params: RenderParams, codec: str, shard_mb: float, seed: int) -> dict:
    """The settings that decide a cache's bytes; a resume must match them exactly."""
    return {"renderer": renderer_record(params), "codec": codec, "shard_mb": shard_mb,
            "shard_bytes": shard_bytes(shard_mb), "seed": seed,
            "image_shape": [params.size, params.size, 3]}


def _open_manifest(cache_dir: Path, scan: TextScan, layout: dict, source: TextSource,
                   overwrite: bool) -> dict:
    """The manifest to continue: the existing one if it matches, else a fresh (empty) one."""
    fresh = {"source": {"sha256": scan.sha256, "n_texts": scan.n_texts, **source.describe()},
             **layout, "shards": []}
    if (cache_dir / MANIFEST).exists():
        try:
            old = read_cache_manifest(cache_dir)
        except CacheError:
            if not overwrite:
                raise
            old = None
        problem = _mismatch(old, fresh) if old else None
        if old and problem is None:
            if old["source"] != fresh["source"]:
                old["source"] = fresh["source"]  # the texts moved; their bytes are the same
                write_cache_manifest(cache_dir, old)
            return old
        if not overwrite:
            raise CacheError(f"the cache at {cache_dir} was built from other inputs: {problem}; "
                             f"pass overwrite=True (--overwrite) to rebuild it, or pick another --out")
        _clear(cache_dir)
    elif any(cache_dir.glob("shard-*")):
        if not overwrite:
            raise CacheError(f"{cache_dir} holds shard files but no {MANIFEST}; pass "
                             f"overwrite=True (--overwrite) to rebuild, or pick an empty folder")
        _clear(cache_dir)
    write_cache_manifest(cache_dir, fresh)
    return fresh


def _resumable(cache_dir: Path, scan: TextScan, layout: dict) -> bool:
    """True when cache_dir holds a cache of these texts and settings (its shards count as done)."""
    try:
        old = read_cache_manifest(cache_dir)
    except CacheError:
        return False
    return _mismatch(old, {"source": {"sha256": scan.sha256, "n_texts": scan.n_texts}, **layout}) is None


def _mismatch(old: dict, new: dict) -> str | None:
    """What differs between an existing manifest and the one this run would write, or None."""
    was, now = old["source"], new["source"]
    if (was.get("sha256"), was.get("n_texts")) != (now["sha256"], now["n_texts"]):
        return (f"source fingerprint {str(was.get('sha256'))[:12]} ({was.get('n_texts', 0):,} texts) "
                f"!= this source's {now['sha256'][:12]} ({now['n_texts']:,} texts)")
    for key in ("renderer", "codec", "shard_bytes", "seed", "image_shape"):
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
    for path in [*cache_dir.glob("shard-*"), *leftover_temporaries(cache_dir), cache_dir / MANIFEST]:
        path.unlink(missing_ok=True)


def _remove_temporaries(cache_dir: Path) -> int:
    """Delete temporaries a killed run left (only this cache's writer creates them)."""
    leftovers = leftover_temporaries(cache_dir)
    for path in leftovers:
        path.unlink(missing_ok=True)
    return len(leftovers)


def _preflight(cache_dir: Path, plan: CachePlan) -> None:
    """Refuse to start when the rest of the cache does not fit the free disk (the budget's check)."""
    from nblib.budget import check_disk

    knob = ("a compressed codec (--codec zlib or png), a smaller --size, fewer texts, or a disk "
            "with more free space")
    check_disk(cache_dir, max(0, plan.predicted_bytes - plan.done_bytes), what="image cache", knob=knob)


def _resumed_codec(cache_dir: Path, scan: TextScan) -> str | None:
    """The codec of an existing cache of the same texts, so codec="auto" resumes what it began."""
    try:
        manifest = read_cache_manifest(cache_dir)
    except CacheError:
        return None
    same = (manifest["source"].get("sha256"), manifest["source"].get("n_texts")) == (scan.sha256, scan.n_texts)
    return manifest.get("codec") if same else None


def _auto_codec(n_images: int, cache_dir: Path, sample_images: list[np.ndarray]) -> str:
    """The codec the budget picks for this many images and the free disk."""
    from nblib import budget
    from nblib.cache.format import measure_codecs

    free = disk_free(cache_dir) + cache_bytes_on_disk(cache_dir)
    choice = budget.choose_codec(n_images, free, measure_codecs(sample_images))
    return getattr(choice, "codec", choice)


def _progress_bar(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="img", desc="rendering", disable=not enabled,
                smoothing=0.1, dynamic_ncols=True)
