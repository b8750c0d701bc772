"""Process pools whose workers die with the process that owns them, and never hold its output pipes.

A killed owner (SIGKILL, SIGTERM, a dying Colab runtime) runs no cleanup. Left alone, a
ProcessPoolExecutor's workers then wait forever on a queue whose write end they hold themselves,
the forkserver waits for them, and all of them keep the owner's stdout and stderr open, so a
`subprocess.run` or notebook cell reading that output never returns. Here each worker watches its
owner: PR_SET_PDEATHSIG (Linux; fires when the direct parent dies, which for a forkserver worker is
the forkserver) plus a watchdog thread on a pidfd of the owner (the owner's own death, whoever the
parent is; a one-second poll where pidfds do not exist), as torch's DataLoader watches its parent.
The forkserver and its resource tracker are started with stdout and stderr on /dev/null, so nothing
they fork holds the caller's pipes even for the moment before the watchdog fires. The trade-off:
a worker's own prints and warnings are not shown (results and exceptions still come back through
the pool).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from nblib.malloc import libc_call

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def pool_context():
    """The multiprocessing context for a pool: forkserver where it exists (started quietly), else spawn."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    _start_forkserver_quietly()
    return multiprocessing.get_context("forkserver")


def watch_owner(owner_pid: int) -> None:
    """Pool initializer: exit this worker as soon as `owner_pid` is gone (or the direct parent dies)."""
    libc_call("prctl", PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)   # Linux: SIGKILL when the parent dies
    if not _alive(owner_pid):
        os._exit(1)
    threading.Thread(target=_watchdog, args=(owner_pid,), name="nblib-owner-watchdog", daemon=True).start()


# ====================================================================================== helpers


def _watchdog(owner_pid: int) -> None:
    """Block until the owner exits, then end this worker at once (no cleanup: the owner is gone)."""
    import select

    try:
        fd = os.pidfd_open(owner_pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfds (old kernel, macOS): poll
        import time

        while _alive(owner_pid):
            time.sleep(1.0)
        os._exit(1)
    select.select([fd], [], [])
    os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _start_forkserver_quietly() -> None:
    """Start the forkserver (and its resource tracker) with fds 1 and 2 on /dev/null, once per process.

    A forkserver already running (started by another library) is left as it is.
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_pid is not None:
        with contextlib.suppress(ChildProcessError):
            pid, _ = os.waitpid(server._forkserver_pid, os.WNOHANG)
            if not pid:
                return  # running
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        saved = [os.dup(1), os.dup(2)]
    except OSError:  # stdout or stderr closed: nothing to protect
        forkserver.ensure_running()
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        forkserver.ensure_running()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)
