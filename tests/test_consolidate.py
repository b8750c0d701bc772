"""Consolidated outputs: a swapped, flipped or cut file is refused by load_outputs and rebuilt to the
same bytes by a rerun; a part from another run is refused; a full disk is a clear error, never
SIGBUS, and a rerun after freeing space gives the same bytes. Real runs, real files, a real tmpfs.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import small_cache, subprocess_env
from nblib import encode as enc
from nblib.atomic import sha256_file
from nblib.cache import ShardedImageCache
from nblib.config import preset
from nblib.errors import BudgetExceeded, ManifestDamaged, ResumeMismatch, StateError

N_TEXTS = 96
OUTPUTS = ("sketches", "checksums", "children")


def _texts(n: int) -> list[str]:
    words = ["consolidated", "outputs", "are", "checked", "against", "their", "index", "before", "anyone",
             "reads", "them"]
    return [f"#{i} " + " ".join(words[(i * 5 + j) % len(words)] for j in range(2 + i % 4)) for i in range(n)]


def _cfg(**changes):
    return preset("smoke").replace(batch_size=16, checkpoint_every=2, consolidate_every=1, **changes)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread(one_torch_thread):
    """Every test of this module encodes with one torch thread."""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cache") / "c"
    return small_cache(folder, _texts(N_TEXTS))


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory) -> dict[str, Path]:
    """Two complete runs of one cache, parts only: "a" (seed 0) and "b" (seed 1, other weights)."""
    root = tmp_path_factory.mktemp("runs")
    for name, seed in (("a", 0), ("b", 1)):
        enc.encode(ShardedImageCache(cache_dir), root / name, _cfg(seed=seed), progress=False,
                   preflight=False, do_consolidate=False)
    return {"a": root / "a", "b": root / "b"}


@pytest.fixture(scope="module")
def reference(runs, tmp_path_factory) -> dict[str, str]:
    """sha256 of run a's consolidated files, built once into a folder of their own."""
    paths = enc.consolidate(runs["a"], tmp_path_factory.mktemp("ref"))
    return {name: sha256_file(path) for name, path in paths.items()}


def _consolidated(run: Path, out: Path) -> dict[str, Path]:
    return enc.consolidate(run, out)


def _hashes(paths: dict[str, Path]) -> dict[str, str]:
    return {name: sha256_file(path) for name, path in paths.items()}


def _later_mtime(path: Path) -> None:
    """Let the clock move past the file's mtime, so an edit now gets another one (coarse clocks)."""
    while time.time_ns() <= path.stat().st_mtime_ns + 20_000_000:
        time.sleep(0.01)


# ---------------------------------------------------------------------------- damaged outputs


def test_sketches_swapped_in_from_another_run_are_refused_then_rebuilt(runs, reference, tmp_path):
    paths = _consolidated(runs["a"], tmp_path / "a")
    other = _consolidated(runs["b"], tmp_path / "b")
    assert _hashes(other)["sketches"] != reference["sketches"]
    os.replace(other["sketches"], paths["sketches"])      # same size and header, other bytes
    with pytest.raises(StateError, match=r"sketches.npy was modified after consolidation"):
        enc.load_outputs(tmp_path / "a")
    with pytest.raises(StateError, match=r"hashes to .*the index records"):
        enc.load_outputs(tmp_path / "a", verify=True)
    assert _hashes(enc.consolidate(runs["a"], tmp_path / "a")) == reference
    assert set(enc.load_outputs(tmp_path / "a")) == set(OUTPUTS)


def test_a_flipped_byte_in_children_is_refused_then_rebuilt(runs, reference, tmp_path):
    paths = _consolidated(runs["a"], tmp_path / "a")
    victim = paths["children"]
    _later_mtime(victim)
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size - 1000)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(StateError, match=r"children.npy was modified after consolidation"):
        enc.load_outputs(tmp_path / "a")
    assert _hashes(enc.consolidate(runs["a"], tmp_path / "a")) == reference


def test_64_bytes_cut_off_the_end_are_refused_then_rebuilt(runs, reference, tmp_path):
    paths = _consolidated(runs["a"], tmp_path / "a")
    size = paths["checksums"].stat().st_size
    os.truncate(paths["checksums"], size - 64)
    with pytest.raises(StateError, match=rf"checksums.npy is {size - 64:,} bytes, the index records {size:,}"):
        enc.load_outputs(tmp_path / "a")
    assert _hashes(enc.consolidate(runs["a"], tmp_path / "a")) == reference


def test_a_rerun_rebuilds_only_the_damaged_output(runs, reference, tmp_path):
    paths = _consolidated(runs["a"], tmp_path / "a")
    before = {name: path.stat().st_mtime_ns for name, path in paths.items()}
    os.truncate(paths["children"], 100)
    enc.consolidate(runs["a"], tmp_path / "a")
    after = {name: path.stat().st_mtime_ns for name, path in paths.items()}
    assert [n for n in OUTPUTS if after[n] != before[n]] == ["children"]
    assert _hashes(paths) == reference


def test_bit_rot_that_keeps_the_mtime_is_caught_by_verify(runs, reference, tmp_path):
    paths = _consolidated(runs["a"], tmp_path / "a")
    victim, st = paths["sketches"], paths["sketches"].stat()
    data = bytearray(victim.read_bytes())
    data[-7] ^= 0x01
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))    # what a flipped bit on disk looks like
    enc.load_outputs(tmp_path / "a")                          # the stat check cannot see it ...
    with pytest.raises(StateError, match="hashes to"):
        enc.load_outputs(tmp_path / "a", verify=True)         # ... its sha256 can
    assert _hashes(enc.consolidate(runs["a"], tmp_path / "a", verify=True)) == reference


def test_a_touched_file_with_the_same_bytes_is_kept_and_trusted_again(runs, reference, tmp_path):
    paths = _consolidated(runs["a"], tmp_path / "a")
    _later_mtime(paths["sketches"])
    os.utime(paths["sketches"])
    touched = paths["sketches"].stat().st_mtime_ns
    with pytest.raises(StateError, match="verify=True"):
        enc.load_outputs(tmp_path / "a")
    assert set(enc.load_outputs(tmp_path / "a", verify=True)) == set(OUTPUTS)
    enc.consolidate(runs["a"], tmp_path / "a")
    assert paths["sketches"].stat().st_mtime_ns == touched, "hashed, found equal, not rewritten"
    enc.load_outputs(tmp_path / "a")
    assert _hashes(paths) == reference


def test_an_index_of_the_old_layout_is_rebuilt(runs, reference, tmp_path, caplog):
    _consolidated(runs["a"], tmp_path / "a")
    (tmp_path / "a" / enc.INDEX_NAME).write_text('{"kind": "nblib.encode/1/index", "files": {}}')
    with pytest.raises(ManifestDamaged, match="not 'nblib.encode.index'"):
        enc.load_outputs(tmp_path / "a")
    with caplog.at_level(logging.WARNING, logger="nblib"):
        assert _hashes(enc.consolidate(runs["a"], tmp_path / "a")) == reference
    assert "every output is rebuilt" in caplog.text
    assert enc.read_index(tmp_path / "a")["files"]["sketches"]["sha256"] == reference["sketches"]


# ---------------------------------------------------------------------------- parts


def test_a_part_from_another_run_is_refused_by_consolidate_and_by_a_resume(cache_dir, runs, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(runs["a"], mixed)
    part = mixed / enc.PARTS_FOLDER / "part-000001"
    shutil.rmtree(part)
    shutil.copytree(runs["b"] / enc.PARTS_FOLDER / "part-000001", part)
    with pytest.raises(ResumeMismatch, match=r"part part-000001 in .* weights changed"):
        enc.consolidate(mixed)
    with pytest.raises(ResumeMismatch, match=r"part part-000001 .*weights changed"):
        enc.encode(ShardedImageCache(cache_dir), mixed, _cfg(), progress=False, preflight=False)


def test_consolidated_rows_are_the_parts_in_sample_order(runs, tmp_path):
    paths = _consolidated(runs["a"], tmp_path / "a")
    outputs = enc.load_outputs(tmp_path / "a")
    with enc.open_store(runs["a"]) as store:
        for name, (start, stop) in store.read_manifest()["parts"].items():
            part = store.read_part(name)
            for o in OUTPUTS:
                assert np.array_equal(outputs[o][start:stop], part[o]), (name, o)
    assert np.load(paths["sketches"]).shape[0] == N_TEXTS


# ---------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A real 128 KiB tmpfs (smaller than run a's outputs), unmounted afterwards."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def _grow(mount: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(mount)], check=True)


def test_outputs_that_do_not_fit_are_refused_before_writing(runs, reference, small_disk):
    with pytest.raises(BudgetExceeded, match=r"needs .*\(\d[\d,]* bytes\) but .*\(\d[\d,]* bytes\) is free"):
        enc.consolidate(runs["a"], small_disk)
    assert list(small_disk.iterdir()) == [], "nothing written, nothing left behind"
    _grow(small_disk, "4m")
    assert _hashes(enc.consolidate(runs["a"], small_disk)) == reference


def test_a_disk_that_fills_while_writing_is_enospc_not_sigbus(runs, reference, small_disk):
    script = ("import sys; from nblib import encode\n"
              "encode.consolidate(sys.argv[1], sys.argv[2], check_space=False)\n")
    done = subprocess.run([sys.executable, "-c", script, str(runs["a"]), str(small_disk)],
                          env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, f"exit {done.returncode} (SIGBUS is -7): {done.stderr[-2000:]}"
    assert f"[Errno {errno.ENOSPC}] No space left on device: '{small_disk}'" in done.stderr
    assert list(small_disk.glob(".tmp-*")) == [], "the temporary files were removed"
    assert not (small_disk / enc.INDEX_NAME).exists()
    _grow(small_disk, "4m")
    assert _hashes(enc.consolidate(runs["a"], small_disk)) == reference
    assert set(enc.load_outputs(small_disk)) == set(OUTPUTS)
