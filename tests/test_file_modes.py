"""Every file nblib writes gets the mode `open` would give it, 0666 less the umask (as exports and every other
tool's files do), not mkstemp's 0600: a cache, record shards, a run's checkpoints, final.pt and train.json,
and each of the atomic writers they go through.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from test_train import FAST, labelled_cache

from nblib.atomic import AtomicWriter, atomic_torch_save, atomic_write_bytes
from nblib.train import train


@pytest.fixture(params=[0o022, 0o077], ids=["umask022", "umask077"])
def umask(request):
    before = os.umask(request.param)
    yield request.param
    os.umask(before)


def modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}


def test_the_atomic_writers_create_files_with_the_umask_mode(tmp_path, umask):
    atomic_write_bytes(tmp_path / "bytes.bin", b"x")
    with AtomicWriter(tmp_path / "streamed.bin") as writer:
        writer.write(b"x")
        writer.commit()
    atomic_torch_save({"w": torch.ones(3)}, tmp_path / "state.pt")
    found = modes(tmp_path)
    assert len(found) == 3 and set(found.values()) == {0o666 & ~umask}, found


def test_a_cache_record_shards_and_a_run_follow_the_umask(tmp_path, umask, one_torch_thread):
    from record_traces import trace_records

    from nblib.cache import write_records

    cache = labelled_cache(tmp_path / "images", 48)
    write_records(trace_records(40, hidden=8, experts=4, layers=2, tokens=(2, 4)), tmp_path / "records",
                  shard_mb=0.01, group_by="layer_id")
    train(cache, tmp_path / "run", FAST.replace(steps=2, batch_size=8, eval_every=2))
    found = modes(tmp_path)
    for part in ("images/cache/", "records/", "run/checkpoints/state-", "run/final.pt", "run/train.json"):
        assert any(name.startswith(part) for name in found), part
    wrong = {name: oct(mode) for name, mode in found.items() if mode != 0o666 & ~umask}
    assert not wrong
