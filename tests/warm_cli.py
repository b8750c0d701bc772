"""`python -m nblib ...` subprocesses of the tests, forked from a warm interpreter that has torch imported.

Why: the suite starts about 300 CLI processes (encode, train, cache, export...), and a fresh `train` spent
about 4 CPU seconds importing torch and torch._dynamo (the optimizer's first `add_param_group` imports it) and
tearing them down at exit. With the installed bytecode, the suite took 1,337 CPU-s cold and 1,124 warm.

What stays real: each run is its own process, forked (not exec'd) from a server process that imported torch,
torch._dynamo and numpy and nothing of nblib. It gets the test's argv, environment (os.environ replaced), cwd,
stdin/stdout/stderr (the file descriptors themselves, passed over a Unix socket), its own session when asked
(`start_new_session=True`, so `os.killpg` reaches it and its workers), its own pid, and it is SIGKILLed,
SIGTERMed and waited for like any child: `subprocess.Popen` and `subprocess.run` are unchanged for the test,
which cannot tell. It imports nblib itself and leaves through the interpreter's normal exit (threads joined,
atexit run, uncaught exceptions printed, SIGINT status after a KeyboardInterrupt); only the final teardown of
its modules is skipped (0.9 s with torch loaded; it prints nothing).

What differs from a fresh interpreter, and how that is kept small:
- modules imported before the fork: torch, torch._dynamo, numpy (never nblib); a run whose environment
  differs from the server's in a variable those read at import (OMP_*, MKL_*, TORCH*, PYTHON*...) starts cold;
- the string-hash seed is the server's: two servers with different seeds take turns, so a run and its
  resume still hash strings differently (a resume that depended on set order would still show);
- the server must hold one thread when it forks (checked; otherwise the run starts cold).

Only `[sys.executable, "-m", "nblib", ...]` goes warm; everything else (torchrun, kernels, `-c` scripts,
nblib's own measuring subprocesses, which must start fresh to measure RSS) runs as before.
`NBLIB_TEST_WARM_CLI=0` starts every run cold.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

PRELOAD = ("torch", "torch._dynamo", "numpy")
SERVERS = 2                                    # hash seeds that take turns
# variables read when the preloaded modules are imported: a run that sets them differently starts cold
IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH", "CUDA_", "LD_", "PYTHON", "TF_",
                        "MALLOC_")
RUN_TIME_OK = ("PYTHONPATH", "PYTHONUNBUFFERED")
WARM_MODULES = ("nblib",)                      # `python -m <one of these> ...` goes warm
ENABLED = os.environ.get("NBLIB_TEST_WARM_CLI", "1") != "0" and hasattr(socket, "send_fds")
HEADER = struct.Struct("!I")


# ------------------------------------------------------------------------------------- the server


def serve(path: str, parent: int) -> dict | None:
    """Accept run requests on the Unix socket `path`; fork one process per request; report its exit status.

    Returns in a forked child only (with its request, its file descriptors already in place); the server
    itself returns None when the test process that started it is gone.
    """
    for name in PRELOAD:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}     # pid -> the connection its exit status goes to
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)                         # the test stopped reading; a child gets its own stdout anyway
    os.close(devnull)
    while os.getppid() == parent:
        for _ in selector.select(timeout=0.02):
            conn, _ = listener.accept()
            request, fds = _receive(conn)
            if len(os.listdir("/proc/self/task")) != 1:
                conn.sendall(b"cold\n")             # a thread would be copied half-way: never fork then
                conn.close()
                for fd in fds:
                    os.close(fd)
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                for other in (listener, *waiting.values()):
                    other.close()
                selector.close()
                _enter(request, fds, conn)
                return request
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{status}\n".encode())
                except OSError:
                    pass                            # the test gave up on it
                conn.close()
    with contextlib.suppress(OSError):
        os.unlink(path)
    return None


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
    (size,) = HEADER.unpack(head)
    body = b""
    while len(body) < size:
        body += conn.recv(size - len(body))
    return json.loads(body), list(fds)


def _enter(request: dict, fds: list[int], conn: socket.socket) -> None:
    """In the forked child: become the requested process (session, stdio, cwd, environment, sys.path, argv)."""
    conn.close()
    if request["new_session"]:
        os.setsid()
    elif request["process_group"] >= 0:
        os.setpgid(0, request["process_group"])
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    if request["cwd"] is not None:
        os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *entries, *request["base_path"]]
    import importlib

    importlib.invalidate_caches()
    _run_sitecustomize()
    import numpy

    numpy.random.seed()                         # a fresh process seeds it from the OS (random reseeds at fork)
    sys.argv = ["-m", *request["argv"][3:]]


def _run_sitecustomize() -> None:
    """What the interpreter's start-up does with a `sitecustomize` on the run's sys.path (site.py): import it.

    The server imported its own at its start (if any); one the run's PYTHONPATH brings (a test's injected
    failure, for example) is imported here, as a fresh process would.
    """
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("sitecustomize", sys.path)
    had = sys.modules.get("sitecustomize")
    if spec is None or (had is not None and getattr(had, "__file__", None) == spec.origin):
        return
    sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401
    except Exception as err:                    # site.execsitecustomize's own words
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(err).__name__}: {err}",
              file=sys.stderr)


def run_child(request: dict) -> None:
    """`python -m nblib ...` in this (forked) process, then the interpreter's exit without its module teardown.

    As the interpreter does for -m: runpy; an uncaught exception printed by sys.excepthook (status 1), a
    SystemExit's code (a string printed, status 1), a KeyboardInterrupt printed and then SIGINT's own status;
    then non-daemon threads joined and atexit run, stdio flushed. Not done: tearing down the modules
    (0.9 s with torch loaded, and no output of its own).
    """
    import runpy
    import signal

    status, interrupted = 0, False
    try:
        runpy.run_module(request["argv"][2], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None:
            status = 0
        elif isinstance(e.code, int):
            status = e.code & 0xFF
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    threading._shutdown()                       # what the interpreter's exit does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


# ------------------------------------------------------------------------------------- the client


class _Servers:
    """This test process's warm servers, started on first use; None when they cannot start."""

    def __init__(self):
        self.lock = threading.Lock()
        self.paths: list[str] | None = None
        self.env: dict[str, str] = {}
        self.base_path: list[str] = []
        self.turn = 0
        self.failed = False

    def next_path(self) -> str | None:
        with self.lock:
            if self.paths is None and not self.failed:
                self._start()
            if not self.paths:
                return None
            self.turn += 1
            return self.paths[self.turn % len(self.paths)]

    def _start(self) -> None:
        folder = tempfile.mkdtemp(prefix="nblib-warm-")
        atexit.register(shutil.rmtree, folder, True)
        here = str(Path(__file__).resolve())
        env = dict(os.environ)
        repo = str(Path(here).parents[1])
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        self.env = env
        started = []
        for i in range(SERVERS):
            path = os.path.join(folder, f"s{i}")
            # in the test process's own process group, as a cold child is (a Ctrl-C reaches both alike)
            process = _COLD_POPEN([sys.executable, here, "serve", path, str(os.getpid())], env=env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=None)
            started.append((path, process))
        paths = []
        for path, process in started:
            if process.stdout.readline().strip() == b"ready":
                paths.append(path)
            process.stdout.close()
        # what a fresh `python -m` puts after the cwd and PYTHONPATH: the interpreter's own entries
        fresh = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path[1:]))"],
                               env={k: v for k, v in env.items() if k != "PYTHONPATH"}, capture_output=True,
                               text=True, check=True)
        self.base_path = json.loads(fresh.stdout)
        self.paths = paths
        self.failed = not paths


_SERVERS = _Servers()
_COLD_POPEN = subprocess.Popen
_COLD_EXECUTE = subprocess.Popen._execute_child
_COLD_POLL = subprocess.Popen._internal_poll
_COLD_TRY_WAIT = subprocess.Popen._try_wait


def warm_argv(args, executable, shell, preexec_fn, pass_fds, close_fds, gid, gids, uid, umask) -> list[str] | None:
    """The argv of a plain `python -m nblib ...` the warm server can run exactly as exec would, else None."""
    if not ENABLED or shell or executable is not None or preexec_fn is not None or pass_fds or not close_fds:
        return None
    if gid is not None or gids is not None or uid is not None or umask >= 0:
        return None
    if not isinstance(args, (list, tuple)) or len(args) < 3 or not all(isinstance(a, (str, os.PathLike))
                                                                     for a in args):
        return None
    argv = [os.fspath(a) for a in args]
    if not all(isinstance(a, str) for a in argv):
        return None
    return argv if argv[0] == sys.executable and argv[1] == "-m" and argv[2] in WARM_MODULES else None


def _same_import_time_env(env: dict[str, str], server_env: dict[str, str]) -> bool:
    def relevant(e):
        return {k: v for k, v in e.items() if k.startswith(IMPORT_TIME_PREFIXES) and k not in RUN_TIME_OK}
    return relevant(env) == relevant(server_env)


def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                   creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                   restore_signals, gid, gids, uid, umask, start_new_session, process_group):
    self._warm = None
    argv = warm_argv(args, executable, shell, preexec_fn, pass_fds, close_fds, gid, gids, uid, umask)
    if argv is not None:
        path = _SERVERS.next_path()
        run_env = dict(os.environ if env is None else env)
        if path is not None and _same_import_time_env(run_env, _SERVERS.env):
            started = _start_warm(self, path, argv, cwd, run_env, start_new_session, process_group,
                                  (p2cread, c2pwrite, errwrite))
            if started:
                self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
                return
    _COLD_EXECUTE(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                  creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                  restore_signals, gid, gids, uid, umask, start_new_session, process_group)


def _start_warm(popen, path, args, cwd, env, new_session, process_group, child_fds) -> bool:
    fds = [fd if fd != -1 else target for target, fd in enumerate(child_fds)]   # -1: inherit ours
    request = {"argv": args, "cwd": None if cwd is None else os.fsdecode(cwd), "env": env,
               "new_session": bool(new_session), "process_group": process_group,
               "base_path": _SERVERS.base_path}
    body = json.dumps(request).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        socket.send_fds(conn, [HEADER.pack(len(body))], fds)
        conn.sendall(body)
        reply = _read_line(conn, None)
    except OSError:
        conn.close()
        return False
    if reply is None or reply == "cold":
        conn.close()
        return False
    popen.pid = int(reply)
    popen._child_created = True
    popen._warm = conn
    return True


def _read_line(conn: socket.socket, timeout: float | None) -> str | None:
    """One line from `conn`; None at EOF; TimeoutError when none came in `timeout` seconds (0: do not wait)."""
    conn.settimeout(timeout)
    data = b""
    try:
        while not data.endswith(b"\n"):
            chunk = conn.recv(64)
            if not chunk:
                return None
            data += chunk
    except (TimeoutError, BlockingIOError) as e:
        if data:                                    # a half line: wait for the rest
            conn.settimeout(None)
            return data.decode() + (_read_line(conn, None) or "")
        raise TimeoutError from e
    return data.decode().strip()


def _warm_status(popen, block: bool) -> int | None:
    """The raw wait status of a warm child, or None while it runs (block=False)."""
    if getattr(popen, "_warm_status", None) is not None:
        return popen._warm_status
    try:
        line = _read_line(popen._warm, None if block else 0.0)
    except TimeoutError:
        return None
    popen._warm_status = 0 if line is None else int(line)   # a vanished server: nothing more to learn
    popen._warm.close()
    return popen._warm_status


def _internal_poll(self, _deadstate=None, **kwargs):
    if getattr(self, "_warm", None) is None:
        return _COLD_POLL(self, _deadstate, **kwargs)
    if self.returncode is None:
        if not self._waitpid_lock.acquire(False):
            return None
        try:
            if self.returncode is None:
                status = _warm_status(self, block=False)
                if status is not None:
                    self._handle_exitstatus(status)
        finally:
            self._waitpid_lock.release()
    return self.returncode


def _try_wait(self, wait_flags):
    if getattr(self, "_warm", None) is None:
        return _COLD_TRY_WAIT(self, wait_flags)
    status = _warm_status(self, block=not (wait_flags & os.WNOHANG))
    return (0, 0) if status is None else (self.pid, status)


def install() -> bool:
    """Route this process's `python -m nblib` subprocesses through warm servers (unless NBLIB_TEST_WARM_CLI=0)."""
    if not ENABLED:
        return False
    subprocess.Popen._execute_child = _execute_child
    subprocess.Popen._internal_poll = _internal_poll
    subprocess.Popen._try_wait = _try_wait
    return True


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        started_by = int(sys.argv[3])
        try:
            child_request = serve(sys.argv[2], started_by)
        except KeyboardInterrupt:             # a Ctrl-C to the test's process group: the server goes quietly
            child_request = None
        if child_request is not None:
            del started_by
            run_child(child_request)
