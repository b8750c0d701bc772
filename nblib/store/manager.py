"""One checkpoint manager for encoding and training: versioned saves local first, a mirror behind them.

`CheckpointManager` owns a folder of checkpoint series (`checkpoints.py`: `<name>-000001.pt` plus its
record of size and digest, written last) and, optionally, a mirror folder (a Drive folder, or a bucket through
the `mirror_ops` the caller passes) that the `mirror.Mirror` thread fills. `DurableStore` (encode)
and `train.store.TrainStore` are both built on it, so both get, from one place: the claim of the
mirror folder for the run's `identity` (`identity.py`: a second run on the mirror is refused at
open, naming the mirror folder), the deadline on every read of the mirror from the caller's thread
(`deadline.py`), the knob checks, retention (`keep_last` versions per name on each side; a version
queued for the mirror stays locally until copied), and an optional background writer:
`save(..., blocking=False)` first waits for the write in flight (raising its error), then stages
the tensors into reused host buffers (`staging.py`; pinned on CUDA) and returns the write's
`concurrent.futures.Future` (torchtitan's `CheckpointManager._async_wait` pattern; the error travels
in the future). When the caller's loop leaves no core spare (`SpareCore`: its threads compute side by side,
as a CPU-bound loop's torch threads do), a writer thread would stall them, so the save serializes and hashes
on the caller's thread instead (no staging copy) and leaves only the fsyncs, renames and records to the
writer. A synchronous save of CUDA tensors stages into the same host buffers, so both
write the same bytes. Only a writer that holds the folder alone (`clean_temporaries`, training's rank
0 under the run folder's lock) removes the `.tmp-` temporaries a killed writer left; a reader opened
to load deletes nothing.

Trade-off: the newest versions live on local disk only until the mirror copies them, and the
staging buffers hold one snapshot of host RAM between saves. Failure modes: a failed background
write is raised at the next `save`, `wait` or logged by `close`; `close` stops both threads even
when interrupted (KeyboardInterrupt).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from nblib import env
from nblib.atomic import remove_temporaries
from nblib.errors import ConfigError

from .checkpoints import CheckpointFolder, Loaded, load_latest
from .deadline import DeadlineOps, MirrorStalled, Stall, call_within, mirror_deadline
from .identity import claim
from .mirror import CopyCheckpoint, Mirror, MirrorStatus, MirrorWarning, Retention, Sides
from .parts import FileOps, PartFolder
from .retention import local_versions_to_drop
from .retry import Retrier, RetryingOps
from .staging import BackgroundWriter, HostStaging

log = logging.getLogger("nblib.store")


class CheckpointManager:
    """Versioned checkpoints in `local_dir`, mirrored to `mirror_dir` by a thread; see the module docstring.

    Args:
        local_dir: the local folder of the series (created).
        mirror_dir: the mirror folder (a path; for a bucket, its 'bucket/prefix' with `mirror_ops`); None: none.
        mirror_ops: the FileOps of the mirror (default: the local file system, a Drive mount).
        keep_last: versions kept per name on each side (locally, one fewer while a new one is written, where
            more than one is kept: `local_versions_to_drop`).
        keep_per_name: versions kept on each side for the names given, instead of keep_last (training keeps
            one best: `nblib.budget.training.retained_versions`).
        keep_local, keep_every: the part retention of a DurableStore sharing this mirror (None: all).
        identity: the run's identity (JSON): claims the mirror folder for this run.
        writer: this process writes the folder: it claims the mirror and runs the mirror thread. A
            reader (False) only loads, and deletes nothing.
        clean_temporaries: a writer that holds the folder's lock alone (no other process writes there)
            removes the `.tmp-` files a killed writer left (False where ranks share the folder).
        prune_unmirrored: prune local versions beyond `keep_last` at each save even with a mirror
            (training: a version queued for the mirror is kept until copied); False: with a mirror,
            local versions go only once a newer one is mirrored (encode).
        retries, backoff_s, retry_interval_s, verify_mirror, remount: how the mirror retries (`retry.py`).
        deadline_s: how long a mirror read may block (default NBLIB_MIRROR_DEADLINE_S).
        on_saved(name, path): called on the writing thread after each version is written (disk watches).
        version_label: what a version is called in errors ("step" for training).
    """

    def __init__(self, local_dir: str | Path, mirror_dir: str | Path | None = None, *,
                 mirror_ops: FileOps | None = None, keep_last: int = 3, keep_per_name: dict[str, int] | None = None,
                 keep_local: int | None = None, keep_every: int | None = None, identity: dict | None = None,
                 writer: bool = True,
                 clean_temporaries: bool = False,
                 prune_unmirrored: bool = False, retries: int = 5, backoff_s: float = 0.5,
                 retry_interval_s: float = 30.0, verify_mirror: bool = True, remount: Callable[[], Any] | None = None,
                 deadline_s: float | None = None, on_saved: Callable[[str, Path], None] | None = None,
                 version_label: str = "version"):
        self.local_dir = Path(local_dir)
        self.mirror_dir = None if mirror_dir is None else Path(mirror_dir)
        check_knobs(self.local_dir, self.mirror_dir if mirror_ops is None else None,
                    keep_local=keep_local, keep_every=keep_every, keep_checkpoints=keep_last, retries=retries,
                    backoff_s=backoff_s)
        self.writer, self.prune_unmirrored = writer, prune_unmirrored
        self.retention = Retention(keep_local, keep_every, keep_last, dict(keep_per_name or {}))
        for kept in self.retention.keep_per_name.values():
            check_knobs(self.local_dir, None, keep_checkpoints=kept)
        self.identity = None if identity is None else json.loads(json.dumps(identity))   # as mirror.json holds it
        self.on_saved, self.version_label = on_saved, version_label
        self.local_dir.mkdir(parents=True, exist_ok=True)
        if writer and clean_temporaries and (removed := remove_temporaries(self.local_dir)):   # a SIGKILL mid-write
            log.info("removed %d half-written temporaries a killed run left in %s", removed, self.local_dir)
        self.local = CheckpointFolder(self.local_dir, FileOps(), "local")
        self.local_parts = PartFolder(self.local_dir, FileOps(), "local")
        self.remote: CheckpointFolder | None = None       # the mirror, read from the caller's thread
        self.reads: FileOps | None = None                 # its ops: retried, each call with the deadline
        self.once: FileOps | None = None                  # one try with the deadline (never the thread's ops)
        self.stall: Stall | None = None
        self.mirror: Mirror | None = None
        self.loaded: dict[str, tuple[int, str]] = {}      # name -> (version, side) load_newest returned
        self._queued: dict[str, int] = {}                 # name -> newest version queued for the mirror
        self._pending: Future | None = None
        self._ready: threading.Event | None = None        # set once the save in flight holds its snapshot
        self._writer: BackgroundWriter | None = None
        self._staging = HostStaging()
        self.last_wait_s = 0.0                            # what the last save waited for the write before it
        self.inline_saves = 0                             # asynchronous saves serialized on the caller's thread
        self._cores = SpareCore()                         # whether the caller's loop leaves the writer a core
        if self.mirror_dir is not None:
            self._open_mirror(mirror_ops, identity is not None, retries, backoff_s, retry_interval_s, verify_mirror,
                              remount, deadline_s)

    def _open_mirror(self, mirror_ops, claimed, retries, backoff_s, retry_interval_s, verify_mirror, remount,
                     deadline_s) -> None:
        ops = mirror_ops if mirror_ops is not None else FileOps()
        if remount is None and mirror_ops is None:   # Colab's remount; a local folder elsewhere needs none
            remount = env.remount_drive if env.runtime() == "colab" else None
        deadline_s = deadline_s if deadline_s is not None else mirror_deadline()
        self.stall = Stall(self.mirror_dir, deadline_s)
        self.reads = DeadlineOps(RetryingOps(ops, Retrier(retries, backoff_s, remount), self.mirror_dir), self.stall)
        self.once = DeadlineOps(ops, self.stall)
        self.remote = CheckpointFolder(self.mirror_dir, self.reads, "mirror")
        if not self.writer:
            return
        if claimed:                               # claimed now: ForeignMirror refuses another run's folder
            try:
                claim(self.reads, self.mirror_dir, self.identity, self.local_dir)
            except MirrorStalled as exc:          # the mount stalls: warn, the thread claims it later
                warnings.warn(f"{exc}; the mirror thread claims {self.mirror_dir} for this run before its first "
                              f"copy", MirrorWarning, stacklevel=2)
        sides = Sides(self.local_parts, PartFolder(self.mirror_dir, ops, "mirror"), self.local,
                      CheckpointFolder(self.mirror_dir, ops, "mirror"))
        self.mirror = Mirror(sides, self.retention, Retrier(retries, backoff_s, remount),
                             retry_interval_s=retry_interval_s, verify_readback=verify_mirror, identity=self.identity,
                             stall_s=deadline_s)

    # ------------------------------------------------------------------------------ saving

    def save(self, objects: dict[str, Any], version: int, *, backup: bool = True, blocking: bool = True,
             backup_also: tuple[str, ...] = (), defer=()) -> Future:
        """Write each object (None: skipped) as version `version` of its name, in order; queue them (and the
        newest version of each `backup_also` name) for the mirror when `backup`; prune. The write's Future.

        The write in flight is waited for first (`last_wait_s`), its error raised here. `blocking=False`
        copies the tensors into host buffers and the containers (lists, dicts, numbers) now, and writes on
        the background thread: what is written is `objects` as they are at this call, whatever the caller
        changes next. `defer` (with `blocking=False`): tensors that only a call the caller fences changes
        (training: the optimizer's moments, behind a step pre-hook that calls `fence()`). Those on CUDA are
        copied without the caller waiting: enqueued now on their device's current stream, so every kernel
        the caller launches next (an edit through `.data` too) runs after them, and synchronized on the
        writer's thread. Those on the host are copied now like the rest: a copy made later could not tell
        an edit through `.data` or numpy, which moves no version counter, from the state of this call.
        """
        self.last_wait_s = self.wait()
        objects = {name: obj for name, obj in objects.items() if obj is not None}
        if blocking:
            future: Future = Future()
            self._write(on_host(objects, self._staging), version, backup, backup_also)
            future.set_result(None)
            return future
        where = f"{'/'.join(objects)} of {self.version_label} {version}"
        if self._cores.none_spare():
            return self._save_inline(objects, version, backup, backup_also, where)
        staged = self._staging.begin(objects)
        later = deferrable(staged, defer)
        staged.copy([key for key in staged.storages if key not in later])
        events = staged.enqueue(later)        # CUDA copies in stream order, synchronized by the writer
        snapshot = staged.build()             # views of the buffers: the deferred ones are filled before the write
        ready = self._ready = threading.Event()
        if not later:
            ready.set()

        def write() -> None:
            if later:
                try:
                    staged.synchronize(events)
                finally:
                    ready.set()
            self._write(snapshot, version, backup, backup_also)

        return self._submit(write, where)

    def _save_inline(self, objects: dict, version: int, backup: bool, backup_also, where: str) -> Future:
        """An asynchronous save when the caller leaves no core spare: serialize and hash on this thread (a sync
        save's CPU work, without the staging copy), and leave the fsyncs, renames and records, the wait for the
        disk, to the writer thread. The bytes are those of a sync save, the state the one of this call.
        """
        pending: dict = {}
        try:
            for name, obj in on_host(objects, self._staging).items():
                self._prune_local(name, coming=version)
                pending[name] = self.local.serialize(obj, name, version)
        except BaseException:
            for temporary in pending.values():
                temporary.discard()
            raise
        self.inline_saves += 1
        self._ready = None

        def write() -> None:
            try:
                self._write(dict.fromkeys(pending), version, backup, backup_also, pending)
            finally:
                for temporary in pending.values():
                    temporary.discard()           # a no-op once committed; a failed write leaves no temporary

        return self._submit(write, where)

    def _submit(self, write, where: str) -> Future:
        """Run `write` on the writer thread; its Future."""
        if self._writer is None:
            self._writer = BackgroundWriter()
        self._pending = self._writer.submit(self._cores.watch(write), f"(raised by the background write of {where})")
        return self._pending

    def fence(self) -> float:
        """Block until the save in flight holds its snapshot (its deferred copies done); the seconds waited."""
        ready = self._ready
        if ready is None or ready.is_set():
            return 0.0
        start = time.perf_counter()
        ready.wait()
        return time.perf_counter() - start

    def wait(self) -> float:
        """Block until the write in flight ended; raise its error. The seconds waited."""
        future, self._pending = self._pending, None
        if future is None:
            return 0.0
        start = time.perf_counter()
        future.result()
        return time.perf_counter() - start

    @property
    def write_seconds(self) -> list[float]:
        """What each background write took."""
        return [] if self._writer is None else list(self._writer.writes)

    @property
    def writing(self) -> bool:
        """A background write is in flight (submitted and not ended)."""
        return self._pending is not None and not self._pending.done()

    def queued(self, name: str) -> int | None:
        """The newest version of `name` queued for the mirror by this process."""
        return self._queued.get(name)

    def enqueue_newest(self, name: str) -> None:
        """Queue the newest local version of `name` for the mirror."""
        versions = self.local.versions(name)
        if versions and self.mirror is not None:
            self._queued[name] = versions[-1]
            self.mirror.enqueue(CopyCheckpoint(name, versions[-1]))

    def _write(self, objects: dict, version: int, backup: bool, backup_also, pending: dict | None = None) -> None:
        """Write each object (or commit its `pending` serialization), then queue, watch and prune."""
        for name, obj in objects.items():
            if pending is None:                   # a pending serialization made its room before it was written
                self._prune_local(name, coming=version)
            path = self.local.save(obj, name, version) if pending is None else self.local.commit(pending[name], name,
                                                                                                version)
            if self.on_saved is not None:
                self.on_saved(name, path)
            if backup and self.mirror is not None:
                self._queued[name] = version
                self.mirror.enqueue(CopyCheckpoint(name, version))
            self._prune_local(name)               # what remains once the new version is complete
        for name in backup_also if backup else ():
            if name not in objects:
                self.enqueue_newest(name)

    def _prune_local(self, name: str, coming: int | None = None) -> None:
        """Remove the local versions retention drops (`local_versions_to_drop`; with `coming`, before it is written)."""
        if self.mirror is not None and not self.prune_unmirrored:
            return                                # the mirror thread prunes once a newer version is copied
        for version in local_versions_to_drop(self.local.versions(name), self.retention.versions_kept(name),
                                              self._queued.get(name), coming):
            self.local.remove(name, version)

    # ----------------------------------------------------------------------------- loading

    def load_newest(self, name: str, timeout_s: float | None = None, map_location="cpu",
                    weights_only: bool = True) -> tuple[Loaded, str]:
        """(what loaded, 'local' | 'mirror' | 'none'): the newest local version that verifies, else the mirror's.

        The mirror is read within `timeout_s` (default: the deadline): TimeoutError or DriveError past it.
        """
        found = load_latest([self.local], name, map_location, weights_only)
        source = "local"
        if found.obj is None and self.remote is not None:
            local_damaged = found.damaged
            limit = timeout_s if timeout_s is not None else self.stall.deadline_s
            found = call_within(lambda: load_latest([self.remote], name, map_location, weights_only), limit,
                                thread_name="nblib-checkpoint-mirror-read")
            found = Loaded(found.obj, local_damaged + found.damaged, found.newest_version, found.loaded_version)
            source = "mirror"
        if found.obj is None:
            return found, "none"
        self.loaded[name] = (found.loaded_version, source)
        return found, source

    # ------------------------------------------------------------------------------ mirror

    def mirror_status(self) -> MirrorStatus:
        return self.mirror.status() if self.mirror is not None else MirrorStatus(0, 0, False, None, 0)

    def flush(self, timeout: float | None) -> bool:
        """Wait up to `timeout` s for the mirror to catch up; True when it did (or there is none)."""
        return True if self.mirror is None else self.mirror.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Join the write in flight (its error logged), flush the mirror for `timeout` s, stop both threads.

        The threads are stopped even when the wait is interrupted (KeyboardInterrupt): nothing keeps
        running after close. True when the mirror caught up (or there is none).
        """
        caught_up = True
        try:
            try:
                self.wait()
            except Exception as exc:              # the caller is already raising; do not hide that error
                log.error("the background write of a checkpoint failed: %s: %s", type(exc).__name__, exc)
            if self.mirror is not None and self.mirror.alive:
                caught_up = self.mirror.wait(timeout)
        finally:
            self._pending = None
            if self._writer is not None:
                self._writer.stop()
            if self.mirror is not None:
                self.mirror.stop()
            self._staging.release()
        return caught_up


def on_host(objects: dict, staging: HostStaging) -> dict:
    """`objects` itself when every tensor is on the CPU, else staged (what torch.save writes: host storages).

    Without an initialized CUDA context no tensor can be on a CUDA device: nothing to walk.
    """
    import torch

    from .staging import _storages_and_tensors

    if not torch.cuda.is_initialized():
        return objects
    storages, _ = _storages_and_tensors(objects, torch)
    return objects if all(s.device.type == "cpu" for s in storages.values()) else staging.stage(objects)


class SpareCore:
    """Whether a loop leaves a core spare for the writer thread: `none_spare` (at a save) looks at what the
    process's threads but the writer wanted (`thread_demand`, `no_spare_core`) since the last write ended, the
    loop unimpeded by a write (one that impedes it lowers its demand: a thread blocked on the GIL or the fence
    wants no core). A save that waited for the write before it keeps the last answer.
    """

    def __init__(self):
        self.writer: int | None = None                 # the writer thread's native id
        self.answer = False
        self.write_ended()

    def write_ended(self) -> None:
        self.clock = (time.perf_counter(), thread_demand())

    def watch(self, write):
        """`write` as the writer thread runs it: that thread left out of the demand, the clock restarted at its end."""
        def job() -> None:
            self.writer = threading.get_native_id()
            try:
                write()
            finally:
                self.write_ended()

        return job

    def none_spare(self) -> bool:
        now = (time.perf_counter(), thread_demand())
        (wall, before), self.clock = self.clock, now
        if now[0] - wall >= 0.1:
            demand = sum(ns - before.get(tid, 0) for tid, ns in now[1].items() if tid != self.writer) / 1e9
            self.answer = no_spare_core(demand, now[0] - wall)
        return self.answer


def no_spare_core(demand_s: float, wall_s: float, cores: int | None = None) -> bool:
    """Whether threads that wanted a core for `demand_s` seconds (running or waiting to run) in `wall_s` wanted
    more than `cores` - 1 by a quarter core (default: the cores this process may run on): a loop whose threads
    compute side by side (torch's intra-op threads), not one thread and its bookkeeping. A writer thread then
    takes a core from them, and such a loop pays more than the write's CPU: its threads wait for each other at
    every op, so one descheduled thread stalls them all (on this 2-core machine, a loop of matmuls on 2 threads
    ran 1.6-1.8x slower beside one busy thread; the benchmark's CPU-bound loop wanted 1.45-1.9 cores, its
    GPU-like loop none, a loop on one torch thread at most 1).
    """
    if cores is None:
        cores = env.usable_cores()
    return demand_s > (cores - 0.75) * wall_s


def thread_demand() -> dict[int, int]:
    """{native thread id: nanoseconds it ran or waited to run} of this process's threads (Linux
    /proc/self/task/*/schedstat: a thread's demand, whatever other processes took of the cores). Elsewhere, the
    process's CPU time under one id (what it ran, not what it waited).
    """
    found = {}
    try:
        for task in os.scandir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError), open(f"{task.path}/schedstat") as f:
                ran, waited = f.read().split()[:2]
                found[int(task.name)] = int(ran) + int(waited)
    except OSError:
        return {0: time.process_time_ns()}
    return found


def deferrable(staged, tensors) -> set:
    """The keys of `staged`'s CUDA storages that `tensors`, what the caller defers, hold (matched by address):
    what `Staged.enqueue` copies in stream order. Host storages are never deferred (see `save`).
    """
    by_address = {key[1:3]: key for key in staged.storages if key[0] == "cuda"}
    found = ((tensor.device.index, tensor.untyped_storage().data_ptr()) for tensor in tensors)
    return {by_address[address] for address in found if address in by_address}


def check_knobs(local: Path, mirror: Path | None, **knobs) -> None:
    """ConfigError for a mirror that is the local folder or a knob out of range (names the knob and the fix)."""
    if mirror is not None and mirror.expanduser().absolute() == local.expanduser().absolute():
        raise ConfigError(f"mirror_dir and local_dir are the same folder ({local}); point mirror_dir at Drive")
    for knob, low in (("keep_local", 0), ("keep_every", 1), ("keep_checkpoints", 1), ("retries", 0)):
        value = knobs.get(knob)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ConfigError(f"{knob}={value!r} is out of range; set it to an integer >= {low}")
    if knobs.get("backoff_s", 0) < 0:
        raise ConfigError(f"backoff_s={knobs['backoff_s']} is negative; set it to 0 or more seconds")
