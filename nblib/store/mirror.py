"""The mirror thread: copy local parts, checkpoints and the manifest to Drive, never making the caller wait.

Work items are small frozen dataclasses in a backlog. Each is retried on OSError with
exponential backoff (and a remount on Errno 107); an item that still fails stays first in the
backlog, the run continues locally, and the mirror tries again on the next write, on flush(), or
every `retry_interval_s`. Copies go through AtomicWriter with the expected digest and are read
back. When the backlog drains, an `Audit` lists the mirror: parts it held before and no longer
holds (a mirror folder deleted mid-run) are copied again, so "caught up" means "all there".
The trade-off: the newest parts live only locally until the mirror catches up (`parts_pending`).
With an `identity`, the mirror folder's claim (`identity.py`) is read before every copy: a folder
another run claimed is never written again by this one. A call that blocks past the deadline (a
frozen mount) marks the mirror `stalled`: `wait` stops waiting for it, and the thread, a daemon,
never keeps the process alive.
"""
from __future__ import annotations

import errno
import logging
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field

from nblib.errors import StateError
from nblib.manifest import Manifest

from .checkpoints import CheckpointFolder
from .identity import ForeignMirror, claim
from .parts import DamagedCopy, FileOps, PartFolder, PartInfo, VerifyLevel
from .retention import checkpoints_to_drop, local_parts_to_drop
from .retry import REAUTHORIZE_HINT, RemountPending, Retrier, describe
from .run_manifest import MANIFEST_FILE, read_run_manifest, run_manifest_bytes

log = logging.getLogger(__name__)


class MirrorWarning(UserWarning):
    """The mirror (Drive) keeps failing: data is safe locally and is mirrored when it is back."""


@dataclass(frozen=True)
class Resync:
    """Queue what an earlier process left unmirrored."""

    label = "the backlog scan"


@dataclass(frozen=True)
class CopyPart:
    name: str

    @property
    def label(self) -> str:
        return f"part {self.name}"


@dataclass(frozen=True)
class CopyManifest:
    label = "the manifest"


@dataclass(frozen=True)
class CopyCheckpoint:
    name: str
    version: int

    @property
    def label(self) -> str:
        return f"checkpoint {self.name}-{self.version:06d}"


@dataclass(frozen=True)
class Audit:
    """List the mirror and re-fill parts it held before and lost (`full`: also torn or shrunk ones)."""

    full: bool = False
    label = "the mirror audit"


Item = Resync | CopyPart | CopyManifest | CopyCheckpoint | Audit


@dataclass(frozen=True)
class MirrorStatus:
    """Where the mirror stands: what is pending, whether it is failing, what it had to re-fill."""

    parts_pending: int
    items_pending: int
    failing: bool
    last_error: str | None
    parts_mirrored: int       # parts known present on the mirror
    refilled: int = 0         # parts found missing on the mirror and queued again
    lost: int = 0             # parts missing on the mirror with no local copy left to re-fill from
    paused: bool = False      # a remount blocks (Drive waits to be re-authorized): see retry.REAUTHORIZE_HINT
    stalled: str | None = None  # a call blocked past the deadline: on what (a frozen mount)
    foreign: str | None = None  # the mirror folder belongs to another run: why nothing more is copied

    @property
    def caught_up(self) -> bool:
        return self.items_pending == 0


@dataclass(frozen=True)
class Sides:
    """The folders one mirror copies between: local and mirror parts and checkpoints."""

    local: PartFolder
    remote: PartFolder
    local_checkpoints: CheckpointFolder
    remote_checkpoints: CheckpointFolder


@dataclass(frozen=True)
class Retention:
    """The retention knobs the mirror applies once a copy is verified on the mirror."""

    keep_local: int | None
    keep_every: int | None
    keep_checkpoints: int
    keep_per_name: dict[str, int] = field(default_factory=dict)   # series kept apart (training's best: 1)

    def versions_kept(self, name: str) -> int:
        """Checkpoint versions of `name` kept on each side."""
        return self.keep_per_name.get(name, self.keep_checkpoints)


class Mirror:
    """A daemon thread working through a backlog of copy items; its status is a MirrorStatus."""

    def __init__(self, sides: Sides, retention: Retention, retrier: Retrier, *,
                 retry_interval_s: float, verify_readback: bool, identity: dict | None, stall_s: float):
        self.sides, self.retention, self.retrier = sides, retention, retrier
        self.retry_interval_s, self.verify_readback = retry_interval_s, verify_readback
        self.identity = identity
        self.stall_s = stall_s
        self._taken_at = 0.0        # when the item in flight was taken up (monotonic)
        self._foreign: str | None = None
        self._cond = threading.Condition()
        self._backlog: deque[Item] = deque()
        self._in_flight: Item | None = None
        self._failing = False
        self._paused = False        # the last failure was a remount that did not return
        self._episodes = 0          # items the thread has taken up, counted
        self._failed_episode = 0    # the number of the last one that failed for good
        self._kicked = False
        self._dirty = False         # something was copied since the last audit
        self._last_error: BaseException | None = None
        self._verified: dict[str, str] = {}    # part name -> content_id verified by sha256 on the mirror
        self._present: set[str] = set()        # part names known present on the mirror
        self._refilled = self._lost = 0
        self._thread = threading.Thread(target=self._run, name="nblib-store-mirror", daemon=True)
        self.enqueue(Resync())
        self._thread.start()

    def enqueue(self, item: Item) -> None:
        """Queue an item (a re-queued one moves behind what came since) and wake the thread."""
        with self._cond:
            if item in self._backlog:
                self._backlog.remove(item)
            self._backlog.append(item)
            if isinstance(item, CopyPart):
                self._verified.pop(item.name, None)
            self._kicked = True
            self._cond.notify_all()

    def forget(self, name: str) -> None:
        """A part was deleted on both sides: it is no longer expected on the mirror."""
        with self._cond:
            self._verified.pop(name, None)
            self._present.discard(name)

    def status(self) -> MirrorStatus:
        with self._cond:
            items = list(self._backlog) + ([self._in_flight] if self._in_flight else [])
            return MirrorStatus(parts_pending=sum(isinstance(i, CopyPart) for i in items),
                                items_pending=len(items), failing=self._failing,
                                last_error=describe(self._last_error) if self._last_error else None,
                                parts_mirrored=len(self._present), refilled=self._refilled, lost=self._lost,
                                paused=self._paused, stalled=self._stalled_on(), foreign=self._foreign)

    def _stalled_on(self) -> str | None:
        """The item in flight when it has been blocked past the deadline (call with the lock held)."""
        if self._in_flight is None or time.monotonic() - self._taken_at < self.stall_s:
            return None
        return self._in_flight.label

    def wait(self, timeout: float | None = None) -> bool:
        """Kick the thread and wait until the backlog is empty (True) or an attempt that started
        after this call failed for good, the timeout passed, the thread is gone, the item in flight
        has blocked past the deadline (`stall_s`: a frozen mount), or the mirror folder belongs to
        another run (False).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            # only a failure of an attempt that starts after this call counts: one already
            # under way may have failed before the target came back
            first_new_episode = self._episodes + 1
            if self._thread.is_alive() and Audit(full=True) not in self._backlog:
                self._backlog.append(Audit(full=True))   # "caught up": the mirror was just seen complete
            self._kicked = True
            self._cond.notify_all()
            while (self._backlog or self._in_flight) and self._failed_episode < first_new_episode:
                now = time.monotonic()
                ends = [t for t in (deadline, self._taken_at + self.stall_s if self._in_flight else None) if t]
                left = min(ends) - now if ends else None
                if (left is not None and left <= 0) or not self._thread.is_alive():
                    break
                self._cond.wait(left)
            return not self._backlog and not self._in_flight and self._foreign is None

    def stop(self) -> bool:
        """Stop the thread (after the item in flight); True if nothing was pending."""
        with self._cond:
            caught_up = not self._backlog and not self._in_flight
            self.retrier.stop.set()
            self._cond.notify_all()
            blocked = self._stalled_on() is not None
        self._thread.join(timeout=0.1 if blocked else 5.0)   # a call blocked in the kernel never returns
        return caught_up

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self.retrier.stop.is_set():
                        return
                    if self._backlog and (not self._failing or self._kicked):
                        break
                    waiting = self._failing and bool(self._backlog)
                    if not self._cond.wait(self.retry_interval_s if waiting else None) and waiting:
                        self._kicked = True      # the retry interval passed: try the backlog again
                self._kicked = False
                self._in_flight = item = self._backlog.popleft()
                self._taken_at = time.monotonic()
                self._episodes += 1
                episode = self._episodes
            try:
                self.retrier.call(lambda item=item: self._do(item), f"mirror {item.label}")
            except OSError as exc:
                self._failed(item, exc, episode)
                continue
            except ForeignMirror as exc:         # another run claimed the folder: copy nothing more
                self._give_up(exc)
                continue
            except Exception as exc:             # a local copy that no longer verifies: not retried
                log.error("cannot mirror %s: %s; not mirroring it", item.label, exc)
            self._done(item)

    def _done(self, item: Item) -> None:
        with self._cond:
            self._in_flight = None
            self._dirty = not isinstance(item, Audit)
            if not self._backlog and self._dirty:    # never "caught up" before an audit passed
                self._backlog.append(Audit())
                self._dirty = False
            if self._failing:
                self._failing = self._paused = False
                log.warning("mirror %s is back; catching up %d items", self.sides.remote.root,
                            len(self._backlog))
            self._cond.notify_all()

    def _give_up(self, exc: ForeignMirror) -> None:
        with self._cond:
            first = self._foreign is None
            self._foreign = str(exc)
            self._backlog.clear()
            self._in_flight = None
            self._cond.notify_all()
        if first:
            msg = f"not mirroring any more: {exc}; every part is safe in {self.sides.local.root}"
            log.warning(msg)
            warnings.warn(msg, MirrorWarning, stacklevel=1)

    def _failed(self, item: Item, exc: OSError, episode: int) -> None:
        with self._cond:
            self._backlog.appendleft(item)       # keep the order: retried first next time
            self._in_flight = None
            self._last_error = exc
            first = not self._failing or (isinstance(exc, RemountPending) and not self._paused)
            self._failing, self._paused = True, isinstance(exc, RemountPending)
            pending = sum(isinstance(i, CopyPart) for i in self._backlog)
        remote, local = self.sides.remote.root, self.sides.local.root   # what failed, what waits locally, what to do
        if isinstance(exc, RemountPending):
            msg = (f"the mirror {remote} is paused: {exc.strerror}. {pending} parts wait in {local} and the run "
                   f"continues locally. {REAUTHORIZE_HINT}")
        else:
            fix = "free Drive space; " if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            msg = (f"mirror {remote} failed {self.retrier.retries + 1} times on {item.label} ({describe(exc)}); "
                   f"{pending} parts wait in {local} and the run continues locally; {fix}the mirror retries on "
                   f"the next write, flush(), or every {self.retry_interval_s:g} s")
        if first:
            log.warning(msg)
            warnings.warn(msg, MirrorWarning, stacklevel=1)
        else:
            log.info(msg)
        with self._cond:                         # only now wake flush(): the warning came first
            self._failed_episode = episode
            self._cond.notify_all()

    def _do(self, item: Item) -> None:
        if self.identity is not None and not isinstance(item, Audit):
            # before every copy: ForeignMirror unless the mirror folder is this run's (claimed here when unclaimed)
            claim(self.sides.remote.ops, self.sides.remote.root, self.identity, self.sides.local.root)
        if isinstance(item, CopyPart):
            self._copy_part(item.name)
        elif isinstance(item, CopyManifest):
            self._copy_manifest()
        elif isinstance(item, CopyCheckpoint):
            self._copy_checkpoint(item.name, item.version)
        elif isinstance(item, Audit):
            self._audit(item.full)
        else:
            self._resync()

    def _copy_part(self, name: str) -> None:
        local, remote = self.sides.local, self.sides.remote
        before = local.check(name, verify=VerifyLevel.SIZES)
        try:
            copy = remote.copy_from(local, name, verify_readback=self.verify_readback)
        except StateError:
            after = local.check(name, verify=VerifyLevel.SIZES)
            if not (isinstance(before, PartInfo) and isinstance(after, PartInfo)
                    and before.content_id == after.content_id):
                return                           # rewritten meanwhile: the rewrite queued it again
            raise
        if copy is None:
            return                               # deleted or being rewritten: a new write re-queues it
        with self._cond:
            self._present.add(name)
            if isinstance(before, PartInfo) and copy.content_id == before.content_id:
                self._verified[name] = copy.content_id
        self._apply_retention()

    def _copy_manifest(self) -> None:
        """Write the local run manifest to the mirror, listing the parts present there; not over a newer one."""
        with self._cond:
            present = sorted(self._present)
        local = read_run_manifest(FileOps(), self.sides.local.root, "local")
        if local is None:
            return
        if isinstance(local, DamagedCopy):
            raise StateError(f"the local manifest no longer verifies: {local.reason}")
        remote = self.sides.remote
        theirs = read_run_manifest(remote.ops, remote.root, "mirror")
        if isinstance(theirs, Manifest) and theirs.seq > local.seq:
            log.warning("mirror manifest seq %d is newer than local seq %d: not overwritten", theirs.seq, local.seq)
            return
        body = run_manifest_bytes(local.body["run"], local.seq, present)
        remote.ops.write_atomic(remote.root / MANIFEST_FILE, [body])

    def _copy_checkpoint(self, name: str, version: int) -> None:
        """Copy one version, then keep the newest versions on both sides; older local ones go only once a newer is
        mirrored.
        """
        local, remote = self.sides.local_checkpoints, self.sides.remote_checkpoints
        if not remote.copy_from(local, name, version):
            return
        keep = self.retention.versions_kept(name)
        for old in checkpoints_to_drop(local.versions(name), keep, up_to=version):
            local.remove(name, old)
        for old in checkpoints_to_drop(remote.versions(name), keep):
            remote.remove(name, old)

    def _audit(self, full: bool) -> None:
        """Re-fill parts the mirror held and lost; re-copy the manifest so it lists what is there.

        A quick audit lists the mirror's folders (one call); a `full` one (on flush) also checks
        each part's part.json and file sizes, so a part torn by a deletion racing a copy counts.
        """
        remote, local = self.sides.remote, self.sides.local
        there = set(remote.names())
        if full:
            with self._cond:
                kept = sorted(self._present & there)
            there -= {name for name in kept if not isinstance(self._check_remote(name), PartInfo)}
        with self._cond:
            vanished = sorted(self._present - there)
            self._present -= set(vanished)
            for name in vanished:
                self._verified.pop(name, None)
        refill = [n for n in vanished if isinstance(local.check(n, verify=VerifyLevel.SIZES), PartInfo)]
        lost = sorted(set(vanished) - set(refill))
        if vanished:                             # run events: how many are re-filled, which must be recomputed
            log.warning("the mirror %s lost %d parts; re-filling %d from local staging", remote.root, len(vanished),
                        len(refill))
        if lost:
            log.warning("the mirror %s lost parts %s and local staging no longer has them (retention "
                        "deleted them after they were mirrored); they must be recomputed", remote.root, lost)
        with self._cond:
            self._refilled += len(refill)
            self._lost += len(lost)
        for name in refill:
            self.enqueue(CopyPart(name))
        manifest_gone = remote.ops.read_bytes(remote.root / MANIFEST_FILE) is None
        if (vanished or manifest_gone) and (local.root / MANIFEST_FILE).exists():
            self.enqueue(CopyManifest())

    def _resync(self) -> None:
        """Queue what an earlier process left unmirrored, in the order to copy it: parts the mirror lacks or holds
        older different content of, checkpoint versions whose records differ, and the run manifest when the
        mirror's is missing or behind.
        """
        local, remote = self.sides.local, self.sides.remote
        remote.ops.makedirs(remote.root)
        there, items = set(remote.names()), []
        for name in local.names():
            mine = local.check(name, verify=VerifyLevel.SIZES)
            if not isinstance(mine, PartInfo):
                continue
            theirs = self._check_remote(name) if name in there else None
            if not isinstance(theirs, PartInfo) or (theirs.content_id != mine.content_id
                                                     and theirs.created <= mine.created):
                items.append(CopyPart(name))
        ckpts_local, ckpts_remote = self.sides.local_checkpoints, self.sides.remote_checkpoints
        for name, version in ckpts_local.stems():
            if ckpts_local.record_bytes(name, version) != ckpts_remote.record_bytes(name, version):
                items.append(CopyCheckpoint(name, version))
        mine = read_run_manifest(FileOps(), local.root, "local")
        theirs = read_run_manifest(remote.ops, remote.root, "mirror")
        if isinstance(mine, Manifest) and not (isinstance(theirs, Manifest) and theirs.seq >= mine.seq):
            items.append(CopyManifest())
        with self._cond:
            self._present |= there
        for item in items:
            self.enqueue(item)

    def _check_remote(self, name: str) -> PartInfo | DamagedCopy | None:
        """Metadata check of one mirror part, retried on its own.

        A scan over many parts must not restart from the first one on every Drive hiccup.
        """
        return self.retrier.call(lambda: self.sides.remote.check(name, verify=VerifyLevel.SIZES), f"check {name}")

    def _apply_retention(self) -> None:
        """Delete local parts outside keep_local / keep_every, only those verified on the mirror."""
        if self.retention.keep_local is None:
            return
        with self._cond:
            known = set(self._present)
        local = self.sides.local
        for name in local_parts_to_drop(local.names(), known, self.retention.keep_local, self.retention.keep_every):
            mine = local.check(name, verify=VerifyLevel.SIZES)
            verified = isinstance(mine, PartInfo) and self._verified_on_mirror(name, mine.content_id)
            if verified and local.delete(name, if_content=mine.content_id):   # not if rewritten meanwhile
                log.debug("retention: deleted local copy of %s (verified on the mirror)", name)

    def _verified_on_mirror(self, name: str, content_id: str) -> bool:
        """True when the mirror holds this part's content and its files verify by sha256."""
        with self._cond:
            if self._verified.get(name) == content_id:
                return True
        theirs = self.sides.remote.check(name, verify=VerifyLevel.HASH)
        if isinstance(theirs, DamagedCopy):
            self.enqueue(CopyPart(name))         # the mirror copy is damaged: mirror it again
        if not isinstance(theirs, PartInfo) or theirs.content_id != content_id:
            return False
        with self._cond:
            self._verified[name] = content_id
        return True
