"""`python -m nblib <verb> ...` called in the test's own process: `nblib.cli.main(argv)` with its output captured.

For tests that check only what a run prints, its exit status and what it writes (click's CliRunner, pytest's
runpytest_inprocess). A test whose point is the process itself (SIGKILL, SIGTERM, resume after a kill, torchrun
ranks, pipes, the environment, memory caps) starts a real, cold `sys.executable -m nblib` instead.

What the run sees as a process would: its own stdout and stderr (warnings and nblib's log records as the
interpreter's last-resort handler prints them), the environment variables given (then the test's again), its cwd,
one torch thread per OMP_NUM_THREADS. `SystemExit` (argparse's --help and usage errors) is its exit status, as
`sys.exit(main())` makes it; any other exception escapes to the test as it is: a traceback is a failure.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import warnings
from typing import NamedTuple

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)


class CliRun(NamedTuple):
    """What a finished run left: the fields of subprocess.CompletedProcess that the tests read."""
    returncode: int
    stdout: str
    stderr: str


def run_nblib(*argv, cwd=None, timeout: float | None = None, **env: str) -> CliRun:
    """`python -m nblib *argv` in this process, with the variables `env` set for the run; (status, out, err).

    timeout: seconds before a run that blocks (a read that never returns) is stopped with
    subprocess.TimeoutExpired (SIGALRM: the test's main thread).
    """
    out, err = io.StringIO(), io.StringIO()
    with _as_a_process(cwd, env, err), _deadline(argv, timeout), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        from nblib.cli import main

        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
    return CliRun(int(code or 0), out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _deadline(argv, timeout: float | None):
    if timeout is None:
        yield
        return

    def expire(signum, frame):
        raise subprocess.TimeoutExpired(["python", "-m", "nblib", *map(str, argv)], timeout)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# what `python -m nblib` starts with (CPython's default filters, no -W, no -X dev); anything else prints once per place
PROCESS_WARNING_FILTERS = (("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, ""),
                           ("ignore", PendingDeprecationWarning, ""), ("ignore", ImportWarning, ""),
                           ("ignore", ResourceWarning, ""))


@contextlib.contextmanager
def _as_a_process(cwd, env: dict[str, str], err: io.StringIO):
    """Within: the run's environment, cwd, torch threads and last-resort printing; after: the test's again."""
    environ, here, handlers = dict(os.environ), os.getcwd(), {s: signal.getsignal(s) for s in SIGNALS}
    os.environ.update({k: str(v) for k, v in env.items()})
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    if torch is not None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    printer = logging.StreamHandler(err)           # what logging.lastResort prints where no handler is set
    printer.setLevel(logging.WARNING)
    logging.getLogger().addHandler(printer)
    try:
        if cwd is not None:
            os.chdir(cwd)
        with warnings.catch_warnings():
            warnings.resetwarnings()               # a process's own filters: a ResourceWarning of a file an earlier
            for action, category, module in PROCESS_WARNING_FILTERS:     # test left open is not the run's output
                warnings.filterwarnings(action, category=category, module=module, append=True)
            warnings.showwarning = lambda *a, **k: print(warnings.formatwarning(*a[:4]), end="", file=sys.stderr)
            yield
    finally:
        logging.getLogger().removeHandler(printer)
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
        for number, handler in handlers.items():
            signal.signal(number, handler)
        if threads is not None:
            sys.modules["torch"].set_num_threads(threads)
        elif "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS", "").isdigit():
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
