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
from cli_runner import run_nblib

from conftest import cache_folder_bytes, subprocess_env
from nblib.atomic import sha256_file
from nblib.cache import read_cache_manifest
from nblib.lock import LOCK_PREFIX

HOST = socket.gethostname()
CACHE_TRIALS = 6            # two cold `nblib cache` processes each; the lock must refuse at least 3 of them


# ------------------------------------------------------------------------------------ helpers


def nblib_cmd(verb, *args):
    return [sys.executable, "-m", "nblib", verb, *map(str, args)]


def run_cli(verb, *args):
    return run_nblib(verb, *args)


def one_error_line(result):
    """The run failed with exit 2 and printed exactly one line, `error: ...`, and no traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def write_texts(path, n):
    path.write_text("".join(f"sample {i} {'word ' * (i % 11)}\n" for i in range(n)))
    return path


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


def race(commands, timeout=600, **env):
    """Start the commands at the same moment; [(pid, returncode, stdout, stderr)] in order."""
    processes = [subprocess.Popen(cmd, env=subprocess_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for cmd in commands]
    outputs = [p.communicate(timeout=timeout) for p in processes]
    return [(p.pid, p.returncode, out, err) for p, (out, err) in zip(processes, outputs)]


def check_races(tmp_path, trials, command, env, refs, bytes_of, folder_word, other_inputs):
    """Race seed 0 against seed 1 on one folder `trials` times: exactly one wins, with a solo run's bytes.

    The loser is refused with one error line: by the lock, naming the winner's pid and host, when the
    runs overlapped, or by the manifest (`other_inputs`) when it started after the winner finished.
    Most trials must overlap, or the race was not exercised.
    """
    winners, busy = [], 0
    for trial in range(trials):
        out = tmp_path / f"race-{trial}"
        results = race([command(out, seed) for seed in (0, 1)], **env)
        won = [seed for seed, (_, rc, _, _) in enumerate(results) if rc == 0]
        assert len(won) == 1, (trial, [(rc, err[-400:]) for _, rc, _, err in results])
        winner, loser = results[won[0]], results[1 - won[0]]
        line = one_error_line(subprocess.CompletedProcess([], loser[1], loser[2], loser[3]))
        if f"pid {winner[0]} on host {HOST}" in line and folder_word in line:
            busy += 1
        else:
            assert other_inputs in line, line
        assert bytes_of(out) == refs[won[0]], f"trial {trial}: the winner's bytes differ from a solo run"
        assert not list(out.glob(f"{LOCK_PREFIX}*"))
        winners.append(won[0])
    print(f"{folder_word} race: {trials} trials, winners by seed {winners}, {busy} refused by the lock")
    assert busy >= trials // 2, "the runs hardly overlapped: the race was not exercised"


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
        refs[seed] = cache_folder_bytes(tmp_path / f"solo-{seed}")
    return texts, refs


@pytest.mark.slow
def test_two_cache_runs_started_together_on_one_folder_one_wins_the_other_is_refused(tmp_path, cache_refs):
    texts, refs = cache_refs
    check_races(tmp_path, CACHE_TRIALS, lambda out, seed: nblib_cmd("cache", *cache_args(texts, out, seed)),
                {}, refs, cache_folder_bytes, "cache folder", "built from other inputs")


@pytest.mark.slow
def test_a_sigkilled_cache_run_leaves_a_lock_the_rerun_takes_over_to_identical_bytes(tmp_path, cache_refs):
    texts, refs = cache_refs
    out = tmp_path / "killed"
    killed_pid = start_and_kill(nblib_cmd("cache", *cache_args(texts, out)), out, "shard-*", 5)
    lock = out / f"{LOCK_PREFIX}0"
    assert f'"pid": {killed_pid}' in lock.read_text()  # the dead holder's lock is still there
    resumed = run_cli("cache", *cache_args(texts, out))
    assert resumed.returncode == 0, resumed.stderr
    assert cache_folder_bytes(out) == refs[0] and not lock.exists()


@pytest.mark.slow
def test_a_repair_while_a_cache_run_writes_is_refused_and_deletes_nothing(tmp_path, cache_refs):
    texts, refs = cache_refs
    out = tmp_path / "busy"
    writer = subprocess.Popen(nblib_cmd("cache", *cache_args(texts, out)), env=subprocess_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while len(list(out.glob("shard-*"))) < 3 and writer.poll() is None:
        time.sleep(0.005)
    writer.send_signal(signal.SIGSTOP)  # hold the writer mid-run (a slow disk), its lock still held
    try:
        assert writer.poll() is None, "the writer finished before the repair could start"
        line = one_error_line(run_cli("cache", "--verify", "--repair", out))
    finally:
        writer.send_signal(signal.SIGCONT)
    assert f"pid {writer.pid} on host {HOST}" in line
    _, err = writer.communicate(timeout=300)
    assert writer.returncode == 0, err
    assert cache_folder_bytes(out) == refs[0]


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
    assert cache_folder_bytes(out) == cache_folder_bytes(ref)


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
    assert cache_folder_bytes(out) == refs[0]
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
    assert cache_folder_bytes(out) == refs[0]
    shutil.rmtree(out)


# ------------------------------------------------------------------------------------- encode


ENCODE_TEXTS = 128
ENCODE_TRIALS = 4           # each a torch start-up pair and a whole encode; the lock refuses at least 2 of them
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
OUTPUTS = ("sketches", "checksums", "children")


def encode_cmd(cache, out, seed=0, *extra):
    return nblib_cmd("encode", "--cache", cache, "--out", out, "--profile", "smoke", "--batch-size", 8,
                     "--checkpoint-every", 1, "--seed", seed, "--no-progress", *extra)


def run_encode(cache, out, seed=0, *extra):
    return run_nblib(*encode_cmd(cache, out, seed, *extra)[3:], **THREADS)


def output_hashes(out):
    return {name: sha256_file(out / f"{name}.npy") for name in OUTPUTS}


@pytest.fixture(scope="module")
def encode_refs(tmp_path_factory):
    """A 128-image smoke cache and a solo run's output hashes per seed."""
    root = tmp_path_factory.mktemp("encode")
    texts = write_texts(root / "texts.txt", ENCODE_TEXTS)
    cache = root / "cache"
    built = run_cli("cache", "--texts", texts, "--out", cache, "--size", 64, "--workers", 0, "--no-progress")
    assert built.returncode == 0, built.stderr
    refs = {}
    for seed in (0, 1):
        done = run_encode(cache, root / f"solo-{seed}", seed)
        assert done.returncode == 0, done.stderr
        refs[seed] = output_hashes(root / f"solo-{seed}")
    assert refs[0] != refs[1]
    return cache, refs


@pytest.mark.slow
def test_two_encode_runs_started_together_on_one_folder_one_wins_the_other_is_refused(tmp_path, encode_refs):
    cache, refs = encode_refs
    check_races(tmp_path, ENCODE_TRIALS, lambda out, seed: encode_cmd(cache, out, seed), THREADS, refs,
                output_hashes, "run folder", "made with other inputs")


@pytest.mark.slow
def test_a_sigkilled_encode_leaves_a_lock_the_rerun_takes_over_to_identical_bytes(tmp_path, encode_refs):
    cache, refs = encode_refs
    out = tmp_path / "killed"
    killed_pid = start_and_kill(encode_cmd(cache, out), out / "parts", "part-*/part.json", 3)
    lock = out / f"{LOCK_PREFIX}0"
    assert f'"pid": {killed_pid}' in lock.read_text()
    resumed = run_encode(cache, out)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at sample" in resumed.stdout
    assert output_hashes(out) == refs[0] and not lock.exists()


@pytest.mark.slow
def test_a_full_disk_mid_encode_is_one_error_line_and_resumes_to_identical_bytes(encode_refs, small_fs):
    cache, refs = encode_refs
    disk = small_fs("disk", 2048)
    filler = fill(disk, 160 * 1024)  # room for some parts, not for all of them and the outputs
    out = disk / "run"
    line = one_error_line(run_encode(cache, out, 0, "--no-preflight"))
    assert "No space left on device" in line and str(disk) in line and "rerun" in line, line
    assert list((out / "parts").glob("part-*/part.json")), "the disk filled before the first part"
    filler.unlink()
    resumed = run_encode(cache, out)
    assert resumed.returncode == 0, resumed.stderr
    assert output_hashes(out) == refs[0]


@pytest.mark.slow
def test_a_read_only_run_folder_is_one_error_line_and_resumes_once_writable(encode_refs, small_fs):
    cache, refs = encode_refs
    disk = small_fs("disk", 4096)
    out = disk / "run"
    start_and_kill(encode_cmd(cache, out), out / "parts", "part-*/part.json", 3)
    remount(disk, "ro")
    line = one_error_line(run_encode(cache, out))
    assert "Read-only file system" in line and str(out) in line, line
    fresh = one_error_line(run_encode(cache, disk / "fresh"))
    assert "Read-only file system" in fresh
    remount(disk, "rw")
    resumed = run_encode(cache, out)
    assert resumed.returncode == 0, resumed.stderr
    assert output_hashes(out) == refs[0]


@pytest.mark.slow
def test_an_encode_out_that_is_a_file_is_one_error_line_and_works_once_moved(tmp_path, encode_refs):
    cache, refs = encode_refs
    out = tmp_path / "taken"
    out.write_text("not a folder")
    for target in (out, out / "sub"):
        line = one_error_line(run_encode(cache, target))
        assert f"{out} is a file, not a folder" in line, line
    out.unlink()
    done = run_encode(cache, out)
    assert done.returncode == 0, done.stderr
    assert output_hashes(out) == refs[0]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_edited_in_place_with_its_mtime_kept_is_never_encoded(tmp_path, encode_refs, workers):
    cache, refs = encode_refs
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)  # copy2: mtimes kept, so the copy opens without a hash
    shard = copy / "shard-00000.npy"
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # the stat check at open cannot see it
    out = tmp_path / "run"
    line = one_error_line(run_encode(copy, out, 0, "--workers", workers))
    assert "shard-00000.npy" in line and "--verify --repair" in line, line
    assert not list((out / "parts").glob("part-*")), "a part was made durable from the edited shard"
    assert run_cli("cache", "--verify", "--repair", copy).returncode == 0
    resumed = run_encode(copy, out, 0, "--workers", workers)
    assert resumed.returncode == 0, resumed.stderr
    assert output_hashes(out) == refs[0]


# ------------------------------------------------------------------------------ encode flags


@pytest.mark.slow
@pytest.mark.parametrize("flags, says", [
    (("--device", "tpu"), "device 'tpu' is not one torch knows"),
    (("--device", "cuda"), "device 'cuda' asked for, but"),
    (("--weights", "{missing}"), "does not exist"),
    (("--weights", "{garbage}"), "is neither a safetensors file nor a torch state dict"),
    (("--weights", "{folder}"), "is a folder"),
], ids=["device-tpu", "device-cuda", "weights-missing", "weights-garbage", "weights-folder"])
def test_bad_encode_flags_are_one_error_line_and_write_nothing(tmp_path, encode_refs, flags, says):
    import torch

    if flags == ("--device", "cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is valid here")
    cache, _ = encode_refs
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(os.urandom(4096))
    paths = {"missing": tmp_path / "nope.pt", "garbage": garbage, "folder": tmp_path}
    flags = tuple(f.format(**paths) for f in flags)
    out = tmp_path / "run"
    line = one_error_line(run_encode(cache, out, 0, *flags))
    assert says in line, line
    assert not out.exists() or not list((out / "parts").glob("part-*"))


@pytest.mark.slow
def test_a_batch_size_beyond_the_cache_encodes_the_same_bytes_as_one_whole_batch(tmp_path, encode_refs):
    cache, _ = encode_refs
    huge = run_encode(cache, tmp_path / "huge", 0, "--batch-size", 1000000000, "--no-preflight")
    whole = run_encode(cache, tmp_path / "whole", 0, "--batch-size", ENCODE_TEXTS, "--no-preflight")
    assert huge.returncode == 0 and whole.returncode == 0, huge.stderr + whole.stderr
    assert output_hashes(tmp_path / "huge") == output_hashes(tmp_path / "whole")


# `python -m nblib ARGS...` that writes its peak address space (VmPeak, bytes) to the file named first, at exit
VM_PEAK_RUN = """\
import atexit, pathlib, runpy, sys
report = pathlib.Path(sys.argv[1])
def peak():
    kb = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmPeak:"))
    report.write_text(str(int(kb) * 1024))
atexit.register(peak)
sys.argv = ["nblib", *sys.argv[2:]]
runpy.run_module("nblib", run_name="__main__", alter_sys=True)
"""


def seed_t4_encode(cache, out, batch):
    return nblib_cmd("encode", "--cache", cache, "--out", out, "--profile", "seed_t4", "--batch-size", batch,
                     "--no-preflight", "--no-progress")


@pytest.mark.slow
def test_running_out_of_memory_is_one_error_line_naming_the_batch_size(tmp_path):
    # a real allocation failure. The cap on the address space is derived on this machine: the peak of the same
    # encode over one sample (interpreter, torch, model, loader: this machine's layout) plus a quarter of what
    # one 64-sample batch's forward pass adds (nblib.budget's figure, checked against measured RSS). Part of the
    # batch lands in address space the small run reserved and never touched (malloc arenas, stacks): measured
    # here, the 64-sample run's peak was 453 MB above the 1-sample run's for a 655 MB budget, so the cap is
    # about 290 MB short of what the batch needs.
    from nblib.budget.memory import forward_peak_delta
    from nblib.config import preset

    caches = {}
    for n in (1, 64):
        caches[n] = tmp_path / f"cache-{n}"
        built = run_cli("cache", "--texts", write_texts(tmp_path / f"texts-{n}.txt", n), "--out", caches[n],
                        "--size", 224, "--workers", 0)
        assert built.returncode == 0, built.stderr
    report = tmp_path / "vm_peak"
    one = subprocess.run([sys.executable, "-c", VM_PEAK_RUN, str(report),
                          *seed_t4_encode(caches[1], tmp_path / "one", 1)[3:]],
                         env=subprocess_env(**THREADS), capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr
    batch_need = forward_peak_delta(preset("seed_t4").replace(batch_size=64))
    assert batch_need > 512 * 2**20, batch_need        # big enough that a quarter is no rounding of a layout
    cap_kb = (int(report.read_text()) + batch_need // 4) // 1024
    command = " ".join(map(str, seed_t4_encode(caches[64], tmp_path / "run", 1000000000)))
    result = subprocess.run(["bash", "-c", f"ulimit -v {cap_kb}; exec {command}"], env=subprocess_env(**THREADS),
                            capture_output=True, text=True, timeout=600)
    line = one_error_line(result)
    assert "out of memory encoding batches of 64 samples" in line and "lower --batch-size" in line, line


# ---------------------------------------------------------------------------- encode preflight


def predicted_need(cache, out, mirror=None):
    """What the encode preflight charges each disk for a fresh smoke run of this CLI's settings."""
    from nblib.cache import ShardedImageCache
    from nblib.cli.encode import _encode_config, _encode_parser
    from nblib.encode.run import disk_needs, plan_run

    args = _encode_parser().parse_args(encode_cmd(cache, out)[4:])
    config = _encode_config(args, "smoke").replace(n_samples=len(ShardedImageCache(cache)))
    plan = plan_run(config, config.run.n_samples)
    return disk_needs(config, out, mirror, plan, list(range(plan.n_parts)))


@pytest.mark.slow
def test_the_preflight_charges_each_disk_only_what_lands_on_it(tmp_path, encode_refs, small_fs):
    cache, refs = encode_refs
    cache_bytes_total = sum(p.stat().st_size for p in cache.iterdir())
    run_need = sum(n for _, n in predicted_need(cache, tmp_path).values())
    assert run_need < cache_bytes_total  # the cache would not fit where the run does
    disk = small_fs("run-disk", 2048)
    fill(disk, int((2 * run_need + cache_bytes_total) / 1.8))  # the run fits with the 10% margin, run + cache not
    done = run_encode(cache, disk / "run")
    assert done.returncode == 0, done.stderr
    assert output_hashes(disk / "run") == refs[0]


@pytest.mark.slow
def test_the_preflight_refusal_shows_two_different_numbers_and_the_disk(tmp_path, encode_refs, small_fs):
    cache, _ = encode_refs
    disk = small_fs("run-disk", 2048)
    needs = predicted_need(cache, disk / "run")
    need = sum(n for _, n in needs.values())
    fill(disk, need - 8192)  # two pages short: in GB both figures read 0.00
    line = one_error_line(run_encode(cache, disk / "run"))
    assert f"({need:,} bytes)" in line and str(disk) in line and "image cache" not in line, line
    shown = line.split("needs ")[1].split(" (")[0], line.split("only ")[1].split(" (")[0]
    assert shown[0] != shown[1] and "GB" not in shown[0], shown

    mirror_disk = small_fs("mirror-disk", 256)  # the run disk has room now; the mirror does not
    (disk / "filler.bin").unlink()
    line = one_error_line(run_encode(cache, disk / "run2", 0, "--mirror", mirror_disk / "m"))
    assert str(mirror_disk) in line and "mirrored parts" in line and "consolidated" not in line, line
