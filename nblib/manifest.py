"""The one versioned manifest: a JSON record {kind, version, seq, body, sha256} written atomically.

Every manifest in nblib (cache, store parts and run, consolidated index, checkpoints) is this
record. `kind` says what it describes, `version` the body's layout, `seq` orders rewrites of the
same manifest (the newest copy wins where several exist), and `sha256` covers the body, so a
torn, edited or foreign manifest is detected on read instead of trusted.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from nblib.atomic import WrittenFile, atomic_write_bytes, json_bytes
from nblib.errors import ManifestDamaged

__all__ = [
    "STAT_KIND", "STAT_SUFFIX", "STAT_VERSION", "Manifest", "body_sha256", "manifest_bytes",
    "parse_manifest", "read_manifest", "read_stat_cache", "record_stats", "stat_cache_path",
    "stat_record", "stat_vouches", "write_manifest", "write_stat_cache",
]

@dataclass(frozen=True)
class Manifest:
    """A parsed, checksum-verified manifest record."""

    kind: str
    version: int
    seq: int
    body: dict


def manifest_bytes(kind: str, body: dict, *, version: int = 1, seq: int = 0) -> bytes:
    """The stored bytes of a manifest record (key-sorted JSON with the body's sha256)."""
    record = {"kind": kind, "version": int(version), "seq": int(seq), "body": body,
              "sha256": body_sha256(body)}
    return json_bytes(record)


def write_manifest(path: str | Path, kind: str, body: dict, *, version: int = 1,
                   seq: int = 0) -> WrittenFile:
    """Write a manifest record to `path` atomically (temporary file, fsync, rename, fsync folder)."""
    return atomic_write_bytes(path, manifest_bytes(kind, body, version=version, seq=seq))


def parse_manifest(raw: bytes, kind: str, *, versions: tuple[int, ...] = (1,),
                   where: str = "manifest") -> Manifest:
    """Parse and verify stored manifest bytes; ManifestDamaged says why they cannot be trusted."""
    try:
        record = json.loads(raw)
    except ValueError as exc:
        raise ManifestDamaged(f"{where} is half-written or not JSON ({exc}); it is ignored and "
                              f"rebuilt from the files it describes") from None
    if not isinstance(record, dict) or record.get("kind") != kind:
        found = record.get("kind") if isinstance(record, dict) else type(record).__name__
        raise ManifestDamaged(f"{where} is a {found!r} record, not {kind!r}: it belongs to "
                              f"something else; point at the right folder or remove it")
    if record.get("version") not in versions:
        raise ManifestDamaged(f"{where} has layout version {record.get('version')!r}; this nblib "
                              f"reads {list(versions)}: rebuild it with this version")
    body = record.get("body")
    if not isinstance(body, dict) or not isinstance(record.get("seq"), int) \
            or body_sha256(body) != record.get("sha256"):
        raise ManifestDamaged(f"{where}: the sha256 of its body differs from the record (edited "
                              f"or corrupt); it is ignored and rebuilt from the files it describes")
    return Manifest(kind, record["version"], record["seq"], body)


def read_manifest(path: str | Path, kind: str, *, versions: tuple[int, ...] = (1,)) -> Manifest | None:
    """The verified manifest at `path`, or None when there is none; ManifestDamaged when damaged."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    return parse_manifest(raw, kind, versions=versions, where=str(path))


def body_sha256(body) -> str:
    """sha256 of a manifest body as compact key-sorted JSON."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ------------------------------------------------------------------------------ the stat cache

STAT_KIND = "nblib.stat-cache"
STAT_VERSION = 2               # 2: a record per file; 1 held only {file: mtime_ns} (read as such)
STAT_SUFFIX = ".stat.json"     # index.json -> index.stat.json, manifest.json -> manifest.stat.json
STAT_NOTE = "non-canonical: stats of this machine's copy of the files; safe to delete (costs a hash each)"


def stat_cache_path(manifest_path: str | Path) -> Path:
    """Where the stat cache of the manifest at `manifest_path` lives (`index.json` -> `index.stat.json`)."""
    path = Path(manifest_path)
    return path.with_name(path.stem + STAT_SUFFIX)


def stat_record(path: str | Path, sha256: str | None = None) -> dict:
    """The stat record of the file at `path` as it is now: {"bytes", "mtime_ns"} (+ the `sha256` it vouches for)."""
    st = Path(path).stat()
    record = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    return record if sha256 is None else {**record, "sha256": sha256}


def stat_vouches(recorded: dict | None, st: os.stat_result, sha256: str | None = None) -> bool:
    """True when a stat-cache record vouches for a file of stat `st` holding `sha256` without hashing it.

    The mtime must be equal; the size and the sha256 too where the record holds them (a record of
    another content, or of another size, vouches for nothing).
    """
    if not isinstance(recorded, dict) or recorded.get("mtime_ns") != st.st_mtime_ns:
        return False
    return recorded.get("bytes", st.st_size) == st.st_size and recorded.get("sha256", sha256) == sha256


def read_stat_cache(manifest_path: str | Path) -> dict[str, dict]:
    """file name -> its stat record ({"bytes", "mtime_ns"[, "sha256"]}); {} when missing or damaged.

    A hint, never a source of truth (docs/formats.md, "Two hashes, two jobs"): losing it costs one hash
    per file. A version-1 cache (mtimes only) reads as records holding only `mtime_ns`.
    """
    try:
        record = read_manifest(stat_cache_path(manifest_path), STAT_KIND, versions=(1, STAT_VERSION))
    except (ManifestDamaged, OSError):
        return {}
    if record is None:
        return {}
    if record.version == 1:
        old = record.body.get("mtime_ns")
        return {str(k): {"mtime_ns": v} for k, v in old.items() if isinstance(v, int)} \
            if isinstance(old, dict) else {}
    files = record.body.get("files")
    if not isinstance(files, dict):
        return {}
    return {str(k): v for k, v in files.items()
            if isinstance(v, dict) and isinstance(v.get("mtime_ns"), int)}


def write_stat_cache(manifest_path: str | Path, stats: dict[str, dict]) -> bool:
    """Replace the stat cache of the manifest at `manifest_path` with `stats` ({file: `stat_record`}), atomically.

    False when the folder cannot be written (a read-only mount): the old stat cache stays, the next check hashes.
    """
    body = {"note": STAT_NOTE, "files": dict(sorted(stats.items()))}
    try:
        write_manifest(stat_cache_path(manifest_path), STAT_KIND, body, version=STAT_VERSION)
    except OSError:
        return False
    return True


def record_stats(manifest_path: str | Path, stats: dict[str, dict]) -> bool:
    """Add (or replace) some files' stat records in the stat cache; `write_stat_cache`'s best effort."""
    return write_stat_cache(manifest_path, {**read_stat_cache(manifest_path), **stats})
