"""The warm fake-CUDA process (nblib.budget.warm): a fork per trace, clean state each time, same results."""
from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import threading
import time

import psutil
import pytest

from conftest import hf_spec
from nblib.budget.warm import WarmProcess, WarmUnavailable

PROBE = textwrap.dedent('''
    import os
    import time

    import torch

    def _child(payload):
        if payload.get("fail"):
            raise ValueError("the probe failed on purpose")
        if payload.get("pidfile"):
            with open(payload["pidfile"], "w") as f:
                f.write(str(os.getpid()))
        if payload.get("sleep"):
            time.sleep(payload["sleep"])
        seen = getattr(torch, "_nblib_probe_mark", None)
        torch._nblib_probe_mark = payload["mark"]          # global torch state, changed in the fork only
        print("a print must not reach the protocol pipe")
        return {"seen": seen, "pid": os.getpid(), "cwd": os.getcwd()}
''')


@pytest.fixture(scope="module")
def warm_probe_path(tmp_path_factory):
    """A folder holding the probe module, for a warm process's PYTHONPATH."""
    folder = tmp_path_factory.mktemp("probe")
    (folder / "nblib_warm_probe.py").write_text(PROBE)
    return folder


def warm_server(folder) -> WarmProcess:
    """A warm process that can import the modules in `folder`."""
    before = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{folder}{os.pathsep}{before}"
    try:
        return WarmProcess(None)
    finally:
        os.environ["PYTHONPATH"] = before


@pytest.fixture(scope="module")
def warm(warm_probe_path):
    server = warm_server(warm_probe_path)
    yield server
    server.close()


def test_each_request_runs_in_its_own_fork_from_a_clean_state(warm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = warm.run("nblib_warm_probe", {"mark": 1}, 60)
    second = warm.run("nblib_warm_probe", {"mark": 2}, 60)
    assert first["seen"] is None and second["seen"] is None      # the first fork's change did not survive it
    assert first["pid"] != second["pid"] and first["cwd"] == second["cwd"] == str(tmp_path)


def test_a_failing_trace_reports_its_last_error_line_and_the_process_stays_warm(warm):
    with pytest.raises(RuntimeError, match="ValueError: the probe failed on purpose"):
        warm.run("nblib_warm_probe", {"mark": 3, "fail": True}, 60)
    assert warm.alive and warm.run("nblib_warm_probe", {"mark": 4}, 60)["seen"] is None


def test_a_trace_past_its_time_limit_is_killed_and_a_new_warm_process_starts(tmp_path_factory, warm):
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run("nblib_warm_probe", {"mark": 5, "sleep": 30}, 1.0)
    assert not warm.alive                     # closed: the next request through run_warm starts a fresh one


def test_a_warm_process_that_ends_mid_trace_is_an_error_and_the_trace_is_killed(warm_probe_path, tmp_path):
    server = warm_server(warm_probe_path)
    pidfile = tmp_path / "trace.pid"
    try:
        killer = threading.Thread(target=_kill_once_started, args=(server.proc.pid, pidfile))
        killer.start()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="the warm process ended while the trace ran"):
            server.run("nblib_warm_probe", {"mark": 6, "sleep": 60, "pidfile": str(pidfile)}, 120)
        killer.join()
        assert time.monotonic() - started < 30           # at the end, not at the time limit
        trace = psutil.Process(int(pidfile.read_text()))
        assert trace.wait(10) is None or not trace.is_running()
    except psutil.NoSuchProcess:
        pass                                              # the trace is gone already: killed and reaped
    finally:
        server.close()


def _kill_once_started(pid: int, pidfile) -> None:
    deadline = time.monotonic() + 60
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)


def test_a_warm_process_holding_a_second_thread_refuses_to_fork(warm_probe_path, tmp_path):
    (warm_probe_path / "sitecustomize.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n")
    server = warm_server(warm_probe_path)
    pidfile = tmp_path / "trace.pid"
    try:
        with pytest.raises(WarmUnavailable, match="2 threads"):
            server.run("nblib_warm_probe", {"mark": 7, "pidfile": str(pidfile)}, 60)
        assert not pidfile.exists()                       # nothing was forked
    finally:
        server.close()
        (warm_probe_path / "sitecustomize.py").unlink()


@pytest.mark.slow
def test_a_warm_budget_equals_a_fresh_process_budget(tmp_path, monkeypatch):
    from nblib.budget.model_vram import model_vram

    spec = hf_spec(tmp_path / "vit.json", "ViTModel", traced=True, hidden_size=32, num_hidden_layers=1,
                   num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8)
    monkeypatch.setenv("NBLIB_WARM_TRACES", "1")
    warm = model_vram(spec, 8, precision="fp16", train=True, find_largest=False)
    monkeypatch.setenv("NBLIB_WARM_TRACES", "0")
    fresh = model_vram(spec, 8, precision="fp16", train=True, find_largest=False)
    assert warm == fresh


def test_a_pythonpath_set_after_the_warm_process_started_reaches_the_next_trace(warm_probe_path, monkeypatch):
    """A fork inherits the warm process's environment: a caller whose traced variables changed since it started
    (a --model's folder put on PYTHONPATH) gets a warm process started under them, as a fresh child would.
    """
    from nblib.budget import shim, warm

    ok, why = shim.backward_capability()
    if not ok:
        pytest.skip(why)
    monkeypatch.setenv("NBLIB_WARM_TRACES", "1")
    monkeypatch.setattr(warm, "_SERVERS", {})
    monkeypatch.delenv("PYTHONPATH", raising=False)
    try:
        with pytest.raises(Exception, match="No module named 'nblib_warm_probe'"):
            shim.run_child("nblib_warm_probe", {"mark": 1}, 120)
        first = next(iter(warm._SERVERS.values())).proc.pid
        monkeypatch.setenv("PYTHONPATH", str(warm_probe_path))
        assert shim.run_child("nblib_warm_probe", {"mark": 2}, 120)["seen"] is None
        server = next(iter(warm._SERVERS.values()))
        assert server.proc.pid != first and server.alive and server.traced_env["PYTHONPATH"] == str(warm_probe_path)
    finally:
        for server in warm._SERVERS.values():
            server.close()
