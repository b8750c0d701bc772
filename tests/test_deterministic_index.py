"""Two identical encode runs give byte-identical consolidated folders, apart from the stat cache.

The index records sizes, sha256, shapes; the mtimes a quick check compares live in
`index.stat.json` (nblib.manifest's stat cache), which differs between runs by design.
"""
from __future__ import annotations

import os

import pytest

from conftest import small_cache
from nblib import encode as enc
from nblib.cache import ShardedImageCache
from nblib.config import preset
from nblib.errors import StateError
from nblib.manifest import read_stat_cache, stat_cache_path

CONFIG = preset("smoke").replace(batch_size=16, checkpoint_every=2, consolidate_every=1)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread(one_torch_thread):
    """Every test of this module encodes with one torch thread."""


def test_two_identical_runs_write_the_same_index_and_outputs(tmp_path):
    cache = ShardedImageCache(small_cache(tmp_path / "c", [f"line {i}" for i in range(48)]))
    folders = [tmp_path / "a", tmp_path / "b"]
    for folder in folders:
        enc.encode(cache, folder, CONFIG, device="cpu", progress=False, preflight=False)
    names = [enc.INDEX_NAME, *(f"{o}.npy" for o in CONFIG.run.outputs)]
    for name in names:
        assert (folders[0] / name).read_bytes() == (folders[1] / name).read_bytes(), name
    assert b"mtime_ns" not in (folders[0] / enc.INDEX_NAME).read_bytes()
    stats = read_stat_cache(folders[0] / enc.INDEX_NAME)
    assert set(stats) == set(CONFIG.run.outputs)


def test_a_touched_output_refreshes_only_the_stat_cache_and_a_lost_one_costs_a_hash(tmp_path):
    cache = ShardedImageCache(small_cache(tmp_path / "c", [f"line {i}" for i in range(32)]))
    out = tmp_path / "r"
    enc.encode(cache, out, CONFIG, device="cpu", progress=False, preflight=False)
    index = (out / enc.INDEX_NAME).read_bytes()
    victim = out / "sketches.npy"
    os.utime(victim, ns=(victim.stat().st_atime_ns, victim.stat().st_mtime_ns + 10**9))   # touched, same bytes
    with pytest.raises(StateError, match="was modified after consolidation"):
        enc.load_outputs(out)
    enc.consolidate(out)
    assert (out / enc.INDEX_NAME).read_bytes() == index          # the canonical index did not change
    assert read_stat_cache(out / enc.INDEX_NAME)["sketches"]["mtime_ns"] == victim.stat().st_mtime_ns
    assert set(enc.load_outputs(out)) == set(CONFIG.run.outputs)
    stat_cache_path(out / enc.INDEX_NAME).unlink()                # lost: quick checks cannot vouch
    assert set(enc.load_outputs(out, verify=True)) == set(CONFIG.run.outputs)
    enc.consolidate(out)                                           # hashes, same bytes: records the mtimes again
    assert (out / enc.INDEX_NAME).read_bytes() == index
    assert set(enc.load_outputs(out)) == set(CONFIG.run.outputs)
