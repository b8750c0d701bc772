"""Images in from where people keep them: `cache --hf` (a save_to_disk folder, Parquet, Arrow) and
`cache --wds` (webdataset tars, streamed) round-trip every pixel and every label or text; bad
columns, damaged tars and hub names are refused in one line; a SIGKILLed wds build resumes to the
same bytes.
"""
from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
from cli_runner import run_nblib
from test_cache_cli import assert_three_kills_resume_to_the_reference, one_error_line, run_cli

from nblib.cache import ShardedImageCache
from nblib.cache.sources import expand_braces, source_labels

SIZE = 16
CLASSES = ["cat", "dog", "eel"]


def pixels(n, size=SIZE, seed=0):
    return [np.random.default_rng(seed + k).integers(0, 256, (size, size, 3), dtype=np.uint8) for k in range(n)]


def png(array) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def cached(folder):
    cache = ShardedImageCache(folder)
    return [np.asarray(cache[k]) for k in range(len(cache))]


def hf_dataset(arrays, labels=None, texts=None):
    import datasets
    from PIL import Image

    columns = {"img": [Image.fromarray(a) for a in arrays]}
    features = {"img": datasets.Image()}
    if labels is not None:
        columns["label"], features["label"] = labels, datasets.ClassLabel(names=CLASSES)
    if texts is not None:
        columns["caption"], features["caption"] = texts, datasets.Value("string")
    return datasets.Dataset.from_dict(columns, features=datasets.Features(features))


def write_wds(folder, arrays, labels, texts, per_tar):
    folder.mkdir()
    for t in range(0, len(arrays), per_tar):
        with tarfile.open(folder / f"shards-{t // per_tar:03d}.tar", "w") as tar:
            for k in range(t, min(t + per_tar, len(arrays))):
                members = {"png": png(arrays[k]), "cls": str(labels[k]).encode(),
                           "json": json.dumps({"text": texts[k]}).encode()}
                for ext, data in members.items():
                    info = tarfile.TarInfo(f"sample{k:05d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    last = (len(arrays) - 1) // per_tar
    return f"{folder}/shards-{{000..{last:03d}}}.tar"


def test_cache_hf_saved_dataset_round_trips_every_pixel_and_label(tmp_path):
    arrays, labels = pixels(10), [k % 3 for k in range(10)]
    hf_dataset(arrays, labels=labels).save_to_disk(str(tmp_path / "ds"))
    assert run_cli("--hf", str(tmp_path / "ds"), "--image-column", "img", "--label-column", "label",
                   "--out", str(tmp_path / "c"), "--shard-mb", "0.002", "--no-progress").returncode == 0
    assert all(np.array_equal(a, b) for a, b in zip(cached(tmp_path / "c"), arrays, strict=True))
    assert source_labels(tmp_path / "c") == {"labels": labels, "classes": CLASSES}

    from nblib.train.data import labels_for_cache

    values, classes = labels_for_cache(ShardedImageCache(tmp_path / "c"))
    assert values.tolist() == labels and classes == CLASSES


def test_cache_hf_text_column_and_a_parquet_file_round_trip_every_text(tmp_path):
    arrays, texts = pixels(7, seed=50), [f"a caption {k} é" for k in range(7)]
    dataset = hf_dataset(arrays, texts=texts)
    dataset.save_to_disk(str(tmp_path / "ds"))
    dataset.to_parquet(str(tmp_path / "x.parquet"))
    for source, out in ((tmp_path / "ds", "c1"), (tmp_path / "x.parquet", "c2")):
        assert run_cli("--hf", str(source), "--image-column", "img", "--text-column", "caption",
                       "--out", str(tmp_path / out), "--no-progress").returncode == 0
        assert all(np.array_equal(a, b) for a, b in zip(cached(tmp_path / out), arrays, strict=True))
        assert source_labels(tmp_path / out) == {"texts": texts}


def test_cache_hf_parquet_keeps_class_names_and_an_arrow_folder_reads(tmp_path):
    arrays, labels = pixels(6, seed=90), [2, 0, 1, 2, 2, 0]
    dataset = hf_dataset(arrays, labels=labels)
    dataset.to_parquet(str(tmp_path / "x.parquet"))
    dataset.save_to_disk(str(tmp_path / "ds"))
    arrow = tmp_path / "arrow"
    arrow.mkdir()
    for f in (tmp_path / "ds").glob("*.arrow"):
        (arrow / f.name).write_bytes(f.read_bytes())
    for source, out in ((tmp_path / "x.parquet", "c1"), (arrow, "c2")):
        assert run_cli("--hf", str(source), "--image-column", "img", "--label-column", "label",
                       "--out", str(tmp_path / out), "--no-progress").returncode == 0
        assert all(np.array_equal(a, b) for a, b in zip(cached(tmp_path / out), arrays, strict=True))
        assert source_labels(tmp_path / out) == {"labels": labels, "classes": CLASSES}


def test_cache_hf_sixteen_bit_images_are_scaled_by_the_one_decoder(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    ramp = np.tile(np.linspace(0, 65535, SIZE).round().astype(np.uint16), (SIZE, 1))
    buffer = io.BytesIO()
    Image.fromarray(ramp).save(buffer, format="PNG")
    pq.write_table(pa.table({"image": [{"bytes": buffer.getvalue(), "path": None}]}), tmp_path / "x.parquet")
    assert run_cli("--hf", str(tmp_path / "x.parquet"), "--out", str(tmp_path / "c"), "--no-progress").returncode == 0
    assert abs(cached(tmp_path / "c")[0].mean() - 127.5) < 1


def test_cache_wds_round_trips_every_pixel_label_and_key_across_three_tars(tmp_path):
    arrays = pixels(11, seed=200)
    labels, texts = [k % 3 for k in range(11)], [f"text {k}" for k in range(11)]
    pattern = write_wds(tmp_path / "wds", arrays, labels, texts, per_tar=4)
    assert len(expand_braces(pattern)) == 3
    assert run_cli("--wds", pattern, "--out", str(tmp_path / "c"), "--shard-mb", "0.003",
                   "--no-progress").returncode == 0
    assert all(np.array_equal(a, b) for a, b in zip(cached(tmp_path / "c"), arrays, strict=True))
    assert source_labels(tmp_path / "c") == {"labels": labels, "classes": ["0", "1", "2"], "texts": texts}

    from nblib.cache.images import source_keys

    assert source_keys(tmp_path / "c") == [f"sample{k:05d}" for k in range(11)]


def test_cache_wds_labels_alone_reach_train(tmp_path):
    from nblib.train.data import labels_for_cache

    arrays, labels = pixels(5, seed=300), [1, 0, 1, 1, 0]
    (tmp_path / "wds").mkdir()
    with tarfile.open(tmp_path / "wds" / "a.tar", "w") as tar:
        for k, array in enumerate(arrays):
            for ext, data in (("png", png(array)), ("cls", b"%d" % labels[k])):
                info = tarfile.TarInfo(f"dir/s{k}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    done = run_cli("--wds", str(tmp_path / "wds" / "a.tar"), "--out", str(tmp_path / "c"), "--no-progress")
    assert done.returncode == 0, done.stderr
    values, classes = labels_for_cache(ShardedImageCache(tmp_path / "c"))
    assert values.tolist() == labels and classes == ["0", "1"]


def test_expand_braces_ranges_lists_and_padding():
    assert expand_braces("s-{000..002}.tar") == ["s-000.tar", "s-001.tar", "s-002.tar"]
    assert expand_braces("{a,b}-{8..10}") == ["a-8", "a-9", "a-10", "b-8", "b-9", "b-10"]
    assert expand_braces("plain.tar") == ["plain.tar"]


@pytest.mark.slow
def test_bad_columns_damaged_tars_and_hub_names_are_one_error_line(tmp_path):
    hf_dataset(pixels(3), labels=[0, 1, 2]).save_to_disk(str(tmp_path / "ds"))
    line = one_error_line(run_cli("--hf", tmp_path / "ds", "--image-column", "img", "--label-column", "lbl",
                                  "--out", tmp_path / "o"))
    assert "'lbl'" in line and "['img', 'label']" in line

    line = one_error_line(run_cli("--hf", "someone/cats", "--out", tmp_path / "o"))
    assert "local datasets only" in line and "save_to_disk" in line

    (tmp_path / "wds").mkdir()
    with tarfile.open(tmp_path / "wds" / "bad.tar", "w") as tar:
        for name, data in (("s0.png", png(pixels(1)[0])), ("s1.png", b"not a png at all")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    line = one_error_line(run_cli("--wds", tmp_path / "wds" / "bad.tar", "--out", tmp_path / "o"))
    assert "bad.tar" in line and "s1.png" in line

    raw = (tmp_path / "wds" / "bad.tar").read_bytes()
    (tmp_path / "wds" / "cut.tar").write_bytes(raw[:700])
    line = one_error_line(run_cli("--wds", tmp_path / "wds" / "cut.tar", "--out", tmp_path / "o2"))
    assert "cut.tar" in line and "s0.png" in line


@pytest.mark.slow
def test_cache_wds_sigkilled_three_times_resumes_to_byte_identical_shards(tmp_path):
    arrays = pixels(280, size=64, seed=1000)
    pattern = write_wds(tmp_path / "wds", arrays, [k % 3 for k in range(280)], [f"t{k}" for k in range(280)],
                        per_tar=100)
    args = lambda out: ("--wds", pattern, "--out", out, "--shard-mb", 0.05, "--no-progress")
    assert_three_kills_resume_to_the_reference(tmp_path, args, shards=70)


@pytest.mark.slow
def test_train_runs_on_a_wds_cache_with_the_labels_of_its_cls_members(tmp_path):

    arrays, labels = pixels(24, size=64, seed=500), [k % 4 for k in range(24)]
    pattern = write_wds(tmp_path / "wds", arrays, labels, [""] * 24, per_tar=12)
    assert run_cli("--wds", pattern, "--out", str(tmp_path / "c"), "--no-progress").returncode == 0
    result = run_nblib("train", "--cache", tmp_path / "c", "--out", tmp_path / "run", "--steps", 1, "--batch-size", 8,
                       NBLIB_PROFILE="smoke")
    assert result.returncode == 0, result.stderr
    assert "4 classes" in result.stdout


def test_a_dataset_dict_folder_is_refused_naming_its_splits(tmp_path):
    import datasets

    from nblib.cache.sources import hf_source
    from nblib.errors import InputError

    datasets.DatasetDict({"train": hf_dataset(pixels(2), labels=[0, 1])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InputError, match=r"DatasetDict of splits \['train'\]"):
        hf_source(tmp_path / "dd", "img")


def test_a_null_text_or_label_is_refused_naming_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nblib.cache.sources import hf_source
    from nblib.errors import InputError

    cells = [{"bytes": png(a), "path": None} for a in pixels(3)]
    pq.write_table(pa.table({"image": cells, "t": ["a", None, "c"], "y": [0, 1, None]}), tmp_path / "x.parquet")
    with pytest.raises(InputError, match="row 1 has no text"):
        hf_source(tmp_path / "x.parquet", text_column="t")
    with pytest.raises(InputError, match="row 2 has no label"):
        hf_source(tmp_path / "x.parquet", label_column="y")


def test_the_export_of_a_wds_cache_carries_every_key_label_and_text(tmp_path):
    import pyarrow.parquet as pq

    from nblib.export import export_cache

    arrays = pixels(5, seed=300)
    labels, texts = [2, 0, 1, 1, 0], [f"caption {k}" for k in range(5)]
    pattern = write_wds(tmp_path / "wds", arrays, labels, texts, per_tar=3)
    assert run_cli("--wds", pattern, "--out", str(tmp_path / "c"), "--no-progress").returncode == 0
    export_cache(tmp_path / "c", tmp_path / "x", "parquet")
    table = pq.read_table(sorted((tmp_path / "x").glob("*.parquet"))).to_pydict()
    assert table["key"] == [f"sample{k:05d}" for k in range(5)]
    assert table["label"] == [str(v) for v in labels] and table["text"] == texts
