"""The tests' warm CLI launcher (tests/warm_cli.py) against a cold `python -m`: what a test can see is the same."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import warm_cli

from conftest import small_cache, subprocess_env
from nblib.atomic import sha256_file

PROBE = r'''
import atexit, json, os, sys, threading, time
what = sys.argv[1]
if what == "report":
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
                      "var": os.environ.get("WARM_PROBE_VAR"), "gone": os.environ.get("WARM_PROBE_GONE"),
                      "own_session": os.getsid(0) == os.getpid(), "hash": hash("warm-probe"),
                      "callers_group": os.getpgid(0) == int(os.environ["WARM_PROBE_GROUP"]),
                      "custom": "warm_probe_custom" in sys.modules}))
    print(input(), file=sys.stderr)
elif what == "exit":
    sys.exit(int(sys.argv[2]) if sys.argv[2].isdigit() else sys.argv[2])
elif what == "raise":
    raise ValueError("from the probe")
elif what == "interrupt":
    raise KeyboardInterrupt
elif what == "late":
    def later():
        time.sleep(0.3)
        print("thread done", flush=True)
    threading.Thread(target=later).start()
    atexit.register(lambda: print("atexit ran", flush=True))
    print("main done", flush=True)
elif what == "sleep":
    print("sleeping", flush=True)
    time.sleep(60)
'''


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A module `warm_probe` on PYTHONPATH, routed warm like nblib; returns a function giving (warm, cold) runs."""
    folder = tmp_path / "probe"
    folder.mkdir()
    (folder / "warm_probe.py").write_text(PROBE)
    (folder / "sitecustomize.py").write_text("import sys\nsys.modules['warm_probe_custom'] = sys\n")
    monkeypatch.setattr(warm_cli, "WARM_MODULES", (*warm_cli.WARM_MODULES, "warm_probe"))
    env = subprocess_env(WARM_PROBE_VAR="yes", WARM_PROBE_GROUP=str(os.getpgid(0)))
    env.pop("WARM_PROBE_GONE", None)
    env["PYTHONPATH"] = f"{folder}{os.pathsep}{env['PYTHONPATH']}"
    monkeypatch.setenv("WARM_PROBE_GONE", "the test's own, not the run's")

    def both(*args, **kwargs):
        command = [sys.executable, "-m", "warm_probe", *map(str, args)]
        runs = {}
        for mode in ("warm", "cold"):
            monkeypatch.setattr(warm_cli, "ENABLED", mode == "warm")
            runs[mode] = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120,
                                        cwd=tmp_path, **kwargs)
        return runs["warm"], runs["cold"]
    return both


needs_warm = pytest.mark.skipif(not warm_cli.ENABLED, reason="NBLIB_TEST_WARM_CLI=0: every run starts cold")


@needs_warm
def test_a_warm_run_sees_the_argv_cwd_environment_stdin_and_sitecustomize_a_cold_one_sees(probe, tmp_path):
    warm, cold = probe("report", "x y", input="from stdin\n")
    assert warm.returncode == cold.returncode == 0, (warm.stderr, cold.stderr)
    w, c = json.loads(warm.stdout), json.loads(cold.stdout)
    assert w.pop("hash") != 0 and c.pop("hash") != 0
    assert w == c == {"argv": ["report", "x y"], "cwd": str(tmp_path), "path0": str(tmp_path), "name": "__main__",
                      "var": "yes", "gone": None, "own_session": False, "callers_group": True,
                      "custom": True}
    assert warm.stderr == cold.stderr == "from stdin\n"


@needs_warm
@pytest.mark.parametrize("args", [("exit", "3"), ("exit", "a message"), ("raise",), ("interrupt",), ("late",)],
                         ids=["exit 3", "exit with a message", "uncaught", "KeyboardInterrupt", "thread+atexit"])
def test_a_warm_run_exits_as_a_cold_one_does(probe, args):
    warm, cold = probe(*args)
    assert warm.returncode == cold.returncode, (warm, cold)
    assert warm.stdout == cold.stdout
    last = [s.strip().splitlines()[-1] if s.strip() else "" for s in (warm.stderr, cold.stderr)]
    assert last[0] == last[1] and ("Traceback" in warm.stderr) == ("Traceback" in cold.stderr), (warm, cold)
    expected = {"exit": {"3": 3, "a message": 1}.get(args[-1]), "raise": 1, "interrupt": -signal.SIGINT, "late": 0}
    assert warm.returncode == expected[args[0]]


@needs_warm
def test_a_warm_run_in_its_own_session_dies_by_killpg_with_minus_9_and_runs_get_other_hash_seeds(probe, tmp_path):
    command = [sys.executable, "-m", "warm_probe", "sleep"]
    env = subprocess_env(PYTHONPATH=f"{tmp_path / 'probe'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    process = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert getattr(process, "_warm", None) is not None                 # it did go warm
    assert process.stdout.readline().strip() == "sleeping"
    assert os.getpgid(process.pid) == process.pid and process.poll() is None
    os.killpg(process.pid, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    process.stdout.close()
    seeds = {json.loads(probe("report", input="\n")[0].stdout)["hash"] for _ in range(2)}
    assert len(seeds) == 2, "consecutive warm runs share a string-hash seed"


@needs_warm
def test_a_warm_encode_writes_the_bytes_of_a_cold_one(tmp_path, monkeypatch):
    cache = small_cache(tmp_path / "cache", [f"warm {i} {'w' * (i % 7)}" for i in range(48)])
    hashes = {}
    for mode in ("warm", "cold"):
        monkeypatch.setattr(warm_cli, "ENABLED", mode == "warm")
        out = tmp_path / mode
        started = time.monotonic()
        run = subprocess.Popen([sys.executable, "-m", "nblib", "encode", "--cache", cache, "--out", out,
                                "--profile", "smoke", "--batch-size", "8", "--no-progress"],
                               env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert (getattr(run, "_warm", None) is not None) == (mode == "warm")
        _, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr
        hashes[mode] = {p.name: sha256_file(p) for p in sorted(out.glob("*.npy"))}
        print(mode, f"{time.monotonic() - started:.2f} s")
    assert hashes["warm"] and hashes["warm"] == hashes["cold"]

