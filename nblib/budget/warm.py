"""A warm fake-CUDA process: the shim, torch and transformers loaded once; each trace runs in a fork of it.

A fresh `python -m` child per trace spends ~5 s importing torch and transformers before a second
or two of tracing, and a model's budget, its simulation and the budget widget ask for many
traces. The warm process loads them once (the shim first, as a fresh child does), then forks one
child per request. The child changes global torch state (fake CUDA, patched functions), writes
its result to a file and exits, so every trace still starts from the same clean state.

Protocol, one JSON line each way: the caller sends {"module", "payload", "cwd", "result", "log"};
the warm process forks, answers {"pid"}, waits for the child and answers {"status"}. A trace past
its time limit is killed by pid (the warm process survives it). Where fork is missing, or the
warm process cannot start or dies, `run_child` runs a fresh process as before.
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


class WarmUnavailable(RuntimeError):
    """The warm process cannot run this request; the caller runs a fresh process instead."""


def enabled() -> bool:
    return hasattr(os, "fork") and os.environ.get("NBLIB_WARM_TRACES", "1") != "0"


def run_warm(module: str, payload: dict, timeout_s: float) -> dict:
    """`module._child(payload)` in a fork of the warm process for `payload["shim"]`: its result.

    WarmUnavailable when the warm process cannot be used (the caller falls back to a fresh one);
    RuntimeError with the child's last error line when the trace itself failed.
    """
    with _LOCK:
        server = _SERVERS.get(payload.get("shim"))
        if server is None or not server.alive:
            server = _SERVERS[payload.get("shim")] = WarmProcess(payload.get("shim"))
        return server.run(module, payload, timeout_s)


class WarmProcess:
    """One warm process (a `python -c` child of this one) that forks a child per request."""

    def __init__(self, shim: str | None, start_timeout_s: float = 120.0):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
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
                pid = self._read(30.0)["pid"]
            except (OSError, KeyError, WarmUnavailable) as exc:
                self.close()
                raise WarmUnavailable(f"the warm process is gone: {exc}") from None
            try:
                status = self._read(timeout_s)["status"]
            except WarmUnavailable:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                self.close()
                raise subprocess.TimeoutExpired(module, timeout_s) from None
            if status == 0 and result.exists():
                return json.loads(result.read_text())
            lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
            raise RuntimeError(lines[-1] if lines else f"exit status {status}")

    def _read(self, timeout_s: float) -> dict:
        """The next answer line, within `timeout_s` (read unbuffered, so select sees every byte)."""
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(fd, 65536) if ready else b""
            if not chunk:
                raise WarmUnavailable("no answer from the warm process")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

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
        pid = os.fork()
        if pid == 0:
            _run_request(request)         # never returns
        _answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _answer({"status": os.waitstatus_to_exitcode(status)})


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
