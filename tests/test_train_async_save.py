"""The asynchronous local save: the snapshot is taken at the save step (training on while the writer
thread writes does not change the written bytes), an async run writes the files a synchronous run
writes, a failed background write is raised (at the next save, before final.pt, as an `error:` line
from the CLI) and never swallowed, and a SIGKILL while the writer is mid-file leaves the previous
state in place (retention prunes only after the new state is complete) and the rerun is exact.
"""
from __future__ import annotations

import contextlib
import errno
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from cli_runner import run_nblib
from test_train import FAST, assert_same_weights, labelled_cache, weights_of

from conftest import subprocess_env
from nblib.store.checkpoints import CheckpointFolder, load_latest
from nblib.store.parts import FileOps
from nblib.train import train
from nblib.train.loop import model_config
from nblib.train.model import Classifier
from nblib.train.store import TrainStore

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return labelled_cache(tmp_path_factory.mktemp("async"), 160)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """One torch thread, as the CLI subprocesses run: the same bytes everywhere."""


def _model_and_optimizer():
    torch.manual_seed(0)
    model = Classifier(model_config("smoke").model, 12)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    _step(model, optimizer)
    return model, optimizer


def _step(model, optimizer) -> None:
    size = model.encoder.config.image_size
    images = torch.randint(0, 256, (4, size, size, 3), dtype=torch.uint8)
    torch.nn.functional.cross_entropy(model(images), torch.tensor([0, 1, 2, 3])).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _state(model, optimizer) -> dict:
    return {"step": 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "history": [{"step": 1}]}


def test_the_snapshot_is_taken_at_the_save_step_and_a_later_optimizer_step_does_not_change_the_file(tmp_path):
    model, optimizer = _model_and_optimizer()
    synced = TrainStore(tmp_path / "sync", sync_save=True)
    synced.save(_state(model, optimizer), 1, backup=False, best={"weights": model.state_dict()})

    store = TrainStore(tmp_path / "async")
    release, entered = threading.Event(), threading.Event()
    original = store.local.save

    def held_save(obj, name, version):                  # the writer thread starts, then waits for the test
        entered.set()
        assert release.wait(300), "the test never released the writer"
        return original(obj, name, version)

    store.local.save = held_save
    waited = store.save(_state(model, optimizer), 1, backup=False, best={"weights": model.state_dict()})
    assert entered.wait(300) and waited >= 0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, optimizer)                              # training goes on while the write is pending
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items()), "the step changed nothing"
    release.set()
    store.wait_saves()
    store.close()
    for name in ("state-000001.pt", "best-000001.pt"):
        written = (tmp_path / "async/checkpoints" / name).read_bytes()
        assert written == (tmp_path / "sync/checkpoints" / name).read_bytes(), name
    loaded = load_latest([CheckpointFolder(tmp_path / "async/checkpoints")], "state").obj
    assert all(torch.equal(loaded["model"][k], before[k]) for k in before)


def test_an_async_run_writes_the_bytes_a_synchronous_run_writes(cache_dir, tmp_path):
    config = FAST.replace(keep_last=8)
    sync = train(cache_dir, tmp_path / "sync", config, sync_save=True)
    asy = train(cache_dir, tmp_path / "async", config)
    assert asy.write_seconds and not sync.write_seconds
    states = sorted(p.name for p in (tmp_path / "sync/checkpoints").glob("*.pt"))
    assert states == sorted(p.name for p in (tmp_path / "async/checkpoints").glob("*.pt"))
    assert len(states) >= 4
    for name in states + ["../final.pt"]:
        assert (tmp_path / "async/checkpoints" / name).read_bytes() == \
            (tmp_path / "sync/checkpoints" / name).read_bytes(), name
    assert len(asy.save_waits) == len(asy.save_seconds) == len(sync.save_seconds)


def _failing_write(monkeypatch, failing_name: str) -> None:
    original = FileOps.write_torch

    def write_torch(self, path, obj, *, sync_dir=True):
        if Path(path).name == failing_name:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return original(self, path, obj, sync_dir=sync_dir)

    monkeypatch.setattr(FileOps, "write_torch", write_torch)


def test_a_failed_background_write_is_raised_at_the_next_save(cache_dir, tmp_path, monkeypatch):
    _failing_write(monkeypatch, "state-000002.pt")
    reached = []
    with pytest.raises(OSError, match="No space left") as caught:
        train(cache_dir, tmp_path / "run", FAST, on_step=lambda step, report: reached.append(step))
    assert max(reached) == 3                              # step 4's save raised step 2's failure
    assert any("step 2" in note for note in getattr(caught.value, "__notes__", []))
    assert not (tmp_path / "run/final.pt").exists()


def test_a_failed_last_write_is_raised_before_final_pt_is_written(cache_dir, tmp_path, monkeypatch):
    _failing_write(monkeypatch, f"state-{FAST.steps:06d}.pt")
    with pytest.raises(OSError, match="No space left"):
        train(cache_dir, tmp_path / "run", FAST)
    assert not (tmp_path / "run/final.pt").exists()
    assert max(TrainStore(tmp_path / "run", sync_save=True).local.versions("state")) == FAST.steps - 2


FAIL_IN_SUBPROCESS = """
import errno, io, sys, time
from pathlib import Path
import torch
from nblib.store.parts import FileOps
from nblib.atomic import AtomicWriter
MODE, TARGET, MARK = sys.argv[1], sys.argv[2], sys.argv[3]
original = FileOps.write_torch
def write_torch(self, path, obj, *, sync_dir=True):
    if Path(path).name != TARGET:
        return original(self, path, obj, sync_dir=sync_dir)
    if MODE == "fail":
        raise OSError(errno.ENOSPC, "No space left on device")
    writer = AtomicWriter(path)                        # half a file in its temporary, then hang
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    writer.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    Path(MARK).write_text("mid-write")
    time.sleep(3600)
FileOps.write_torch = write_torch
from nblib.cli import main
sys.exit(main(sys.argv[4:]))
"""


def _cli(cache_dir, out, *extra) -> list[str]:
    return ["train", "--cache", str(cache_dir), "--out", str(out), "--steps", "8", "--batch-size", "16",
            "--save-every", "2", "--backup-every", "4", "--eval-every", "4", "--no-progress", *extra]


def test_the_cli_reports_a_failed_background_write_as_one_error_line(cache_dir, tmp_path):
    cmd = [sys.executable, "-c", FAIL_IN_SUBPROCESS, "fail", "state-000004.pt", str(tmp_path / "mark"),
           *_cli(cache_dir, tmp_path / "run")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(OMP_NUM_THREADS="1"), timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "No space left" in errors[0], done.stderr[-3000:]
    assert not (tmp_path / "run/final.pt").exists()


def test_sigkill_mid_background_write_keeps_the_previous_state_and_the_rerun_is_exact(cache_dir, tmp_path):
    env = subprocess_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    whole = run_nblib(*_cli(cache_dir, tmp_path / "whole"), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    assert whole.returncode == 0, whole.stderr[-3000:]
    out, mark = tmp_path / "run", tmp_path / "mark"
    cmd = [sys.executable, "-c", FAIL_IN_SUBPROCESS, "hang", "state-000004.pt", str(mark),
           *_cli(cache_dir, out, "--keep-last", "1")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not mark.exists():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the writer never reached state 4"
            time.sleep(0.01)
        proc.kill()                                       # SIGKILL with the temporary half-written
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    folder = CheckpointFolder(out / "checkpoints")
    assert folder.versions("state") == [2]               # keep_last=1, yet 2 stays: 4 never completed
    assert list((out / "checkpoints").glob(".tmp-*"))   # the torn temporary, never a state
    assert load_latest([folder], "state").obj["step"] == 2
    rerun = run_nblib(*_cli(cache_dir, out, "--keep-last", "1"), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "steps 2 -> 8 (resumed from local)" in rerun.stdout
    assert_same_weights(weights_of(out), weights_of(tmp_path / "whole"))



def test_a_resumed_store_removes_the_half_written_temporaries_a_killed_writer_left(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    half = folder / ".tmp-state-000006.pt.4owqjkn4"          # SIGKILL mid-write leaves this name
    half.write_bytes(b"half a state")
    kept = folder / "notes.txt"
    kept.write_text("not ours")
    store = TrainStore(tmp_path / "run")
    try:
        assert not half.exists() and kept.exists()
        assert store.load_latest() == (None, "none")
    finally:
        store.close(0)


@contextlib.contextmanager
def _busy_threads(count: int):
    """`count` threads that each want a core for the block's length (sha256 releases the GIL), as torch's
    intra-op threads of a CPU-bound loop do.
    """
    import hashlib

    block, stop = bytes(1 << 20), threading.Event()

    def spin():
        while not stop.is_set():
            hashlib.sha256(block).digest()

    threads = [threading.Thread(target=spin) for _ in range(count)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def test_an_async_save_after_steps_that_kept_every_core_busy_is_serialized_on_the_loops_thread(tmp_path,
                                                                                              monkeypatch):
    import os

    model, optimizer = _model_and_optimizer()
    synced = TrainStore(tmp_path / "sync", sync_save=True)
    synced.save(_state(model, optimizer), 1, backup=False)
    store = TrainStore(tmp_path / "async")
    store.guard(optimizer)
    savers = []
    original = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: (savers.append(threading.current_thread()),
                                                         original(*a, **k))[1])
    with _busy_threads(len(os.sched_getaffinity(0))):     # a CPU-bound loop: no core left for a writer thread
        time.sleep(0.5)
        store.save(_state(model, optimizer), 1, backup=False)
    assert store.manager.inline_saves == 1 and savers == [threading.current_thread()]
    _step(model, optimizer)                               # no wait: nothing was deferred
    assert store.fence_seconds == 0.0
    store.wait_saves()
    time.sleep(0.5)                                       # a GPU-like loop: its thread waits
    store.save(_state(model, optimizer), 2, backup=False)
    store.close()
    assert store.manager.inline_saves == 1 and savers[-1] is not threading.current_thread()
    written = (tmp_path / "async/checkpoints/state-000001.pt").read_bytes()
    assert written == (tmp_path / "sync/checkpoints/state-000001.pt").read_bytes()
    assert not list((tmp_path / "async/checkpoints").glob(".tmp-*"))


def test_an_inline_serialized_save_becomes_a_version_only_once_the_writer_committed_it(tmp_path, monkeypatch):
    from nblib.store import manager

    model, optimizer = _model_and_optimizer()
    monkeypatch.setattr(manager.SpareCore, "none_spare", lambda self: True)
    store = TrainStore(tmp_path / "run")
    release = threading.Event()
    original = store.local.commit
    store.local.commit = lambda *args: (release.wait(300), original(*args))[1]
    store.save(_state(model, optimizer), 1, backup=False)
    folder = tmp_path / "run/checkpoints"
    # serialized, not a version
    assert store.local.versions("state") == [] and list(folder.glob(".tmp-state-000001.pt*"))
    release.set()
    store.wait_saves()
    assert store.local.versions("state") == [1] and not list(folder.glob(".tmp-*"))
    store.close()


def test_a_failed_commit_of_an_inline_save_is_raised_at_the_next_save_and_leaves_no_temporary(tmp_path, monkeypatch):
    from nblib.store import manager

    model, optimizer = _model_and_optimizer()
    monkeypatch.setattr(manager.SpareCore, "none_spare", lambda self: True)
    monkeypatch.setattr("nblib.atomic.os.fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    store = TrainStore(tmp_path / "run")
    store.save(_state(model, optimizer), 1, backup=False)
    with pytest.raises(OSError, match="I/O error") as caught:
        store.save(_state(model, optimizer), 2, backup=False)
    assert any("step 1" in note for note in getattr(caught.value, "__notes__", []))
    assert store.local.versions("state") == [] and not list((tmp_path / "run/checkpoints").glob(".tmp-*"))
    store.close()


def test_a_loop_leaves_no_spare_core_when_its_threads_wanted_a_quarter_core_more_than_all_cores_but_one():
    from nblib.store.manager import no_spare_core, thread_demand

    assert no_spare_core(1.4, 1.0, cores=2) and not no_spare_core(1.0, 1.0, cores=2)
    assert no_spare_core(0.6, 1.0, cores=1) and not no_spare_core(0.2, 1.0, cores=1)
    with _busy_threads(1):
        before = thread_demand()
        time.sleep(0.3)
        after = thread_demand()
    time.sleep(0.3)
    assert sum(ns - after.get(tid, 0) for tid, ns in thread_demand().items() if tid in after) / 1e9 < 0.3
    gained = sum(ns - before.get(tid, 0) for tid, ns in after.items()) / 1e9
    assert gained >= 0.25                                 # the busy thread wanted a core all along (0.3 s)


def test_a_save_that_waited_for_the_previous_write_is_said_once_with_an_interval_that_avoids_it(cache_dir, tmp_path,
                                                                                               monkeypatch, caplog):
    from nblib.store.manager import CheckpointManager
    from nblib.train.loop import SAVE_WAIT_NOTICE_S

    original = CheckpointManager._write

    def slow_write(self, *args, **kwargs):           # a disk slower than two steps, even on a loaded machine
        time.sleep(2.5)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointManager, "_write", slow_write)
    reports = []
    with caplog.at_level("WARNING", logger="nblib.train"):
        train(cache_dir, tmp_path / "run", FAST, on_step=lambda step, report: reports.append(report))
    waits = [w for w in reports[-1].save_waits if w > SAVE_WAIT_NOTICE_S]
    said = [r.getMessage() for r in caplog.records if "for the previous write" in r.getMessage()]
    assert len(waits) >= 2 and len(said) == 1, (reports[-1].save_waits, said)
    figures = re.search(r"a write takes (.+?), \d+ steps (.+?);", said[0]).groups()
    write_s, steps_s = (parse_duration(text) for text in figures)
    every = int(said[0].split("--save-every ")[1].split(",")[0])
    assert write_s >= 2.5 and every > FAST.save_every
    assert every * steps_s / FAST.save_every >= write_s * 0.95      # the write ends within the steps between saves


def parse_duration(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"µs": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0}[unit]


def test_the_interval_a_waiting_save_names_covers_the_write():
    from nblib.train.loop import save_wait_line

    assert "--save-every 26," in save_wait_line(2.0, 2.6, 0.1, 5)          # 26 steps of 0.1 s cover a 2.6 s write
    assert "--save-every 6," in save_wait_line(0.2, 0.3, 0.5, 5)           # never fewer than one more than now
