"""Drive calls that fail and come back: retry with exponential backoff, remount on Errno 107.

`Retrier` retries a whole operation (the mirror thread's copy of one item); `RetryingOps`
retries each FileOps call the caller makes on the mirror and, when Drive stays away, raises
DriveError naming the fix. Answers such as FileNotFoundError are never retried. The trade-off:
a dead mirror costs `retries` backoffs (capped at 30 s each) before the error surfaces.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nblib.errors import DriveError

from .parts import FileOps

log = logging.getLogger("nblib.store")
MAX_BACKOFF_S = 30.0
NOT_FAULTS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError)


class Retrier:
    """Call a function, retrying OSError with exponential backoff; remount on Errno 107."""

    def __init__(self, retries: int, backoff_s: float, remount: Callable[[], Any] | None,
                 stop: threading.Event | None = None):
        self.retries, self.backoff_s, self.remount = retries, backoff_s, remount
        self.stop = stop if stop is not None else threading.Event()

    def call(self, fn: Callable[[], Any], what: str, passes: tuple = ()):
        """fn(), retried; the last OSError is raised. `passes` are answers, not faults: never retried."""
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except passes:
                raise
            except OSError as exc:
                if attempt == self.retries or self.stop.is_set():
                    raise
                log.info("%s: %s (attempt %d of %d)", what, describe(exc), attempt + 1, self.retries + 1)
                if is_disconnected(exc) and self.remount is not None:
                    try:
                        self.remount()
                    except Exception as remount_exc:  # remount trouble is one more failed attempt
                        log.info("remount failed: %s", remount_exc)
                self.stop.wait(min(self.backoff_s * 2 ** attempt, MAX_BACKOFF_S))


class RetryingOps(FileOps):
    """Mirror FileOps for the caller's reads: each call retried, then DriveError with the fix."""

    def __init__(self, inner: FileOps, retrier: Retrier, root: Path):
        self.inner, self.retrier, self.root = inner, retrier, root

    def _call(self, what: str, fn: Callable[[], Any]):
        try:
            return self.retrier.call(fn, what, passes=NOT_FAULTS)
        except NOT_FAULTS:
            raise
        except OSError as exc:
            raise DriveError(
                f"the mirror {self.root} is unreachable ({what}: {describe(exc)}, "
                f"{self.retrier.retries + 1} attempts); remount Drive (nblib.env.remount_drive()) and "
                f"retry, or open the store with mirror_dir=None to use local staging only") from None

    def open(self, path, mode="rb"):
        return self._call(f"open {path.name}", lambda: self.inner.open(path, mode))

    def listdir(self, path):
        return self._call(f"list {path.name}", lambda: self.inner.listdir(path))

    def stat(self, path):
        return self._call(f"stat {path.name}", lambda: self.inner.stat(path))

    def read_bytes(self, path):
        return self._call(f"read {path.name}", lambda: self.inner.read_bytes(path))

    def sha256(self, path):
        return self._call(f"verify {path.name}", lambda: self.inner.sha256(path))

    def load_npy(self, path, mmap):
        return self._call(f"read {path.name}", lambda: self.inner.load_npy(path, mmap))

    def is_dir(self, path):
        return self._call(f"stat {path.name}", lambda: self.inner.is_dir(path))

    def makedirs(self, path):
        return self._call(f"create {path.name}", lambda: self.inner.makedirs(path))

    def replace(self, src, dst):
        return self._call(f"rename {src.name}", lambda: self.inner.replace(src, dst))

    def unlink(self, path):
        return self._call(f"delete {path.name}", lambda: self.inner.unlink(path))

    def rmdir(self, path):
        return self._call(f"delete {path.name}", lambda: self.inner.rmdir(path))

    def fsync_dir(self, path):
        return self._call(f"sync {path.name}", lambda: self.inner.fsync_dir(path))

    def write_atomic(self, path, blocks, expect_sha256=None):
        blocks = list(blocks)
        return self._call(f"write {path.name}", lambda: self.inner.write_atomic(path, blocks, expect_sha256))


def is_disconnected(exc: OSError) -> bool:
    return exc.errno == errno.ENOTCONN or "Transport endpoint is not connected" in str(exc)


def describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"[Errno {exc.errno}] {exc.strerror or os.strerror(exc.errno)}"
    return f"{type(exc).__name__}: {exc}"
