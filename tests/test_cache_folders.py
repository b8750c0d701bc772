"""Images as people keep them: a tree of class folders of mixed sizes caches with `--size` and trains a
user's `--model` on the folders' labels; a labels file labels a flat folder; a refused build leaves
nothing behind; labels are checked once, at cache time (negative, absurd, id-like), for folders, wds
tars and HF datasets; a wds tar's unused member is skipped unread, and a tar cut between two members is
refused; a missing HF image is named as such.
"""
from __future__ import annotations

import io
import json
import tarfile
import tracemalloc

import numpy as np
import pytest
from cli_runner import run_nblib
from test_cache_cli import one_error_line, run_cli

from conftest import importable_models
from nblib.cache import ShardedImageCache, read_cache_manifest
from nblib.cache.images import RESIZE_POLICY, source_keys
from nblib.cache.pixels import DECODE_POLICY
from nblib.cache.sources import images_source, source_labels, wds_source
from nblib.errors import ConfigError, InputError

CLASSES = ["ant", "bee", "cat"]
SIZES = [(48, 80), (96, 64), (64, 64), (120, 90)]      # (height, width): wide, tall, square, big
FACTORY = '''
import torch
from torch import nn


class Net(nn.Module):
    """A user's model: a conv net giving pooled features; train puts a head of the cache's classes on it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x)).mean(dim=(2, 3))


def build():
    return Net()
'''


def picture(cls: int, k: int, size=None) -> np.ndarray:
    """An image of class `cls` (its colour channel bright), of the k-th of SIZES unless `size` is given."""
    h, w = size or SIZES[k % len(SIZES)]
    rng = np.random.default_rng(100 * cls + k)
    array = rng.integers(0, 60, (h, w, 3), dtype=np.uint8)
    array[..., cls] += 180
    return array


def class_tree(root, per_class=10):
    """root/ant, root/bee, root/cat of PNG and JPEG files in four sizes."""
    from PIL import Image

    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for k in range(per_class):
            Image.fromarray(picture(c, k)).save(root / name / f"{k:02d}.{'png' if k % 2 else 'jpg'}")
    return root


def centre_crop(path, size):
    """The stated policy, computed with Pillow alone: shorter side to `size` (bicubic), then the centre crop."""
    from PIL import Image

    with Image.open(path) as image:
        image = image.convert("RGB")
        scale = size / min(image.size)
        w, h = max(size, round(image.width * scale)), max(size, round(image.height * scale))
        image = image.resize((w, h), Image.Resampling.BICUBIC)
        left, top = (w - size) // 2, (h - size) // 2
        return np.asarray(image.crop((left, top, left + size, top + size)))


def test_class_folders_of_mixed_sizes_cache_at_size_64_and_train_a_users_model_on_the_folder_labels(
        tmp_path, one_torch_thread):
    from nblib.train.data import labels_for_cache

    root = class_tree(tmp_path / "tree")
    built = run_cli("--images", root, "--out", tmp_path / "c", "--size", 64, "--shard-mb", 0.05)
    assert built.returncode == 0, built.stderr
    assert "decoding images" in built.stderr and "rendering" not in built.stderr
    manifest = read_cache_manifest(tmp_path / "c")
    assert manifest["image_shape"] == [64, 64, 3] and manifest["resize"] == {"size": 64, "policy": RESIZE_POLICY,
                                                                         "decode": DECODE_POLICY}
    assert manifest["source"]["side"]["classes"] == CLASSES

    cache = ShardedImageCache(tmp_path / "c")
    labels, classes = labels_for_cache(cache)
    keys = source_keys(tmp_path / "c")
    assert len(keys) == len(cache) == 30 and classes == CLASSES
    assert [classes[label] for label in labels] == [key.split("/")[0] for key in keys]
    for k in (0, 1, 3):                             # wide, tall and big: each resized and cropped as stated
        assert np.array_equal(cache[k], centre_crop(root / keys[k], 64)), keys[k]

    (tmp_path / "models").mkdir()
    with importable_models(tmp_path / "models", {}, FACTORY):
        trained = run_nblib("train", "--cache", tmp_path / "c", "--out", tmp_path / "run", "--model",
                            "tinyfactory:build", "--steps", 4, "--batch-size", 8, "--eval-every", 4,
                            "--no-progress", NBLIB_PROFILE="smoke")
    assert trained.returncode == 0, trained.stderr
    assert "3 classes" in trained.stdout and (tmp_path / "run" / "final.pt").is_file()


def test_mixed_sizes_without_size_are_one_line_naming_two_sizes_and_the_refused_build_leaves_nothing(tmp_path):
    root = class_tree(tmp_path / "tree", per_class=2)
    line = one_error_line(run_cli("--images", root, "--out", tmp_path / "c", "--no-progress"))
    assert "64x96 px" in line and "80x48 px" in line and "--size N" in line
    assert not (tmp_path / "c").exists()
    (tmp_path / "mine").mkdir()                     # a folder the user made stays, empty
    one_error_line(run_cli("--images", root, "--out", tmp_path / "mine", "--no-progress"))
    assert list((tmp_path / "mine").iterdir()) == []
    retried = run_cli("--images", root, "--out", tmp_path / "c", "--size", 32, "--no-progress")
    assert retried.returncode == 0, retried.stderr  # no --overwrite needed


@pytest.mark.parametrize("suffix", ["csv", "json"])
def test_a_labels_file_labels_a_flat_folder_and_rows_that_miss_or_stray_are_refused(tmp_path, suffix):
    from PIL import Image

    (tmp_path / "flat").mkdir()
    names = [f"im{k}.png" for k in range(6)]
    for k, name in enumerate(names):
        Image.fromarray(picture(k % 3, 2)).save(tmp_path / "flat" / name)
    given = {name: CLASSES[k % 3] for k, name in enumerate(names)}
    labels_file = tmp_path / f"labels.{suffix}"
    if suffix == "csv":                             # a header, and files named without their suffix
        labels_file.write_text("filename,class\n" + "".join(f"{n[:-4]},{c}\n" for n, c in given.items()))
    else:
        labels_file.write_text(json.dumps(given))
    assert run_cli("--images", tmp_path / "flat", "--labels", labels_file, "--out", tmp_path / "c",
                   "--no-progress").returncode == 0
    table = source_labels(tmp_path / "c")
    assert table["classes"] == CLASSES
    assert [table["classes"][v] for v in table["labels"]] == [given[k] for k in source_keys(tmp_path / "c")]

    ghost = {"ghost.png": "ant"}                    # first in JSON (no header there), last in CSV (after one)
    stray = {**ghost, **given} if suffix == "json" else {**given, **ghost}
    short = {k: v for k, v in given.items() if k != "im4.png"}
    write = (lambda rows: "".join(f"{k},{v}\n" for k, v in rows.items())) if suffix == "csv" else json.dumps
    labels_file.write_text(write(stray))
    with pytest.raises(InputError, match=r"1 rows name no image .* \(first: 'ghost.png'\)"):
        images_source(tmp_path / "flat", labels=labels_file)
    labels_file.write_text(write(short))
    with pytest.raises(InputError, match=r"1 of the 6 images have no label \(first: 'im4.png'\)"):
        images_source(tmp_path / "flat", labels=labels_file)


def test_an_unlabelled_image_cache_tells_train_how_to_label_it_not_to_pass_texts(tmp_path):
    from PIL import Image

    (tmp_path / "flat").mkdir()
    for k in range(4):
        Image.fromarray(picture(0, 2)).save(tmp_path / "flat" / f"{k}.png")
    assert run_cli("--images", tmp_path / "flat", "--out", tmp_path / "c", "--no-progress").returncode == 0
    from nblib.train.data import labels_for_cache

    with pytest.raises(ConfigError, match=r"holds images without labels .* one subfolder per class .* --labels FILE"):
        labels_for_cache(ShardedImageCache(tmp_path / "c"))


def tar_member(tar, name, data: bytes):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def png(array) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("label, expected", [(-1, "label -1 is negative"),
                                             (10 ** 12, "would make 1,000,000,000,001 classes")])
def test_a_wds_label_that_is_negative_or_absurd_is_one_line_naming_the_sample(tmp_path, label, expected):
    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        for k, cls in enumerate([0, 1, label, 1]):
            tar_member(tar, f"s{k}.png", png(picture(0, 2, size=(8, 8))))
            tar_member(tar, f"s{k}.cls", str(cls).encode())
    line = one_error_line(run_cli("--wds", tmp_path / "a.tar", "--out", tmp_path / "c", "--no-progress"))
    assert expected in line and "sample 's2'" in line
    assert not (tmp_path / "c").exists()


def test_hf_and_labels_file_labels_that_are_negative_or_one_per_row_are_refused_at_cache_time(tmp_path):
    import datasets

    from nblib.cache.labels import DISTINCT_ROWS
    from nblib.cache.sources import hf_source

    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    arrays = [picture(0, 2, size=(8, 8)) for _ in range(3)]
    from PIL import Image

    datasets.Dataset.from_dict({"img": [Image.fromarray(a) for a in arrays], "label": [0, -1, 2]},
                               features=features).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(InputError, match=r"row 1: label -1 is negative \(datasets marks a missing ClassLabel"):
        hf_source(tmp_path / "ds", "img", label_column="label")

    (tmp_path / "flat").mkdir()
    for k in range(DISTINCT_ROWS):
        (tmp_path / "flat" / f"{k:03d}.png").write_bytes(png(arrays[0]))
    (tmp_path / "ids.csv").write_text("".join(f"{k:03d}.png,photo of thing {k}\n" for k in range(DISTINCT_ROWS)))
    with pytest.raises(InputError, match=rf"{DISTINCT_ROWS} distinct labels in {DISTINCT_ROWS} rows .* not of classes"):
        images_source(tmp_path / "flat", labels=tmp_path / "ids.csv")


def test_a_none_image_in_an_hf_dataset_is_named_a_missing_image_with_its_row(tmp_path):
    import datasets
    from PIL import Image

    from nblib.cache import write_images
    from nblib.cache.sources import hf_source

    images = [Image.fromarray(picture(0, 2, size=(8, 8))), None, Image.fromarray(picture(1, 2, size=(8, 8)))]
    datasets.Dataset.from_dict({"img": images}, features=datasets.Features({"img": datasets.Image()})) \
        .save_to_disk(str(tmp_path / "ds"))
    source = hf_source(tmp_path / "ds", "img")
    with pytest.raises(InputError, match=r"row 1 of the dataset \(column 'img'\) has no image \(None\): a missing"):
        write_images(source.images, tmp_path / "c", progress=False)


def test_a_large_unused_wds_member_is_skipped_unread(tmp_path):
    """Each sample carries a 64 MB `npy` member nobody uses (sparse on disk): the build reads none of it."""
    big = 64 << 20
    with open(tmp_path / "big.tar", "wb") as f:
        for k in range(3):
            for name, data in ((f"s{k}.png", png(picture(k, 2, size=(8, 8)))), (f"s{k}.cls", b"%d" % k)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                f.write(info.tobuf() + data + b"\0" * (-len(data) % 512))
            info = tarfile.TarInfo(f"s{k}.npy")
            info.size = big
            f.write(info.tobuf())
            f.seek(big, 1)                          # a hole: the member's bytes are zeros, never written
        f.write(b"\0" * 1024)                       # the end-of-archive blocks
    tracemalloc.start()
    try:
        source = wds_source(str(tmp_path / "big.tar"))
        images = list(source.images)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(images) == 3 and source.labels == [0, 1, 2]
    assert peak < big // 8, f"peak {peak:,} bytes: the unused member was read"


def test_a_wds_tar_cut_between_two_members_is_refused_not_a_short_cache(tmp_path):
    with tarfile.open(tmp_path / "whole.tar", "w") as tar:
        for k in range(4):
            tar_member(tar, f"s{k}.png", png(picture(0, 2, size=(8, 8))))
            tar_member(tar, f"s{k}.cls", b"0")
    with tarfile.open(tmp_path / "whole.tar") as tar:
        cut_at = tar.getmember("s2.png").offset     # the header of sample 2: samples 0 and 1 are whole
    (tmp_path / "cut.tar").write_bytes((tmp_path / "whole.tar").read_bytes()[:cut_at])
    line = one_error_line(run_cli("--wds", tmp_path / "cut.tar", "--out", tmp_path / "c", "--no-progress"))
    assert "cut.tar ends after member 's1.cls'" in line and "end-of-archive" in line
    assert not (tmp_path / "c").exists()


def test_a_class_tree_with_images_beside_it_or_an_empty_class_is_refused_and_hidden_folders_are_skipped(tmp_path):
    from nblib.cache.sources import folder_images

    root = class_tree(tmp_path / "tree", per_class=1)
    (root / "__MACOSX" / "ant").mkdir(parents=True)
    (root / "__MACOSX" / "ant" / "._00.jpg").write_bytes(b"resource fork, not an image")
    (root / ".ipynb_checkpoints").mkdir()
    files, classes = folder_images(root)
    assert classes == CLASSES and [f.relative_to(root).as_posix() for f in files] == ["ant/00.jpg", "bee/00.jpg",
                                                                                   "cat/00.jpg"]
    (root / "dog").mkdir()
    with pytest.raises(InputError, match="the class subfolder 'dog' holds no image files"):
        folder_images(root)
    (root / "dog").rmdir()
    (root / "stray.png").write_bytes(png(picture(0, 2, size=(8, 8))))
    with pytest.raises(InputError, match="holds 1 image files beside 3 subfolders of images"):
        folder_images(root)
