"""Cache v3: identical builds give identical folders, every read path checks the bytes it serves,
the first-touch check, zstd with a dictionary, and the refusal of an older cache layout.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from nblib import cache
from nblib.cache import ShardedImageCache, populate, read_cache_manifest, verify
from nblib.cache.codecs import DICT_MIN_GAIN, train_dictionary
from nblib.errors import CacheError
from nblib.render import render_text

SIZE = 32
TEXTS = [f"text {i}: " + "lorem ipsum dolor sit amet " * (i % 7) for i in range(120)]


def build(folder, codec="raw", texts=TEXTS, shard_mb=0.02, **kw):
    return populate(texts, folder, image_size=SIZE, shard_mb=shard_mb, workers=0, codec=codec,
                    progress=False, **kw)


def flip_keeping_stat(path, at):
    """Flip one byte in place and put the mtime back: neither size nor mtime shows the edit."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def image_byte(folder, shard, local):
    """The offset of a byte in the middle of image `local` of listed shard `shard`."""
    entry = read_cache_manifest(folder)["shards"][shard]
    path = folder / entry["file"]
    if entry["file"].endswith(".npy"):
        array = np.load(path, mmap_mode="r")
        return path, array.offset + local * SIZE * SIZE * 3 + SIZE * SIZE
    from nblib.cache.format import open_packed

    codec = read_cache_manifest(folder)["codec"]
    data, offsets, base, _ = open_packed(path, entry["count"], codec, (SIZE, SIZE, 3))
    data.close()
    return path, base + (int(offsets[local]) + int(offsets[local + 1])) // 2


# ------------------------------------------------------------------------------ determinism


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_two_identical_builds_give_byte_identical_folders_except_the_local_stat_cache(tmp_path, codec):
    """The manifest holds content only (sizes, hashes): the stat of each shard lives in the stat cache."""
    build(tmp_path / "a", codec)
    build(tmp_path / "b", codec)
    a, b = ({p.name: p.read_bytes() for p in sorted(d.iterdir())} for d in (tmp_path / "a", tmp_path / "b"))
    assert set(a) == set(b) and cache.STAT_CACHE in a
    assert {k: v for k, v in a.items() if k != cache.STAT_CACHE} == \
           {k: v for k, v in b.items() if k != cache.STAT_CACHE}
    assert b"mtime" not in a["manifest.json"]


def test_the_stat_cache_may_be_deleted_the_next_open_hashes_each_shard_once(tmp_path):
    build(tmp_path)
    (tmp_path / cache.STAT_CACHE).unlink()
    with pytest.warns(UserWarning, match="another stat"):
        ShardedImageCache(tmp_path)
    assert verify(tmp_path, repair=True).ok
    assert (tmp_path / cache.STAT_CACHE).exists()
    ShardedImageCache(tmp_path)  # no warning: the stats are recorded again


def test_a_garbage_stat_cache_costs_a_hash_not_an_error(tmp_path):
    build(tmp_path)
    (tmp_path / cache.STAT_CACHE).write_text("{not json")
    with pytest.warns(UserWarning, match="another stat"):
        images = ShardedImageCache(tmp_path)
    assert np.array_equal(images[3], render_text(TEXTS[3], SIZE))


# ------------------------------------------------------------------------------ checked reads


def read_random(folder):
    ShardedImageCache(folder)[7]


def read_in_order(folder):
    images = ShardedImageCache(folder)
    for start in range(0, len(images), 5):
        images.get_batch(start, min(len(images), start + 5))


def read_iter_shards(folder):
    list(ShardedImageCache(folder).iter_shards())


def read_torch_dataset(folder):
    cache.CacheDataset(str(folder), check="image")[7]


def read_dataloader_workers(folder):
    torch = pytest.importorskip("torch")
    dataset = cache.CacheDataset(str(folder), check="image")
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2)
    for _ in loader:
        pass


READ_PATHS = [read_random, read_in_order, read_iter_shards, read_torch_dataset, read_dataloader_workers]


@pytest.mark.parametrize("read", READ_PATHS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_a_byte_flipped_in_place_with_the_mtime_kept_is_caught_on_every_read_path(tmp_path, codec, read):
    build(tmp_path, codec)
    entry = next(i for i, s in enumerate(read_cache_manifest(tmp_path)["shards"]) if s["start"] <= 7 < s["stop"])
    local = 7 - read_cache_manifest(tmp_path)["shards"][entry]["start"]
    path, at = image_byte(tmp_path, entry, local)
    flip_keeping_stat(path, at)
    with pytest.raises(Exception, match=r"image 7 .*is corrupt: its bytes do not match.*--verify --repair"):
        read(tmp_path)


def test_an_in_order_read_raises_at_the_damaged_image_and_serves_the_ones_before(tmp_path):
    build(tmp_path, "raw")
    path, at = image_byte(tmp_path, 2, 4)
    start = read_cache_manifest(tmp_path)["shards"][2]["start"]
    flip_keeping_stat(path, at)
    images = ShardedImageCache(tmp_path)
    served = [images[i] for i in range(start, start + 4)]  # the intact ones before it
    assert np.array_equal(served[3], render_text(TEXTS[start + 3], SIZE))
    with pytest.raises(CacheError, match=f"image {start + 4} "):
        images[start + 4]


def test_first_touch_refuses_a_damaged_shard_before_serving_any_of_its_images(tmp_path):
    build(tmp_path, "raw")
    path, at = image_byte(tmp_path, 2, 5)
    start = read_cache_manifest(tmp_path)["shards"][2]["start"]
    flip_keeping_stat(path, at)
    with pytest.raises(CacheError, match=f"{path.name} .*xxh3 differs.*none of its images was served"):
        ShardedImageCache(tmp_path, check="first-touch")[start]
    assert np.array_equal(ShardedImageCache(tmp_path, check="image")[start], render_text(TEXTS[start], SIZE))


def swap_in_other_shard(tmp_path):
    """Shard 0 of cache a replaced by cache b's (same size, self-consistent), mtime put back."""
    build(tmp_path / "a", "raw", texts=TEXTS[:30])
    build(tmp_path / "b", "raw", texts=[t + "!" for t in TEXTS[:30]])
    a, b = tmp_path / "a" / "shard-00000.npy", tmp_path / "b" / "shard-00000.npy"
    assert a.stat().st_size == b.stat().st_size
    st = a.stat()
    a.write_bytes(b.read_bytes())
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    return tmp_path / "a"


def test_a_self_consistent_shard_swapped_in_place_is_caught_by_first_touch_only(tmp_path):
    """The documented trade-off: per-image tables check a shard against itself, first touch against the manifest."""
    folder = swap_in_other_shard(tmp_path)
    served = ShardedImageCache(folder, check="image")[0]
    assert np.array_equal(served, render_text(TEXTS[0] + "!", SIZE))  # another cache's image: served
    with pytest.raises(CacheError, match="shard-00000.npy .*xxh3 differs"):
        ShardedImageCache(folder, check="first-touch")[0]
    assert verify(folder).corrupt == ("shard-00000.npy",)


def test_the_torch_dataset_checks_first_touch_by_default_in_every_dataloader_worker(tmp_path):
    torch = pytest.importorskip("torch")
    folder = swap_in_other_shard(tmp_path)
    dataset = cache.CacheDataset(str(folder))
    assert dataset.cache.check == "first-touch"
    with pytest.raises(CacheError, match="xxh3 differs"):
        dataset[0]
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=2)
    with pytest.raises(Exception, match="shard-00000.npy .*xxh3 differs"):
        list(loader)


def test_first_touch_hashes_each_shard_once_per_process(tmp_path, monkeypatch):
    build(tmp_path, "raw")
    from nblib.cache import format

    calls = []
    real = format.xxh3_file
    monkeypatch.setattr(format, "xxh3_file", lambda p: calls.append(p.name) or real(p))
    images = ShardedImageCache(tmp_path, check="first-touch")
    for _ in range(2):
        for i in range(len(images)):
            images[i]
        list(images.iter_shards())  # closes and reopens each shard's map: no second hash
    assert sorted(calls) == sorted(s["file"] for s in images.manifest["shards"])


# ------------------------------------------------------------------------------ zstd


def test_zstd_keeps_a_dictionary_only_when_it_pays():
    texts = [render_text(t, 64) for t in TEXTS]
    dictionary, gain = train_dictionary(texts)
    assert dictionary is not None and gain >= DICT_MIN_GAIN
    noise = [np.random.default_rng(k).integers(0, 256, (64, 64, 3), dtype=np.uint8) for k in range(64)]
    dictionary, gain = train_dictionary(noise)
    assert dictionary is None and gain < DICT_MIN_GAIN


def test_a_zstd_cache_resumes_with_its_dictionary_to_identical_bytes(tmp_path):
    build(tmp_path / "ref", "zstd", shard_mb=0.003, codec_level=5)
    target = tmp_path / "t"
    shutil.copytree(tmp_path / "ref", target)
    manifest = read_cache_manifest(target)
    assert manifest["codec_options"]["level"] == 5 and manifest["codec_options"]["dictionary"]
    assert len(manifest["shards"]) >= 3
    from nblib.cache.format import write_cache_manifest

    for entry in manifest["shards"][2:]:
        (target / entry["file"]).unlink()
    manifest["shards"] = manifest["shards"][:2]
    write_cache_manifest(target, manifest)
    summary = build(target, "zstd", shard_mb=0.003, codec_level=5)
    assert summary.shards_reused == 2
    ref = {p.name: p.read_bytes() for p in (tmp_path / "ref").iterdir() if p.name != cache.STAT_CACHE}
    assert {p.name: p.read_bytes() for p in target.iterdir() if p.name != cache.STAT_CACHE} == ref
    images = ShardedImageCache(target)
    assert np.array_equal(images[len(TEXTS) - 1], render_text(TEXTS[-1], SIZE))


def test_another_zstd_level_is_another_cache(tmp_path):
    build(tmp_path, "zstd", codec_level=3)
    with pytest.raises(CacheError, match="codec_level was 3, now 9.*overwrite"):
        build(tmp_path, "zstd", codec_level=9)
    with pytest.raises(Exception, match=r"codec_level=99 is out of range for zstd: pick an integer 1\.\.22"):
        build(tmp_path / "x", "zstd", codec_level=99)


def test_the_budget_the_config_and_the_registry_know_the_same_codecs():
    from nblib import budget, config
    from nblib.cache import CODECS

    assert set(CODECS) == set(budget.CODEC_RATIO_ESTIMATE) == set(config.CODECS)
    assert budget.cache_bytes(1000, 224, "zstd") < budget.cache_bytes(1000, 224, "zlib")
    assert budget.cache_bytes(1000, 224, "zstd") == budget.cache_bytes(1000, 224, "zstd", 224 * 224 * 3 * 0.09)


# ------------------------------------------------------------------------------ format versions


def test_a_cache_of_the_previous_layout_is_refused_with_rebuild_and_overwrite_rebuilds(tmp_path):
    from nblib.manifest import write_manifest

    body = {"source": {"sha256": "0" * 64, "n_texts": 1}, "codec": "raw", "shards": []}
    write_manifest(tmp_path / "manifest.json", "nblib.cache", body, version=2)
    with pytest.raises(CacheError, match="older nblib .*v2: its shards carry no per-image checksums.*rebuild"):
        ShardedImageCache(tmp_path)
    with pytest.raises(CacheError, match="older nblib.*--overwrite"):
        build(tmp_path, texts=TEXTS[:10])
    build(tmp_path, texts=TEXTS[:10], overwrite=True)
    assert verify(tmp_path).ok
    assert json.loads((tmp_path / "manifest.json").read_text())["version"] == 3
