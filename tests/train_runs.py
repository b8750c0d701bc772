"""Real `python -m nblib train` runs for the resume tests (test_train_resume, test_train_gcs): the
command, its environment, an uninterrupted reference run, a run SIGKILLed once a checkpoint exists,
the resume from a bucket alone (any fsspec server: moto's S3, gcp-storage-emulator), and a free
port on 127.0.0.1 for a local bucket server.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from cli_runner import run_nblib
from test_train import assert_same_weights, labelled_cache, weights_of

from conftest import shared_artifact, subprocess_env

STEPS = 12
ARGS = ["--steps", str(STEPS), "--batch-size", "16", "--save-every", "2", "--backup-every", "4",
        "--eval-every", "4", "--no-progress", "--mirror-timeout", "30"]
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def train_cli(cache_dir: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nblib", "train", "--cache", str(cache_dir), "--out", str(out), *ARGS, *extra]


def train_env(**extra: str) -> dict[str, str]:
    return subprocess_env(**THREADS, **extra)


def uninterrupted_weights(cache_dir: Path, out: Path) -> dict:
    """The final weights of one uninterrupted single-process run (no mirror)."""
    done = run_train(train_cli(cache_dir, out))
    assert done.returncode == 0, done.stderr[-3000:]
    return weights_of(out)


def run_train(cmd: list[str], **env: str):
    """A `train_cli` command in this process (cli_runner), with one torch thread as the real runs have."""
    return run_nblib(*cmd[3:], **THREADS, **env)


def newest_step(out: Path) -> int:
    return max((int(p.stem.split("-")[1]) for p in (out / "checkpoints").glob("state-*.json")), default=0)


def run_and_kill(cmd, out: Path, *, after_step: int = 1, extra_s: float, env=None, mirrored: Path | None = None,
                 done=None, group: bool = False, finished_ok: bool = False) -> None:
    """Start `cmd`, SIGKILL it (its process group with `group`) `extra_s` after the step is saved (or `done`).

    finished_ok: a run that ended well before it could be killed is no failure (the caller checks for it).
    """
    proc = subprocess.Popen(cmd, env=env or train_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    if done is None and mirrored is not None:
        done = lambda: bool(list((mirrored / "checkpoints").glob("state-*.json")))  # noqa: E731
    if done is None:
        done = lambda: newest_step(out) >= after_step  # noqa: E731
    try:
        deadline = time.monotonic() + 600
        while not done() and proc.poll() is None:
            assert time.monotonic() < deadline, "timed out waiting for a checkpoint"
            time.sleep(0.01)
        time.sleep(extra_s)
        if finished_ok and proc.poll() == 0:
            return
        assert proc.poll() is None, f"the run ended before the kill: {proc.stderr.read()[-2000:]}"
        if group:                                                # torchrun's ranks and loader workers too
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.send_signal(signal.SIGKILL)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.stderr.close()


def assert_the_bucket_alone_resumes_exactly(cache_dir: Path, reference: dict, out: Path, fs, url: str,
                                            env: dict[str, str]) -> None:
    """Kill a run mirrored to `url` once the bucket holds a state, delete the run folder (a new VM), rerun:
    the uninterrupted run's weights; the bucket holds step 12, byte for byte, and at most keep_last (3) states.
    """
    for attempt in range(3):        # on a loaded machine the run can finish before the bucket holds a state
        attempt_url = url if attempt == 0 else f"{url}-retry{attempt}"
        prefix = attempt_url.split("://", 1)[1]
        sooner = () if attempt == 0 else ("--backup-every", "2")   # a retry: a backup from step 2 (same weights)
        cmd = train_cli(cache_dir, out, "--mirror", attempt_url, *sooner)
        run_and_kill(cmd, out, extra_s=0, env=env, done=lambda prefix=prefix: bucket_holds_a_state(fs, prefix),
                     finished_ok=True)
        finished = (out / "final.pt").exists()
        shutil.rmtree(out)                                       # a new VM: only the bucket survives
        if not finished:
            break
    assert not finished, "the run finished before its bucket held a state, 3 times: no kill mid-run to resume from"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from mirror" in done.stdout and f"mirror holds step {STEPS}" in done.stdout, done.stdout
    assert_same_weights(weights_of(out), reference)
    names = {p.rsplit("/", 1)[-1] for p in ls_or_empty(fs, f"{prefix}/checkpoints")}
    newest = f"state-{STEPS:06d}"
    assert f"{newest}.pt" in names and f"{newest}.json" in names
    assert len([n for n in names if n.startswith("state-") and n.endswith(".pt")]) <= 3     # keep_last on the bucket
    assert fs.cat_file(f"{prefix}/checkpoints/{newest}.pt") == (out / "checkpoints" / f"{newest}.pt").read_bytes()


def ls_or_empty(fs, path: str) -> list[str]:
    """An fsspec listing of `path`, [] where the prefix does not exist yet."""
    try:
        return fs.ls(path, detail=False)
    except FileNotFoundError:
        return []


def bucket_holds_a_state(fs, prefix: str) -> bool:
    """Whether the mirror under bucket/`prefix` holds a train state's record yet."""
    return any(p.endswith(".json") and "state-" in p for p in ls_or_empty(fs, f"{prefix}/checkpoints"))


TWO_RANK_STEPS = 16             # two epochs of 8 steps at 2 ranks x batch 16 of the 128 training samples


def torchrun_cli(cache_dir: Path, out: Path, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "--max-restarts", "0", "-m", "nblib", "train", "--cache", str(cache_dir), "--out", str(out), *ARGS,
            "--steps", str(TWO_RANK_STEPS), "--device", "cpu"]


def build_two_rank_runs(folder: Path) -> SimpleNamespace:
    """Real torchrun launches of 2 ranks in `folder`, for tests that only read them: `whole` an unkilled launch;
    `killed` a launch SIGKILLed (the ranks and torchrun) once step 4 was saved, then rerun to the end (its stdout
    in `resumed_stdout`); `killed_snapshot` a copy of that folder as the kill left it. The per-step sample and
    dropout-seed logs are on (NBLIB_TRAIN_SAMPLE_LOG).
    """
    cache_dir = labelled_cache(folder / "data", 160)
    env = train_env(NBLIB_TRAIN_SAMPLE_LOG="1")
    whole, killed = folder / "whole", folder / "killed"
    done = subprocess.run(torchrun_cli(cache_dir, whole), env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    run_and_kill(torchrun_cli(cache_dir, killed), killed, after_step=4, extra_s=0.05, env=env, group=True)
    assert not (killed / "final.pt").exists()
    shutil.copytree(killed, folder / "killed_snapshot")
    done = subprocess.run(torchrun_cli(cache_dir, killed), env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return SimpleNamespace(cache_dir=cache_dir, whole=whole, killed=killed, killed_snapshot=folder / "killed_snapshot",
                           resumed_stdout=done.stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cache_and_reference(name: str, n_images: int = 160):
    """A test module's two module-scoped fixtures: a labelled cache, and one uninterrupted run's weights.

    Assign both to module names (`cache_dir, reference = cache_and_reference("gcs")`) for pytest to find.
    """
    @pytest.fixture(scope="module")
    def cache_dir(tmp_path_factory) -> Path:
        return labelled_cache(tmp_path_factory.mktemp(name), n_images)

    @pytest.fixture(scope="module")
    def reference(cache_dir, tmp_path_factory) -> dict:
        """The final weights of one uninterrupted single-process run on the same images and labels (a cache
        built the same way elsewhere: the bytes are the same), made once a session for every module.
        """
        def build(folder: Path) -> None:
            uninterrupted_weights(labelled_cache(folder / "data", n_images), folder / "run")

        return weights_of(shared_artifact(tmp_path_factory, f"train-reference-{n_images}", build) / "run")

    return cache_dir, reference
