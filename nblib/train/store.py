"""Train states local-first, copied to a mirror (a Drive folder or a bucket) by the store's mirror thread.

Every `save_every` steps the state is written to RUN/checkpoints as `state-<step>.pt` plus its
manifest record (nblib.store.checkpoints: atomic, sha256, record last); every `backup_every`
steps that version is queued for the mirror. The copy runs on `nblib.store.mirror.Mirror`'s
thread, with its retries, remounts and stall handling: training never waits for Drive or the
bucket, and `durability()` says which step is only local. Retention keeps the newest `keep_last`
states on each side, plus the `best` series (weights only, written when the named metric
improves), whose newest version is the best so far. Resume is local-first: the mirror is read
only when the run folder holds no state that loads (a new VM). Trade-off: between backups the
newest states exist on one disk only; the backup interval bounds what a lost VM costs.
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from nblib.errors import DriveError
from nblib.store.checkpoints import CheckpointFolder, load_latest
from nblib.store.mirror import CopyCheckpoint, Mirror, MirrorStatus, Retention, Sides
from nblib.store.parts import FileOps, PartFolder
from nblib.store.retention import checkpoints_to_drop
from nblib.store.retry import Retrier, RetryingOps

from .objstore import is_url, mirror_target

STATE, BEST = "state", "best"
log = logging.getLogger("nblib.train")
FOLDER = "checkpoints"


@dataclass(frozen=True)
class Durability:
    """Where the run's newest state stands: local step, last step queued and known on the mirror."""

    local_step: int
    queued_step: int | None
    mirror_caught_up: bool
    mirror_failing: bool
    last_error: str | None

    def line(self) -> str:
        if self.queued_step is None:
            return f"step {self.local_step} is saved locally only (no mirror)"
        if self.mirror_caught_up:
            return f"mirror holds step {self.queued_step}; steps after it are local only"
        why = f" ({self.last_error})" if self.mirror_failing and self.last_error else ""
        return (f"NOT YET DURABLE: the mirror has not confirmed step {self.queued_step}{why}; "
                f"the newest state (step {self.local_step}) is on local disk only; rerun to retry the copy")


class TrainStore:
    """A run's train states and best weights: local folder first, mirror thread behind it."""

    def __init__(self, run_dir: str | Path, mirror: str | Path | None = None, *, keep_last: int = 3,
                 storage_options: dict | None = None, retries: int = 3, backoff_s: float = 0.5,
                 retry_interval_s: float = 30.0, remount=None, start_mirror: bool = True):
        self.local_root = Path(run_dir) / FOLDER
        self.local_root.mkdir(parents=True, exist_ok=True)
        self.local = CheckpointFolder(self.local_root, FileOps(), "local")
        self.keep_last = keep_last
        self.mirror_label = None if mirror is None else str(mirror)
        self.remote: CheckpointFolder | None = None
        self._mirror: Mirror | None = None
        self._queued: int | None = None
        self._mirror_dir = None if mirror is None or is_url(mirror) else Path(mirror)
        self.watch = None
        self.startup_timeout_s = 60.0      # a stalled mirror at start: give up on it after this, start afresh
        if mirror is not None:
            root, ops = mirror_target(mirror, storage_options)
            root = root / FOLDER
            if remount is None and not is_url(mirror):
                from nblib.store import _default_remount
                remount = _default_remount()
            self.remote = CheckpointFolder(root, RetryingOps(ops, Retrier(retries, backoff_s, remount), root), "mirror")
            if start_mirror:
                sides = Sides(PartFolder(self.local_root), PartFolder(root, ops, "mirror"), self.local,
                              CheckpointFolder(root, ops, "mirror"))
                self._mirror = Mirror(sides, Retention(None, None, keep_last), Retrier(retries, backoff_s, remount),
                                      retry_interval_s=retry_interval_s)

    def save(self, state: dict, step: int, *, backup: bool) -> Path:
        """Write `state` as version `step` locally (atomic); queue it for the mirror when `backup`."""
        path = self.local.save(state, STATE, step)
        self._watch_disks(path.stat().st_size)
        if backup and self._mirror is not None:
            self._queued = step
            self._mirror.enqueue(CopyCheckpoint(STATE, step))
        self._prune_local(STATE, keep_also=self._queued)
        return path

    def save_best(self, weights: dict, step: int, *, backup: bool) -> Path:
        """Write the best-so-far weights as version `step` of the best series."""
        path = self.local.save(weights, BEST, step)
        if backup:
            self.backup_best()
        self._prune_local(BEST)
        return path

    def backup_best(self) -> None:
        """Queue the newest best version for the mirror (at a backup step)."""
        versions = self.local.versions(BEST)
        if versions and self._mirror is not None:
            self._mirror.enqueue(CopyCheckpoint(BEST, versions[-1]))

    def load_latest(self) -> tuple[dict | None, str]:
        """(newest state that verifies and loads, 'local' | 'mirror' | 'none'): local first."""
        found = load_latest([self.local], STATE, weights_only=True)
        _warn(found.damaged)
        if found.obj is not None:
            return found.obj, "local"
        if self.remote is None:
            return None, "none"
        try:
            found = _within(lambda: load_latest([self.remote], STATE, weights_only=True), self.startup_timeout_s)
        except (DriveError, TimeoutError) as exc:
            # Safe to start over: a run is deterministic, so any state this run writes at step s has
            # the bytes of one the mirror may hold for step s; only the recomputation is lost.
            log.warning("no local state and the mirror cannot be read (%s): starting from step 0", exc)
            warnings.warn(f"no local state in {self.local_root} and the mirror cannot be read ({exc}); "
                          f"training starts from step 0 (a deterministic run: nothing it writes conflicts with "
                          f"what the mirror may hold)", stacklevel=2)
            return None, "start (mirror unreachable)"
        _warn(found.damaged)
        return (found.obj, "mirror") if found.obj is not None else (None, "none")

    def local_versions(self, name: str = STATE) -> list[int]:
        return self.local.versions(name)

    def mirror_status(self) -> MirrorStatus:
        return self._mirror.status() if self._mirror is not None else MirrorStatus(0, 0, False, None, 0)

    def durability(self, local_step: int) -> Durability:
        status = self.mirror_status()
        return Durability(local_step, self._queued if self._mirror else None, status.caught_up,
                          status.failing, status.last_error)

    def flush(self, timeout: float | None) -> bool:
        """Wait up to `timeout` s for the mirror to catch up; True when it did (or there is none)."""
        return True if self._mirror is None else self._mirror.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> Durability:
        """Flush for at most `timeout` s, stop the mirror thread; what is durable where."""
        if self._mirror is None:
            return self.durability(max(self.local.versions(STATE), default=0))
        self._mirror.wait(timeout)
        result = self.durability(max(self.local.versions(STATE), default=0))
        self._mirror.stop()
        return result

    def _watch_disks(self, checkpoint_bytes: int) -> None:
        """Warn before the local disk or the mirror folder (Drive) runs out of room for the next states."""
        from .ops import DiskWatch

        if self.watch is None:
            folders = {"local disk": self.local_root}
            if self._mirror_dir is not None:
                folders["mirror"] = self._mirror_dir
            self.watch = DiskWatch(folders, checkpoint_bytes, headroom=self.keep_last + 1)
        self.watch.check()

    def _prune_local(self, name: str, keep_also: int | None = None) -> None:
        """Keep the newest `keep_last` versions locally, and the newest queued backup until copied."""
        for version in checkpoints_to_drop(self.local.versions(name), self.keep_last):
            if version != keep_also:
                self.local.remove(name, version)


def _within(fn, timeout_s: float):
    """fn() on a daemon thread; TimeoutError when it has not returned in `timeout_s` (a stalled mount or bucket)."""
    import threading

    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:          # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="nblib-train-mirror-read", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"the mirror did not answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _warn(damaged) -> None:
    if damaged:
        listed = "; ".join(f"{d.name} ({d.side}: {d.reason})" for d in damaged[:3])
        warnings.warn(f"{len(damaged)} damaged checkpoint copies skipped: {listed}", stacklevel=3)


@contextlib.contextmanager
def timed():
    """Yield a one-item list that holds the seconds the block took."""
    took = [0.0]
    start = time.perf_counter()
    try:
        yield took
    finally:
        took[0] = time.perf_counter() - start
