"""A warm fake-CUDA process: the shim, torch and transformers loaded once; each trace runs in a fork of it.

A fresh `python -m` child per trace spends ~5 s importing torch and transformers before a second or two
of tracing, and a model's budget and its simulation ask for many traces (one per job and process:
model_vram replays a traced job's further batches itself). The warm process loads them once (the shim
first, as a fresh child does), then forks one child per request. The child changes global torch state
(fake CUDA, patched functions), writes its result to a file and exits, so every trace still starts from
the same clean state.

Protocol, one JSON line each way: the caller sends {"module", "payload", "cwd", "result", "log"};
the warm process forks, answers {"pid"}, lets the child start, waits for it and answers {"status"}. A trace
past its time limit is killed by pid (the warm process survives it). Where fork is missing, or the warm
process cannot start or dies before it answers a pid (its child then exits unstarted), `run_child` runs a
fresh process as before.
It forks only while it holds one thread (a fork copies no other thread, so a lock one held would
stay locked in the child): with more it refuses, and this process runs fresh ones from then on.
Fail closed: a warm process that ends while a trace runs (after it answered the trace's pid) is an
error, and the trace is killed: never a result, a status of 0 or a silent second run.
A fork sees the environment the warm process started with: a caller whose variables that shape a trace
(shim.traced_environment: a PYTHONPATH set since, an NBLIB_ variable) differ gets a new warm process started under
its own, so a warm trace is the trace a fresh process would make.
Trade-off: the warm process holds ~0.5 GB of RSS for as long as the caller lives; it exits when
the caller closes its pipe (or dies), and `NBLIB_WARM_TRACES=0` turns it off.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_LOCK = threading.Lock()
_SERVERS: dict[str | None, WarmProcess] = {}


_REFUSED: set[str | None] = set()         # shims whose warm process would not fork: fresh processes only


class WarmUnavailable(RuntimeError):
    """The warm process cannot run this request; the caller runs a fresh process instead."""


class WarmRefused(WarmUnavailable):
    """The warm process would not fork (it held more than one thread); nothing ran."""


class _NoAnswerYet(Exception):
    """The warm process is alive but sent no whole line within the time given."""


def enabled() -> bool:
    return hasattr(os, "fork") and os.environ.get("NBLIB_WARM_TRACES", "1") != "0"


def run_warm(module: str, payload: dict, timeout_s: float, traced_env: dict | None = None) -> dict:
    """`module._child(payload)` in a fork of the warm process for `payload["shim"]`: its result.

    `traced_env`: the caller's variables that shape a trace (shim.traced_environment); a fork inherits the warm
    process's, so one started under others (a PYTHONPATH or NBLIB_ variable set since) is replaced by a new one.

    WarmUnavailable when the warm process cannot be used (the caller falls back to a fresh one);
    RuntimeError with the child's last error line when the trace itself failed.
    """
    shim = payload.get("shim")
    with _LOCK:
        if shim in _REFUSED:
            raise WarmUnavailable("the warm process held more than one thread: it does not fork")
        server = _SERVERS.get(shim)
        if server is not None and (not server.alive or server.traced_env != traced_env):
            server.close()
            server = None
        if server is None:
            server = _SERVERS[shim] = WarmProcess(shim, traced_env)
        try:
            return server.run(module, payload, timeout_s)
        except WarmRefused:
            _REFUSED.add(shim)
            raise


class WarmProcess:
    """One warm process (a `python -c` child of this one) that forks a child per request."""

    def __init__(self, shim: str | None, traced_env: dict | None = None, start_timeout_s: float = 120.0):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.traced_env = traced_env          # the caller's traced variables at start: what every fork sees
        code = f"from nblib.budget.warm import serve; serve({shim!r})"
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, env=env)
        except OSError as exc:
            raise WarmUnavailable(f"cannot start the warm process: {exc}") from None
        self._buffer = b""
        if self._read(start_timeout_s).get("ready") is not True:
            self.close()
            raise WarmUnavailable("the warm process did not start")
        atexit.register(self.close)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, module: str, payload: dict, timeout_s: float) -> dict:
        with tempfile.TemporaryDirectory(prefix="nblib-warm-") as tmp:
            result, log = Path(tmp) / "result.json", Path(tmp) / "log.txt"
            request = {"module": module, "payload": payload, "cwd": os.getcwd(), "result": str(result),
                       "log": str(log)}
            try:
                self.proc.stdin.write(json.dumps(request).encode() + b"\n")
                self.proc.stdin.flush()
                answer = self._read(30.0)
            except (OSError, ValueError, WarmUnavailable, _NoAnswerYet) as exc:
                self.close()
                raise WarmUnavailable(f"the warm process is gone: {exc}") from None
            if type(answer.get("pid")) is not int or answer["pid"] <= 0:   # it did not fork: nothing runs
                self.close()
                raise WarmRefused(answer.get("refused") or f"the warm process answered {answer}")
            pid = answer["pid"]
            try:
                status = self._read(timeout_s)["status"]
            except _NoAnswerYet:
                self._kill(pid)
                raise subprocess.TimeoutExpired(module, timeout_s) from None
            except (WarmUnavailable, KeyError, ValueError) as exc:    # it ended (or garbled) mid-trace
                self._kill(pid)
                raise RuntimeError(f"the warm process ended while the trace ran (pid {pid}, killed): {exc}") \
                    from None
            if type(status) is not int:
                self._kill(pid)
                raise RuntimeError(f"the warm process answered {status!r} for the trace's exit status")
            if status == 0 and result.exists():
                return json.loads(result.read_text())
            lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
            raise RuntimeError(lines[-1] if lines else f"exit status {status}")

    def _read(self, timeout_s: float) -> dict:
        """The next answer line, within `timeout_s` (read unbuffered, so select sees every byte).

        _NoAnswerYet past the time; WarmUnavailable when the warm process closed its end (it ended).
        """
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise _NoAnswerYet(f"no answer from the warm process in {timeout_s:g} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise WarmUnavailable(f"the warm process ended (exit status {self.proc.poll()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _kill(self, pid: int) -> None:
        """Kill the trace `pid` and close the warm process (a later request starts a new one)."""
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------- the warm process
def serve(shim: str | None) -> None:
    """In the warm process: load the shim, torch and transformers, then fork a child per request line."""
    import ctypes
    import importlib

    if shim:
        ctypes.CDLL(shim)                 # before torch: its CUDA hooks are chosen when torch starts
    import torch  # noqa: F401
    try:
        import transformers.modeling_utils  # noqa: F401
    except ImportError:
        pass
    importlib.import_module("nblib.budget.trace")
    _answer({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        threads = _thread_count()
        if threads != 1:
            _answer({"refused": f"the warm process holds {threads} threads, and a fork copies only one"})
            continue
        go, told = os.pipe()              # the child starts once its pid is answered: never a trace the caller
        pid = os.fork()                   # cannot name (a warm process killed in between left one running)
        if pid == 0:
            os.close(told)
            if not os.read(go, 1):        # the warm process ended before it answered: nothing runs
                os._exit(1)
            _run_request(request)         # never returns
        os.close(go)
        _answer({"pid": pid})
        os.write(told, b"1")
        os.close(told)
        _, status = os.waitpid(pid, 0)
        _answer({"status": os.waitstatus_to_exitcode(status)})


def _thread_count() -> int:
    """This process's threads, native ones included (/proc), else the Python ones."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _run_request(request: dict) -> None:
    """In the forked child: run the module's `_child`, write its result, exit without cleanup."""
    import importlib
    import traceback

    code = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log, 1)                   # prints must not reach the protocol pipe
        os.dup2(log, 2)
        os.chdir(request["cwd"])
        out = importlib.import_module(request["module"])._child(request["payload"])
        staged = request["result"] + ".tmp"
        Path(staged).write_text(json.dumps(out))
        os.replace(staged, request["result"])
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
