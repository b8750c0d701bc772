"""`python -m nblib <verb> ...` for the tests, through one of two doors that give the same result (a `CliRun`).

- `door="inprocess"` (the default; `run_nblib` is its short form): `nblib.cli.main(argv)` in the test's own
  process with its output captured, for tests that check what a run prints, its exit status and what it writes
  (click's CliRunner, pytest's runpytest_inprocess).
- `door="cold"`: a real `sys.executable -m nblib` of this checkout. A test whose point is the process itself
  (SIGKILL, SIGTERM, resume after a kill, torchrun ranks, pipes, memory caps) starts one; tests marked
  `two_doors` take a `door` argument and run once through each (conftest.py), so the two must agree.

What an in-process run sees as a fresh process would: its own stdout and stderr (warnings and nblib's log
records as the interpreter's last-resort handler prints them), the environment variables given (then the
test's again), its cwd and PYTHONPATH on `sys.path` (and no user module a run before it imported from there),
the temporary folder TMPDIR names, nblib's per-process state empty (every `functools.lru_cache` of an nblib
module, and the traced streams and warm trace servers of `PROCESS_STATE`), one torch thread per
OMP_NUM_THREADS. `SystemExit` (argparse's --help and usage errors) is its exit status, as `sys.exit(main())`
makes it; any other exception escapes to the test as it is: a traceback is a failure.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import site
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)
DOORS = ("inprocess", "cold")
# nblib's module-level state a process starts without (an lru_cache is found by itself): an in-process run gets
# an empty one of each and the test's own back after it; a warm trace server the run started is closed
# (tests/test_cli_runner.py fails when nblib holds an empty module-level container not listed here)
PROCESS_STATE = {"nblib.budget.model_vram": ("_STREAMS",), "nblib.budget.warm": ("_SERVERS", "_REFUSED"),
                 "nblib.budget.trace": ("_has_kernel",)}


class CliRun(NamedTuple):
    """What a finished run left: the fields of subprocess.CompletedProcess that the tests read."""
    returncode: int
    stdout: str
    stderr: str


def run_cli(argv, door: str = "inprocess", *, cwd=None, timeout: float | None = None,
            env: dict | None = None) -> CliRun:
    """`python -m nblib *argv` through `door` ("inprocess" or "cold"), with the variables `env` set for the run.

    timeout: seconds before a run that blocks (a read that never returns) is stopped with
    subprocess.TimeoutExpired (in-process: SIGALRM, the test's main thread; cold: the child is killed).
    """
    argv, env = [str(a) for a in argv], {k: str(v) for k, v in (env or {}).items()}
    if door == "cold":
        return _cold(argv, cwd, timeout, env)
    if door != "inprocess":
        raise ValueError(f"door={door!r}: one of {DOORS}")
    out, err = io.StringIO(), io.StringIO()
    with _as_a_process(cwd, env, err), _a_fresh_process(), _deadline(argv, timeout), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        from nblib.cli import main

        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
    return CliRun(int(code or 0), out.getvalue(), err.getvalue())


def run_nblib(*argv, cwd=None, timeout: float | None = None, **env: str) -> CliRun:
    """`run_cli(argv)` through the in-process door, the variables `env` given as keywords."""
    return run_cli(argv, cwd=cwd, timeout=timeout, env=env)


def _cold(argv: list[str], cwd, timeout: float | None, env: dict[str, str]) -> CliRun:
    """A real `python -m nblib *argv` of this checkout, the test's environment and `env` its own."""
    environ = {**os.environ, **env}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), environ.get("PYTHONPATH", ""))))
    done = subprocess.run([sys.executable, "-m", "nblib", *argv], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=timeout)
    return CliRun(done.returncode, done.stdout, done.stderr)


# where the interpreter, its libraries and this checkout live: a module from anywhere else is the user's
HOMES = tuple(os.path.join(os.path.realpath(p), "") for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, str(REPO),
                                                                *site.getsitepackages(), site.getusersitepackages()})


def _user_module(module) -> bool:
    """A module of the user's (a model file on PYTHONPATH or in the cwd): not the interpreter's, nor this checkout's."""
    file = getattr(module, "__file__", None)
    return bool(file) and not os.path.realpath(file).startswith(HOMES)


@contextlib.contextmanager
def _a_fresh_process():
    """Within: what a new `python -m nblib` has (its cwd and PYTHONPATH first on sys.path, no user module imported,
    TMPDIR read afresh, nblib's caches and PROCESS_STATE empty); after: the test's sys.path, modules and state.
    """
    path, tempdir = list(sys.path), tempfile.tempdir
    users = {name: m for name, m in list(sys.modules.items()) if _user_module(m)}
    for name in users:
        del sys.modules[name]
    pythonpath = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [os.getcwd(), *pythonpath]     # `python -m` puts the cwd first, then PYTHONPATH
    tempfile.tempdir = None                       # gettempdir() reads TMPDIR again, as a new process does
    _clear_nblib_caches()
    saved = _swap_state({})
    try:
        yield
    finally:
        warm = sys.modules.get("nblib.budget.warm")
        for server in list(getattr(warm, "_SERVERS", {}).values()):     # the run's warm trace servers die with it
            server.close()
        _swap_state(saved)
        for name in [name for name, m in list(sys.modules.items()) if _user_module(m)]:
            del sys.modules[name]
        sys.modules.update(users)
        sys.path[:] = path
        tempfile.tempdir = tempdir


def _clear_nblib_caches() -> None:
    """Empty every functools.lru_cache (and functools.cache) defined at the top of a loaded nblib module."""
    for name, module in list(sys.modules.items()):
        if name == "nblib" or name.startswith("nblib."):
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)) and getattr(value, "__module__", None) == name:
                    value.cache_clear()


def _swap_state(values: dict) -> dict:
    """Set each PROCESS_STATE name of a loaded module to `values`' (an empty one of its type where not given);
    return what they held.
    """
    held = {}
    for module, names in PROCESS_STATE.items():
        for attr in names:
            if module in sys.modules and hasattr(sys.modules[module], attr):
                held[module, attr] = getattr(sys.modules[module], attr)
                setattr(sys.modules[module], attr, values.get((module, attr), type(held[module, attr])()))
    return held


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
