"""Train states local-first, copied to a mirror (a Drive folder or a bucket) by the store's mirror thread.

Every `save_every` steps the state is written to RUN/checkpoints as `state-<step>.pt` plus its
manifest record (nblib.store.checkpoints: atomic, sha256, record last); every `backup_every`
steps that version is queued for the mirror. The copy runs on `nblib.store.mirror.Mirror`'s
thread, with its retries, remounts and stall handling: training never waits for Drive or the
bucket, and `durability()` says which step is only local. The local write itself is asynchronous
too: `save` takes a staged snapshot (a deep copy of the tensors in host memory, taken at the save
step) and hands it to one writer thread (`StateWriter`), which writes it through the same atomic
writer and record, then queues the mirror and prunes; at most one write is in flight (the next
save waits for it), and a failed write is raised at the next save or at `wait_saves`/`close`.
Retention keeps the newest `keep_last` states on each side, plus the `best` series (weights
only, written when the named metric improves), whose newest version is the best so far. Resume
is local-first: the mirror is read only when the run folder holds no state that loads (a new
VM). Trade-off: between backups the newest states exist on one disk only; the backup interval
bounds what a lost VM costs; the newest save costs the loop a host copy of the state, not its write.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from nblib.atomic import remove_temporaries
from nblib.errors import DriveError
from nblib.store.checkpoints import CheckpointFolder, load_latest
from nblib.store.deadline import call_within
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
                 retry_interval_s: float = 30.0, remount=None, start_mirror: bool = True,
                 sync_save: bool = False, quota_bytes: int | None = None):
        self.local_root = Path(run_dir) / FOLDER
        self.local_root.mkdir(parents=True, exist_ok=True)
        if removed := remove_temporaries(self.local_root):      # a SIGKILL mid-write; one writer per run folder
            log.info("removed %d half-written temporaries a killed run left in %s", removed, self.local_root)
        self.local = CheckpointFolder(self.local_root, FileOps(), "local")
        self.keep_last = keep_last
        self.mirror_label = None if mirror is None else str(mirror)
        self.remote: CheckpointFolder | None = None
        self._mirror: Mirror | None = None
        self._queued: int | None = None
        self._mirror_dir = None if mirror is None or is_url(mirror) else Path(mirror)
        self.watch = None
        self.quota_bytes = quota_bytes     # the mirror folder's quota (Drive) for the disk watch
        self.sync_save = sync_save
        self.writer: StateWriter | None = None     # started by the first asynchronous save
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

    def save(self, state: dict, step: int, *, backup: bool, best: dict | None = None) -> float:
        """Write `state` as version `step` locally (atomic), `best` first as the best series' version `step`;
        queue both for the mirror when `backup`. Asynchronous unless `sync_save`: the tensors are copied
        now, the files written on the writer thread. The seconds waited for the previous write.
        """
        if self.sync_save:
            self._write(state, step, backup, best)
            return 0.0
        if self.writer is None:
            self.writer = StateWriter()
        staged_state, staged_best = snapshot((state, best))
        return self.writer.submit(lambda: self._write(staged_state, step, backup, staged_best), step)

    def wait_saves(self) -> float:
        """Wait for the write in flight; raise its error if it failed. The seconds waited."""
        return 0.0 if self.writer is None else self.writer.wait()

    def _write(self, state: dict, step: int, backup: bool, best: dict | None) -> None:
        """The save itself: best weights, then the state, then the mirror queue and local retention."""
        if best is not None:
            self.local.save(best, BEST, step)
            self._prune_local(BEST)
        path = self.local.save(state, STATE, step)
        self._watch_disks(path.stat().st_size)
        if backup and self._mirror is not None:
            self._queued = step
            self._mirror.enqueue(CopyCheckpoint(STATE, step))
        self._prune_local(STATE, keep_also=self._queued)      # only once the new state is complete
        if backup:
            self.backup_best()

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
            found = call_within(lambda: load_latest([self.remote], STATE, weights_only=True), self.startup_timeout_s,
                                    thread_name="nblib-train-mirror-read")
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
        """Join the local writer, flush the mirror for at most `timeout` s, stop its thread; what is durable where.

        A write that failed and was not raised yet (the run is ending on another error) is logged here.
        """
        if self.writer is not None:
            try:
                self.writer.wait()
            except Exception as exc:          # the caller is already raising; do not hide that error
                log.error("the background write of a train state failed: %s: %s", type(exc).__name__, exc)
            self.writer.stop()
            self.writer = None
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
            quota = {} if self.quota_bytes is None or self._mirror_dir is None else {"mirror": self.quota_bytes}
            self.watch = DiskWatch(folders, checkpoint_bytes, headroom=self.keep_last + 1, quota_bytes=quota)
        self.watch.check()

    def _prune_local(self, name: str, keep_also: int | None = None) -> None:
        """Keep the newest `keep_last` versions locally, and the newest queued backup until copied."""
        for version in checkpoints_to_drop(self.local.versions(name), self.keep_last):
            if version != keep_also:
                self.local.remove(name, version)


class StateWriter:
    """One background thread that runs save jobs in order, at most one in flight; a failure is kept
    and raised by the next `submit` or `wait`, never lost. `writes` holds each write's seconds.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._job = None
        self._busy = False
        self._error: BaseException | None = None
        self._step = 0
        self._stopping = False
        self.writes: list[float] = []       # what each background write took
        self._thread = threading.Thread(target=self._run, name="nblib-train-writer", daemon=True)
        self._thread.start()

    def submit(self, job, step: int) -> float:
        """Wait for the write in flight (raising its error), then start `job`; the seconds waited."""
        waited = self.wait()
        with self._cond:
            self._job, self._busy, self._step = job, True, step
            self._cond.notify_all()
        return waited

    def wait(self) -> float:
        """Block until no write is in flight; raise a failed write's error. The seconds waited."""
        start = time.perf_counter()
        with self._cond:
            while self._busy:
                self._cond.wait()
            error, self._error = self._error, None
        waited = time.perf_counter() - start
        if error is not None:
            raise error
        return waited

    def stop(self) -> None:
        """End the thread once idle (after `wait`)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._stopping:
                    self._cond.wait()
                if self._job is None:
                    return
                job, self._job = self._job, None
            start = time.perf_counter()
            error = None
            try:
                job()
            except BaseException as exc:      # raised on the training thread at the next save or wait
                exc.add_note(f"(raised by the background write of the train state of step {self._step})")
                error = exc
            with self._cond:
                self.writes.append(time.perf_counter() - start)
                self._error, self._busy = error, False
                self._cond.notify_all()


def snapshot(obj):
    """A deep copy of `obj` whose tensors live in host memory: CPU tensors cloned (storage sharing,
    state-dict metadata and container types kept, so torch.save writes the same bytes), CUDA tensors
    copied with .cpu() (a save then records them as CPU storages; a resume maps to CPU anyway).
    """
    import torch

    memo: dict = {}

    def stage(value):
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu" and id(value) not in memo:
                memo[id(value)] = value.detach().cpu()
        elif isinstance(value, dict):
            for item in value.values():
                stage(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                stage(item)

    stage(obj)
    return copy.deepcopy(obj, memo)


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
