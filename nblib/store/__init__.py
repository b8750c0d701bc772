"""Durable checkpoints: write to fast local staging first, mirror to Drive in a background thread.

`DurableStore` is a short front over: `manager` (the `CheckpointManager` training shares: the
mirror and its claim, the deadline on mirror reads, the checkpoint series and its retention, an
optional background writer), `parts` (the part format over one folder), `mirror` (the
thread that copies to Drive and re-fills what the mirror lost), `retry` (Drive calls retried,
remounted), `checkpoints` (a versioned torch checkpoint series), `run_manifest` (the run's
manifest, newest sequence wins) and `retention` (which local copies may go). The caller never waits
on Drive: `write_part` returns once the local copy is durable. The trade-off: the newest parts
live only on local disk until the mirror catches up (`mirror_lag`), so a runtime death loses
at most those, never a half-written file.

Layout (the store owns both folders; put nothing else in them):
    <dir>/<part name>/<key>.npy, <dir>/<part name>/part.json   parts
    <dir>/manifest.json                                        the run manifest (newest seq wins)
    <dir>/<name>-000001.pt, <dir>/<name>-000001.json           torch checkpoints

Reading takes the newest complete copy from either side; damaged copies are returned by
`verify()`, logged (one WARNING record per copy: docs/layout.md says why `logging`) and ignored, so
the caller recomputes them. The mirror's claim (`identity.py`, ForeignMirror) and its deadline
(`deadline.py`, `mirror=stalled`): docs/failures.md.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from nblib import env
from nblib.atomic import atomic_write_bytes
from nblib.errors import DriveError, StateError

from .checkpoints import CheckpointFolder, load_latest, stem
from .deadline import MirrorStalled
from .identity import ForeignMirror
from .manager import CheckpointManager
from .mirror import CopyManifest, CopyPart, Mirror, MirrorStatus, MirrorWarning
from .parts import DamagedCopy, FileEntry, FileOps, PartFolder, PartInfo, VerifyLevel, check_name
from .retention import retained_parts
from .run_manifest import MANIFEST_FILE, newest, read_run_manifest, run_manifest_bytes

log = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "DamagedCopy", "DurableStore", "FileEntry", "FileOps", "ForeignMirror", "MirrorStalled",
           "MirrorStatus", "MirrorWarning", "PartFolder", "PartInfo", "VerifyLevel", "retained_parts"]


class DurableStore:
    """Local-first store of parts, a run manifest and checkpoints, mirrored to `mirror_dir` in a thread.

    Args:
        local_dir: fast local staging; every write is durable here before the call returns.
        mirror_dir: the durable copy (Drive), filled by a background thread; None: no mirror.
        keep_local: parts kept locally once mirrored (None: all); keep_every: keep every N-th too.
        keep_checkpoints: torch checkpoint versions kept per name.
        retries, backoff_s: how a failing mirror call is retried (exponential backoff).
        retry_interval_s: how often a failing mirror tries its backlog again.
        verify_mirror: hash each mirrored part again after the copy.
        remount: what to call on "Transport endpoint is not connected" (default: Colab's remount).
        identity: the run's identity (JSON): claims the mirror folder for this run (`identity.py`).
        deadline_s: how long a mirror read may block before the mirror counts as stalled
            (default NBLIB_MIRROR_DEADLINE_S, 120 s).

    Raises:
        ConfigError for a knob out of range or a mirror that is the local folder itself;
        ForeignMirror when another run claimed the mirror folder.
    """

    def __init__(self, local_dir: str | Path, mirror_dir: str | Path | None = None, *,
                 keep_local: int | None = None, keep_every: int | None = None,
                 keep_checkpoints: int = 3, retries: int = 5, backoff_s: float = 0.5,
                 retry_interval_s: float = 30.0, verify_mirror: bool = True,
                 remount: Callable[[], Any] | None = None, identity: dict | None = None,
                 deadline_s: float | None = None, _ops: FileOps | None = None):
        self.local_dir = Path(local_dir)
        self.mirror_dir = Path(mirror_dir) if mirror_dir is not None else None
        self.checkpoints = CheckpointManager(
            self.local_dir, self.mirror_dir, mirror_ops=_ops, keep_last=keep_checkpoints, keep_local=keep_local,
            keep_every=keep_every, identity=identity, retries=retries, backoff_s=backoff_s,
            retry_interval_s=retry_interval_s, verify_mirror=verify_mirror, remount=remount, deadline_s=deadline_s)
        self.local = self.checkpoints.local_parts
        self._folders = [self.local]
        self._mirror: Mirror | None = self.checkpoints.mirror
        self._versions: dict[str, int] = {}
        self._manifest_seq: int | None = None
        self._stall_warned = False
        if self.mirror_dir is not None:
            self._folders.append(PartFolder(self.mirror_dir, self.checkpoints.reads, "mirror"))

    # ------------------------------------------------------------------------------ parts

    def write_part(self, name: str, arrays: dict[str, np.ndarray], meta: dict | None = None) -> PartInfo:
        """Write one .npy per array, then part.json last, atomically; queue the part for mirroring."""
        info = self.local.write(name, arrays, meta)
        self._enqueue(CopyPart(name))
        return info

    def list_parts(self, verify: VerifyLevel = VerifyLevel.HASH) -> list[PartInfo]:
        """Complete parts, newest copy of either side, checked at the `VerifyLevel` asked."""
        return self._scan(verify)[0]

    def verify(self) -> tuple[list[PartInfo], list[DamagedCopy]]:
        """Full sha256 check of every part on both sides: (good parts, damaged copies)."""
        return self._scan(VerifyLevel.HASH)

    def read_part(self, name: str, mmap: bool = True, verify: VerifyLevel = VerifyLevel.HASH) -> dict[str, np.ndarray]:
        """The arrays of part `name` from a checked copy (newest; local on a tie), memory-mapped if `mmap`."""
        check_name(name, "part name")
        best, bad = self._best_copy(name, verify)
        if best is None:
            why = "; ".join(f"{d.side}: {d.reason}" for d in bad) or "no copy on either side"
            raise StateError(f"part {name!r} has no complete, verified copy ({why}); recompute it")
        folder, info = best
        return folder.load(info, mmap)

    def delete_part(self, name: str) -> None:
        """Delete part `name` on both sides (each copy stops existing at once)."""
        for folder in self._folders:
            self._unless_stalled(lambda folder=folder: folder.delete(name), folder)
        if self._mirror is not None:
            self._mirror.forget(name)

    # ---------------------------------------------------------------------------- manifest

    def write_manifest(self, obj: dict) -> None:
        """Write the run manifest (next sequence number, sha256) atomically, then queue its mirror."""
        try:                                     # refuse what JSON cannot hold, now, not in the thread
            body = json.loads(json.dumps(obj))
        except (TypeError, ValueError) as exc:
            raise StateError(f"the manifest must be plain JSON (dict, list, str, int, float): {exc}; "
                             f"convert numpy values with int() / float() / .tolist()") from None
        if self._manifest_seq is None:
            self._manifest_seq = self._newest_manifest_seq()
        self._manifest_seq += 1
        atomic_write_bytes(self.local_dir / MANIFEST_FILE, run_manifest_bytes(body, self._manifest_seq))
        self._enqueue(CopyManifest())

    def read_manifest(self, local_only: bool = False) -> dict | None:
        """The newest valid run manifest of either side (`local_only`: never touch the mirror).

        None (and a warning) if no copy is valid; DriveError if the mirror stays unreachable.
        """
        folders = [self.local] if local_only else self._folders
        found = [self._unless_stalled(lambda f=f: read_run_manifest(f.ops, f.root, f.side), f) for f in folders]
        copies = [c for c in found if c is not None and not isinstance(c, DamagedCopy)]
        damaged = [c for c in found if isinstance(c, DamagedCopy)]
        _warn_damaged(damaged, "ignored" if copies else "ignored; no valid manifest is left, returning None")
        best = newest(copies)
        if best is None:
            return None
        self._manifest_seq = max(self._manifest_seq or 0, best.seq)
        return best.body["run"]

    # --------------------------------------------------------------------------- checkpoints

    def save(self, obj, name: str) -> Path:
        """torch.save `obj` as the next numbered version `name-000001.pt` (atomic), keep the last N."""
        check_name(name, "checkpoint name")
        if name not in self._versions:          # scan once; later saves never touch Drive here
            self._versions[name] = max([0, *self._checkpoint_versions(name)])
        version = self._versions[name] = self._versions[name] + 1
        self.checkpoints.save({name: obj}, version)
        return self.checkpoints.local.root / f"{stem(name, version)}.pt"

    def load_latest(self, name: str, map_location="cpu", weights_only: bool = True):
        """The newest checkpoint `name` that verifies and loads, from either side; None if none does."""
        sides = [self.checkpoints.local] + ([self.checkpoints.remote] if self.mirror_dir is not None else [])
        loaded = load_latest(sides, name, map_location, weights_only)
        self._versions[name] = max(self._versions.get(name, 0), loaded.newest_version)
        what = "skipped; no checkpoint of this name loads, load_latest returns None"
        _warn_damaged(loaded.damaged, what if loaded.obj is None else "skipped; loaded an older one instead")
        return loaded.obj

    # ------------------------------------------------------------------------------ mirror

    @property
    def mirror_lag(self) -> int:
        """Parts written locally and not yet verified on the mirror."""
        return self.mirror_status().parts_pending

    def mirror_status(self) -> MirrorStatus:
        """Pending parts and items, whether the mirror is failing, its last error, what it re-filled."""
        return self.checkpoints.mirror_status()

    def flush(self, timeout: float | None = None, *, unmount: bool = False, strict: bool = False) -> bool:
        """Wait until the mirror caught up (and was audited): True; False and a MirrorWarning if not.

        `strict` raises DriveError instead of warning. `unmount` (Colab only) then calls
        `google.colab.drive.flush_and_unmount()`; use it last, the mirror is gone afterwards.
        """
        if self.mirror_dir is None:
            return True                       # no mirror: nothing to wait for, and no Drive of ours to unmount
        if not self.checkpoints.flush(timeout):
            msg = behind_message(self.mirror_status(), self.mirror_dir, self.local_dir, timeout)
            if strict:
                raise DriveError(msg)
            warnings.warn(msg, MirrorWarning, stacklevel=2)
            return False
        if unmount:
            _colab_flush_and_unmount()
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Flush (warning if the mirror is failing), then stop the mirror thread. Idempotent."""
        if self._mirror is None:
            return True
        try:
            if self._mirror.alive:
                self.flush(timeout)
        finally:
            stopped = self._mirror.stop()
        return stopped

    def __enter__(self) -> DurableStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --------------------------------------------------------------------------- helpers

    def _enqueue(self, item) -> None:
        if self._mirror is not None:
            self._mirror.enqueue(item)

    def _unless_stalled(self, fn: Callable[[], Any], folder: PartFolder, default=None):
        """fn() for a folder; for the mirror once it stalled: `default` and a warning (local staging goes on)."""
        try:
            return fn()
        except MirrorStalled as exc:
            if folder is self.local:
                raise
            if not self._stall_warned:
                self._stall_warned = True
                warnings.warn(str(exc), MirrorWarning, stacklevel=3)
            return default

    def _scan(self, verify: VerifyLevel) -> tuple[list[PartInfo], list[DamagedCopy]]:
        """(good parts, damaged copies): the damaged ones logged, a good local copy queued to repair the mirror."""
        verify = VerifyLevel.of(verify)
        names = sorted({n for folder in self._folders for n in self._unless_stalled(folder.names, folder, [])})
        parts, damaged = [], []
        for name in names:
            best, bad = self._best_copy(name, verify)
            damaged += bad
            if best is not None:
                parts.append(best[1])
                if best[0] is self.local and any(d.side == "mirror" for d in bad):
                    self._enqueue(CopyPart(name))   # repair the mirror from the good local copy
        _warn_damaged(damaged, "ignored; the caller should recompute the parts that have no good copy")
        return parts, damaged

    def _best_copy(self, name: str,
                   verify: VerifyLevel) -> tuple[tuple[PartFolder, PartInfo] | None, list[DamagedCopy]]:
        good, bad = [], []
        for rank, folder in enumerate(self._folders):
            result = self._unless_stalled(lambda folder=folder: folder.check(name, verify), folder)
            if isinstance(result, PartInfo):
                good.append((result.created, -rank, folder, result))
            elif result is not None:
                bad.append(result)
        best = max(good, key=lambda g: g[:2], default=None)
        return (best[2], best[3]) if best else None, bad

    def _checkpoint_versions(self, name: str) -> list[int]:
        """Versions of `name` on either side, one try each; an unreachable mirror is skipped."""
        folders = [self.checkpoints.local]
        if self.mirror_dir is not None:
            folders.append(CheckpointFolder(self.mirror_dir, self.checkpoints.once, "mirror"))
        versions = []
        for folder in folders:
            with contextlib.suppress(OSError):   # mirror down: the thread catches up later
                versions += folder.versions(name)
        return versions

    def _newest_manifest_seq(self) -> int:
        """The highest seq on either side, one try each (the thread never overwrites a newer one)."""
        folders = [self.local]
        if self.mirror_dir is not None:
            folders.append(PartFolder(self.mirror_dir, self.checkpoints.once, "mirror"))
        seqs = [0]
        for folder in folders:
            with contextlib.suppress(OSError):
                seqs.append(getattr(read_run_manifest(folder.ops, folder.root, folder.side), "seq", 0))
        return max(seqs)


def behind_message(status: MirrorStatus, mirror_dir: Path, local_dir: Path, timeout: float | None) -> str:
    """Why the mirror is behind and what to do: a foreign claim, a stalled call, a full Drive, a failure."""
    if status.foreign:
        return f"not mirrored: {status.foreign}"
    head = (f"the mirror {mirror_dir} is behind by {status.parts_pending} parts ({status.items_pending} items")
    if status.stalled:
        return (f"mirror=stalled: {head}; its thread has been blocked on {status.stalled} for over the "
                f"deadline: a frozen Drive mount?); every part is safe locally in {local_dir}. Remount Drive "
                f"(nblib.env.remount_drive()) and rerun to catch the mirror up")
    why = f"last error: {status.last_error}" if status.failing else f"waited {timeout} s"
    full = status.last_error is not None and any(f"[Errno {e}]" in status.last_error
                                                   for e in (errno.ENOSPC, errno.EDQUOT))
    fix = ("Free Drive space (empty Drive's trash, or buy storage), then call flush() again or rerun"
           if full else "Check that Drive is mounted (nblib.env.remount_drive()) and call flush() again")
    return f"{head}, {why}); everything is safe in {local_dir}. {fix}"


def _warn_damaged(damaged: list[DamagedCopy], what: str) -> None:
    """One WARNING log record per damaged copy (a second damaged part is never folded into the first)."""
    for d in damaged:
        log.warning("damaged copy %s (%s: %s) %s", d.name, d.side, d.reason, what)


def _colab_flush_and_unmount() -> None:
    if env._colab_drive() is not None:
        from google.colab import drive  # type: ignore[import-not-found]

        drive.flush_and_unmount()
