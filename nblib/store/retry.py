"""Drive calls that fail and come back: retry with exponential backoff, remount on Errno 107.

`Retrier` retries a whole operation (the mirror thread's copy of one item); `RetryingOps`
retries each FileOps call the caller makes on the mirror and, when Drive stays away, raises
DriveError naming the fix. Answers such as FileNotFoundError are never retried. The trade-off:
a dead mirror costs `retries` backoffs (capped at 30 s each) before the error surfaces.
A remount runs on its own thread and is given `remount_timeout_s` (NBLIB_REMOUNT_TIMEOUT_S,
default 60 s): in Colab a remount that needs Drive to be re-authorized blocks until someone
answers, so past that it raises RemountPending and is not started again while it still blocks.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nblib.errors import ConfigError, DriveError

from .parts import FileOps

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 30.0
REMOUNT_TIMEOUT_ENV = "NBLIB_REMOUNT_TIMEOUT_S"
DEFAULT_REMOUNT_TIMEOUT_S = 60.0
REAUTHORIZE_HINT = ("Colab is probably waiting for Google Drive to be re-authorized: once this cell ends "
                    "(or after interrupting it), run nblib.env.remount_drive() and accept the prompt; "
                    "the mirror then catches up by itself, or when you rerun the same cell")
NOT_FAULTS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError)


class RemountPending(OSError):
    """A Drive remount did not return in time (most likely waiting for re-authorization)."""


class Retrier:
    """Call a function, retrying OSError with exponential backoff; remount on Errno 107."""

    def __init__(self, retries: int, backoff_s: float, remount: Callable[[], Any] | None):
        self.retries, self.backoff_s, self.remount = retries, backoff_s, remount
        self.stop = threading.Event()
        self.remount_timeout_s = seconds_from_env(REMOUNT_TIMEOUT_ENV, DEFAULT_REMOUNT_TIMEOUT_S, example=60)
        self._remounting: threading.Thread | None = None

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
                disconnected = exc.errno == errno.ENOTCONN or "Transport endpoint is not connected" in str(exc)
                if disconnected and self.remount is not None:
                    self._remount_within_timeout(exc)
                self.stop.wait(min(self.backoff_s * 2 ** attempt, MAX_BACKOFF_S))


    def _remount_within_timeout(self, cause: OSError) -> None:
        """Remount on a thread; RemountPending when it (or the one before) still blocks after the timeout."""
        if self._remounting is None or not self._remounting.is_alive():
            self._remounting = threading.Thread(target=self._remount_logged, name="nblib-drive-remount",
                                                daemon=True)
            self._remounting.start()
        deadline = time.monotonic() + self.remount_timeout_s
        while self._remounting.is_alive() and not self.stop.is_set() and time.monotonic() < deadline:
            self._remounting.join(min(0.1, max(deadline - time.monotonic(), 0.0)))
        if self._remounting.is_alive():
            raise RemountPending(errno.ENOTCONN, f"the Drive remount did not return within "
                                 f"{self.remount_timeout_s:g} s ({describe(cause)})") from cause

    def _remount_logged(self) -> None:
        try:
            self.remount()
        except Exception as exc:                 # remount trouble is one more failed attempt
            log.info("remount failed: %s", exc)


def _passed(method: str, label: str):
    """A `WrappedOps` method: `inner.<method>(path, ...)` through `_call`, labelled "<label> <path's name>"."""
    def call(self, path, *args, **kwargs):
        return self._call(f"{label} {path.name}", lambda: getattr(self.inner, method)(path, *args, **kwargs))

    call.__name__ = method
    return call


class WrappedOps(FileOps):
    """FileOps that pass every call through `self._call(label, fn)`.

    The one delegation list of the mirror's wrappers: RetryingOps retries each call,
    store.deadline.DeadlineOps bounds each call in time.
    """

    inner: FileOps

    def _call(self, what: str, fn: Callable[[], Any]):
        raise NotImplementedError

    open = _passed("open", "open")
    listdir = _passed("listdir", "list")
    stat = _passed("stat", "stat")
    read_bytes = _passed("read_bytes", "read")
    sha256 = _passed("sha256", "verify")
    load_npy = _passed("load_npy", "read")
    is_dir = _passed("is_dir", "stat")
    makedirs = _passed("makedirs", "create")
    replace = _passed("replace", "rename")
    unlink = _passed("unlink", "delete")
    rmdir = _passed("rmdir", "delete")
    fsync_dir = _passed("fsync_dir", "sync")
    load_torch = _passed("load_torch", "read")
    create_exclusive = _passed("create_exclusive", "create")

    def write_atomic(self, path, blocks, expect_digest=None, *, algorithm="sha256"):
        blocks = list(blocks)
        return self._call(f"write {path.name}",
                          lambda: self.inner.write_atomic(path, blocks, expect_digest, algorithm=algorithm))


class RetryingOps(WrappedOps):
    """Mirror FileOps for the caller's reads: each call retried, then DriveError with the fix."""

    def __init__(self, inner: FileOps, retrier: Retrier, root: Path):
        self.inner, self.retrier, self.root = inner, retrier, root

    def _call(self, what: str, fn: Callable[[], Any]):
        try:
            return self.retrier.call(fn, what, passes=NOT_FAULTS)
        except NOT_FAULTS:
            raise
        except RemountPending as exc:
            raise DriveError(f"the mirror {self.root} is paused: {exc.strerror}; {REAUTHORIZE_HINT}, "
                             f"or open the store with mirror_dir=None to use local staging only") from None
        except OSError as exc:
            raise DriveError(
                f"the mirror {self.root} is unreachable ({what}: {describe(exc)}, "
                f"{self.retrier.retries + 1} attempts); remount Drive (nblib.env.remount_drive()) and "
                f"retry, or open the store with mirror_dir=None to use local staging only") from None


def seconds_from_env(name: str, default: float, *, example: float, finite: bool = False) -> float:
    """A positive number of seconds from the environment variable `name` (unset or empty: `default`).

    ConfigError naming the variable and the fix otherwise; `finite` refuses inf as well.
    """
    raw = os.environ.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = -1.0
    if not (0 < value < float("inf") if finite else value > 0):
        raise ConfigError(f"{name}={raw!r} is not a positive number of seconds; "
                          f"unset it (default {default:g} s) or set it to e.g. {example:g}")
    return value


def describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"[Errno {exc.errno}] {exc.strerror or os.strerror(exc.errno)}"
    return f"{type(exc).__name__}: {exc}"
