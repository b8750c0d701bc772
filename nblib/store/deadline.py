"""Mirror calls with a deadline: a frozen Drive mount must not hang the caller.

A FUSE mount that stops answering (Drive after a network drop, or a FIFO in a test) blocks
open() or read() forever, in the kernel, where no timeout or signal reaches. `DeadlineOps` runs
each of the caller's mirror calls on a daemon thread and waits `deadline_s` for it; past that it
raises MirrorStalled (a DriveError) and every later call fails at once, so the run goes on from
local staging. The blocked thread is a daemon: it never keeps the process alive at exit. The
trade-off: one thread start per mirror call (~0.1 ms, nothing beside a Drive round trip), and a
mount slower than the deadline counts as stalled (NBLIB_MIRROR_DEADLINE_S, default 120 s).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nblib.errors import DriveError

from .parts import FileOps
from .retry import WrappedOps, seconds_from_env

DEADLINE_ENV = "NBLIB_MIRROR_DEADLINE_S"
DEFAULT_DEADLINE_S = 120.0


class MirrorStalled(DriveError):
    """A mirror call did not return within its deadline (a frozen mount): the mirror is left alone."""


def mirror_deadline() -> float:
    """Seconds a mirror call may block before the mirror counts as stalled: NBLIB_MIRROR_DEADLINE_S."""
    return seconds_from_env(DEADLINE_ENV, DEFAULT_DEADLINE_S, example=120, finite=True)


def call_within(fn: Callable[[], Any], timeout_s: float, what: str = "the mirror",
                thread_name: str = "nblib-mirror-call"):
    """fn() on a daemon thread, waited for `timeout_s`: its value or its exception, TimeoutError
    ("`what` did not answer within ...") past it.

    The thread may stay blocked (a frozen mount), but as a daemon it never holds the process.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread as it is
            box["error"] = exc

    thread = threading.Thread(target=run, name=thread_name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Stall:
    """Whether a mirror has stalled, and on what; shared by every DeadlineOps of one store."""

    def __init__(self, root: Path, deadline_s: float):
        self.root, self.deadline_s = Path(root), deadline_s
        self.what: str | None = None

    def error(self) -> MirrorStalled:
        return MirrorStalled(f"mirror=stalled: the mirror {self.root} did not answer within "
                             f"{self.deadline_s:g} s ({self.what}; a frozen Drive mount?); the run goes on "
                             f"from local staging, where every part is safe. Remount Drive "
                             f"(nblib.env.remount_drive()) and rerun to catch the mirror up")

    def call(self, what: str, fn: Callable[[], Any]):
        """fn() on a daemon thread, waited for `deadline_s`; MirrorStalled past it (and for every later call)."""
        if self.what is not None:
            raise self.error()
        try:
            return call_within(fn, self.deadline_s, thread_name=f"nblib-mirror-call {what}")
        except TimeoutError:
            self.what = what
            raise self.error() from None


class DeadlineOps(WrappedOps):
    """FileOps for the caller's reads of the mirror: each call bounded by the shared Stall's deadline."""

    def __init__(self, inner: FileOps, stall: Stall):
        self.inner, self.stall = inner, stall

    def _call(self, what: str, fn: Callable[[], Any]):
        return self.stall.call(what, fn)
