"""Hostile inputs to `python -m nblib train` (issue 27, item 4): a resume on other labels, mirrors that are
no second copy, an --out inside its cache, out-of-range seeds and unknown protocols, a mistyped bucket, and
SIGTERM with loader workers. Each is one `error:` line and exit 2, or works. Real files, a real S3 server (moto)
on 127.0.0.1, a real process for SIGTERM and the environment; the other runs call the CLI in this process.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
import test_train_resume
from cli_runner import run_nblib
from test_train import assert_same_weights, weights_of
from train_runs import THREADS, cache_and_reference, free_port, newest_step, train_cli, train_env

from nblib.errors import ConfigError
from tests.test_hostile import one_error_line

cache_dir, reference = cache_and_reference("hostile_train")
moto = test_train_resume.moto                   # the fixture: a real S3 server (moto) on 127.0.0.1
SHORT = ["--steps", "2", "--save-every", "2", "--backup-every", "2"]
LONGER = ["--steps", "4", "--save-every", "2", "--backup-every", "2"]


def run(cmd, cwd=None):
    """A `train_cli` command, in this process (cli_runner)."""
    return run_nblib(*cmd[3:], cwd=cwd, **THREADS)


# ------------------------------------------------------------------------------ a resume on other labels


@pytest.mark.parametrize("how", ["texts file edited", "--texts a shuffled copy"])
def test_a_resume_whose_labels_changed_is_refused_naming_the_labels(cache_dir, tmp_path, how):
    """Before: the resume trained on the new labels with exit 0 (the identity held the class names only)."""
    from nblib.cli.train import _train_args
    from nblib.train import train
    from nblib.train.command import config_from_args

    texts = Path(json.loads((cache_dir / "manifest.json").read_text())["body"]["source"]["path"])
    original = texts.read_text(encoding="utf-8")
    out = tmp_path / "run"
    argv = train_cli(cache_dir, out, *LONGER)
    train(cache_dir, out, config_from_args(_train_args(argv[4:])), stop_after=2)   # the run, stopped at step 2
    lines = original.splitlines(keepends=True)
    random.Random(0).shuffle(lines)                             # the same kinds, other images get them
    if how == "texts file edited":
        extra = []
        texts.write_text("".join(lines), encoding="utf-8")
    else:
        copy = tmp_path / "texts.jsonl"
        copy.write_text("".join(lines), encoding="utf-8")
        extra = ["--texts", str(copy)]
    try:
        line = one_error_line(run(argv + extra))
    finally:
        texts.write_text(original, encoding="utf-8")
    expected = "are not the ones the cache" if how == "texts file edited" else f"in another order than {texts}"
    assert expected in line and "label" in line, line                # refused at start, before the identity check
    assert newest_step(out) == 2                                # nothing trained on the wrong labels
    done = run(argv)                                            # the original texts resume
    assert done.returncode == 0 and "resumed from local" in done.stdout, done.stderr[-3000:]


def test_a_state_saved_before_labels_were_recorded_still_resumes():
    from nblib.train.state import check_identity

    check_identity({"classes": ["a"]}, {"classes": ["a"], "labels": "f" * 64}, "RUN")


# ------------------------------------------------------------------------------ folders and mirrors

FOLDER_CASES = {
    "empty mirror": (lambda c, o: ["--mirror", ""], "is empty"),
    "s3:// with no bucket": (lambda c, o: ["--mirror", "s3://"], "names no bucket"),
    "memory://": (lambda c, o: ["--mirror", "memory://x"], "dies with it"),
    "ftp://": (lambda c, o: ["--mirror", "ftp://host/x"], "does not write to ftp://"),
    "http://": (lambda c, o: ["--mirror", "http://host/x"], "does not write to http://"),
    "mirror = out": (lambda c, o: ["--mirror", str(o)], "same folder"),
    "mirror inside out": (lambda c, o: ["--mirror", str(o / "backup")], "is inside --out"),
    "mirror inside the cache": (lambda c, o: ["--mirror", str(c / "backup")], "is inside --cache"),
    "out = cache": (lambda c, o: ["--out", str(c)], "same folder"),
    "out inside the cache": (lambda c, o: ["--out", str(c / "run")], "is inside --cache"),
    "cache inside out": (lambda c, o: ["--out", str(c.parent)], "is inside --out"),
}


@pytest.mark.parametrize("case", FOLDER_CASES)
def test_a_mirror_or_run_folder_that_is_no_second_copy_is_refused_before_anything_is_written(cache_dir, tmp_path,
                                                                                             case):
    """Before: each was accepted and reported durable (`s3://` became a local folder named `s3:`, `""` the
    current folder, `memory://` lived in the process); ftp:// was a TypeError traceback. The command line
    in this process (the subprocess test below runs one case for real).
    """
    from cli_runner import run_cli

    flags, expected = FOLDER_CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "run"
    before = sorted(p.name for p in cache_dir.iterdir())
    line = one_error_line(run_cli(train_cli(cache_dir, out, *SHORT, *flags(cache_dir, out))[3:], cwd=work))
    assert expected in line, line
    assert not out.exists() and not list(work.iterdir())        # no run folder, no `s3:` or checkpoints/ here
    assert sorted(p.name for p in cache_dir.iterdir()) == before


@pytest.mark.parametrize("mirror", ["s3://", ""])
def test_a_mirror_with_no_bucket_or_no_name_is_one_error_line_from_the_real_command(cache_dir, tmp_path, mirror):
    out = tmp_path / "run"
    line = one_error_line(run(train_cli(cache_dir, out, *SHORT, "--mirror", mirror), cwd=tmp_path))
    assert "names no bucket" in line or "is empty" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == []      # before: s3:/checkpoints, checkpoints/


def test_the_library_call_refuses_the_same_folders(cache_dir, tmp_path):
    from nblib.train import TrainConfig, train

    with pytest.raises(ConfigError, match="same folder"):
        train(cache_dir, cache_dir, TrainConfig(steps=2))
    with pytest.raises(ConfigError, match="dies with it"):
        train(cache_dir, tmp_path / "run", TrainConfig(steps=2), mirror="memory://x")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ seeds


def test_a_seed_beyond_two_to_the_64_is_one_error_line_and_one_beyond_two_to_the_32_trains(cache_dir, tmp_path):
    """Before: --seed 2**32 was numpy's ValueError traceback (np.random.seed takes 32 bits)."""
    line = one_error_line(run(train_cli(cache_dir, tmp_path / "big", *SHORT, "--seed", str(2 ** 64))))
    assert "2**64 - 1" in line and "--seed" in line, line
    assert not (tmp_path / "big").exists()
    for seed in (2 ** 32, 2 ** 64 - 1):
        done = run(train_cli(cache_dir, tmp_path / f"seed{seed}", *SHORT, "--seed", str(seed)))
        assert done.returncode == 0, done.stderr[-3000:]
        assert (tmp_path / f"seed{seed}" / "final.pt").exists()
    with pytest.raises(ConfigError, match="2\\*\\*64 - 1"):
        from nblib.train import TrainConfig

        TrainConfig(seed=2 ** 64)


# ------------------------------------------------------------------------------ buckets


def test_a_mistyped_bucket_is_refused_by_name_and_never_created(cache_dir, tmp_path, moto):
    """Before: the mirror's makedirs created `no-such-bucket` silently and the run reported it durable."""
    endpoint, fs = moto
    env = train_env(**test_train_resume._aws(endpoint))
    line = one_error_line(subprocess.run(train_cli(cache_dir, tmp_path / "run", *SHORT, "--mirror",
                                                   "s3://no-such-bucket/run"), env=env, capture_output=True,
                                         text=True, timeout=600))      # the environment names the server
    assert "s3://no-such-bucket does not exist" in line and "create it first" in line, line
    assert not fs.exists("no-such-bucket")
    assert not (tmp_path / "run").exists()


def test_the_mirror_never_creates_a_bucket_and_an_existing_one_passes_the_check(moto):
    from nblib.train.objstore import check_bucket_exists, mirror_target

    _, fs = moto
    if not fs.exists("runs"):
        fs.mkdir("runs")
    check_bucket_exists("s3://runs/exp", timeout_s=30)          # exists: no error
    root, ops = mirror_target("s3://made-by-a-typo/run")
    ops.makedirs(root / "checkpoints")
    assert not fs.exists("made-by-a-typo")


def test_an_unreachable_or_stalled_endpoint_lets_the_run_start(monkeypatch):
    """A dead port, or a server that accepts and never answers: not a refusal (training never waits)."""
    from test_train_stall import StallServer

    from nblib.train.objstore import check_bucket_exists

    for key, value in test_train_resume._aws(f"http://127.0.0.1:{free_port()}").items():
        monkeypatch.setenv(key, value)
    check_bucket_exists("s3://gone/exp", timeout_s=30)
    with StallServer() as server:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.port}")
        check_bucket_exists("s3://stall/exp", timeout_s=1)


# ------------------------------------------------------------------------------ SIGTERM


@pytest.mark.parametrize("pending", [False, True])
def test_a_worker_that_exited_unexpectedly_is_the_sigterm_only_once_this_process_got_one(pending):
    """A SIGTERM to the group ends the workers; torch says so in two ways: its SIGCHLD handler's "killed by
    signal: Terminated", or, when its queue poll sees the dead workers first, "exited unexpectedly" (one
    fresh-clone run exited 1 with that traceback). The second is the SIGTERM only if this process got one.
    """
    from nblib.train.command import SigtermStop, Terminated

    stop = SigtermStop()
    stop.pending = pending
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGCHLD)}   # the stop ignores SIGTERM
    try:
        with pytest.raises(Terminated if pending else RuntimeError), stop.workers_terminated():
            raise RuntimeError("DataLoader worker (pid(s) 1955, 1956) exited unexpectedly")
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    with pytest.raises(RuntimeError, match="out of memory"), stop.workers_terminated():
        raise RuntimeError("CUDA out of memory")


@pytest.mark.parametrize("target", ["the main process", "the process group"])
def test_sigterm_with_two_workers_stops_cleanly_releases_the_pipes_and_the_rerun_is_exact(cache_dir, reference,
                                                                                          tmp_path, target):
    """Before: SIGTERM killed the main process at once (exit -15), its two loader workers held the caller's
    stdout and stderr 5 s longer (their watchdog's interval), and one sometimes printed a BrokenPipeError
    traceback; a SIGTERM to the group gave torch's "DataLoader worker ... killed by signal" traceback.
    """
    out = tmp_path / "run"
    cmd = train_cli(cache_dir, out, "--workers", "2")
    proc = subprocess.Popen(cmd, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    eof: dict[str, float] = {}
    text: dict[str, bytes] = {}

    def drain(name, pipe):
        text[name] = pipe.read()
        eof[name] = time.monotonic()

    readers = [threading.Thread(target=drain, args=(n, p), daemon=True)
               for n, p in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 600
        while newest_step(out) < 2 and proc.poll() is None:
            assert time.monotonic() < deadline, "timed out waiting for a checkpoint"
            time.sleep(0.01)
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert proc.poll() is None and len(workers) >= 2, "the run ended (or had no workers) before the signal"
        if target == "the main process":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        status = proc.wait(timeout=120)
        exited = time.monotonic()
        for reader in readers:
            reader.join(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    held = sorted({"stdout", "stderr"} - set(eof))
    assert not held, (f"{' and '.join(held)} still open 60 s after the main process ended (status {status}): "
                      f"a process it started holds the caller's pipes")
    stderr = text["stderr"].decode()
    assert status == 128 + signal.SIGTERM, (status, stderr[-3000:])
    assert "Traceback" not in stderr and "terminated (SIGTERM" in stderr, stderr[-3000:]
    # the pipes close with the process (before: 5 s after it, held by the workers), and no worker outlives it
    assert max(eof.values()) - exited < 3.0, (eof, exited)
    # no worker outlives it: each is gone within 2 s of the main process (the old watchdog took 5 s; the
    # forkserver and resource tracker notice their parent's exit through a pipe, a few ms later)
    _, alive = psutil.wait_procs(workers, timeout=max(0.0, exited + 2.0 - time.monotonic()))
    assert not [w for w in alive if w.status() != psutil.STATUS_ZOMBIE], alive
    assert not (out / "final.pt").exists()
    done = run(cmd)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from local" in done.stdout
    assert_same_weights(weights_of(out), reference)
