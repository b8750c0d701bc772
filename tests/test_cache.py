"""nblib.cache in-process: round trips per codec, resume, refusals, damage found, refused and repaired."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings

import numpy as np
import pytest

from nblib import cache
from nblib.cache import ShardedImageCache, populate, read_cache_manifest, read_texts, verify
from nblib.cache.format import write_cache_manifest
from nblib.errors import BudgetExceeded, CacheError, ConfigError, InputError
from nblib.manifest import read_stat_cache
from nblib.render import render_text

SIZE = 32
TEXTS = [f"text {i}: " + "lorem ipsum dolor sit amet " * (i % 7) for i in range(150)]
SHARD_MB = 0.02  # ~6 raw images of 32 px per shard -> 25 shards


def build(folder, texts=TEXTS, codec="raw", workers=0, shard_mb=SHARD_MB, **kw):
    return populate(texts, folder, image_size=SIZE, shard_mb=shard_mb, workers=workers,
                    codec=codec, progress=False, **kw)


def folder_bytes(folder):
    """Every file's bytes, the manifest's included; the local stat cache (stats of this copy) left out."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != cache.STAT_CACHE}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One complete raw cache, built once; tests that damage it copy it first."""
    folder = tmp_path_factory.mktemp("reference")
    build(folder)
    return folder


def copy_of(reference, tmp_path):
    """A copy keeping each file's mtime (as `cp -p` does), so the recorded stats still match."""
    target = tmp_path / "cache"
    shutil.copytree(reference, target)
    return target


def shard_path(folder, k):
    return folder / read_cache_manifest(folder)["shards"][k]["file"]


def flip_byte_keeping_stat(path, at=None):
    """Flip one byte in place and put the mtime back: a stat cannot see this edit."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


# ------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("codec", ["raw", "zlib", "png"])
def test_every_image_reads_back_equal_to_the_renderer_for_each_codec(tmp_path, codec):
    build(tmp_path, codec=codec)
    images = ShardedImageCache(tmp_path)
    assert len(images) == len(TEXTS) and images.codec == codec and images.complete
    expected = np.stack([render_text(t, SIZE) for t in TEXTS])
    assert np.array_equal(images.get_batch(0, len(TEXTS)), expected)
    assert np.array_equal(images[37], expected[37]) and np.array_equal(images[-1], expected[-1])
    assert np.array_equal(images.get_batch(5, 61), expected[5:61])  # spans several shards
    assert np.array_equal(np.concatenate(list(images.iter_shards())), expected)


def test_raw_shards_are_plain_npy_files_that_np_load_memory_maps(reference):
    manifest = read_cache_manifest(reference)
    first = np.load(reference / manifest["shards"][0]["file"], mmap_mode="r")
    assert isinstance(first, np.memmap) and first.shape == (manifest["shards"][0]["count"], SIZE, SIZE, 3)


def test_shards_are_cut_by_the_target_size(reference):
    manifest = read_cache_manifest(reference)
    per_image = SIZE * SIZE * 3
    counts = [s["count"] for s in manifest["shards"]]
    assert counts[:-1] == [int(SHARD_MB * 1e6 // per_image)] * (len(counts) - 1)
    assert sum(counts) == len(TEXTS)


def test_compressed_shards_are_much_smaller_than_raw(tmp_path):
    raw = build(tmp_path / "raw")
    small = build(tmp_path / "zlib", codec="zlib")
    assert small.bytes_on_disk * 4 < raw.bytes_on_disk


def test_cache_bytes_do_not_depend_on_worker_count(tmp_path, reference):
    build(tmp_path, workers=2)
    assert folder_bytes(tmp_path) == folder_bytes(reference)


def test_out_of_range_index_raises_index_error(reference):
    images = ShardedImageCache(reference)
    with pytest.raises(IndexError, match="out of range"):
        images[len(TEXTS)]
    with pytest.raises(IndexError):
        images.get_batch(10, len(TEXTS) + 1)


def test_reader_pickles_without_its_open_maps(reference):
    images = ShardedImageCache(reference)
    images[3]
    clone = pickle.loads(pickle.dumps(images))
    assert np.array_equal(clone[3], images[3]) and len(pickle.dumps(images)) < 100_000


def test_torch_dataset_feeds_a_dataloader_the_same_images(reference):
    torch = pytest.importorskip("torch")
    images = ShardedImageCache(reference)
    loader = torch.utils.data.DataLoader(cache.CacheDataset(str(reference)), batch_size=16, shuffle=False)
    batch = next(iter(loader))
    assert batch.dtype == torch.uint8 and tuple(batch.shape) == (16, SIZE, SIZE, 3)
    assert np.array_equal(batch.numpy(), images.get_batch(0, 16))


def test_fingerprint_changes_when_the_cache_changes(tmp_path, reference):
    other = build(tmp_path, texts=TEXTS[:-1] + ["changed"])
    assert ShardedImageCache(reference).fingerprint != ShardedImageCache(other.cache_dir).fingerprint
    assert ShardedImageCache(reference).fingerprint == ShardedImageCache(reference).fingerprint


def test_reader_warns_when_the_folder_would_hold_too_many_files_for_drive(tmp_path, reference):
    target = copy_of(reference, tmp_path)
    manifest = read_cache_manifest(target)
    entry = manifest["shards"][0]
    from nblib.budget.drive import FOLDER_ITEMS_LIMIT  # the budget's items-per-folder limit, the one number

    manifest["shards"] = [dict(entry, start=i, stop=i + 1, count=1) for i in range(FOLDER_ITEMS_LIMIT)]
    write_cache_manifest(target, manifest)
    with pytest.warns(UserWarning, match=f"{FOLDER_ITEMS_LIMIT + 1:,} files: Drive items in the cache folder "
                                         f"{FOLDER_ITEMS_LIMIT + 1:,} > {FOLDER_ITEMS_LIMIT:,}: shard_mb>="):
        ShardedImageCache(target)
    manifest["shards"] = manifest["shards"][:-1]          # shards + the manifest at the limit: no warning
    write_cache_manifest(target, manifest)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardedImageCache(target)


# ------------------------------------------------------------------------------ resume, refusals


def test_rerun_on_a_complete_cache_renders_nothing_and_changes_nothing(tmp_path, reference):
    target = copy_of(reference, tmp_path)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in target.iterdir()}
    summary = build(target)
    assert summary.images_rendered == 0 and summary.shards_written == 0
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in target.iterdir()} == before


def test_resume_after_losing_the_last_shards_gives_identical_bytes(tmp_path, reference):
    target = copy_of(reference, tmp_path)
    manifest = read_cache_manifest(target)
    for entry in manifest["shards"][10:]:
        (target / entry["file"]).unlink()
    manifest["shards"] = manifest["shards"][:10]
    write_cache_manifest(target, manifest)
    (target / ".tmp-shard-00010.npy.abc").write_bytes(b"half a shard")
    summary = build(target)
    assert summary.shards_reused == 10 and summary.shards_written == len(reference_shards(reference)) - 10
    assert folder_bytes(target) == folder_bytes(reference)


def reference_shards(reference):
    return read_cache_manifest(reference)["shards"]


def test_changed_source_is_refused_with_both_fingerprints(tmp_path, reference):
    target = copy_of(reference, tmp_path)
    with pytest.raises(CacheError, match=r"source fingerprint .* \(150 texts\) .* \(151 texts\).*overwrite"):
        build(target, texts=TEXTS + ["one more"])


def test_changed_image_size_is_refused_naming_the_setting(tmp_path, reference):
    target = copy_of(reference, tmp_path)
    with pytest.raises(CacheError, match="renderer changed .*size 32 -> 48.*never mixed.*overwrite"):
        populate(TEXTS, target, image_size=48, shard_mb=SHARD_MB, workers=0, progress=False)


def test_overwrite_rebuilds_a_cache_of_other_texts(tmp_path, reference):
    target = copy_of(reference, tmp_path)
    build(target, texts=TEXTS[:20], overwrite=True)
    images = ShardedImageCache(target)
    assert len(images) == 20 and images.complete
    assert verify(target).ok


def test_manifest_is_a_versioned_record_of_content_and_the_stats_live_in_the_local_stat_cache(reference):
    record = json.loads((reference / "manifest.json").read_text())
    assert (record["kind"], record["version"]) == ("nblib.cache", 3)
    manifest = record["body"]
    assert set(manifest) == {"source", "renderer", "codec", "codec_level", "codec_options", "shard_mb",
                             "shard_bytes", "seed", "image_shape", "shards", "coverage"}
    assert set(manifest["shards"][0]) == {"file", "start", "stop", "count", "bytes", "sha256", "xxh3"}
    assert manifest["source"]["n_texts"] == len(TEXTS)
    first = reference / manifest["shards"][0]["file"]
    assert cache.STAT_CACHE == "manifest.stat.json"                  # nblib.manifest's stat cache
    stats = read_stat_cache(reference / "manifest.json")
    assert stats[first.name] == {"bytes": first.stat().st_size, "mtime_ns": first.stat().st_mtime_ns,
                                 "sha256": manifest["shards"][0]["sha256"]}


def test_a_manifest_of_the_old_format_is_refused_naming_the_fix_and_overwrite_rebuilds(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "nblib-image-cache", "version": 1,
                                                        "shards": []}))
    with pytest.raises(CacheError, match="older nblib.*overwrite=True"):
        ShardedImageCache(tmp_path)
    with pytest.raises(CacheError, match="older nblib.*--overwrite"):
        build(tmp_path, texts=TEXTS[:10])
    build(tmp_path, texts=TEXTS[:10], overwrite=True)
    assert verify(tmp_path).ok


def test_preflight_refuses_a_cache_larger_than_the_free_disk(tmp_path):
    huge = [""] * 60_000  # 60,000 images of 1024 px raw are 189 GB
    with pytest.raises(BudgetExceeded, match=r"image cache needs \d+\.\d+ GB.*--codec zstd"):
        populate(huge, tmp_path, image_size=1024, shard_mb=400, workers=0, progress=False)
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_a_refused_overwrite_keeps_the_old_cache(tmp_path, reference):
    target = copy_of(reference, tmp_path)
    with pytest.raises(BudgetExceeded):
        populate([""] * 60_000, target, image_size=1024, shard_mb=400, workers=0, progress=False,
                 overwrite=True)
    assert folder_bytes(target) == folder_bytes(reference)


def test_bad_knobs_are_refused_with_their_values(tmp_path):
    with pytest.raises(ConfigError, match="shard_mb=0"):
        build(tmp_path, shard_mb=0)
    with pytest.raises(ConfigError, match="codec='bmp'"):
        build(tmp_path, codec="bmp")
    with pytest.raises(ConfigError, match="workers=-1"):
        build(tmp_path, workers=-1)


def test_auto_codec_lets_the_budget_pick_and_resumes_with_the_same_codec(tmp_path):
    summary = build(tmp_path, texts=TEXTS[:30], codec="auto")
    assert summary.codec == "raw"  # plenty of disk: the fastest-decoding codec fits
    assert build(tmp_path, texts=TEXTS[:30], codec="auto").images_rendered == 0


@pytest.mark.parametrize("content, match", [(b"", "is empty"), (b"\n  \n\n", "only blank lines")])
def test_an_empty_or_blank_jsonl_is_refused_and_no_cache_is_made(tmp_path, content, match):
    path = tmp_path / "texts.jsonl"
    path.write_bytes(content)
    with pytest.raises(InputError, match=match + ".*no text to render"):
        build(tmp_path / "c", texts=path)
    assert not (tmp_path / "c").exists()
    with pytest.raises(InputError, match="list of texts is empty"):
        build(tmp_path / "c", texts=[])


def test_a_cache_of_another_renderer_is_refused_never_mixed(tmp_path, reference):
    target = copy_of(reference, tmp_path)
    manifest = read_cache_manifest(target)
    manifest["renderer"] = {**manifest["renderer"], "version": -1}
    write_cache_manifest(target, manifest)
    with pytest.raises(CacheError, match="renderer changed .*version -1 -> .*never mixed.*overwrite=True"):
        build(target)
    (target / manifest["shards"][2]["file"]).unlink()
    with pytest.raises(CacheError, match="other renderer settings.*version -1.*overwrite=True"):
        verify(target, repair=True, texts=TEXTS)


# ------------------------------------------------------------------------------ verify and repair


def damage_truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def damage_flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def damage_delete(path):
    path.unlink()


@pytest.mark.parametrize("codec", ["raw", "zlib"])
@pytest.mark.parametrize("damage, field", [(damage_truncate, "truncated"),
                                           (damage_flip_byte, "corrupt"),
                                           (damage_delete, "missing")])
def test_verify_finds_a_damaged_shard_and_repair_restores_its_bytes(tmp_path, codec, damage, field):
    folder = tmp_path / codec
    build(folder, codec=codec)
    original = folder_bytes(folder)
    victim = sorted(folder.glob("shard-*"))[1]
    damage(victim)
    report = verify(folder)
    assert not report.ok and getattr(report, field) == (victim.name,)
    assert victim.name in str(report) and "--repair" in str(report)
    repaired = verify(folder, repair=True, texts=TEXTS)
    assert repaired.ok and repaired.repaired == (victim.name,)
    assert folder_bytes(folder) == original
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the manifest records the repaired shard's new stat
        assert np.array_equal(ShardedImageCache(folder)[-1], render_text(TEXTS[-1], SIZE))


def test_verify_finds_a_stray_temporary_and_repair_deletes_it(tmp_path, reference):
    target = copy_of(reference, tmp_path)
    (target / ".tmp-shard-00003.npy.x1y2").write_bytes(b"\0" * 1000)
    report = verify(target)
    assert not report.ok and report.temporaries == (".tmp-shard-00003.npy.x1y2",)
    assert verify(target, repair=True).ok
    assert folder_bytes(target) == folder_bytes(reference)


def test_opening_a_cache_with_a_truncated_shard_raises_cache_error_pointing_at_repair(tmp_path, reference):
    target = copy_of(reference, tmp_path)
    damage_truncate(target / reference_shards(reference)[0]["file"])
    with pytest.raises(CacheError, match="shard-00000.npy .* another size.*--verify --repair"):
        ShardedImageCache(target)


@pytest.mark.parametrize("codec", ["raw", "zlib"])
def test_a_same_size_shard_from_another_cache_is_refused_when_opened(tmp_path, codec):
    build(tmp_path / "a", codec=codec, texts=TEXTS[:40])
    build(tmp_path / "b", codec=codec, texts=[t + "!" for t in TEXTS[:40]])
    a, b = shard_path(tmp_path / "a", 0), shard_path(tmp_path / "b", 0)
    if codec == "zlib":
        b.write_bytes(b.read_bytes()[:a.stat().st_size].ljust(a.stat().st_size, b"\0"))
    shutil.copy2(b, a)  # its own mtime comes along, as with cp -p
    assert a.stat().st_size == (tmp_path / "a" / a.name).stat().st_size
    with pytest.raises(CacheError, match=f"{a.name} .*xxh3 differs.*--verify --repair"):
        ShardedImageCache(tmp_path / "a")


def test_a_flipped_byte_that_changes_the_mtime_is_refused_when_opened(tmp_path, reference):
    target = copy_of(reference, tmp_path)
    damage_flip_byte(shard_path(target, 3))
    with pytest.raises(CacheError, match="shard-00003.npy .*xxh3 differs.*python -m nblib cache --verify"):
        ShardedImageCache(target)


@pytest.mark.parametrize("codec, why", [("raw", "is corrupt: its bytes do not match the shard.s xxh3"),
                                         ("zlib", "malformed.*trailer")])
def test_an_edit_that_kept_size_and_mtime_is_caught_by_an_in_order_pass(tmp_path, codec, why):
    """The stat check cannot see it (documented); the per-image xxh3 (raw) or the trailer's (packed) do.

    The byte is in the last image of a raw shard, in the trailer of a packed one.
    """
    build(tmp_path, codec=codec)
    victim = shard_path(tmp_path, 2)
    flip_byte_keeping_stat(victim, at=victim.stat().st_size - (3 if codec != "raw" else 32 + 8 * 6 + 3))
    images = ShardedImageCache(tmp_path)  # opens: size and mtime are the recorded ones
    with pytest.raises(CacheError, match=f"{victim.name}.*{why}.*--verify --repair"):
        list(images.iter_shards())
    images.close()
    with pytest.raises(CacheError, match=f"{victim.name}"):
        for start in range(0, len(images), 16):
            images.get_batch(start, min(len(images), start + 16))
    assert verify(tmp_path).corrupt == (victim.name,)


@pytest.mark.parametrize("codec", ["zlib", "png"])
def test_a_corrupt_compressed_image_raises_cache_error_naming_shard_and_image(tmp_path, codec):
    build(tmp_path, codec=codec, texts=TEXTS[:40])
    victim = shard_path(tmp_path, 0)
    flip_byte_keeping_stat(victim, at=40)  # inside the first image's blob
    images = ShardedImageCache(tmp_path)
    with pytest.raises(CacheError, match=f"image 0 .*number 0 of shard {victim.name}.*corrupt.*--repair"):
        images[0]


def test_a_copied_cache_is_hashed_once_on_open_and_repair_records_the_new_stats(tmp_path, reference):
    target = tmp_path / "copy"
    shutil.copytree(reference, target, copy_function=shutil.copyfile)  # new mtimes, same bytes
    with pytest.warns(UserWarning, match=r"25 shard\(s\) .*another stat.*match"):
        ShardedImageCache(target)
    report = verify(target, repair=True)
    assert report.ok and not report.touched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardedImageCache(target)


def test_repair_refuses_texts_that_are_not_the_source(tmp_path, reference):
    target = copy_of(reference, tmp_path)
    damage_flip_byte(target / reference_shards(reference)[0]["file"])
    with pytest.raises(CacheError, match="not the ones this cache was built from"):
        verify(target, repair=True, texts=TEXTS[::-1])
    with pytest.raises(CacheError, match="in-memory texts; pass texts="):
        verify(target, repair=True)


def test_verify_of_a_folder_without_manifest_is_not_ok(tmp_path):
    report = verify(tmp_path)
    assert not report.ok and "no manifest.json" in str(report)


@pytest.mark.parametrize("damage", [damage_truncate, damage_flip_byte])
def test_populate_repairs_a_damaged_listed_shard_on_resume(tmp_path, reference, damage):
    target = copy_of(reference, tmp_path)
    damage(target / reference_shards(reference)[4]["file"])
    summary = build(target)
    assert summary.shards_written == 1 and summary.shards_repaired == 1 and "repaired 1" in str(summary)
    assert folder_bytes(target) == folder_bytes(reference)
    assert verify(target).ok


def test_populate_repairs_a_same_size_shard_swapped_in_from_another_cache(tmp_path, reference):
    target = copy_of(reference, tmp_path)
    other = build(tmp_path / "other", texts=[t + "?" for t in TEXTS]).cache_dir
    shutil.copy2(shard_path(tmp_path / "other", 1), target / reference_shards(reference)[1]["file"])
    assert build(target).shards_repaired == 1 and other
    assert folder_bytes(target) == folder_bytes(reference)


# ------------------------------------------------------------------------------ inputs


def test_text_file_lines_are_texts_and_empty_lines_are_blank_images(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_bytes(b"first\n\nthird\r\n")
    assert list(read_texts(path)) == ["first", "", "third"]
    build(tmp_path / "c", texts=path)
    images = ShardedImageCache(tmp_path / "c")
    assert len(images) == 3 and (images[1] == 255).all() and (images[0] < 128).any()


def test_jsonl_reads_the_field_and_skips_blank_lines(tmp_path):
    path = tmp_path / "texts.jsonl"
    path.write_text('{"text": "a", "body": "x"}\n\n{"text": "b", "body": "y"}\n')
    assert list(read_texts(path)) == ["a", "b"]
    assert list(read_texts(path, field="body")) == ["x", "y"]


@pytest.mark.parametrize("content, match", [
    ('{"text": "a"}\n{"body": "b"}\n', r"line 2 has no field 'text' \(has: \['body'\]\)"),
    ('{"text": "a"}\nnot json\n', "line 2 is not JSON"),
    ('{"text": 5}\n', "line 1: field 'text' is a int"),
])
def test_bad_jsonl_is_refused_naming_the_line(tmp_path, content, match):
    path = tmp_path / "texts.jsonl"
    path.write_text(content)
    with pytest.raises(InputError, match=match):
        list(read_texts(path))


def test_invalid_utf8_is_refused_naming_the_line_or_replaced_when_asked(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_bytes(b"good\nbad \xff\xfe here\n")
    with pytest.raises(InputError, match=r"line 2 is not valid UTF-8 .*errors='replace'"):
        build(tmp_path / "c", texts=path)
    assert not (tmp_path / "c" / "manifest.json").exists()
    assert list(read_texts(path, errors="replace")) == ["good", "bad \ufffd\ufffd here"]
    build(tmp_path / "c", texts=path, errors="replace")
    assert len(ShardedImageCache(tmp_path / "c")) == 2


def test_hostile_texts_populate_a_verified_cache(tmp_path):
    hostile = ["", "a" * 100_000, "nul\x00inside\x00", "😀👍🏽🇺🇳", "שלום עולם", "e\u0301\u0301",
               "x\ud800y", "\n" * 1000, "\t\r\x1b[31mred"]
    build(tmp_path, texts=hostile, codec="zlib")
    images = ShardedImageCache(tmp_path)
    assert len(images) == len(hostile) and verify(tmp_path).ok
    assert (images[0] == 255).all() and np.array_equal(images[2], render_text("nulinside", SIZE))


def test_non_string_items_are_refused_naming_the_index(tmp_path):
    with pytest.raises(InputError, match="text 2 is a int"):
        build(tmp_path, texts=["a", "b", 3])


def test_missing_text_file_is_refused(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        build(tmp_path, texts=tmp_path / "nope.txt")


def test_a_folder_passed_as_texts_is_named_a_folder(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(InputError, match=r"is a folder, not a file.*such as .*a\.jsonl"):
        build(tmp_path / "c", texts=tmp_path / "in")


# ------------------------------------------------------------------------------ codec stats


def test_measure_codecs_gives_the_budget_shape_and_plausible_numbers():
    sample = [render_text(t, 64) for t in TEXTS[:20]]
    stats = cache.measure_codecs(sample, min_seconds=0.05)
    assert set(stats) == {"raw", "png", "zlib", "zstd"}
    for s in stats.values():
        assert set(s) == {"bytes_per_image", "decode_images_per_s"} and s["decode_images_per_s"] > 0
    assert stats["raw"]["bytes_per_image"] == 64 * 64 * 3
    assert stats["zlib"]["bytes_per_image"] < stats["raw"]["bytes_per_image"] / 4
    from nblib import budget

    assert budget.choose_codec(10, 10 ** 12, stats) in stats


def test_plan_predicts_raw_shard_bytes_within_a_percent(tmp_path, reference):
    plan = cache.plan_cache(len(TEXTS), tmp_path, SIZE, SHARD_MB, "raw")
    on_disk = sum(p.stat().st_size for p in reference.glob("shard-*"))
    assert abs(plan.predicted_bytes - on_disk) / on_disk < 0.01
    assert plan.n_shards == len(reference_shards(reference))


def test_plan_is_the_budgets_prediction(tmp_path):
    from nblib import budget

    plan = cache.plan_cache(10_000, tmp_path, 224, 400, "zlib", bytes_per_image=2_000)
    assert plan.predicted_bytes == budget.cache_bytes(10_000, 224, "zlib", 2_016, shard_mb=400)


def test_no_warnings_for_a_normal_cache(reference):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardedImageCache(reference)
