"""nblib.lock with real files and processes: one writer per folder, ranks of one launch share it, stale locks."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import subprocess_env
from nblib.lock import LOCK_PREFIX, FolderBusyError, FolderLock, LockLostError, launch_id, read_holders, run_identity

HOLD = """
import sys, time
from nblib.lock import FolderLock
lock = FolderLock(sys.argv[1], identity=sys.argv[2], rank=int(sys.argv[3])).acquire()
print("held", flush=True)
time.sleep(float(sys.argv[4]))
"""

RACE = """
import os, sys, time
from nblib.lock import FolderBusyError, FolderLock
folder, identity, go, done = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
print("ready", flush=True)  # imports done: the parent starts the race once every child has said so
while not os.path.exists(go):
    time.sleep(0.001)
try:
    with FolderLock(folder, identity=identity):
        print("won", flush=True)
        while not os.path.exists(done):  # hold it until every racer has had its answer
            time.sleep(0.005)
except FolderBusyError as exc:
    print("refused:", exc, flush=True)
"""


def start_holder(folder, identity="run-a", rank=0, seconds=60.0):
    """A real process that takes the lock and keeps it; returns once it holds it."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), identity, str(rank), str(seconds)],
                               env=subprocess_env(), stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def kill(process):
    process.kill()
    process.wait()


def write_lock_file(folder, rank=0, **fields):
    record = {"pid": 1, "host": "elsewhere", "boot_id": "", "pid_start": None, "started": time.time(),
              "identity": "run-x", "rank": rank, "token": "t" * 32, **fields}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{LOCK_PREFIX}{rank}"
    path.write_text(json.dumps(record))
    return path


def test_a_lock_file_names_its_holder_and_is_removed_on_release(tmp_path):
    with FolderLock(tmp_path / "run", identity="run-a") as lock:
        (holder,) = read_holders(tmp_path / "run")
        assert (holder.pid, holder.host, holder.rank) == (os.getpid(), socket.gethostname(), 0)
        assert holder.identity == "run-a"
        assert holder.token == lock.token and lock.held
        lock.check()
    assert not lock.held and not list((tmp_path / "run").iterdir())


def test_a_second_writer_is_refused_naming_the_holders_pid_and_host(tmp_path):
    holder = start_holder(tmp_path)
    try:
        with pytest.raises(FolderBusyError) as refused:
            FolderLock(tmp_path, identity="run-b", what="run folder", hint="use another --out").acquire()
        message = str(refused.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in message
        assert "run folder" in message and "use another --out" in message
        with pytest.raises(FolderBusyError):  # the same identity at the same rank is a second writer too
            FolderLock(tmp_path, identity="run-a").acquire()
    finally:
        kill(holder)


def test_ranks_of_one_launch_share_the_folder_and_another_launch_is_refused_at_any_rank(tmp_path):
    rank0 = start_holder(tmp_path, identity="fp@launch-1", rank=0)
    try:
        with FolderLock(tmp_path, identity="fp@launch-1", rank=1) as rank1:
            assert sorted(h.rank for h in read_holders(tmp_path)) == [0, 1] and rank1.held
            with pytest.raises(FolderBusyError, match=f"pid {rank0.pid} "):
                FolderLock(tmp_path, identity="fp@launch-2", rank=2).acquire()
            assert not (tmp_path / f"{LOCK_PREFIX}2").exists()  # the refused rank left nothing behind
    finally:
        kill(rank0)


def test_torchrun_ranks_get_one_identity_and_separate_launches_differ():
    ranks = [{"TORCHELASTIC_RUN_ID": "abc", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": str(r)}
             for r in range(4)]
    assert len({run_identity("fp", env) for env in ranks}) == 1
    other = {**ranks[0], "MASTER_PORT": "29501"}
    assert run_identity("fp", other) != run_identity("fp", ranks[0]) != run_identity("fp2", ranks[0])
    assert launch_id({}) == f"{socket.gethostname()}:{os.getpid()}"  # no launcher: this process alone


def test_the_lock_of_a_sigkilled_holder_is_taken_over(tmp_path):
    holder = start_holder(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert (tmp_path / f"{LOCK_PREFIX}0").exists()  # SIGKILL ran no cleanup
    with FolderLock(tmp_path, identity="run-b") as lock:
        assert [h.pid for h in lock.taken_over] == [holder.pid]
        assert read_holders(tmp_path)[0].token == lock.token


def test_a_stale_lock_at_another_rank_of_another_launch_is_taken_over(tmp_path):
    holder = start_holder(tmp_path, identity="old-launch", rank=3)
    kill(holder)
    with FolderLock(tmp_path, identity="new-launch", rank=0) as lock:
        assert [h.rank for h in lock.taken_over] == [3]
        assert [h.rank for h in read_holders(tmp_path)] == [0]


def test_a_lock_from_another_host_is_kept_while_it_beats_and_taken_over_when_it_stops(tmp_path):
    path = write_lock_file(tmp_path, host="elsewhere", pid=4242)
    with pytest.raises(FolderBusyError, match="pid 4242 on host elsewhere"):
        FolderLock(tmp_path, identity="run-b", stale_after_s=60).acquire()
    old = time.time() - 61
    os.utime(path, (old, old))
    with FolderLock(tmp_path, identity="run-b", stale_after_s=60) as lock:
        assert [h.host for h in lock.taken_over] == ["elsewhere"]


def test_a_reused_pid_a_zombie_and_a_past_boot_do_not_hold_a_lock(tmp_path):
    here = socket.gethostname()
    for fields in ({"pid": os.getppid(), "pid_start": "1"},         # alive, but started at another time
                   {"pid": os.getpid(), "boot_id": "a-past-boot"}):  # this host rebooted since
        write_lock_file(tmp_path, host=here, **fields)
        with FolderLock(tmp_path, identity="run-b") as lock:
            assert len(lock.taken_over) == 1, fields
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    while Path(f"/proc/{zombie.pid}/stat").read_text().split(") ")[1][0] != "Z":  # exited, not reaped yet
        time.sleep(0.01)
    write_lock_file(tmp_path, host=here, pid=zombie.pid)
    with FolderLock(tmp_path, identity="run-b") as lock:
        assert [h.pid for h in lock.taken_over] == [zombie.pid]
    zombie.wait()


def test_an_empty_lock_file_is_a_creation_in_progress_until_it_is_old(tmp_path):
    path = tmp_path / f"{LOCK_PREFIX}0"
    path.write_bytes(b"")
    started = time.monotonic()
    with pytest.raises(FolderBusyError, match="unreadable lock file"):
        FolderLock(tmp_path, identity="run-b").acquire()
    assert time.monotonic() - started < 5  # waited about a second for the content, not forever
    old = time.time() - 60
    os.utime(path, (old, old))
    with FolderLock(tmp_path, identity="run-b") as lock:
        assert len(lock.taken_over) == 1


def test_check_stops_a_writer_whose_lock_was_taken_over(tmp_path):
    lock = FolderLock(tmp_path, identity="run-a").acquire()
    try:
        write_lock_file(tmp_path, host=socket.gethostname(), pid=os.getppid(), token="u" * 32)
        with pytest.raises(LockLostError, match=f"pid {os.getppid()}"):
            lock.check()
        lock.release()
        assert (tmp_path / f"{LOCK_PREFIX}0").exists()  # release never removes another run's lock
    finally:
        lock.release()


def test_the_heartbeat_touches_the_lock_file(tmp_path):
    with FolderLock(tmp_path, identity="run-a", stale_after_s=0.2):
        path = tmp_path / f"{LOCK_PREFIX}0"
        old = time.time() - 100
        os.utime(path, (old, old))
        time.sleep(0.3)
        assert time.time() - path.stat().st_mtime < 5


def test_a_process_that_exits_without_releasing_removes_its_lock_at_exit(tmp_path):
    code = ("import sys; from nblib.lock import FolderLock; "
            "FolderLock(sys.argv[1], identity='x').acquire()")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=subprocess_env(), check=True)
    assert not list(tmp_path.iterdir())


def _race(tmp_path, n, trial, prepare=None):
    """Start `n` real processes that take one folder's lock at the same moment; their outputs."""
    folder, go, done = tmp_path / f"trial-{trial}", tmp_path / f"go-{trial}", tmp_path / f"done-{trial}"
    folder.mkdir()
    if prepare:
        prepare(folder)
    processes = [subprocess.Popen([sys.executable, "-c", RACE, str(folder), f"run-{i}", str(go), str(done)],
                                  env=subprocess_env(), stdout=subprocess.PIPE, text=True) for i in range(n)]
    for p in processes:  # a start barrier that holds under any load: every child spins on the go file
        assert p.stdout.readline().strip() == "ready"
    go.touch()
    answers = [p.stdout.readline() for p in processes]  # the winner holds the lock until all answered
    done.touch()
    outputs = [answer + p.communicate(timeout=60)[0] for answer, p in zip(answers, processes)]
    return processes, outputs


@pytest.mark.slow
@pytest.mark.parametrize("stale_first", [False, True], ids=["empty-folder", "stale-lock-to-take-over"])
def test_processes_racing_for_one_folder_leave_exactly_one_winner(tmp_path, stale_first):
    prepare = None
    if stale_first:
        prepare = lambda folder: write_lock_file(folder, host=socket.gethostname(), pid=os.getpid(),
                                                 boot_id="a-past-boot")
    for trial in range(8):
        processes, outputs = _race(tmp_path, 4, trial, prepare)
        winners = [p.pid for p, out in zip(processes, outputs) if out.startswith("won")]
        assert len(winners) == 1, (trial, outputs)
        for out in outputs:
            if not out.startswith("won"):
                assert out.startswith("refused:") and f"pid {winners[0]} on host {socket.gethostname()}" in out, out
