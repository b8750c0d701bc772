"""The part format over one folder: write, list, check, read and delete parts, on either side.

A *part* is a folder of `.npy` files plus a `part.json` written last (an `nblib.manifest`
record holding each file's bytes, sha256, shape, dtype and stat fingerprint): a part without a
valid `part.json` does not exist. The same `PartFolder` serves local staging and the mirror;
only its root and its `FileOps` differ. Checks come in three strengths, trading reads for
certainty, named by what they compare (`VerifyLevel`): SIZES (part.json and each file's size),
STAT (sizes + stat fingerprint, hashing only files whose fingerprint changed) and HASH (sha256 of
every file: a full read).
"""
from __future__ import annotations

import contextlib
import enum
import io
import os
import re
import secrets
import stat as stat_mod
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nblib.atomic import (
    TMP_PREFIX,
    AtomicWriter,
    WrittenFile,
    algorithm_of,
    atomic_torch_save,
    file_digest,
    fsync_dir,
    npy_header,
    sha256_file,
    sha256_json,
)
from nblib.errors import ConfigError, ManifestDamaged, StateError
from nblib.manifest import manifest_bytes, parse_manifest

__all__ = [
    "CHECKPOINT_HASH", "CHUNK", "PART_FILE", "PART_KIND", "PART_VERSION", "DamagedCopy", "FileEntry", "FileOps",
    "PartFolder", "PartInfo", "VerifyLevel", "check_name", "is_plain_name",
]

PART_KIND = "nblib.store.part"
PART_VERSION = 2
PART_FILE = "part.json"
CHUNK = 8 << 20
CHECKPOINT_HASH = "xxh3_128"     # what a torch checkpoint's record checks (atomic.new_hash says why not sha256)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class VerifyLevel(enum.Enum):
    """How hard a part check looks; each name says what is compared with part.json.

    SIZES: part.json parses and every file has its recorded size (no file is read).
    STAT: SIZES, and a file whose stat fingerprint (mtime) changed is hashed (a resume's check).
    HASH: SIZES, and every file is hashed (sha256): a full read, catches bit rot behind a kept mtime.
    """

    SIZES = "sizes"
    STAT = "stat"
    HASH = "hash"

    @classmethod
    def of(cls, value: VerifyLevel | bool | str) -> VerifyLevel:
        """The level `value` names: a member, its value ("sizes", "stat", "hash"), or a bool (True:
        HASH, False: SIZES, the two levels the old `verify: bool` meant); ConfigError otherwise.
        """
        if isinstance(value, cls):
            return value
        if value is True or value is False:
            return cls.HASH if value else cls.SIZES
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"verify={value!r} is not a check level; use VerifyLevel.HASH (hash every "
                              f"file), VerifyLevel.STAT (sizes and stat fingerprints) or VerifyLevel.SIZES "
                              f"(sizes only)") from None


@dataclass(frozen=True)
class FileEntry:
    """One array file of a part: its name, size, sha256, shape, dtype and mtime when written."""

    file: str
    bytes: int
    sha256: str
    shape: tuple[int, ...]
    dtype: str
    mtime_ns: int = field(default=0, compare=False)   # stat fingerprint: differs between sides


@dataclass(frozen=True)
class PartInfo:
    """A complete, checked copy of a part: where it is and what it holds."""

    name: str
    side: str                       # the folder's label: "local" or "mirror"
    path: Path                      # the part's folder on that side
    files: dict[str, FileEntry]     # array key -> file entry
    meta: dict
    created: float                  # time.time() when the part was written

    @property
    def nbytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    @property
    def content_id(self) -> str:
        """What the part holds (name, created, meta, files' sha256): equal for both sides' copies."""
        return sha256_json({"name": self.name, "created": self.created, "meta": self.meta,
                            "files": {k: _entry_json(e, with_mtime=False) for k, e in self.files.items()}})


@dataclass(frozen=True)
class DamagedCopy:
    """A copy that failed its check: which, on which side, and why."""

    name: str
    side: str
    reason: str


class FileOps:
    """The filesystem calls a folder makes: the one seam where tests inject Drive errors.

    The primitives (open, stat, listdir, ...) are the real calls; the composite ones
    (read_bytes, sha256, load_npy, write_atomic) are built on them or on AtomicWriter, so a
    subclass that fails a primitive fails the composite mid-way, like a dying FUSE mount.
    """

    def open(self, path: Path, mode: str = "rb"):
        return open(path, mode)

    def replace(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)

    def makedirs(self, path: Path) -> None:
        os.makedirs(path, exist_ok=True)

    def listdir(self, path: Path) -> list[str]:
        return os.listdir(path)

    def stat(self, path: Path) -> os.stat_result:
        return os.stat(path)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def rmdir(self, path: Path) -> None:
        os.rmdir(path)

    def fsync_dir(self, path: Path) -> None:
        fsync_dir(path)

    def create_exclusive(self, path: Path, data: bytes) -> None:
        """Create `path` holding `data`; FileExistsError when it exists (O_EXCL, fsync, fsync the folder)."""
        with self.open(path, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(OSError):
            self.fsync_dir(path.parent)

    def write_atomic(self, path: Path, blocks: Iterable, expect_digest: str | None = None, *,
                     algorithm: str = "sha256") -> WrittenFile:
        """Write `blocks` to `path` through AtomicWriter (temporary, fsync, rename, fsync folder).

        Hashed with `algorithm`, or with the algorithm of `expect_digest`, which the bytes must match.
        """
        if expect_digest is not None:
            algorithm = algorithm_of(expect_digest)
        with AtomicWriter(path, algorithm=algorithm) as writer:
            for block in blocks:
                writer.write(block)
            return writer.commit(expect_digest)

    def write_torch(self, path: Path, obj, *, sync_dir: bool = True) -> WrittenFile:
        """torch.save `obj` to `path` atomically (atomic.atomic_torch_save: no in-memory copy), as a checkpoint:
        hashed with CHECKPOINT_HASH, without torch's zip CRCs (the record's digest covers every byte).
        """
        return atomic_torch_save(obj, path, sync_dir=sync_dir, algorithm=CHECKPOINT_HASH, zip_crc32=False)

    def load_torch(self, path: Path, nbytes: int, digest: str, map_location="cpu", weights_only: bool = True):
        """torch.load `path` once its size and digest (`atomic.digest_string`) match; StateError otherwise.

        torch.load and the hash (through `open`) read the file side by side (both release the GIL); a
        mismatch discards what was loaded, and is what is raised when the load itself failed on the
        damaged bytes. The tensors are read, never mapped: a loaded object neither changes nor dies
        (SIGBUS) when its file is overwritten or truncated afterwards.
        """
        import torch

        obj, failed = None, None
        with ThreadPoolExecutor(1, thread_name_prefix="nblib-load-hash") as pool:
            hashing = pool.submit(file_digest, path, algorithm_of(digest), CHUNK, open_file=self.open)
            try:
                obj = torch.load(path, map_location=map_location, weights_only=weights_only)
            except Exception as exc:          # a corrupt file can fail to unpickle: its digest says why
                failed = exc
            found = hashing.result()          # the hash's own error, if it failed, is raised here
        _check(path, found, nbytes, digest)
        if failed is not None:
            raise failed
        return obj

    def read_bytes(self, path: Path) -> bytes | None:
        """The file's bytes, or None when it does not exist."""
        try:
            with self.open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def sha256(self, path: Path) -> str:
        return sha256_file(path, CHUNK, open_file=self.open)

    def load_npy(self, path: Path, mmap: bool) -> np.ndarray:
        if mmap:
            self.stat(path)
            return np.load(path, mmap_mode="r", allow_pickle=False)
        with self.open(path, "rb") as f:
            return np.load(io.BytesIO(f.read()), allow_pickle=False)

    def is_dir(self, path: Path) -> bool:
        try:
            return stat_mod.S_ISDIR(self.stat(path).st_mode)
        except FileNotFoundError:
            return False


class PartFolder:
    """Parts under one root (local staging or the mirror), read and written through `ops`."""

    def __init__(self, root: str | Path, ops: FileOps | None = None, side: str = "local"):
        self.root = Path(root)
        self.ops = ops if ops is not None else FileOps()
        self.side = side
        self._lock = threading.RLock()     # a part's commit against its deletion by retention

    def names(self) -> list[str]:
        """Folders under the root that may be parts (plain names; files and temporaries skipped)."""
        try:
            entries = self.ops.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(n for n in entries if is_plain_name(n) and self.ops.is_dir(self.root / n))

    def write(self, name: str, arrays: dict[str, np.ndarray], meta: dict | None = None) -> PartInfo:
        """Write one .npy per array (np.save's exact bytes), then part.json last, atomically."""
        check_name(name, "part name")
        if not arrays:
            raise StateError(f"part {name!r} has no arrays; pass at least one key -> array")
        arrays = {key: _checked_array(key, a) for key, a in arrays.items()}
        folder = self.root / name
        with self._lock:
            self.ops.makedirs(folder)
            with contextlib.suppress(FileNotFoundError):   # an old record must not vouch for new files
                self.ops.unlink(folder / PART_FILE)
            files = {}
            for key, array in arrays.items():
                written = self.ops.write_atomic(folder / f"{key}.npy", _npy_blocks(array))
                files[key] = FileEntry(f"{key}.npy", written.bytes, written.sha256, tuple(array.shape),
                                       array.dtype.str, written.mtime_ns)
            info = PartInfo(name, self.side, folder, files, dict(meta or {}), time.time())
            self._write_record(info)
        return info

    def check(self, name: str, verify: VerifyLevel = VerifyLevel.HASH) -> PartInfo | DamagedCopy | None:
        """The checked part, why its copy is damaged, or None when this folder has no such part."""
        level = VerifyLevel.of(verify)
        folder = self.root / name
        raw = self.ops.read_bytes(folder / PART_FILE)
        if raw is None:
            try:
                names = self.ops.listdir(folder)
            except (FileNotFoundError, NotADirectoryError):
                return None
            has_npy = any(n.endswith(".npy") and not n.startswith(".") for n in names)
            return DamagedCopy(name, self.side, "torn: .npy files without part.json") if has_npy else None
        try:
            info = self._parse_record(name, raw)
        except (ManifestDamaged, ValueError, KeyError, TypeError, AttributeError) as exc:
            return DamagedCopy(name, self.side, f"part.json is damaged ({type(exc).__name__}: {exc})")
        for entry in info.files.values():
            reason = self._file_problem(folder / entry.file, entry, level)
            if reason is not None:
                return DamagedCopy(name, self.side, reason)
        return info

    def list(self, verify: VerifyLevel = VerifyLevel.HASH) -> tuple[list[PartInfo], list[DamagedCopy]]:
        """Every part of this folder that passes the check, and the copies that do not."""
        parts, damaged = [], []
        for name in self.names():
            result = self.check(name, verify)
            if isinstance(result, PartInfo):
                parts.append(result)
            elif result is not None:
                damaged.append(result)
        return parts, damaged

    def read(self, name: str, mmap: bool = True, verify: VerifyLevel = VerifyLevel.HASH) -> dict[str, np.ndarray]:
        """The arrays of part `name`, checked first; StateError when it has no good copy here."""
        result = self.check(name, verify)
        if not isinstance(result, PartInfo):
            why = result.reason if result is not None else f"no such part in {self.root}"
            raise StateError(f"part {name!r} has no complete, verified copy ({why}); recompute it")
        return self.load(result, mmap)

    def load(self, info: PartInfo, mmap: bool = True) -> dict[str, np.ndarray]:
        """The arrays of a part already checked (memory-mapped when `mmap`)."""
        return {key: self.ops.load_npy(info.path / e.file, mmap) for key, e in info.files.items()}

    def delete(self, name: str, if_content: str | None = None) -> bool:
        """Delete a part (gone at once: renamed to a temporary, then removed); False if kept.

        With `if_content`, the part is deleted only while its content_id is still that one
        (retention must not delete a part rewritten meanwhile).
        """
        check_name(name, "part name")
        folder = self.root / name
        with self._lock:
            if if_content is not None:
                current = self.check(name, verify=VerifyLevel.SIZES)
                if not isinstance(current, PartInfo) or current.content_id != if_content:
                    return False
            trash = self.root / f"{TMP_PREFIX}deleted-{name}-{secrets.token_hex(4)}"
            try:
                self.ops.replace(folder, trash)
            except FileNotFoundError:
                return True
            self.ops.fsync_dir(self.root)
        self._remove_tree(trash)
        return True

    def copy_from(self, source: PartFolder, name: str, verify_readback: bool = True) -> PartInfo | None:
        """Copy part `name` from `source` (checked by sha256 on the way); None if there is none.

        An older copy here is replaced (its part.json removed first); a newer one is kept and
        returned as it is. Each file goes through AtomicWriter with the expected sha256, and
        is hashed again here after the write when `verify_readback`.
        """
        src = source.check(name, verify=VerifyLevel.SIZES)
        if not isinstance(src, PartInfo):
            return None
        folder = self.root / name
        theirs = self.ops.read_bytes(folder / PART_FILE)
        if theirs is not None and _created(theirs) > src.created:
            kept = self.check(name, verify=VerifyLevel.SIZES)
            return kept if isinstance(kept, PartInfo) else None
        self.ops.makedirs(folder)
        with contextlib.suppress(FileNotFoundError):
            self.ops.unlink(folder / PART_FILE)
        files = {}
        for key, entry in src.files.items():
            try:
                written = self.ops.write_atomic(folder / entry.file, _read_blocks(source.ops, src.path / entry.file),
                                                expect_digest=entry.sha256)
            except ValueError as exc:            # the local bytes no longer match their record
                raise StateError(f"{source.side} copy of {name}/{entry.file} changed or is corrupt: {exc}") from None
            if verify_readback and self.ops.sha256(written.path) != entry.sha256:
                raise OSError(5, f"{written.path} reads back with another sha256 than was written")
            files[key] = FileEntry(entry.file, written.bytes, written.sha256, entry.shape, entry.dtype,
                                   written.mtime_ns)
        info = PartInfo(name, self.side, folder, files, src.meta, src.created)
        self._write_record(info)
        return info

    # ------------------------------------------------------------------------ helpers

    def _write_record(self, info: PartInfo) -> None:
        body = {"name": info.name, "created": info.created, "meta": info.meta,
                "files": {k: _entry_json(e) for k, e in info.files.items()}}
        self.ops.write_atomic(info.path / PART_FILE,
                              [manifest_bytes(PART_KIND, body, version=PART_VERSION)])

    def _parse_record(self, name: str, raw: bytes) -> PartInfo:
        body = parse_manifest(raw, PART_KIND, versions=(PART_VERSION,), where=f"{name}/{PART_FILE}").body
        if body.get("name") != name:
            raise ValueError(f"it describes part {body.get('name')!r}, not {name!r}")
        files = {k: _entry_from_json(v) for k, v in body["files"].items()}
        return PartInfo(name, self.side, self.root / name, files, dict(body.get("meta") or {}),
                        float(body["created"]))

    def _file_problem(self, path: Path, entry: FileEntry, level: VerifyLevel) -> str | None:
        try:
            st = self.ops.stat(path)
        except FileNotFoundError:
            return f"{entry.file} is missing"
        if st.st_size != entry.bytes:
            return f"{entry.file} has {st.st_size} bytes, part.json says {entry.bytes} (truncated?)"
        must_hash = level is VerifyLevel.HASH or (level is VerifyLevel.STAT and st.st_mtime_ns != entry.mtime_ns)
        if must_hash and self.ops.sha256(path) != entry.sha256:
            return f"{entry.file} sha256 differs from part.json (corrupt)"
        return None

    def _remove_tree(self, folder: Path) -> None:
        """Remove a renamed-away part folder: part.json first, then its files, then the folder."""
        try:
            names = self.ops.listdir(folder)
        except FileNotFoundError:
            return
        for n in sorted(names, key=lambda n: n != PART_FILE):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
                self.ops.unlink(folder / n)
        with contextlib.suppress(OSError):
            self.ops.rmdir(folder)


def check_name(name: str, what: str) -> None:
    """StateError unless `name` is a plain file name (no path, no leading dot, no reserved suffix)."""
    if not isinstance(name, str) or not is_plain_name(name):
        raise StateError(f"{what} {name!r} is not a plain file name; use letters, digits, '_', '-', '.' "
                         f"and start with a letter or digit")


def is_plain_name(name: str) -> bool:
    return bool(_NAME.match(name)) and not name.endswith((".json", ".pt", ".npy"))


def _checked_array(key: str, array) -> np.ndarray:
    check_name(key, "array key")
    if key == Path(PART_FILE).stem:
        raise StateError(f"array key {key!r} is reserved; rename it")
    array = np.asarray(array)
    if array.dtype.hasobject:
        raise StateError(f"array {key!r} has dtype object, which .npy cannot store without pickle")
    return array


def _npy_blocks(array: np.ndarray) -> list:
    """np.save's exact bytes for `array` as (header, data) buffers, without copying C or F data."""
    if array.flags.f_contiguous and not array.flags.c_contiguous:   # np.save keeps Fortran order
        return [npy_header(array.dtype, array.shape, fortran_order=True), array.T.reshape(-1).view(np.uint8)]
    data = np.ascontiguousarray(array).reshape(-1)
    return [npy_header(array.dtype, array.shape), data.view(np.uint8) if data.size else b""]


def _read_blocks(ops: FileOps, path: Path):
    with ops.open(path, "rb") as f:
        while block := f.read(CHUNK):
            yield block


def _entry_json(e: FileEntry, with_mtime: bool = True) -> dict:
    entry = {"file": e.file, "bytes": e.bytes, "sha256": e.sha256, "shape": list(e.shape), "dtype": e.dtype}
    if with_mtime:
        entry["mtime_ns"] = e.mtime_ns
    return entry


def _entry_from_json(d: dict) -> FileEntry:
    if not _NAME.match(d["file"]):
        raise ValueError(f"file name {d['file']!r} is not plain")
    return FileEntry(d["file"], int(d["bytes"]), str(d["sha256"]), tuple(d["shape"]), str(d["dtype"]),
                     int(d.get("mtime_ns", 0)))


def _created(raw: bytes) -> float:
    """The `created` time of a part.json, or -inf when it does not parse."""
    try:
        return float(parse_manifest(raw, PART_KIND, versions=(PART_VERSION,)).body["created"])
    except (ManifestDamaged, KeyError, TypeError, ValueError):
        return float("-inf")


def _check(path: Path, found: tuple[str, int], nbytes: int, digest: str) -> None:
    if found[1] != nbytes:
        raise StateError(f"{path.name} has {found[1]} bytes, its record says {nbytes}")
    if found[0] != digest:
        raise StateError(f"{algorithm_of(digest)} differs from its record")
