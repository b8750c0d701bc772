"""Lock a folder against a second writer: one lock file per rank, all ranks under one run identity.

A writer creates `.lock-rank-<r>` in the folder with O_CREAT|O_EXCL and writes into it its pid,
host, boot id, start time, rank and run identity. A second writer is refused with `FolderBusyError`,
which names the holder's pid and host. Ranks of one `torchrun` launch share a run identity (the
caller's fingerprint plus the launch id from the environment), so they coexist; a lock file of
another identity, at any rank, refuses the folder. A lock whose holder died is taken over: on
the holder's host its pid is checked (os.kill(pid, 0) plus the process start time, so a reused
pid does not count); from another host, a lock whose heartbeat (the file's mtime, touched by a
thread every `stale_after_s / 4`) is older than `stale_after_s`. Trade-off: a holder on another
host that stops beating for `stale_after_s` while alive (a frozen VM) loses its lock; `check()`
at each commit then stops it instead of letting two writers mix their files.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from nblib.atomic import fsync_dir
from nblib.errors import FolderBusyError, LockLostError
from nblib.units import fmt_duration

__all__ = [
    "ATTEMPTS", "LOCK_PREFIX", "READ_RETRIES", "STALE_AFTER_S", "TAKEOVER_GRACE_S", "TAKEOVER_SUFFIX",
    "UNWRITTEN_GRACE_S", "FolderBusyError", "FolderLock", "LockHolder", "LockLostError", "is_stale", "launch_id",
    "read_holders", "run_identity",
]

LOCK_PREFIX = ".lock-rank-"
STALE_AFTER_S = 600.0      # a lock from another host without a heartbeat for this long is taken over
UNWRITTEN_GRACE_S = 10.0   # a lock file still empty this long after its creation is a crashed creator's
READ_RETRIES = 40          # reads of a lock file caught between its creation and its content (x 25 ms)
ATTEMPTS = 200             # rounds of take-over-then-create before giving up
TAKEOVER_SUFFIX = ".takeover"  # the short-lived mutex takers of a stale lock serialize on
TAKEOVER_GRACE_S = 5.0     # a take-over mutex older than this was left by a taker that died


@dataclass(frozen=True)
class LockHolder:
    """What one lock file says about its holder, plus the file's stat (for staleness and take-over)."""

    path: Path
    pid: int
    host: str
    boot_id: str
    pid_start: str | None   # the holder's start time in /proc (clock ticks since boot), to spot a reused pid
    started: float          # time.time() when it took the lock
    identity: str
    rank: int
    token: str
    mtime: float            # the last heartbeat
    inode: int
    readable: bool = True   # False: the file is empty or torn (caught mid-creation, or its creator died)

    def describe(self) -> str:
        if not self.readable:
            return f"an unreadable lock file {self.path.name} (being created, or left by a crash)"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (f"pid {self.pid} on host {self.host} (rank {self.rank}, started {when}, last heartbeat "
                f"{fmt_duration(max(0.0, time.time() - self.mtime))} ago, run {self.identity})")


def launch_id(environ: dict | None = None) -> str:
    """The id one launch shares across its ranks: torchrun's run id and rendezvous address, else this process."""
    env = os.environ if environ is None else environ
    parts = [env[k] for k in ("TORCHELASTIC_RUN_ID",) if env.get(k)]
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        parts.append(f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}")
    return "/".join(parts) if parts else f"{socket.gethostname()}:{os.getpid()}"


def run_identity(fingerprint: str, environ: dict | None = None) -> str:
    """A run's lock identity: what it computes (`fingerprint`) and which launch computes it."""
    return f"{fingerprint}@{launch_id(environ)}"


def read_holders(folder: str | Path) -> list[LockHolder]:
    """Every lock file in `folder`, as its holder describes itself (ranks in order)."""
    return [holder for path in sorted(Path(folder).glob(f"{LOCK_PREFIX}*"))
            if path.name[len(LOCK_PREFIX):].isdigit() and (holder := _read_holder(path)) is not None]


def is_stale(holder: LockHolder, stale_after_s: float = STALE_AFTER_S) -> bool:
    """True when the holder is gone: a dead (or reused) pid on this host, else no heartbeat for long."""
    age = time.time() - holder.mtime
    if not holder.readable:
        return age > UNWRITTEN_GRACE_S
    if holder.host == socket.gethostname():
        if holder.boot_id and holder.boot_id != _boot_id():
            return True  # this host rebooted since: every process of that boot is gone
        return not _pid_alive(holder.pid, holder.pid_start)
    return age > stale_after_s


class FolderLock:
    """The lock of one rank of one run on `folder`; a context manager, released at exit too.

    `identity` is the run's (`run_identity(fingerprint)`): ranks of the same identity share the
    folder, any other identity is refused with `FolderBusyError`. `what` and `hint` word the refusal
    ("cache folder", "use another --out"). With `read_only_ok`, a folder on a read-only file system
    is entered without a lock (`read_only` is then True): nobody can write it through this mount,
    and any write the caller tries fails with EROFS on its own.
    """

    def __init__(self, folder: str | Path, *, identity: str, rank: int = 0, what: str = "folder",
                 hint: str = "use another folder", stale_after_s: float = STALE_AFTER_S,
                 read_only_ok: bool = False):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank={rank!r} must be an integer >= 0")
        self.folder = Path(folder)
        self.path = self.folder / f"{LOCK_PREFIX}{rank}"
        self.identity, self.rank, self.what, self.hint = identity, rank, what, hint
        self.stale_after_s, self.read_only_ok, self.read_only = stale_after_s, read_only_ok, False
        self.token = uuid.uuid4().hex
        self.taken_over: list[LockHolder] = []   # stale holders this lock replaced
        self._pid: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._pid == os.getpid()

    def acquire(self) -> FolderLock:
        """Take the lock, taking over stale ones; FolderBusyError when a live run of another identity holds it."""
        if self.held:
            return self
        try:
            taken = self._take()
        except OSError as exc:
            if exc.errno == errno.EROFS and self.read_only_ok:
                self.read_only = True
                return self
            raise
        if taken:
            self._pid = os.getpid()
            atexit.register(self.release)
            self._stop.clear()
            self._beat = threading.Thread(target=self._heartbeat, name="nblib-lock-heartbeat", daemon=True)
            self._beat.start()
            return self
        raise FolderBusyError(f"could not lock the {self.what} {self.folder}: its lock file {self.path.name} "
                              f"changed hands {ATTEMPTS} times while this run tried to take it; rerun "
                              f"when the other runs have finished, or {self.hint}")

    def release(self) -> None:
        """Remove this rank's lock file (only if it is still ours); safe to call twice."""
        if not self.held:
            return
        self._pid = None
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        atexit.unregister(self.release)
        self._remove_own_file()

    def check(self) -> None:
        """LockLostError unless this rank's lock file is still this lock's: call it before each commit."""
        if self.read_only:
            return
        if not self.held:
            raise LockLostError(f"the lock on the {self.what} {self.folder} is not held; take it (with "
                           f"FolderLock(...)) before writing")
        holder = _read_holder(self.path)
        if holder is None or holder.token != self.token:
            now = "removed" if holder is None else f"taken by {holder.describe()}"
            raise LockLostError(f"the lock {self.path} of this run (pid {os.getpid()}) was {now} while it "
                           f"was writing; stopped so that two runs do not mix their files: let the "
                           f"other run finish, then rerun this one to resume")

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    # ---------------------------------------------------------------------------------- helpers

    def _take(self) -> bool:
        """Create this rank's lock file, taking over stale ones; False when it kept changing hands."""
        for _ in range(ATTEMPTS):
            self._refuse_other_runs()
            if not self._create():
                holder = _read_holder(self.path)
                if holder is not None and not self._take_over_if_stale(holder):
                    raise self._busy(holder)
                continue
            try:
                self._refuse_other_runs()  # another launch may have locked another rank meanwhile
            except BaseException:
                self._remove_own_file()
                raise
            return True
        return False

    def _create(self) -> bool:
        """Create this rank's lock file exclusively and write the holder record; False if it exists."""
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        stat = _proc_stat(os.getpid())
        record = {"pid": os.getpid(), "host": socket.gethostname(), "boot_id": _boot_id(),
                  "pid_start": stat[1] if stat else None, "started": time.time(),
                  "identity": self.identity, "rank": self.rank, "token": self.token}
        try:
            os.write(fd, json.dumps(record, sort_keys=True).encode())
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        return True

    def _refuse_other_runs(self) -> None:
        """FolderBusyError if a live run of another identity holds any rank; stale ones are taken over."""
        for holder in read_holders(self.folder):
            if holder.path == self.path or (holder.readable and holder.identity == self.identity):
                continue
            if not self._take_over_if_stale(holder):
                raise self._busy(holder)

    def _take_over_if_stale(self, holder: LockHolder) -> bool:
        """Remove a stale holder's file (only that very file); False if the holder is alive.

        Takers serialize on a short-lived `<lock>.takeover` file (O_EXCL): under it, the lock file
        is read again and removed only if it is still the stale holder's, so a live lock that
        another taker created meanwhile is never removed (a rename-then-check would move it away).
        """
        if not is_stale(holder, self.stale_after_s):
            return False
        mutex = holder.path.with_name(holder.path.name + TAKEOVER_SUFFIX)
        if not _acquire_takeover(mutex):
            return True  # another taker is at it; the caller looks again
        try:
            current = _read_holder(holder.path)
            if current is None:
                return True  # removed already; the caller creates its own
            if (current.token, current.inode) != (holder.token, holder.inode):
                return True  # replaced meanwhile: the caller judges the new holder
            holder.path.unlink(missing_ok=True)
            fsync_dir(holder.path.parent)
            self.taken_over.append(holder)
            return True
        finally:
            mutex.unlink(missing_ok=True)

    def _busy(self, holder: LockHolder) -> FolderBusyError:
        mine = holder.readable and holder.pid == os.getpid() and holder.host == socket.gethostname()
        who = "this very process (an unfinished call still holds it)" if mine else holder.describe()
        return FolderBusyError(
            f"the {self.what} {self.folder} is in use by another run: {who}; wait for it to finish, or "
            f"{self.hint}. A lock whose process is gone is taken over automatically (on another host "
            f"after {fmt_duration(self.stale_after_s)} without a heartbeat): {holder.path}")

    def _remove_own_file(self) -> None:
        holder = _read_holder(self.path)
        if holder is not None and holder.token == self.token:
            self.path.unlink(missing_ok=True)

    def _heartbeat(self) -> None:
        """Touch the lock file every stale_after_s / 4 while it is ours (its mtime is the heartbeat)."""
        while not self._stop.wait(self.stale_after_s / 4):
            holder = _read_holder(self.path)
            if holder is None or holder.token != self.token:
                return  # lost: check() reports it at the next commit
            with contextlib.suppress(OSError):  # a mount hiccup; the next beat tries again
                os.utime(self.path)


# ====================================================================================== helpers


def _read_holder(path: Path) -> LockHolder | None:
    """The holder a lock file names (retrying a file caught mid-creation); None if there is none."""
    for attempt in range(READ_RETRIES):
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                raw = f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            r = json.loads(raw)
            return LockHolder(path=path, pid=int(r["pid"]), host=str(r["host"]), boot_id=str(r.get("boot_id", "")),
                              pid_start=r.get("pid_start"), started=float(r["started"]),
                              identity=str(r["identity"]), rank=int(r["rank"]), token=str(r["token"]),
                              mtime=st.st_mtime, inode=st.st_ino)
        except (ValueError, KeyError, TypeError):
            if time.time() - st.st_mtime > UNWRITTEN_GRACE_S or attempt == READ_RETRIES - 1:
                return LockHolder(path=path, pid=0, host="?", boot_id="", pid_start=None, started=0.0,
                                  identity="?", rank=-1, token="", mtime=st.st_mtime, inode=st.st_ino,
                                  readable=False)
            time.sleep(0.025)
    return None


def _acquire_takeover(mutex: Path) -> bool:
    """Create the take-over mutex exclusively; one left by a taker that died is removed after a grace."""
    try:
        os.close(os.open(mutex, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        with contextlib.suppress(FileNotFoundError):
            if time.time() - mutex.stat().st_mtime > TAKEOVER_GRACE_S:
                mutex.unlink(missing_ok=True)
        time.sleep(0.01)
        return False


def _pid_alive(pid: int, pid_start: str | None) -> bool:
    """True when `pid` runs on this host and is the process that took the lock (not a reuse, not a zombie)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    stat = _proc_stat(pid)
    if stat is None:
        return True  # no /proc here: trust os.kill
    state, start = stat
    return state not in ("Z", "X") and (pid_start is None or start == pid_start)


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) from /proc/<pid>/stat, or None without /proc."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime 22
    return fields[0], fields[19]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
