"""nblib.manifest's stat cache: the one home of the non-canonical stats kept beside a manifest.

The cache (`manifest.json` -> `manifest.stat.json`) and the consolidated index (`index.json` ->
`index.stat.json`) both keep their files' stats there. Anything wrong with it costs a hash, never a
wrong answer and never an error.
"""
from __future__ import annotations

import json
import os
import warnings

import numpy as np

from nblib import cache
from nblib.cache import ShardedImageCache, populate, verify
from nblib.cache.format import LEGACY_STAT_CACHE
from nblib.manifest import (
    STAT_KIND,
    read_stat_cache,
    record_stats,
    stat_cache_path,
    stat_record,
    stat_vouches,
    write_manifest,
    write_stat_cache,
)
from nblib.render import render_text

SIZE = 24
TEXTS = [f"text {i}: " + "lorem ipsum " * (i % 5) for i in range(60)]


def build(folder):
    return populate(TEXTS, folder, image_size=SIZE, shard_mb=0.01, workers=0, codec="zstd", progress=False)


def test_records_round_trip_merge_and_vouch_only_for_the_same_stat_and_content(tmp_path):
    manifest = tmp_path / "index.json"
    data = tmp_path / "a.npy"
    data.write_bytes(b"12345")
    assert stat_cache_path(manifest).name == "index.stat.json"
    assert read_stat_cache(manifest) == {}                                   # none yet
    assert write_stat_cache(manifest, {"a.npy": stat_record(data, "aa")})
    assert record_stats(manifest, {"b.npy": {"bytes": 1, "mtime_ns": 2}})     # merged, not replaced
    stats = read_stat_cache(manifest)
    assert set(stats) == {"a.npy", "b.npy"}
    st = data.stat()
    assert stat_vouches(stats["a.npy"], st, "aa")
    assert not stat_vouches(stats["a.npy"], st, "bb")                       # another content
    assert not stat_vouches({**stats["a.npy"], "bytes": 4}, st, "aa")        # another size
    assert not stat_vouches(None, st, "aa")
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert not stat_vouches(stats["a.npy"], data.stat(), "aa")               # touched


def test_a_damaged_old_or_unwritable_stat_cache_reads_empty_or_is_skipped(tmp_path):
    manifest = tmp_path / "manifest.json"
    path = stat_cache_path(manifest)
    path.write_text("{not json")
    assert read_stat_cache(manifest) == {}
    write_manifest(path, STAT_KIND, {"mtime_ns": {"x.npy": 7}}, version=1)   # a1's first layout
    assert read_stat_cache(manifest) == {"x.npy": {"mtime_ns": 7}}
    path.unlink()
    path.mkdir()                                # cannot be replaced by a file: as on a read-only mount
    assert write_stat_cache(manifest, {"x.npy": {"bytes": 1, "mtime_ns": 2}}) is False
    assert read_stat_cache(manifest) == {}


def test_the_cache_keeps_its_stats_beside_its_manifest_and_identical_builds_match(tmp_path):
    build(tmp_path / "a")
    build(tmp_path / "b")
    assert stat_cache_path("manifest.json").name == cache.STAT_CACHE
    folders = [{p.name: p.read_bytes() for p in (tmp_path / d).iterdir()} for d in "ab"]
    assert cache.STAT_CACHE in folders[0] and LEGACY_STAT_CACHE not in folders[0]
    assert {k: v for k, v in folders[0].items() if k != cache.STAT_CACHE} == \
           {k: v for k, v in folders[1].items() if k != cache.STAT_CACHE}
    shards = sorted(p.name for p in (tmp_path / "a").glob("shard-*"))
    assert set(read_stat_cache(tmp_path / "a" / "manifest.json")) == set(shards)


def test_a_cache_with_the_legacy_stat_file_opens_without_hashing_and_moves_it_on_the_next_record(tmp_path):
    build(tmp_path)
    stats = read_stat_cache(tmp_path / "manifest.json")
    (tmp_path / LEGACY_STAT_CACHE).write_text(json.dumps({"note": "local", "shards": stats}))
    (tmp_path / cache.STAT_CACHE).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # "another stat ... hashed" would be a warning
        images = ShardedImageCache(tmp_path)
    assert np.array_equal(images[5], render_text(TEXTS[5], SIZE))
    first = tmp_path / sorted(stats)[0]
    st = first.stat()
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))           # touched: its stat is recorded again
    assert verify(tmp_path, repair=True).ok
    assert not (tmp_path / LEGACY_STAT_CACHE).exists()
    moved = read_stat_cache(tmp_path / "manifest.json")
    assert set(moved) == set(stats)                                          # the others carried over
    assert moved[first.name]["mtime_ns"] == first.stat().st_mtime_ns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardedImageCache(tmp_path)
