"""`nblib.export` and `python -m nblib export`: a cache and an encode run's outputs to Parquet and an HF
datasets folder, read back with pyarrow and `datasets` to the same pixels and outputs (a SIGKILLed export:
test_export_complete.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import small_cache
from nblib.cache import ShardedImageCache, populate
from nblib.export import export_cache, export_outputs, layout_bytes, read_export, read_parquet_column
from nblib.render import render_text

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

TEXTS = [f"row {i}: " + "export me " * (i % 5) for i in range(48)]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    (root / "texts.txt").write_text("".join(t + "\n" for t in TEXTS))
    folder = root / "c"
    populate(root / "texts.txt", folder, image_size=32, shard_mb=0.002, workers=0, codec="zstd", progress=False)
    return folder


@pytest.fixture(scope="module")
def outputs_dir(tmp_path_factory):
    """An encode run's consolidated outputs (the smoke model on a small cache)."""
    import torch

    from nblib import encode as enc
    from nblib.config import preset

    root = tmp_path_factory.mktemp("run")
    texts = [f"#{i} outputs become a dataset" for i in range(24)]
    (root / "texts.txt").write_text("".join(t + "\n" for t in texts))
    cache = small_cache(root / "cache", texts)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        enc.encode(ShardedImageCache(cache), root / "run", preset("smoke").replace(batch_size=8),
                   progress=False, preflight=False, do_consolidate=False)
    finally:
        torch.set_num_threads(before)
    enc.consolidate(root / "run", root / "outputs")
    return root


def test_a_cache_goes_to_parquet_one_zstd_row_group_per_shard_and_reads_back_with_pyarrow(cache_dir, tmp_path):
    summary = export_cache(cache_dir, tmp_path, "parquet")
    cache = ShardedImageCache(cache_dir)
    files = sorted(tmp_path.glob("*.parquet"))
    assert summary.n_files == len(files) == len(cache.manifest["shards"]) >= 2
    for f, shard in zip(files, cache.manifest["shards"]):
        meta = pq.ParquetFile(f).metadata
        assert meta.num_row_groups == 1 and meta.num_rows == shard["count"]
        assert meta.row_group(0).column(2).compression == "ZSTD"
    images = read_parquet_column(tmp_path, "image")  # pyarrow only
    assert images.shape == (len(TEXTS), 32, 32, 3)
    assert np.array_equal(images, cache.get_batch(0, len(cache)))
    table = pq.read_table(files[0])
    assert table.column("index").to_pylist() == list(range(cache.manifest["shards"][0]["count"]))
    assert table.column("text").to_pylist() == TEXTS[:cache.manifest["shards"][0]["count"]]


def test_a_cache_goes_to_an_hf_folder_that_datasets_loads_to_the_same_pixels(cache_dir, tmp_path):
    export_cache(cache_dir, tmp_path, "hf")
    dataset = datasets.load_from_disk(str(tmp_path))
    assert dataset.features["image"] == datasets.Array3D(shape=(3, 32, 32), dtype="uint8")
    pixels = np.stack([np.asarray(row["image"], dtype=np.uint8) for row in dataset.with_format("numpy")])
    assert np.array_equal(pixels.transpose(0, 2, 3, 1), np.stack([render_text(t, 32) for t in TEXTS]))
    again = export_cache(cache_dir, tmp_path, "hf")
    assert again.files_written == 0 and again.files_reused == again.n_files


@pytest.mark.parametrize("fmt", ["parquet", "hf"])
def test_outputs_export_row_aligned_with_the_texts_and_read_back(outputs_dir, tmp_path, fmt):
    from nblib.encode.consolidate import load_outputs

    arrays = load_outputs(outputs_dir / "outputs")
    summary = export_outputs(outputs_dir / "outputs", tmp_path, fmt, texts=outputs_dir / "texts.txt")
    assert summary.n_rows == 24
    texts = (outputs_dir / "texts.txt").read_text().splitlines()
    if fmt == "parquet":
        table = pq.read_table(tmp_path)
        assert table.column("text").to_pylist() == texts
        for name, array in arrays.items():
            assert np.array_equal(read_parquet_column(tmp_path, name), np.asarray(array)), name
    else:
        dataset = datasets.load_from_disk(str(tmp_path))
        assert dataset["text"] == texts and dataset["index"] == list(range(24))
        for name, array in arrays.items():
            back = np.stack([np.asarray(row[name]) for row in dataset.with_format("numpy")]).astype(array.dtype)
            assert np.array_equal(back, np.asarray(array)), name
    back = read_export(tmp_path)
    assert back["text"] == texts and list(back["index"]) == list(range(24))
    assert all(np.array_equal(back[name], np.asarray(array)) for name, array in arrays.items())


def test_texts_that_do_not_match_the_rows_are_refused(outputs_dir, tmp_path):
    from nblib.errors import InputError

    with pytest.raises(InputError, match="23 texts for 24 output rows"):
        export_outputs(outputs_dir / "outputs", tmp_path, texts=[f"t{i}" for i in range(23)])


def test_an_export_of_something_else_in_the_folder_is_refused_unless_overwrite(cache_dir, outputs_dir, tmp_path):
    from nblib.errors import StateError

    export_cache(cache_dir, tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(StateError, match="export of something else.*overwrite"):
        export_outputs(outputs_dir / "outputs", tmp_path)
    export_outputs(outputs_dir / "outputs", tmp_path, overwrite=True)
    assert not list(tmp_path.glob("*.parquet"))[1:]  # the cache's files went, one outputs file came
    assert (tmp_path / "notes.txt").read_text() == "mine"  # not listed by the manifest: kept


def test_channel_first_keeps_arrow_near_the_raw_bytes_and_hwc_does_not():
    images = np.stack([render_text(t, 64) for t in TEXTS[:16]])
    ratios = layout_bytes(images)
    assert ratios["hwc"] > 2.0 and ratios["chw"] < 1.1
