"""nblib.store: durable parts, manifest and checkpoints, local first, mirrored in the background.

Real files and real processes throughout. The failing mirror is a real folder whose calls go
through `FlakyOps`, which raises real OSError(ENOTCONN / EIO) on a schedule (the `_ops` seam).
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from nblib.atomic import TMP_PREFIX, sha256_file
from nblib.errors import ConfigError, DriveError, StateError
from nblib.manifest import read_manifest
from nblib.store import (
    DurableStore,
    FileOps,
    MirrorWarning,
    PartFolder,
    PartInfo,
    VerifyLevel,
    retained_parts,
)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def logged(pattern: str | None = None):
    """The WARNING records nblib logs inside the block (from any thread); one must match `pattern`."""
    handler, logger = _Records(), logging.getLogger("nblib")
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
    if pattern is not None:
        texts = [r.getMessage() for r in handler.records]
        assert any(re.search(pattern, t) for t in texts), f"no record matches {pattern!r}: {texts}"


FAST = dict(retries=4, backoff_s=0.001, retry_interval_s=60.0)


class FlakyOps(FileOps):
    """Real filesystem calls on the mirror that raise real OSErrors: in bursts, or always while down.

    Every primitive call, every read and every block written can fail, so copies die mid-way
    like on a dying FUSE mount (the composite calls of FileOps are built on these).
    """

    def __init__(self, burst_every: int = 0, burst_len: int = 2, down: bool = False):
        self.burst_every, self.burst_len, self.down = burst_every, burst_len, down
        self.calls = self.failures = 0
        self.gate: threading.Event | None = None   # when set to an unset Event, mirror calls block

    def check(self) -> None:
        if self.gate is not None:
            self.gate.wait()
        self.calls += 1
        failing = self.down or (self.burst_every and self.calls % self.burst_every < self.burst_len)
        if failing:
            self.failures += 1
            code = errno.ENOTCONN if self.failures % 2 else errno.EIO
            raise OSError(code, os.strerror(code))

    def open(self, path, mode="rb"):
        self.check()
        return _FlakyFile(super().open(path, mode), self)

    def write_atomic(self, path, blocks, expect_digest=None, **options):
        self.check()
        return super().write_atomic(path, self._checked(blocks), expect_digest, **options)

    def _checked(self, blocks):
        for block in blocks:
            self.check()
            yield block

    def replace(self, src, dst):
        self.check()
        return super().replace(src, dst)

    def makedirs(self, path):
        self.check()
        return super().makedirs(path)

    def listdir(self, path):
        self.check()
        return super().listdir(path)

    def stat(self, path):
        self.check()
        return super().stat(path)

    def unlink(self, path):
        self.check()
        return super().unlink(path)

    def rmdir(self, path):
        self.check()
        return super().rmdir(path)

    def fsync_dir(self, path):
        self.check()
        return super().fsync_dir(path)


class _FlakyFile:
    """A real open file whose reads and writes can fail mid-way like a dying FUSE mount."""

    def __init__(self, f, ops: FlakyOps):
        self.f, self.ops = f, ops

    def write(self, data):
        self.ops.check()
        return self.f.write(data)

    def read(self, *args):
        self.ops.check()
        return self.f.read(*args)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def arrays_for(i: int, n: int = 1000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(i)
    return {"sketches": rng.standard_normal((n, 8)).astype(np.float16),
            "ids": np.arange(i * n, (i + 1) * n, dtype=np.int64)}


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every non-temporary file under root, keyed by relative path."""
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(TMP_PREFIX)}


def assert_same_content(local: Path, mirror: Path) -> None:
    """Both sides hold the same files: data byte for byte; part.json and manifest.json by content.

    (Each side's part.json records its own files' stat fingerprints, and the mirror's manifest
    lists the parts verified on the mirror, so those two differ in bytes, not in what they say.)
    """
    records = ("part.json", "manifest.json")
    data = [{k: v for k, v in tree_hashes(root).items() if Path(k).name not in records} for root in (local, mirror)]
    assert data[0] == data[1]
    assert sorted(str(p.relative_to(local)) for p in local.rglob("part.json")) == \
        sorted(str(p.relative_to(mirror)) for p in mirror.rglob("part.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sides = [{p.name: p.content_id for p in DurableStore(root).list_parts()} for root in (local, mirror)]
        assert sides[0] == sides[1]
        assert DurableStore(local).read_manifest() == DurableStore(mirror).read_manifest()


def test_parts_round_trip_with_shapes_dtypes_and_meta(tmp_path):
    store = DurableStore(tmp_path / "local")
    info = store.write_part("part-000000", arrays_for(0), meta={"first": 0, "count": 1000})
    (part,) = store.list_parts()
    assert part.name == "part-000000" and part.side == "local" and part.meta == {"first": 0, "count": 1000}
    assert part.files["sketches"].shape == (1000, 8) and part.files["sketches"].dtype == "<f2"
    assert part.files == info.files and part.nbytes == sum(f.stat().st_size for f in part.path.glob("*.npy"))
    back = store.read_part("part-000000")
    for key, arr in arrays_for(0).items():
        np.testing.assert_array_equal(back[key], arr)
        assert back[key].dtype == arr.dtype
    assert part.files["ids"].sha256 == sha256_file(part.path / "ids.npy")


@pytest.mark.parametrize("array", [np.arange(12.0).reshape(3, 4), np.asfortranarray(np.arange(12).reshape(3, 4)),
                                   np.arange(10)[::2], np.float16(3.5) * np.ones(()), np.zeros((0, 3), np.int8),
                                   np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]), np.array([True, False])])
def test_part_files_are_the_exact_bytes_np_save_writes(tmp_path, array):
    info = DurableStore(tmp_path / "store").write_part("p", {"x": array})
    np.save(tmp_path / "ref.npy", array)
    assert (info.path / "x.npy").read_bytes() == (tmp_path / "ref.npy").read_bytes()
    assert info.files["x"].sha256 == sha256_file(tmp_path / "ref.npy")


def test_writer_does_not_wait_for_a_blocked_mirror(tmp_path):
    ops = FlakyOps()
    ops.gate = threading.Event()                 # the mirror hangs, like a stalled Drive
    store = DurableStore(tmp_path / "local", tmp_path / "mirror", _ops=ops, **FAST)
    for i in range(3):
        store.write_part(f"part-{i:06d}", arrays_for(i))
    assert store.mirror_lag == 3                 # all three returned while the mirror could not move
    assert [p.name for p in DurableStore(tmp_path / "local").list_parts()] == [f"part-{i:06d}" for i in range(3)]
    ops.gate.set()
    assert store.flush(timeout=30) and store.mirror_lag == 0
    store.close()


def test_intermittent_mirror_failures_lose_nothing_and_remount_on_enotconn(tmp_path):
    remounts = []
    ops = FlakyOps(burst_every=61, burst_len=2)  # a copy attempt takes ~25 calls
    store = DurableStore(tmp_path / "local", tmp_path / "mirror", _ops=ops,
                         remount=lambda: remounts.append(1), **FAST)
    for i in range(12):
        store.write_part(f"part-{i:06d}", arrays_for(i), meta={"i": i})
        store.write_manifest({"parts_done": i + 1})
    store.save({"step": 7}, "state")
    assert store.flush(timeout=60)
    store.close()
    assert ops.failures >= 5 and remounts, "the schedule must really have failed calls"
    assert_same_content(tmp_path / "local", tmp_path / "mirror")
    assert len(tree_hashes(tmp_path / "mirror")) == 12 * 3 + 1 + 2
    assert DurableStore(tmp_path / "mirror").read_manifest() == {"parts_done": 12}


def test_intermittent_then_permanent_failure_runs_locally_then_mirror_catches_up(tmp_path):
    ops = FlakyOps(burst_every=61, burst_len=2)
    store = DurableStore(tmp_path / "local", tmp_path / "mirror", _ops=ops, keep_local=1, **FAST)
    for i in range(3):                           # Drive hiccups: retried, nothing to see
        store.write_part(f"part-{i:06d}", arrays_for(i))
    assert store.flush(timeout=60) and ops.failures > 0
    ops.down = True                              # then Drive goes away for good
    with pytest.warns(MirrorWarning, match="run continues locally|behind by"):
        for i in range(3, 8):
            store.write_part(f"part-{i:06d}", arrays_for(i))
        store.write_manifest({"parts_done": 8})
        assert store.flush(timeout=30) is False
    status = store.mirror_status()
    assert status.failing and status.parts_pending == 5 and "Errno" in status.last_error
    with pytest.raises(DriveError, match="unreachable"):
        store.list_parts()
    with pytest.raises(DriveError, match="is behind by 5 parts"):
        store.flush(timeout=30, strict=True)
    # nothing lost: retention never deleted an unmirrored part, all 5 verify locally
    local_only = DurableStore(tmp_path / "local")
    assert [p.name for p in local_only.list_parts()] == [f"part-{i:06d}" for i in range(2, 8)]

    ops.down = False                             # Drive is back
    assert store.flush(timeout=60) and store.mirror_lag == 0
    mirror = DurableStore(tmp_path / "mirror")
    assert [p.name for p in mirror.list_parts()] == [f"part-{i:06d}" for i in range(8)]
    for i in range(8):
        np.testing.assert_array_equal(mirror.read_part(f"part-{i:06d}")["ids"], arrays_for(i)["ids"])
    assert mirror.read_manifest() == {"parts_done": 8}
    assert sorted(p.name for p in (tmp_path / "local").iterdir() if p.is_dir()) == ["part-000007"]
    store.close()


def test_a_remount_waiting_for_reauthorization_pauses_the_mirror_and_the_run_goes_on(tmp_path, monkeypatch):
    from nblib.encode.run import RunPlan, _postfix

    drive = colab_stub_drive(tmp_path / "stub", monkeypatch)
    monkeypatch.setenv("NBLIB_REMOUNT_TIMEOUT_S", "0.5")
    mountpoint = tmp_path / "content" / "drive"
    drive.mount(str(mountpoint))
    local, mirror = tmp_path / "local", mountpoint / "MyDrive" / "nblib" / "parts"
    store = DurableStore(local, mirror, retries=2, backoff_s=0.01, retry_interval_s=0.2,
                         remount=lambda: drive.mount(str(mountpoint), force_remount=True))
    try:
        store.write_part("part-000000", arrays_for(0))
        assert store.flush(timeout=30)
        drive.control(disconnected=True, reauth=True)   # Errno 107, and the remount waits for the user
        started = time.monotonic()
        with pytest.warns(MirrorWarning) as caught:
            for i in range(1, 4):
                store.write_part(f"part-{i:06d}", arrays_for(i))
            assert store.flush(timeout=30) is False       # returns, not hangs on the blocked remount
        paused = r"is paused: the Drive remount did not return within 0.5 s.*re-authorized.*remount_drive\(\)"
        assert any(re.search(paused, str(w.message)) for w in caught), [str(w.message) for w in caught]
        assert time.monotonic() - started < 15
        status = store.mirror_status()
        assert status.paused and status.failing and status.parts_pending == 3
        post = _postfix(store, {"parts": dict.fromkeys(range(4))}, RunPlan(40, 1, 10), device=_cpu())
        assert post["mirror"] == "paused: re-authorize Drive" and post["mirror_lag"] == 3
        with pytest.raises(DriveError, match="is paused.*re-authorized"):
            store.list_parts()                            # a caller's read times out too
        assert [p.name for p in store.local.list()[0]] == [f"part-{i:06d}" for i in range(4)]

        drive.control(reauth=False)                       # the user accepts the prompt: the mount returns
        assert store.flush(timeout=30) and store.mirror_lag == 0
        assert not store.mirror_status().paused and "mirror" not in _postfix(
            store, {"parts": {}}, RunPlan(40, 1, 10), device=_cpu())
        store.close()
        assert_same_content(local, mirror)
    finally:
        store.close(timeout=10)
        drive.flush_and_unmount()


def colab_stub_drive(home: Path, monkeypatch):
    """tests/colab_stub's `google.colab.drive`, loaded under another name (this process stays non-Colab)."""
    import importlib.util

    monkeypatch.setenv("COLAB_STUB_HOME", str(home))
    path = Path(__file__).parent / "colab_stub" / "google" / "colab" / "drive.py"
    spec = importlib.util.spec_from_file_location("colab_stub_drive", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cpu():
    from types import SimpleNamespace

    return SimpleNamespace(type="cpu")


def test_backlog_of_a_dead_process_is_mirrored_by_the_next_store(tmp_path):
    ops = FlakyOps(down=True)
    with pytest.warns(MirrorWarning):
        first = DurableStore(tmp_path / "local", tmp_path / "mirror", _ops=ops, **FAST)
        for i in range(3):
            first.write_part(f"part-{i:06d}", arrays_for(i))
        first.write_manifest({"parts_done": 3})
        first.close(timeout=30)
    assert not (tmp_path / "mirror" / "part-000000" / "part.json").exists()
    with DurableStore(tmp_path / "local", tmp_path / "mirror", **FAST) as second:
        assert second.flush(timeout=60)
    assert_same_content(tmp_path / "local", tmp_path / "mirror")


def test_truncated_npy_is_detected_and_not_trusted(tmp_path):
    store = DurableStore(tmp_path)
    store.write_part("part-000000", arrays_for(0))
    store.write_part("part-000001", arrays_for(1))
    npy = tmp_path / "part-000001" / "sketches.npy"
    npy.write_bytes(npy.read_bytes()[:-100])
    with logged("truncated"):
        assert [p.name for p in store.list_parts()] == ["part-000000"]
    with logged("truncated"):
        parts, damaged = store.verify()
    assert [p.name for p in parts] == ["part-000000"]
    assert [(d.name, d.side) for d in damaged] == [("part-000001", "local")]
    with pytest.raises(StateError, match="part-000001.*recompute"):
        store.read_part("part-000001")


def test_flipped_byte_of_same_size_is_detected_by_sha256(tmp_path):
    store = DurableStore(tmp_path)
    store.write_part("part-000000", arrays_for(0))
    npy = tmp_path / "part-000000" / "ids.npy"
    data = bytearray(npy.read_bytes())
    data[-1] ^= 0xFF
    npy.write_bytes(bytes(data))
    assert [p.name for p in DurableStore(tmp_path).list_parts(verify=VerifyLevel.SIZES)] == ["part-000000"]  # size only
    with logged("sha256"):
        assert DurableStore(tmp_path).list_parts() == []


@pytest.mark.parametrize("damage", ["missing", "half-written", "other part"])
def test_part_without_a_valid_part_json_does_not_exist(tmp_path, damage):
    store = DurableStore(tmp_path)
    store.write_part("part-000000", arrays_for(0))
    store.write_part("part-000001", arrays_for(1))
    record = tmp_path / "part-000000" / "part.json"
    if damage == "missing":
        record.unlink()
    elif damage == "half-written":
        record.write_bytes(record.read_bytes()[: len(record.read_bytes()) // 2])
    else:
        record.write_bytes((tmp_path / "part-000001" / "part.json").read_bytes())
    with logged("part-000000"):
        assert [p.name for p in DurableStore(tmp_path).list_parts()] == ["part-000001"]


def test_temporaries_and_foreign_folders_are_never_parts(tmp_path):
    store = DurableStore(tmp_path)
    store.write_part("part-000000", arrays_for(0))
    (tmp_path / "part-000001").mkdir()
    (tmp_path / "part-000001" / f"{TMP_PREFIX}sketches.npy.x1").write_bytes(b"\x93NUMPY half")
    (tmp_path / f"{TMP_PREFIX}part-000002").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # a leftover temporary is not damage, just litter
        assert [p.name for p in store.list_parts()] == ["part-000000"]


@pytest.mark.parametrize("damage", ["half-written", "body edited"])
def test_damaged_manifest_is_detected_and_the_other_side_used(tmp_path, damage):
    store = DurableStore(tmp_path / "local", tmp_path / "mirror", **FAST)
    store.write_manifest({"parts_done": 3, "fingerprint": "abc"})
    assert store.flush(timeout=30)
    local = tmp_path / "local" / "manifest.json"
    raw = local.read_bytes()
    edited = raw.replace(b'"parts_done": 3', b'"parts_done": 9')
    assert edited != raw
    local.write_bytes(raw[: len(raw) // 2] if damage == "half-written" else edited)
    with logged("manifest.json"):
        assert store.read_manifest() == {"parts_done": 3, "fingerprint": "abc"}
    store.close()
    with logged("returning None"):
        assert DurableStore(tmp_path / "local").read_manifest() is None


def test_newest_manifest_wins_and_sequence_survives_restart(tmp_path):
    with DurableStore(tmp_path / "local", tmp_path / "mirror", **FAST) as store:
        store.write_manifest({"n": 1})
        store.write_manifest({"n": 2})
    (tmp_path / "local" / "manifest.json").unlink()     # a fresh Colab VM: local staging is empty
    with DurableStore(tmp_path / "local", tmp_path / "mirror", **FAST) as store:
        assert store.read_manifest() == {"n": 2}
        store.write_manifest({"n": 3})
        assert store.flush(timeout=30)
    assert DurableStore(tmp_path / "mirror").read_manifest() == {"n": 3}


def test_resume_takes_the_newest_verified_copy_from_either_side(tmp_path):
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    with DurableStore(local, mirror, **FAST) as store:
        for i in range(3):
            store.write_part(f"part-{i:06d}", arrays_for(i))
        assert store.flush(timeout=30)
    # local copy deleted (fresh VM): the mirror has it
    DurableStore(local).delete_part("part-000000")
    # mirror copy corrupt: the local one is good
    bad = mirror / "part-000001" / "ids.npy"
    bad.write_bytes(bad.read_bytes()[:-8] + b"garbage!")
    # local copy rewritten later with other data: the newer copy wins
    DurableStore(local).write_part("part-000002", arrays_for(99))
    store = DurableStore(local, mirror, **FAST)
    with logged("part-000001 \\(mirror"):
        sides = {p.name: p.side for p in store.list_parts()}
    assert sides == {"part-000000": "mirror", "part-000001": "local", "part-000002": "local"}
    np.testing.assert_array_equal(store.read_part("part-000000")["ids"], arrays_for(0)["ids"])
    np.testing.assert_array_equal(store.read_part("part-000002")["ids"], arrays_for(99)["ids"])
    assert store.flush(timeout=30)               # ... and the damaged mirror copy was repaired
    store.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(DurableStore(mirror).list_parts()) == 3
    # and a still newer copy on the mirror side beats the local one, and is not overwritten by it
    DurableStore(mirror).write_part("part-000002", arrays_for(7))
    with DurableStore(local, mirror, **FAST) as store:
        assert store.flush(timeout=30)
        np.testing.assert_array_equal(store.read_part("part-000002")["ids"], arrays_for(7)["ids"])
        assert {p.name: p.side for p in store.list_parts()}["part-000002"] == "mirror"


def test_mirror_folder_deleted_mid_run_is_refilled_and_the_status_says_so(tmp_path):
    """Issue #10 item 6: a mirror deleted mid-run was reported caught up while missing parts 0-3."""
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    store = DurableStore(local, mirror, **FAST)
    for i in range(4):
        store.write_part(f"part-{i:06d}", arrays_for(i))
        store.write_manifest({"parts_done": i + 1})
    assert store.flush(timeout=30) and store.mirror_status().refilled == 0
    shutil.rmtree(mirror)                        # someone deletes the Drive folder between part writes
    for i in range(4, 16):
        store.write_part(f"part-{i:06d}", arrays_for(i))
        store.write_manifest({"parts_done": i + 1})
    assert store.flush(timeout=60)
    status = store.mirror_status()
    assert status.caught_up and status.refilled == 4 and status.lost == 0 and status.parts_mirrored == 16
    store.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parts, damaged = DurableStore(mirror).verify()   # every file hashed on the mirror
    assert [p.name for p in parts] == [f"part-{i:06d}" for i in range(16)] and damaged == []
    record = read_manifest(mirror / "manifest.json", "nblib.store.run", versions=(2,))
    assert record.body["parts"] == [f"part-{i:06d}" for i in range(16)]
    assert record.body["run"] == {"parts_done": 16}


def test_mirror_deleted_while_copying_still_ends_complete(tmp_path):
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    with DurableStore(local, mirror, **FAST) as store:
        for i in range(12):
            store.write_part(f"part-{i:06d}", arrays_for(i))
            if i in (3, 7):                      # no flush: the thread may be mid-copy
                shutil.rmtree(mirror, ignore_errors=True)
        assert store.flush(timeout=60) and store.mirror_status().lost == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [p.name for p in DurableStore(mirror).list_parts()] == [f"part-{i:06d}" for i in range(12)]


def test_parts_lost_on_the_mirror_after_retention_are_reported_not_hidden(tmp_path):
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    store = DurableStore(local, mirror, keep_local=1, **FAST)
    for i in range(4):
        store.write_part(f"part-{i:06d}", arrays_for(i))
    assert store.flush(timeout=30)
    assert [p.name for p in store.local.list()[0]] == ["part-000003"]   # retention freed the rest
    shutil.rmtree(mirror)
    with logged("lost parts.*part-000000.*recomputed"):
        assert store.flush(timeout=30)
    status = store.mirror_status()
    assert status.lost == 3 and status.refilled == 1 and status.parts_mirrored == 1
    store.close()
    assert [p.name for p in DurableStore(mirror).list_parts()] == ["part-000003"]


class CountingOps(FileOps):
    """Real calls, counting which files are opened (a hash opens the file, a stat does not)."""

    def __init__(self):
        self.opened: list[str] = []

    def open(self, path, mode="rb"):
        self.opened.append(Path(path).name)
        return super().open(path, mode)


def test_quick_check_hashes_only_files_whose_stat_fingerprint_changed(tmp_path):
    DurableStore(tmp_path).write_part("part-000000", arrays_for(0))
    ops = CountingOps()
    folder = PartFolder(tmp_path, ops)
    assert [p.name for p in folder.list(verify=VerifyLevel.STAT)[0]] == ["part-000000"]
    assert ops.opened == ["part.json"]           # metadata only: nothing hashed
    npy = tmp_path / "part-000000" / "ids.npy"
    data = bytearray(npy.read_bytes())
    data[-1] ^= 0xFF
    npy.write_bytes(bytes(data))                 # same size, new mtime
    ops.opened.clear()
    assert isinstance(folder.check("part-000000", verify=VerifyLevel.SIZES), PartInfo)       # sizes only: fooled
    assert "sha256" in folder.check("part-000000", verify=VerifyLevel.STAT).reason          # fingerprint: hashed
    assert ops.opened.count("ids.npy") == 1 and "sketches.npy" not in ops.opened
    with logged("sha256"):
        assert DurableStore(tmp_path).list_parts(verify=VerifyLevel.STAT) == []
    with pytest.raises(ConfigError, match="verify='full'"):
        folder.check("part-000000", verify="full")


def test_local_folder_reads_local_copies_without_a_second_store(tmp_path):
    store = DurableStore(tmp_path / "local", tmp_path / "mirror", **FAST)
    store.write_part("part-000000", arrays_for(0))
    np.testing.assert_array_equal(store.local.read("part-000000", verify=VerifyLevel.STAT)["ids"], arrays_for(0)["ids"])
    assert store.local.root == store.local_dir and store.close()


def test_retention_keeps_last_n_and_every_kth_locally():
    names = [f"part-{i:06d}" for i in range(10)]
    assert retained_parts(names, keep_last=2, keep_every=4) == {"part-000000", "part-000004", "part-000008",
                                                                "part-000009"}
    assert retained_parts(names, keep_last=None, keep_every=4) == set(names)
    assert retained_parts(names, keep_last=0, keep_every=None) == set()


def test_retention_deletes_only_parts_verified_on_the_mirror(tmp_path):
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    ops = FlakyOps()
    with DurableStore(local, mirror, keep_local=2, keep_every=4, _ops=ops, **FAST) as store:
        for i in range(10):
            store.write_part(f"part-{i:06d}", arrays_for(i))
        assert store.flush(timeout=60)
        ops.down = True                          # from here nothing reaches the mirror
        with pytest.warns(MirrorWarning):
            for i in range(10, 13):
                store.write_part(f"part-{i:06d}", arrays_for(i))
            store.flush(timeout=30)
        kept = sorted(p.name for p in local.iterdir() if p.is_dir())
        assert kept == ["part-000000", "part-000004", "part-000008", "part-000009",
                        "part-000010", "part-000011", "part-000012"]
        ops.down = False
        assert store.flush(timeout=60)
    kept = sorted(p.name for p in local.iterdir() if p.is_dir())
    assert kept == ["part-000000", "part-000004", "part-000008", "part-000011", "part-000012"]
    assert len(DurableStore(mirror).list_parts()) == 13


def test_checkpoint_round_trip_with_a_real_state_dict_and_fallback_on_corruption(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    states = []
    with DurableStore(tmp_path / "local", tmp_path / "mirror", keep_checkpoints=2, **FAST) as store:
        for step in range(3):
            with torch.no_grad():
                model[0].weight.add_(1.0)
            states.append({k: v.clone() for k, v in model.state_dict().items()})
            store.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, "trainer")
        assert store.flush(timeout=30)
        loaded = store.load_latest("trainer")
    assert loaded["step"] == 2 and all(torch.equal(loaded["model"][k], v) for k, v in states[2].items())
    assert loaded["opt"]["state"][0]["exp_avg"].shape == (16, 8)
    for side in ("local", "mirror"):             # last 2 versions kept on both sides
        kept = sorted(p.name for p in (tmp_path / side).glob("trainer-*.pt"))
        assert kept == ["trainer-000002.pt", "trainer-000003.pt"]
    # the newest is corrupt everywhere: truncated on the mirror, one weight silently flipped locally
    mirror_newest = tmp_path / "mirror" / "trainer-000003.pt"
    mirror_newest.write_bytes(mirror_newest.read_bytes()[:100])
    local_newest = tmp_path / "local" / "trainer-000003.pt"
    data = bytearray(local_newest.read_bytes())
    at = data.find(states[2]["0.weight"].numpy().tobytes())
    assert at > 0
    data[at + 3] ^= 0x40                         # still a loadable file: only sha256 can tell
    local_newest.write_bytes(bytes(data))
    with logged("trainer-000003"):
        older = DurableStore(tmp_path / "local", tmp_path / "mirror", **FAST).load_latest("trainer")
    assert older["step"] == 1 and torch.equal(older["model"]["0.weight"], states[1]["0.weight"])


def test_checkpoint_loads_from_the_mirror_on_a_fresh_machine_and_numbering_continues(tmp_path):
    torch = pytest.importorskip("torch")
    with DurableStore(tmp_path / "local", tmp_path / "mirror", **FAST) as store:
        store.save({"w": torch.arange(3.0)}, "model")
    for p in (tmp_path / "local").iterdir():
        p.unlink()
    with DurableStore(tmp_path / "local", tmp_path / "mirror", **FAST) as store:
        assert torch.equal(store.load_latest("model")["w"], torch.arange(3.0))
        assert store.save({"w": torch.ones(3)}, "model").name == "model-000002.pt"
        assert store.load_latest("nothing-saved") is None


def test_bad_knobs_and_names_are_refused_with_the_knob_named(tmp_path):
    with pytest.raises(ConfigError, match="same folder"):
        DurableStore(tmp_path, tmp_path)
    with pytest.raises(ConfigError, match="keep_local=-1"):
        DurableStore(tmp_path, keep_local=-1)
    with pytest.raises(ConfigError, match="keep_every=0"):
        DurableStore(tmp_path, keep_every=0)
    store = DurableStore(tmp_path)
    for name in ("../escape", ".hidden", "a/b", ""):
        with pytest.raises(StateError, match="plain file name"):
            store.write_part(name, {"x": np.zeros(1)})
    with pytest.raises(StateError, match="no arrays"):
        store.write_part("p", {})
    with pytest.raises(StateError, match="dtype object"):
        store.write_part("p", {"x": np.array([{}], dtype=object)})


def test_flush_without_colab_is_a_no_op_unmount_and_close_is_idempotent(tmp_path):
    store = DurableStore(tmp_path / "local", tmp_path / "mirror", **FAST)
    store.write_part("part-000000", arrays_for(0))
    assert store.flush(unmount=True)             # google.colab absent: nothing to unmount
    assert store.close() and store.close()
    assert DurableStore(tmp_path / "local").flush()


WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from nblib.store import DurableStore

    local, mirror, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = DurableStore(local, mirror, keep_local=3, keep_every=5, backoff_s=0.001)
    done = {p.name for p in store.list_parts()}
    for i in range(n):
        name = f"part-{i:06d}"
        if name in done:
            continue
        rng = np.random.default_rng(i)
        store.write_part(name, {"big": rng.standard_normal(300_000).astype(np.float32),
                                "ids": np.arange(i * 10, i * 10 + 10)}, meta={"i": i})
        store.write_manifest({"parts_done": i + 1})
        print(i, flush=True)
    store.close()
    print("done", flush=True)
""")


def expected_part(i: int) -> dict[str, np.ndarray]:
    return {"big": np.random.default_rng(i).standard_normal(300_000).astype(np.float32),
            "ids": np.arange(i * 10, i * 10 + 10)}


@pytest.mark.slow
def test_sigkill_mid_write_leaves_only_complete_verified_parts(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    local, mirror, n = tmp_path / "local", tmp_path / "mirror", 40
    rng = random.Random(5)
    kills = torn = 0
    for attempt in range(8):
        proc = subprocess.Popen([sys.executable, str(script), str(local), str(mirror), str(n)],
                                stdout=subprocess.PIPE, text=True)
        if attempt < 3:
            for _ in range(rng.randint(2, 5)):   # let a few parts land, then kill at a random moment
                if proc.stdout.readline() in ("", "done\n"):
                    break
            time.sleep(rng.uniform(0.0, 0.05))
            proc.send_signal(signal.SIGKILL)
            kills += 1
        out, _ = proc.communicate(timeout=120)
        with logged() as records:                # torn parts are expected here
            parts = DurableStore(local, mirror, **FAST).list_parts()
        torn += sum("torn" in r.getMessage() for r in records)
        for part in parts:                       # every listed part is complete and right
            assert not part.name.startswith(TMP_PREFIX)
            got = DurableStore(local, mirror, **FAST).read_part(part.name)
            i = int(part.name.split("-")[1])
            for key, arr in expected_part(i).items():
                np.testing.assert_array_equal(got[key], arr)
        if "done" in out:
            break
    assert kills == 3
    with DurableStore(local, mirror, **FAST) as store:
        with warnings.catch_warnings():
            warnings.simplefilter("error")       # after the clean finish nothing is torn
            assert [p.name for p in store.list_parts()] == [f"part-{i:06d}" for i in range(n)]
        assert store.read_manifest() == {"parts_done": n}
        assert store.flush(timeout=60)
    assert [p.name for p in DurableStore(mirror).list_parts()] == [f"part-{i:06d}" for i in range(n)]


def test_a_large_atomic_write_starts_writeback_of_every_range_in_order_and_still_commits_its_bytes(tmp_path,
                                                                                                monkeypatch):
    """Pages go to the disk every WRITEBACK_BYTES while the file is written, so commit's fsync waits only
    for the tail; the ranges cover the file once, in order, and the committed bytes and hash are unchanged.
    """
    import hashlib
    import sys

    from nblib import atomic

    if sys.platform.startswith("linux"):
        call = atomic._sync_file_range()
        with open(tmp_path / "probe", "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
            assert call is not None and call(f.fileno(), 0, 4096, 2) == 0
    ranges = []
    real = atomic.start_writeback
    monkeypatch.setattr(atomic, "start_writeback", lambda fd, off, n: (ranges.append((off, n)), real(fd, off, n)))
    block = bytes(range(256)) * 4096                   # 1 MiB
    with atomic.AtomicWriter(tmp_path / "big.bin") as writer:
        for _ in range(40):
            writer.write(block)
        written = writer.commit()
    step = atomic.WRITEBACK_BYTES
    assert ranges == [(i * step, step) for i in range(40 * len(block) // step)]
    assert written.sha256 == hashlib.sha256(block * 40).hexdigest() == hashlib.sha256(
        (tmp_path / "big.bin").read_bytes()).hexdigest()


def test_a_torch_save_is_written_through_its_temporarys_descriptor_and_hashed_as_written_never_read_back(
        tmp_path, monkeypatch):
    """torch gets the temporary's descriptor (its own open by path truncated the file new_temporary made, and ext4
    allocated the truncated file's blocks at its close: twice the time of a 210 MB save), and the digest is taken
    from the bytes as they pass: nothing reads the file back, and the record's digest is the file's.
    """
    import os

    import torch

    from nblib import atomic

    state = {"w": torch.arange(300_000, dtype=torch.float32), "step": 3}
    opened = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (opened.append(f), real_save(obj, f, *a, **k))[1])

    def no_read(*args, **kwargs):
        raise AssertionError("the file was read back")

    monkeypatch.setattr(os, "preadv", no_read)
    monkeypatch.setattr(os, "pread", no_read)
    written = atomic.atomic_torch_save(state, tmp_path / "s.pt", algorithm="xxh3_128", zip_crc32=False)
    monkeypatch.undo()
    assert len(opened) == 1 and not isinstance(opened[0], (str, os.PathLike))
    assert written.digest == atomic.file_digest(tmp_path / "s.pt", "xxh3_128")[0]
    assert written.bytes == (tmp_path / "s.pt").stat().st_size
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3


def test_a_store_without_a_mirror_flushes_at_once_and_unmounts_no_drive(tmp_path, monkeypatch):
    import nblib.store

    def unmount():
        raise AssertionError("a store with no mirror unmounted Drive")

    monkeypatch.setattr(nblib.store, "_colab_flush_and_unmount", unmount)
    store = nblib.store.DurableStore(tmp_path / "local")
    assert store.flush(unmount=True) is True
    store.close()
