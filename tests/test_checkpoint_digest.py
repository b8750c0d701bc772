"""Checkpoint digests (commit 9739b7a): version-3 records hold an xxh3_128 of the file, version-2
records (sha256) still load, checkpoint files carry no zip CRC32s (the first a process writes too), and a
load reads its file (never maps it). Real files in tmp_path, real (small) torch tensors.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import uuid
import zipfile
from pathlib import Path

import pytest
import torch
import xxhash

from nblib.atomic import (
    AtomicWriter,
    algorithm_of,
    atomic_torch_save,
    digest_bytes,
    digest_string,
    leftover_temporaries,
    new_hash,
    torch_zip_crc32,
)
from nblib.errors import StateError
from nblib.manifest import manifest_bytes
from nblib.store.checkpoints import (
    CHECKPOINT_KIND,
    CHECKPOINT_VERSION,
    READABLE_VERSIONS,
    CheckpointFolder,
    load_latest,
    stem,
)
from nblib.store.parts import DamagedCopy, FileOps

NAME = "ck"
REAL_TORCH_LOAD = torch.load


def state(version: int) -> dict:
    """A small checkpoint whose tensor bytes are distinct per version (so a flip can be aimed at them)."""
    return {"w": torch.arange(1000 * version, 1000 * version + 64, dtype=torch.float32),
            "step": torch.tensor(version)}


def assert_state_equal(obj, version: int) -> None:
    expected = state(version)
    assert set(obj) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(obj[key], tensor), key


def flip_tensor_byte(path: Path, tensor: torch.Tensor) -> None:
    """Flip one byte inside `tensor`'s stored data in place (the file keeps its size)."""
    data = bytearray(path.read_bytes())
    at = data.find(tensor.numpy().tobytes())
    assert at >= 0, "the tensor's bytes are not stored verbatim"
    data[at + 9] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(data)


def flip_pickle_byte(path: Path) -> None:
    """Flip one byte of data.pkl (the pickled structure) in place; a torch.load of it then fails itself."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    name_len, extra_len = int.from_bytes(data[info.header_offset + 26:info.header_offset + 28], "little"), \
        int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len
    data[start + 2] ^= 0x41                  # the first opcode after PROTO: torch.load raises on it
    with open(path, "r+b") as f:
        f.write(data)


def record_of(folder: CheckpointFolder, version: int) -> dict:
    return json.loads(folder.record_bytes(NAME, version))


def write_v2_record(folder: CheckpointFolder, version: int, sha256: str | None = None) -> Path:
    """Version `version` as nblib wrote it before 9739b7a: torch.save plus a version-2 record holding a sha256."""
    path = folder.root / f"{stem(NAME, version)}.pt"
    atomic_torch_save(state(version), path)
    data = path.read_bytes()
    body = {"name": NAME, "version": version, "file": path.name, "bytes": len(data),
            "sha256": sha256 if sha256 is not None else hashlib.sha256(data).hexdigest(), "created": 1.0}
    (folder.root / f"{stem(NAME, version)}.json").write_bytes(manifest_bytes(CHECKPOINT_KIND, body, version=2))
    return path


@pytest.fixture
def load_calls(monkeypatch):
    """Every torch.load call's `mmap` argument (None when not passed), in order."""
    calls: list = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("mmap"))
        return REAL_TORCH_LOAD(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    return calls


# ------------------------------------------------------------------------ the digest helpers


def test_digest_strings_are_bare_hex_for_sha256_and_prefixed_for_xxh3():
    data = b"checkpoint bytes" * 100
    assert digest_bytes(data) == hashlib.sha256(data).hexdigest()
    assert digest_bytes(data, "xxh3_128") == "xxh3_128:" + xxhash.xxh3_128(data).hexdigest()
    assert algorithm_of(digest_bytes(data)) == "sha256"
    assert algorithm_of(digest_bytes(data, "xxh3_128")) == "xxh3_128"
    assert digest_string("sha256", "ab") == "ab" and digest_string("xxh3_128", "ab") == "xxh3_128:ab"
    with pytest.raises(ValueError, match="unknown hash"):
        new_hash("md5")
    with pytest.raises(ValueError, match="unknown hash"):
        algorithm_of("md5:00")


def test_an_xxh3_writer_refuses_bytes_that_do_not_match_the_expected_digest_and_leaves_no_file(tmp_path):
    data = b"x" * 5000
    target = tmp_path / "f.bin"
    with AtomicWriter(target, algorithm="xxh3_128") as writer:
        writer.write(data)
        with pytest.raises(ValueError, match="expected xxh3_128:"):
            writer.commit(expect_digest=digest_bytes(data + b"!", "xxh3_128"))
    assert not target.exists() and leftover_temporaries(tmp_path) == []
    with AtomicWriter(target, algorithm="xxh3_128") as writer:
        writer.write(data)
        written = writer.commit(expect_digest=digest_bytes(data, "xxh3_128"))
    assert target.read_bytes() == data and written.digest == digest_bytes(data, "xxh3_128")
    with pytest.raises(ValueError, match="not sha256"):
        written.sha256  # noqa: B018  (the property raises)


# ------------------------------------------------------------------------ what a save writes


def test_a_checkpoint_save_writes_a_version_3_record_with_the_xxh3_128_of_the_file_and_no_sha256(tmp_path):
    folder = CheckpointFolder(tmp_path, FileOps())
    path = folder.save(state(1), NAME, 1)
    record = record_of(folder, 1)
    body = record["body"]
    assert record["kind"] == CHECKPOINT_KIND and record["version"] == CHECKPOINT_VERSION == 3
    assert "sha256" not in body and "digest" not in body
    assert len(body["xxh3_128"]) == 32 and int(body["xxh3_128"], 16) >= 0
    data = path.read_bytes()
    assert body["xxh3_128"] == xxhash.xxh3_128(data).hexdigest()
    assert body["bytes"] == len(data) and body["file"] == path.name == f"{stem(NAME, 1)}.pt"
    assert leftover_temporaries(tmp_path) == []


def test_write_torch_reports_the_xxh3_digest_and_size_of_what_it_wrote(tmp_path):
    written = FileOps().write_torch(tmp_path / "a.pt", state(1))
    data = written.path.read_bytes()
    assert written.digest == "xxh3_128:" + xxhash.xxh3_128(data).hexdigest()
    assert written.bytes == len(data)
    with pytest.raises(ValueError, match="xxh3_128, not sha256"):
        written.sha256  # noqa: B018


def test_a_checkpoint_file_has_no_zip_crc32s_while_a_default_atomic_torch_save_keeps_them(tmp_path):
    checkpoint = CheckpointFolder(tmp_path / "ck", FileOps()).save(state(1), NAME, 1)
    plain = atomic_torch_save(state(1), tmp_path / "plain.pt").path
    with zipfile.ZipFile(checkpoint) as z:
        assert all(info.CRC == 0 for info in z.infolist())
        assert z.testzip() is not None                 # the stored CRCs do not match the bytes
    with zipfile.ZipFile(plain) as z:
        assert z.testzip() is None
        assert any(info.CRC != 0 for info in z.infolist())
    assert_state_equal(torch.load(checkpoint, weights_only=True), 1)
    assert_state_equal(torch.load(plain, weights_only=True), 1)
    assert torch.utils.serialization.config.save.compute_crc32 is True


def test_torch_computes_zip_crc32s_again_after_a_checkpoint_save_fails(tmp_path):
    folder = CheckpointFolder(tmp_path, FileOps())
    with pytest.raises(Exception):  # noqa: B017  (whatever pickle raises for a lambda)
        folder.save({"f": lambda: 0}, NAME, 1)
    assert torch.utils.serialization.config.save.compute_crc32 is True
    assert folder.versions(NAME) == [] and leftover_temporaries(tmp_path) == []
    buffer = io.BytesIO()
    torch.save(state(1), buffer)
    with zipfile.ZipFile(buffer) as z:
        assert z.testzip() is None


# ------------------------------------------------------------------------ loading


def test_a_checkpoint_saved_and_loaded_round_trips_its_tensors(tmp_path, load_calls):
    folder = CheckpointFolder(tmp_path, FileOps())
    folder.save(state(1), NAME, 1)
    folder.save(state(2), NAME, 2)
    loaded = load_latest([folder], NAME)
    assert loaded.loaded_version == 2 and loaded.newest_version == 2 and loaded.damaged == []
    assert_state_equal(loaded.obj, 2)
    assert load_calls == [None]                               # read, not mapped


def test_a_version_2_record_with_its_sha256_still_loads(tmp_path, load_calls):
    folder = CheckpointFolder(tmp_path, FileOps())
    assert 2 in READABLE_VERSIONS
    folder.save(state(1), NAME, 1)
    write_v2_record(folder, 2)
    loaded = load_latest([folder], NAME)
    assert loaded.loaded_version == 2 and loaded.damaged == []
    assert_state_equal(loaded.obj, 2)


def test_a_version_2_record_whose_sha256_is_wrong_is_skipped_as_damaged(tmp_path):
    folder = CheckpointFolder(tmp_path, FileOps())
    folder.save(state(1), NAME, 1)
    path = write_v2_record(folder, 2, sha256="0" * 64)
    assert_state_equal(torch.load(path, weights_only=True), 2)    # the file itself is fine: only its digest is off
    loaded = load_latest([folder], NAME)
    assert loaded.loaded_version == 1 and loaded.newest_version == 2
    assert_state_equal(loaded.obj, 1)
    assert [(d.name, d.side) for d in loaded.damaged] == [(stem(NAME, 2), "local")]
    assert "sha256 differs from its record" in loaded.damaged[0].reason


def test_a_flipped_byte_in_the_newest_checkpoint_is_caught_and_the_version_before_loads(tmp_path, load_calls):
    folder = CheckpointFolder(tmp_path, FileOps())
    folder.save(state(1), NAME, 1)
    path = folder.save(state(2), NAME, 2)
    size = path.stat().st_size
    flip_tensor_byte(path, state(2)["w"])
    assert path.stat().st_size == size
    corrupt = REAL_TORCH_LOAD(path, weights_only=True)     # torch itself loads it (no CRC): only the digest sees it
    assert not torch.equal(corrupt["w"], state(2)["w"])
    load_calls.clear()
    loaded = load_latest([folder], NAME)
    assert loaded.loaded_version == 1 and loaded.newest_version == 2
    assert_state_equal(loaded.obj, 1)
    assert len(loaded.damaged) == 1
    damaged = loaded.damaged[0]
    assert isinstance(damaged, DamagedCopy) and damaged.name == stem(NAME, 2) and damaged.side == "local"
    assert damaged.reason == "StateError: xxh3_128 differs from its record"
    assert load_calls == [None, None]      # loaded side by side with its hash, then discarded


def test_a_checkpoint_whose_size_differs_from_its_record_is_skipped(tmp_path):
    folder = CheckpointFolder(tmp_path, FileOps())
    folder.save(state(1), NAME, 1)
    path = folder.save(state(2), NAME, 2)
    with open(path, "ab") as f:
        f.write(b"\0" * 16)               # zip readers find the central directory from the end, so torch loads it
    loaded = load_latest([folder], NAME)
    assert loaded.loaded_version == 1
    assert "bytes, its record says" in loaded.damaged[0].reason


def test_a_record_without_its_file_is_skipped_as_damaged(tmp_path):
    folder = CheckpointFolder(tmp_path, FileOps())
    folder.save(state(1), NAME, 1)
    folder.save(state(2), NAME, 2).unlink()
    loaded = load_latest([folder], NAME)
    assert loaded.loaded_version == 1 and loaded.newest_version == 2
    assert loaded.damaged[0].name == stem(NAME, 2) and "FileNotFoundError" in loaded.damaged[0].reason


def test_a_threaded_load_skips_a_checkpoint_whose_pickle_is_corrupt_and_names_the_digest(tmp_path):
    folder = CheckpointFolder(tmp_path, FileOps())
    folder.save(state(1), NAME, 1)
    flip_pickle_byte(folder.save(state(2), NAME, 2))
    loaded = load_latest([folder], NAME)
    assert loaded.loaded_version == 1 and loaded.damaged[0].name == stem(NAME, 2)
    assert loaded.damaged[0].reason == "StateError: xxh3_128 differs from its record"


def test_a_loaded_checkpoint_keeps_its_tensors_when_its_file_is_overwritten_or_deleted(tmp_path):
    """`cp` over a loaded checkpoint writes into the same file (same inode): a map of it would change."""
    from nblib.store.manager import CheckpointManager

    folder = CheckpointManager(tmp_path).local                # the run folder's own checkpoints
    path = folder.save(state(3), NAME, 3)
    other = folder.save(state(4), NAME, 4)
    loaded = folder.load(folder.record_bytes(NAME, 3), NAME, 3)
    inode = path.stat().st_ino
    shutil.copyfile(other, path)
    assert path.stat().st_ino == inode and path.read_bytes() == other.read_bytes()
    assert_state_equal(loaded, 3)
    path.unlink()
    assert_state_equal(loaded, 3)


def test_the_first_checkpoint_a_process_writes_has_no_zip_crc32s(tmp_path):
    """torch imports its serialization config at its first save: the switch is found before that one too."""
    code = (f"from nblib.store.checkpoints import CheckpointFolder; import torch; "
            f"print(CheckpointFolder({str(tmp_path)!r}).save({{'w': torch.ones(4)}}, 'ck', 1))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with zipfile.ZipFile(done.stdout.strip()) as z:
        assert all(info.CRC == 0 for info in z.infolist())


# ------------------------------------------------------------------------ copying between folders


def test_copy_from_copies_a_version_3_checkpoint_byte_for_byte(tmp_path):
    source = CheckpointFolder(tmp_path / "local", FileOps(), "local")
    target = CheckpointFolder(tmp_path / "mirror", FileOps(), "mirror")
    path = source.save(state(1), NAME, 1)
    assert target.copy_from(source, NAME, 1) is True
    assert (target.root / path.name).read_bytes() == path.read_bytes()
    assert target.record_bytes(NAME, 1) == source.record_bytes(NAME, 1)
    assert_state_equal(load_latest([target], NAME).obj, 1)


@pytest.mark.parametrize("record_version", [2, 3])
def test_copy_from_refuses_a_source_checkpoint_whose_bytes_changed_and_writes_nothing(tmp_path, record_version):
    source = CheckpointFolder(tmp_path / "local", FileOps(), "local")
    target = CheckpointFolder(tmp_path / "mirror", FileOps(), "mirror")
    path = write_v2_record(source, 1) if record_version == 2 else source.save(state(1), NAME, 1)
    flip_tensor_byte(path, state(1)["w"])
    with pytest.raises(StateError, match=f"local checkpoint {path.name} changed or is corrupt"):
        target.copy_from(source, NAME, 1)
    assert sorted(os.listdir(target.root)) == []
    assert load_latest([target], NAME).obj is None


# ------------------------------------------------------------------------ object storage (fsspec)


@pytest.fixture
def bucket():
    """(root, FsspecOps) over fsspec's in-memory filesystem, under a prefix of its own; emptied afterwards."""
    pytest.importorskip("fsspec")
    from nblib.train.objstore import FsspecOps, mirror_target

    root, ops = mirror_target(f"memory://bucket/ck-{uuid.uuid4().hex}")
    assert isinstance(ops, FsspecOps)
    yield root, ops
    if ops.fs.exists(str(root)):
        ops.fs.rm(str(root), recursive=True)


def test_fsspec_ops_write_a_checkpoint_without_crc32s_and_load_it_back_by_its_xxh3(bucket):
    root, ops = bucket
    written = ops.write_torch(root / "a.pt", state(1))
    data = ops.read_bytes(root / "a.pt")
    assert written.digest == "xxh3_128:" + xxhash.xxh3_128(data).hexdigest() and written.bytes == len(data)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert z.testzip() is not None
    assert torch.utils.serialization.config.save.compute_crc32 is True
    assert_state_equal(ops.load_torch(root / "a.pt", written.bytes, written.digest), 1)


def test_fsspec_ops_refuse_a_corrupted_or_resized_object(bucket):
    root, ops = bucket
    written = ops.write_torch(root / "a.pt", state(1))
    data = bytearray(ops.read_bytes(root / "a.pt"))
    at = data.find(state(1)["w"].numpy().tobytes())
    data[at + 9] ^= 0xFF
    ops.fs.pipe_file(str(root / "a.pt"), bytes(data))
    assert not torch.equal(torch.load(io.BytesIO(bytes(data)), weights_only=True)["w"], state(1)["w"])
    with pytest.raises(StateError, match="xxh3_128 differs from its record"):
        ops.load_torch(root / "a.pt", written.bytes, written.digest)
    ops.fs.pipe_file(str(root / "a.pt"), bytes(data) + b"\0")
    with pytest.raises(StateError, match="bytes, its record says"):
        ops.load_torch(root / "a.pt", written.bytes, written.digest)


def test_a_checkpoint_folder_in_object_storage_skips_a_corrupted_version(tmp_path, bucket):
    root, ops = bucket
    remote = CheckpointFolder(root, ops, "mirror")
    local = CheckpointFolder(tmp_path, FileOps(), "local")
    local.save(state(1), NAME, 1)
    local.save(state(2), NAME, 2)
    assert remote.copy_from(local, NAME, 1) and remote.copy_from(local, NAME, 2)
    assert json.loads(remote.record_bytes(NAME, 2))["body"]["xxh3_128"] == record_of(local, 2)["body"]["xxh3_128"]
    assert load_latest([remote], NAME).loaded_version == 2
    key = str(root / f"{stem(NAME, 2)}.pt")
    data = bytearray(ops.fs.cat_file(key))
    data[data.find(state(2)["w"].numpy().tobytes()) + 9] ^= 0xFF
    ops.fs.pipe_file(key, bytes(data))
    loaded = load_latest([remote], NAME)
    assert loaded.loaded_version == 1 and loaded.damaged[0].side == "mirror"
    assert_state_equal(loaded.obj, 1)
    assert loaded.damaged[0].reason == "StateError: xxh3_128 differs from its record"


def test_two_threads_switching_off_the_zip_crcs_leave_torchs_switch_on_when_both_are_done():
    """Two overlapping patches would each restore the value they found: the last one out would leave it off."""
    config = torch.utils.serialization.config
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def first():
        with torch_zip_crc32(False):
            a_in.set()
            b_in.wait(0.5)                 # with the patches taking turns, the second cannot be inside now
        a_out.set()

    def second():
        a_in.wait(5)
        with torch_zip_crc32(False):
            b_in.set()
            a_out.wait(5)                  # out after the first: it would restore the "off" it found

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert config.save.compute_crc32 is True
