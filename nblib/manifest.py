"""The one versioned manifest: a JSON record {kind, version, seq, body, sha256} written atomically.

Every manifest in nblib (cache, store parts and run, consolidated index, checkpoints) is this
record. `kind` says what it describes, `version` the body's layout, `seq` orders rewrites of the
same manifest (the newest copy wins where several exist), and `sha256` covers the body, so a
torn, edited or foreign manifest is detected on read instead of trusted.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from nblib.atomic import WrittenFile, atomic_write_bytes, json_bytes
from nblib.errors import ManifestDamaged

__all__ = [
    "STAT_KIND", "STAT_SUFFIX", "Manifest", "body_sha256", "manifest_bytes", "parse_manifest",
    "read_manifest", "read_stat_cache", "stat_cache_path", "write_manifest", "write_stat_cache",
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
STAT_SUFFIX = ".stat.json"     # index.json -> index.stat.json, beside the manifest it serves


def stat_cache_path(manifest_path: str | Path) -> Path:
    """Where the stat cache of the manifest at `manifest_path` lives (`index.json` -> `index.stat.json`)."""
    path = Path(manifest_path)
    return path.with_name(path.stem + STAT_SUFFIX)


def read_stat_cache(manifest_path: str | Path) -> dict[str, int]:
    """file name -> st_mtime_ns recorded when the file was last checked; {} when missing or damaged.

    The stat cache is the non-canonical side of a manifest (as git keeps its index apart from its
    objects): the manifest itself holds only what two identical runs agree on (sizes, sha256,
    shapes), so its bytes are the same; the mtimes that let a quick check skip hashing live here.
    Losing this file costs one hash per file, never a wrong answer.
    """
    try:
        record = read_manifest(stat_cache_path(manifest_path), STAT_KIND)
    except ManifestDamaged:
        return {}
    if record is None or not isinstance(record.body.get("mtime_ns"), dict):
        return {}
    return {str(k): int(v) for k, v in record.body["mtime_ns"].items() if isinstance(v, int)}


def write_stat_cache(manifest_path: str | Path, mtime_ns: dict[str, int]) -> None:
    """Record each file's st_mtime_ns beside the manifest at `manifest_path` (atomically)."""
    write_manifest(stat_cache_path(manifest_path), STAT_KIND, {"mtime_ns": dict(sorted(mtime_ns.items()))})
