"""Verify a folder of shards against its manifest (every shard's size and sha256), and repair what is wrong.

`verify` (an image cache) and `verify_records` (record shards) hash every listed shard, so they also
catch what the readers' quick check (a stat per shard) cannot: a same-size edit that kept the file's
mtime. Repair deletes leftover temporaries and unlisted shard files and records in the local stat
cache the new stat of shards whose bytes match but whose stat changed (a copied cache), so readers
trust them again without hashing. An image cache's damaged shards are re-rendered from the source
texts (the recorded path, or `texts`); record shards are rebuilt by rerunning `write_records` over
the source (the path the manifest recorded, or the records passed): listed shards whose records hash
as recorded are skipped, damaged ones are rewritten to their recorded sha256, and an unfinished folder
is finished. Verify hashes with sha256 (identity), where readers use xxh3 (integrity).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from nblib.atomic import leftover_temporaries
from nblib.cache.format import (
    current_stat,
    read_cache_manifest,
    record_shard_stats,
    shard_findings,
    write_cache_manifest,
)
from nblib.cache.populate import cache_lock, rerender_shard, resolve_workers
from nblib.cache.reader import expected_images
from nblib.cache.record_format import read_record_manifest
from nblib.cache.texts import TextSource, scan_texts, text_source
from nblib.errors import CacheError

RECORD_SHARDS = "record shards"      # a VerifyReport's `kind` for record shards (`verify_records`)


@dataclass(frozen=True)
class VerifyReport:
    """A shard folder's health against its manifest: missing, truncated and corrupt shards, stray files, what
    a repair did. One report for an image cache (`verify`) and record shards (`verify_records`).
    """

    folder: str
    kind: str = "cache"             # "cache" (an image cache) or RECORD_SHARDS
    n_shards: int = 0
    n_items: int = 0                # images or records written
    expected_items: int = 0         # images an image cache's manifest plans (record shards: n_items)
    complete: bool = False          # every planned item written (record shards: the manifest says so)
    missing: tuple[str, ...] = ()
    truncated: tuple[str, ...] = ()
    corrupt: tuple[str, ...] = ()
    temporaries: tuple[str, ...] = ()
    unlisted: tuple[str, ...] = ()
    touched: tuple[str, ...] = ()   # bytes match, mtime changed since written (a copy)
    manifest_problem: str | None = None
    repaired: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()

    @property
    def damaged(self) -> tuple[str, ...]:
        return self.missing + self.truncated + self.corrupt

    @property
    def ok(self) -> bool:
        return self.manifest_problem is None and self.complete and not self.damaged and not self.temporaries \
            and not self.unlisted

    def __str__(self) -> str:
        head = f"{self.kind} {self.folder}: "
        if self.manifest_problem:
            return head + f"BROKEN: {self.manifest_problem}"
        records = self.kind == RECORD_SHARDS
        count = f"{self.n_items:,} records" if records else f"{self.n_items:,} of {self.expected_items:,} images"
        lines = [head + ("OK" if self.ok else "PROBLEMS") + f" - {self.n_shards} shards, {count}"]
        redo = "repair rewrites them from the source records" if records else "repair re-renders them"
        for label, names, hint in (
                ("missing", self.missing, redo),
                ("truncated (size differs from the manifest)", self.truncated, redo),
                ("corrupt (sha256 differs from the manifest)", self.corrupt, redo),
                ("leftover temporary files", self.temporaries, "repair deletes them"),
                ("shard files the manifest does not list", self.unlisted, "repair deletes them"),
                ("intact but with a new mtime (copied)", self.touched,
                 "readers hash them on open; repair records their new stat"),
                ("repaired", self.repaired, ""), ("removed", self.removed, "")):
            if names:
                lines.append(f"  {label}: {', '.join(names)}" + (f" ({hint})" if hint else ""))
        if not self.complete:
            lines.append("  incomplete: rerun the same cache --records command to finish" if records else
                         f"  incomplete: {self.expected_items - self.n_items:,} images not rendered "
                         f"yet; rerun the same populate command to finish")
        if self.damaged or self.temporaries or self.unlisted:
            lines.append(f"  fix: python -m nblib cache --verify --repair {self.folder}")
        return "\n".join(lines)


def verify(cache_dir: str | Path, repair: bool = False, texts=None, field: str | None = None,
           workers: int | None = None) -> VerifyReport:
    """Check every shard's size and sha256 against the manifest; with repair, fix what is wrong.

    Repair deletes leftover temporaries and unlisted shard files, re-renders exactly the damaged
    shards from the source texts and records the new stat of shards that were only copied. Repair
    holds the folder's lock: while a populate run writes the folder it is refused (FolderBusyError).

    Args:
        cache_dir: the cache folder.
        repair: fix what is wrong (else only report it).
        texts: the source texts for a re-render (default: the path the manifest recorded).
        field: the JSON field of a JSONL `texts` file.
        workers: render processes for a re-render; None: all cores.

    Returns:
        A `VerifyReport` (`ok`; missing, truncated, corrupt, touched shards; stray files; what was
        repaired and removed). After a repair it describes the folder as it is now.

    Raises:
        CacheError when `cache_dir` is not a folder; FolderBusyError (repair while it is written).
    """
    cache_dir = Path(cache_dir)
    if not cache_dir.is_dir():
        what = "is a file, not a cache folder" if cache_dir.exists() else "does not exist"
        raise CacheError(f"{cache_dir} {what}: there is no cache to verify; check the path, or build "
                         f"one with python -m nblib cache --texts PATH --out DIR")
    if not repair:
        return _inspect(cache_dir)
    with cache_lock(cache_dir):  # no populate may write while temporaries are deleted
        return _repair(cache_dir, texts, field, workers)


# ====================================================================================== helpers


def _repair(cache_dir: Path, texts, field: str | None, workers: int | None) -> VerifyReport:
    """Inspect, then delete strays, re-render damaged shards and restamp copied ones (lock held)."""
    report = _inspect(cache_dir)
    if report.manifest_problem or (report.ok and not report.touched):
        return report
    manifest = read_cache_manifest(cache_dir)
    removed = _mend(cache_dir, report, manifest["shards"])
    source = _repair_source(manifest, texts, field) if report.damaged else None
    workers = resolve_workers(workers) if report.damaged else 1
    repaired = []
    for i, entry in enumerate(manifest["shards"]):
        if entry["file"] in report.damaged:
            manifest["shards"][i] = rerender_shard(cache_dir, manifest, entry, source, workers)
            repaired.append(entry["file"])
            write_cache_manifest(cache_dir, manifest)
    after = _inspect(cache_dir)
    return dataclasses.replace(after, repaired=tuple(repaired), removed=tuple(removed))


def _inspect(folder: Path, kind: str = "cache") -> VerifyReport:
    """Full check of an image cache or record shards (`kind`): stat and sha256 of every listed shard, plus stray
    files (`shard_findings`).
    """
    records = kind == RECORD_SHARDS
    try:
        manifest = (read_record_manifest if records else read_cache_manifest)(folder)
    except CacheError as exc:
        return VerifyReport(folder=str(folder), kind=kind, manifest_problem=str(exc))
    shards = manifest["shards"]
    if records:
        n_items = expected = sum(s["count"] for s in shards)
        complete = bool(manifest.get("complete"))
    else:
        n_items, expected = shards[-1]["stop"] if shards else 0, expected_images(manifest) or 0
        complete = n_items == expected
    found, unlisted = shard_findings(folder, shards)
    return VerifyReport(
        folder=str(folder), kind=kind, n_shards=len(shards), n_items=n_items, expected_items=expected,
        complete=complete, unlisted=tuple(unlisted), **{state: tuple(names) for state, names in found.items()},
        temporaries=tuple(str(p.relative_to(folder)) for p in leftover_temporaries(folder)))


def _mend(folder: Path, report: VerifyReport, shards: list[dict], damaged: tuple[str, ...] = ()) -> list[str]:
    """Delete leftover temporaries, unlisted shard files and `damaged` ones, and record the new stat of the
    listed shards that were only copied; the names of the strays removed.
    """
    removed = [*report.temporaries, *report.unlisted]
    for name in [*removed, *damaged]:
        (folder / name).unlink(missing_ok=True)
    for entry in shards:
        if entry["file"] in report.touched:
            record_shard_stats(folder, current_stat(folder, entry))
    return removed


def _repair_source(manifest: dict, texts, field_name: str | None) -> TextSource:
    """The source to re-render from: `texts` if given, else the recorded path; fingerprint checked."""
    recorded = manifest["source"]
    if recorded.get("kind") == "images":
        raise CacheError("this cache was written from images (write_images / cache --images), not "
                         "rendered from texts: rerun the same write_images call (or cache --images "
                         "command) with the same images; it rewrites the damaged shards")
    if texts is None:
        if not recorded.get("path"):
            raise CacheError("this cache was built from in-memory texts; pass texts=... (or "
                             "--texts PATH) to repair it")
        texts = recorded["path"]
        field_name = recorded.get("field") if field_name is None else field_name
    source = text_source(texts, field_name, recorded.get("errors", "strict"))
    scan = scan_texts(source, sample_size=0)
    if (scan.sha256, scan.n_texts) != (recorded["sha256"], recorded["n_texts"]):
        raise CacheError(f"cannot repair: the texts at hand (fingerprint {scan.sha256[:12]}, "
                         f"{scan.n_texts:,} texts) are not the ones this cache was built from "
                         f"({recorded['sha256'][:12]}, {recorded['n_texts']:,}); pass the original with --texts")
    return source


# ====================================================================================== record shards


def verify_records(folder: str | Path, *, repair: bool = False, records=None,
                   trust: bool = False) -> VerifyReport:
    """Check every shard's size and sha256; with `repair`, rebuild what is wrong from the source.

    Args:
        folder: the folder of record shards.
        repair: delete strays and rewrite damaged shards from the source.
        records: the source to rebuild from (default: the file the manifest recorded; a folder written
            from an iterable needs it passed again).
        trust: as for `record_source` (a pickle's globals).

    Raises:
        CacheError: not a folder; a repair without a source at hand; another input than the one written.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CacheError(f"{folder} is not a folder of record shards; check the path")
    report = _inspect(folder, RECORD_SHARDS)
    if not repair or report.manifest_problem or (report.ok and not report.touched):
        return report
    manifest = read_record_manifest(folder)
    rebuild = report.damaged or not report.complete
    source = _records_source(folder, manifest, records, trust) if rebuild else None  # before anything is deleted
    with cache_lock(folder):
        # a damaged shard may keep its size and mtime (only sha256 saw it): remove it, so the rerun rewrites it
        removed = _mend(folder, report, manifest["shards"], report.truncated + report.corrupt)
    if rebuild:
        from nblib.cache.records import write_records

        write_records(source, folder, shard_mb=manifest["shard_mb"], group_by=manifest["group_by"],
                      codec=manifest["codec"], codec_level=manifest["codec_level"])
    after = _inspect(folder, RECORD_SHARDS)
    return dataclasses.replace(after, repaired=tuple(n for n in report.damaged if n not in after.damaged),
                               removed=tuple(removed))


def _records_source(folder: Path, manifest: dict, records, trust: bool):
    """What to rebuild from: `records`, or the file the manifest recorded (CacheError when neither is at hand)."""
    from nblib.cache.record_sources import record_source

    if records is None:
        path = manifest["source"].get("path")
        if not path:
            raise CacheError(f"{folder} was written from records in memory; pass them again "
                             f"(verify_records(folder, repair=True, records=...)) to rebuild its damaged shards")
        if not Path(path).is_file():
            raise CacheError(f"the source {path} these shards were written from is not there; pass "
                             f"records=... (or put the file back) to rebuild the damaged shards")
        records = record_source(path, trust=trust)
    return records
