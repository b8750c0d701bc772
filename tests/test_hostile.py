"""The CLI against a hostile user and machine: two runs on one folder, SIGKILLed holders, full and read-only disks."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import subprocess_env
from nblib.cache import read_cache_manifest
from nblib.lock import LOCK_PREFIX

HOST = socket.gethostname()
CACHE_TRIALS = 8


# ------------------------------------------------------------------------------------ helpers


def nblib_cmd(verb, *args):
    return [sys.executable, "-m", "nblib", verb, *map(str, args)]


def run_cli(verb, *args, timeout=300):
    return subprocess.run(nblib_cmd(verb, *args), env=subprocess_env(), capture_output=True, text=True,
                          timeout=timeout)


def one_error_line(result):
    """The run failed with exit 2 and printed exactly one line, `error: ...`, and no traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def write_texts(path, n):
    path.write_text("".join(f"sample {i} {'word ' * (i % 11)}\n" for i in range(n)))
    return path


def cache_bytes(folder):
    """Every file's bytes; of the manifest, its body without the shard stats (mtime_ns)."""
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir())
             if p.is_file() and p.name != "manifest.json"}
    body = read_cache_manifest(folder)
    files["manifest.json"] = {**body, "shards": [{k: v for k, v in s.items() if k != "mtime_ns"}
                                                 for s in body["shards"]]}
    return files


def start_and_kill(cmd, folder, pattern, count, timeout=120.0):
    """Start `cmd`, SIGKILL its process group once `count` files match `pattern` in `folder`."""
    process = subprocess.Popen(cmd, env=subprocess_env(), start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and process.poll() is None:
            if len(list(folder.glob(pattern))) >= count:
                break
            time.sleep(0.002)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL, f"the run ended on its own before {count} x {pattern}"
    return process.pid


def race(commands, timeout=300):
    """Start the commands at the same moment; [(pid, returncode, stdout, stderr)] in order."""
    processes = [subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for cmd in commands]
    outputs = [p.communicate(timeout=timeout) for p in processes]
    return [(p.pid, p.returncode, out, err) for p, (out, err) in zip(processes, outputs)]


@pytest.fixture
def small_fs(tmp_path):
    """Make real size-limited file systems: tmpfs, else a loop-mounted ext2 image; skip if neither mounts."""
    mounted = []

    def mount(name, size_kb):
        folder = tmp_path / name
        folder.mkdir()
        tried = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(folder)],
                               capture_output=True, text=True)
        if tried.returncode != 0:
            image = tmp_path / f"{name}.img"
            with open(image, "wb") as f:
                f.truncate(size_kb * 1024)
            made = subprocess.run(["mkfs.ext2", "-q", "-F", "-m", "0", str(image)], capture_output=True, text=True)
            looped = subprocess.run(["mount", "-o", "loop", str(image), str(folder)], capture_output=True,
                                    text=True) if made.returncode == 0 else made
            if looped.returncode != 0:
                pytest.skip(f"cannot mount a small file system here (tmpfs: {tried.stderr.strip()}; "
                            f"loop image: {looped.stderr.strip()}); run as root in a VM or container "
                            f"that allows mount")
        mounted.append(folder)
        return folder

    yield mount
    for folder in reversed(mounted):
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def remount(folder, option):
    subprocess.run(["mount", "-o", f"remount,{option}", str(folder)], check=True)


def fill(folder, leave_bytes):
    """Write a filler file that leaves about `leave_bytes` free on `folder`'s file system."""
    st = os.statvfs(folder)
    size = max(0, st.f_bavail * st.f_frsize - leave_bytes)
    filler = folder / "filler.bin"
    with open(filler, "wb") as f:
        f.write(b"\xff" * size)
    return filler


# -------------------------------------------------------------------------------------- cache


CACHE_TEXTS = 160
CACHE_FLAGS = ("--size", 64, "--shard-mb", 0.05, "--workers", 1, "--no-progress")


def cache_args(texts, out, seed=0, *extra):
    return ("--texts", texts, "--out", out, *CACHE_FLAGS, "--seed", seed, *extra)


@pytest.fixture
def cache_refs(tmp_path):
    """The texts, and a solo run's cache bytes per seed."""
    texts = write_texts(tmp_path / "texts.txt", CACHE_TEXTS)
    refs = {}
    for seed in (0, 1):
        done = run_cli("cache", *cache_args(texts, tmp_path / f"solo-{seed}", seed))
        assert done.returncode == 0, done.stderr
        refs[seed] = cache_bytes(tmp_path / f"solo-{seed}")
    return texts, refs


@pytest.mark.slow
def test_two_cache_runs_started_together_on_one_folder_one_wins_the_other_is_refused(tmp_path, cache_refs):
    texts, refs = cache_refs
    winners = []
    for trial in range(CACHE_TRIALS):
        out = tmp_path / f"race-{trial}"
        results = race([nblib_cmd("cache", *cache_args(texts, out, seed)) for seed in (0, 1)])
        won = [seed for seed, (_, rc, _, _) in enumerate(results) if rc == 0]
        assert len(won) == 1, (trial, [(rc, err[-300:]) for _, rc, _, err in results])
        winner, loser = results[won[0]], results[1 - won[0]]
        line = one_error_line(subprocess.CompletedProcess([], loser[1], loser[2], loser[3]))
        assert f"pid {winner[0]} on host {HOST}" in line and "cache folder" in line, line
        assert cache_bytes(out) == refs[won[0]], f"trial {trial}: the winner's cache differs from a solo run"
        assert not list(out.glob(f"{LOCK_PREFIX}*"))
        winners.append(won[0])
    print(f"cache race: {CACHE_TRIALS} trials, winners by seed {winners}")


@pytest.mark.slow
def test_a_sigkilled_cache_run_leaves_a_lock_the_rerun_takes_over_to_identical_bytes(tmp_path, cache_refs):
    texts, refs = cache_refs
    out = tmp_path / "killed"
    killed_pid = start_and_kill(nblib_cmd("cache", *cache_args(texts, out)), out, "shard-*", 5)
    lock = out / f"{LOCK_PREFIX}0"
    assert f'"pid": {killed_pid}' in lock.read_text()  # the dead holder's lock is still there
    resumed = run_cli("cache", *cache_args(texts, out))
    assert resumed.returncode == 0, resumed.stderr
    assert cache_bytes(out) == refs[0] and not lock.exists()


@pytest.mark.slow
def test_a_repair_while_a_cache_run_writes_is_refused_and_deletes_nothing(tmp_path, cache_refs):
    texts, refs = cache_refs
    out = tmp_path / "busy"
    writer = subprocess.Popen(nblib_cmd("cache", *cache_args(texts, out)), env=subprocess_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while len(list(out.glob("shard-*"))) < 3 and writer.poll() is None:
        time.sleep(0.005)
    line = one_error_line(run_cli("cache", "--verify", "--repair", out))
    assert f"pid {writer.pid} on host {HOST}" in line
    _, err = writer.communicate(timeout=300)
    assert writer.returncode == 0, err
    assert cache_bytes(out) == refs[0]


@pytest.mark.slow
def test_a_full_disk_mid_cache_is_one_error_line_and_resumes_to_identical_bytes(tmp_path, small_fs):
    # many tiny shards: each takes a whole 4 KiB page, more than the predicted bytes, so the
    # preflight passes and the disk fills up mid-run, as a disk shared with other writers does
    texts = write_texts(tmp_path / "texts.txt", 500)
    flags = ("--size", 16, "--shard-mb", 0.002, "--workers", 1, "--no-progress")
    ref = tmp_path / "ref"
    assert run_cli("cache", "--texts", texts, "--out", ref, *flags).returncode == 0
    disk = small_fs("disk", 2048)
    filler = fill(disk, 1024 * 1024)
    out = disk / "cache"
    line = one_error_line(run_cli("cache", "--texts", texts, "--out", out, *flags))
    assert "No space left on device" in line and str(disk) in line and "rerun" in line, line
    assert 0 < len(read_cache_manifest(out)["shards"]) < len(read_cache_manifest(ref)["shards"])
    filler.unlink()  # the fix: free space
    resumed = run_cli("cache", "--texts", texts, "--out", out, *flags)
    assert resumed.returncode == 0, resumed.stderr
    assert cache_bytes(out) == cache_bytes(ref)


@pytest.mark.slow
def test_a_read_only_cache_folder_is_one_error_line_and_resumes_once_writable(tmp_path, small_fs, cache_refs):
    texts, refs = cache_refs
    disk = small_fs("disk", 8192)
    out = disk / "cache"
    start_and_kill(nblib_cmd("cache", *cache_args(texts, out)), out, "shard-*", 5)
    remount(disk, "ro")
    line = one_error_line(run_cli("cache", *cache_args(texts, out)))
    assert "Read-only file system" in line and str(out) in line, line
    fresh = one_error_line(run_cli("cache", *cache_args(texts, disk / "fresh")))
    assert "Read-only file system" in fresh
    remount(disk, "rw")
    resumed = run_cli("cache", *cache_args(texts, out))
    assert resumed.returncode == 0, resumed.stderr
    assert cache_bytes(out) == refs[0]
    remount(disk, "ro")  # a finished cache on a read-only mount is still reused, and read
    reused = run_cli("cache", *cache_args(texts, out))
    assert reused.returncode == 0 and "reused" in reused.stdout, reused.stderr
    assert run_cli("cache", "--verify", out).returncode == 0


@pytest.mark.slow
def test_a_cache_out_that_is_a_file_is_one_error_line_and_works_once_moved(tmp_path, cache_refs):
    texts, refs = cache_refs
    out = tmp_path / "taken"
    out.write_text("not a folder")
    line = one_error_line(run_cli("cache", *cache_args(texts, out)))
    assert "is a file, not a folder" in line and str(out) in line
    nested = one_error_line(run_cli("cache", *cache_args(texts, out / "sub")))
    assert "Not a directory" in nested and str(out) in nested
    out.unlink()
    done = run_cli("cache", *cache_args(texts, out))
    assert done.returncode == 0, done.stderr
    assert cache_bytes(out) == refs[0]
    shutil.rmtree(out)
