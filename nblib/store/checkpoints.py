"""A versioned series of torch checkpoints in one folder: `<name>-000001.pt` and its record.

Each version is the torch.save bytes (written atomically) plus `<name>-000001.json`, an
`nblib.manifest` record of the file's size and xxh3_128 digest (version 3; a version-2 record's
sha256 still loads), written last: a version without a valid record does not exist. Loading walks
versions newest first across the given folders and takes the first that verifies and loads, so a
torn or corrupt newest checkpoint costs one version, not the run. torch is imported only when a
checkpoint is written or loaded.

Cost and safety (torch writes the file itself, no zip CRCs, 3 fsyncs a version; a load hashes as it
reads and maps nothing): docs/training.md, "Writer". The digest checks what nblib wrote against torn
writes and bit rot, not against a forger. Failure mode: a crash before the folder's fsync may keep the
record without its file; that version then reads as damaged and the one before it loads.
"""
from __future__ import annotations

import contextlib
import pickle
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from nblib.atomic import algorithm_of, digest_string, torch_save_temporary
from nblib.errors import ManifestDamaged, StateError
from nblib.manifest import manifest_bytes, parse_manifest

from .parts import CHECKPOINT_HASH, DamagedCopy, FileOps, check_name

CHECKPOINT_KIND = "nblib.store.checkpoint"
CHECKPOINT_VERSION = 3
READABLE_VERSIONS = (2, 3)      # 2: the record holds a sha256
RECORD = re.compile(r"(.+)-(\d{6,})\.json")     # a version's record: <name>-000001.json


@dataclass(frozen=True)
class Loaded:
    """What `load_latest` found: the object (None if nothing loads) and the copies it skipped."""

    obj: object
    damaged: list[DamagedCopy]
    newest_version: int          # the highest version number seen on any side (0: none)
    loaded_version: int | None = None    # the version `obj` is (None: nothing loaded)


class CheckpointFolder:
    """Checkpoint versions of any name under one root, read and written through `ops`."""

    def __init__(self, root: str | Path, ops: FileOps | None = None, side: str = "local"):
        self.root = Path(root)
        self.ops = ops if ops is not None else FileOps()
        self.side = side

    def versions(self, name: str) -> list[int]:
        """Version numbers of `name` that have a record here (unchecked), ascending."""
        return sorted(version for stem_name, version in self.stems() if stem_name == name)

    def stems(self) -> list[tuple[str, int]]:
        """(name, version) of every record here, for a resync after a restart."""
        try:
            entries = self.ops.listdir(self.root)
        except FileNotFoundError:
            return []
        found = [RECORD.fullmatch(e) for e in sorted(entries)]
        return [(m.group(1), int(m.group(2))) for m in found if m]

    def save(self, obj, name: str, version: int) -> Path:
        """torch.save `obj` as version `version` of `name` (atomic), then its record.

        Three fsyncs: the file, the record, and the folder once after both renames (a crash before
        it may keep the record without the file: a damaged version, skipped like a torn one).
        """
        check_name(name, "checkpoint name")
        written = self.ops.write_torch(self.root / f"{stem(name, version)}.pt", obj, sync_dir=False)
        self._write_record(name, version, written.path.name, written.bytes, written.digest)
        return written.path

    def serialize(self, obj, name: str, version: int):
        """The CPU half of `save`, now: torch.save `obj` into a temporary (an `atomic.AtomicWriter`), hashed as
        written; `commit` does the rest (fsync, rename, record), the wait for the disk, on any thread. A local
        folder only.
        """
        check_name(name, "checkpoint name")
        return torch_save_temporary(obj, self.root / f"{stem(name, version)}.pt", algorithm=CHECKPOINT_HASH,
                                    zip_crc32=False)

    def commit(self, pending, name: str, version: int) -> Path:
        """Make a `serialize`d version durable: the file fsynced and renamed, then its record (as `save`)."""
        written = pending.commit(sync_dir=False)
        self._write_record(name, version, written.path.name, written.bytes, written.digest)
        return written.path

    def record_bytes(self, name: str, version: int) -> bytes | None:
        return self.ops.read_bytes(self.root / f"{stem(name, version)}.json")

    def load(self, record: bytes, name: str, version: int, map_location="cpu", weights_only: bool = True):
        """The checkpoint object a record describes, once the file's size and digest matched it."""
        body = _record_body(record, name, version)
        return self.ops.load_torch(self.root / body["file"], body["bytes"], body["digest"], map_location,
                                   weights_only)

    def copy_from(self, source: CheckpointFolder, name: str, version: int) -> bool:
        """Copy one version from `source` (its digest checked), record last; False if it is gone there."""
        raw = source.record_bytes(name, version)
        if raw is None:
            return False                          # pruned already: a newer version supersedes it
        body = _record_body(raw, name, version)
        self.ops.makedirs(self.root)
        with contextlib.suppress(FileNotFoundError):
            self.ops.unlink(self.root / f"{stem(name, version)}.json")
        data = source.ops.read_bytes(source.root / body["file"])
        if data is None:
            return False
        try:
            self.ops.write_atomic(self.root / body["file"], [data], expect_digest=body["digest"])
        except ValueError as exc:
            raise StateError(f"{source.side} checkpoint {body['file']} changed or is corrupt: {exc}") from None
        self.ops.write_atomic(self.root / f"{stem(name, version)}.json", [raw])
        return True

    def remove(self, name: str, version: int) -> None:
        """Delete one version, record first (without it the file is not a checkpoint)."""
        for suffix in (".json", ".pt"):
            with contextlib.suppress(FileNotFoundError):
                self.ops.unlink(self.root / f"{stem(name, version)}{suffix}")

    def _write_record(self, name: str, version: int, file: str, nbytes: int, digest: str) -> None:
        algorithm = algorithm_of(digest)
        body = {"name": name, "version": version, "file": file, "bytes": nbytes,
                algorithm: digest.removeprefix(f"{algorithm}:"), "created": time.time()}
        self.ops.write_atomic(self.root / f"{stem(name, version)}.json",
                              [manifest_bytes(CHECKPOINT_KIND, body, version=CHECKPOINT_VERSION)],
                              algorithm=CHECKPOINT_HASH)


def load_latest(folders: list[CheckpointFolder], name: str, map_location="cpu",
                weights_only: bool = True) -> Loaded:
    """The newest version of `name` that verifies and loads from any folder (first folder first)."""
    check_name(name, "checkpoint name")
    versions = sorted({v for folder in folders for v in folder.versions(name)}, reverse=True)
    damaged = []
    for version in versions:
        for folder in folders:
            record = folder.record_bytes(name, version)
            if record is None:
                continue                          # this folder has no such version
            try:
                obj = folder.load(record, name, version, map_location, weights_only)
                return Loaded(obj, damaged, versions[0], version)
            except (ValueError, KeyError, TypeError, OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
                damaged.append(DamagedCopy(stem(name, version), folder.side, f"{type(exc).__name__}: {exc}"))
    return Loaded(None, damaged, versions[0] if versions else 0)


def stem(name: str, version: int) -> str:
    return f"{name}-{version:06d}"


def versions_in(entries: Iterable[str], name: str) -> list[int]:
    return sorted(int(m.group(2)) for e in entries if (m := RECORD.fullmatch(e)) and m.group(1) == name)


def _record_body(raw: bytes, name: str, version: int) -> dict:
    """The record's body, with `digest` (`atomic.digest_string`) from its xxh3_128 (version 3) or sha256 (2)."""
    where = f"{stem(name, version)}.json"
    record = parse_manifest(raw, CHECKPOINT_KIND, versions=READABLE_VERSIONS, where=where)
    body = record.body
    if body.get("name") != name or body.get("version") != version or not isinstance(body.get("file"), str) \
            or Path(body["file"]).name != body["file"]:
        raise ManifestDamaged(f"{where} describes another checkpoint")
    algorithm, hex_length = ("xxh3_128", 32) if record.version == 3 else ("sha256", 64)
    value = body.get(algorithm)
    if not isinstance(value, str) or not re.fullmatch(f"[0-9a-f]{{{hex_length}}}", value):
        raise ManifestDamaged(f"{where} has no {algorithm} of its file")
    return {**body, "digest": digest_string(algorithm, value)}
