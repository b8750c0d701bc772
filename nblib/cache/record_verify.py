"""Verify record shards against their manifest (size and sha256 of each), and repair them from the source.

`verify_records` hashes every listed shard (sha256, identity), so it catches a same-size edit that
kept the file's mtime, which a reader's stat check cannot. Repair deletes leftover temporaries and
unlisted shard files, then reruns `write_records` over the source (the path the manifest recorded,
or the records passed): listed shards whose records hash as recorded are skipped, damaged ones are
rewritten to their recorded sha256, and an unfinished folder is finished.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from nblib.cache.format import current_stat, record_shard_stats
from nblib.cache.populate import cache_lock
from nblib.cache.record_format import read_record_manifest
from nblib.cache.verify import RECORD_SHARDS, VerifyReport, shard_report
from nblib.errors import CacheError


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
    if not repair:
        return _inspect(folder)
    report = _inspect(folder)
    if report.manifest_problem or (report.ok and not report.touched):
        return report
    manifest = read_record_manifest(folder)
    rebuild = report.damaged or not report.complete
    source = _source(folder, manifest, records, trust) if rebuild else None  # before anything is deleted
    with cache_lock(folder):
        removed = [*report.temporaries, *report.unlisted]
        # a damaged shard may keep its size and mtime (only sha256 saw it): remove it, so the rerun rewrites it
        for name in [*removed, *report.truncated, *report.corrupt]:
            (folder / name).unlink(missing_ok=True)
        for entry in manifest["shards"]:
            if entry["file"] in report.touched:
                record_shard_stats(folder, current_stat(folder, entry))
    if rebuild:
        from nblib.cache.records import write_records

        write_records(source, folder, shard_mb=manifest["shard_mb"], group_by=manifest["group_by"],
                      codec=manifest["codec"], codec_level=manifest["codec_level"])
    after = _inspect(folder)
    return dataclasses.replace(after, repaired=tuple(n for n in report.damaged if n not in after.damaged),
                               removed=tuple(removed))


def _source(folder: Path, manifest: dict, records, trust: bool):
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


def _inspect(folder: Path) -> VerifyReport:
    try:
        manifest = read_record_manifest(folder)
    except CacheError as exc:
        return VerifyReport(folder=str(folder), kind=RECORD_SHARDS, manifest_problem=str(exc))
    n_records = sum(s["count"] for s in manifest["shards"])
    return shard_report(folder, manifest["shards"], kind=RECORD_SHARDS, n_items=n_records,
                        expected_items=n_records, complete=bool(manifest.get("complete")))
