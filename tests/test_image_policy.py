"""The one pixel policy of every image source, and what `cache --images/--hf/--wds` says and refuses.

Each expected array is computed here with Pillow alone, from the policy docs/formats.md states: open,
`draft('RGB', (N, N))` for a JPEG with `--size N`, `ImageOps.exif_transpose`, `convert('RGB')`, the
shorter side to N (bicubic), the centre N x N crop. The same EXIF-rotated JPEG gives those pixels through
a folder, a `--labels` folder, a wds tar, Parquet and an HF `save_to_disk` folder. Class folders: NFC and
NFD spellings are one class, a symlinked class is refused naming both, a file name that is not UTF-8 is
refused naming its bytes. `--size` past 16,384, a labels CSV that is not UTF-8, list labels and
Pillow's bomb warning are one line each; a BOM CSV keeps its first row; whole floats are class indices.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
import unicodedata

import numpy as np
import pytest
from test_cache_cli import one_error_line, run_cli

from nblib.cache import ShardedImageCache
from nblib.cache.sources import source_labels

ORIENTATION = 0x0112


def photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A smooth picture with a corner marker, so any rotation, flip or draft shows in the pixels."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    array = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1),
                      (x + y) * 127 // max(width + height - 2, 1)], axis=2).astype(np.uint8)
    array[: height // 4, : width // 4] = [250, 20, 20]
    return np.clip(array.astype(int) + rng.integers(-12, 13, array.shape), 0, 255).astype(np.uint8)


def jpeg_bytes(array: np.ndarray, orientation: int | None = None) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    exif = Image.Exif()
    if orientation is not None:
        exif[ORIENTATION] = orientation
    Image.fromarray(array).save(buffer, "JPEG", quality=92, exif=exif.tobytes())
    return buffer.getvalue()


def stated_policy(data: bytes, size: int | None, draft: bool = True) -> np.ndarray:
    """docs/formats.md's pixel policy, in Pillow calls: draft, exif_transpose, RGB, resize, centre crop."""
    from PIL import Image, ImageOps

    image = Image.open(io.BytesIO(data))
    if size is not None and draft:
        image.draft("RGB", (size, size))
    image = ImageOps.exif_transpose(image).convert("RGB")
    if size is None:
        return np.asarray(image)
    scale = size / min(image.size)
    w, h = max(size, round(image.width * scale)), max(size, round(image.height * scale))
    image = image.resize((w, h), Image.Resampling.BICUBIC)
    left, top = (w - size) // 2, (h - size) // 2
    return np.asarray(image.crop((left, top, left + size, top + size)))


def cached(folder) -> list[np.ndarray]:
    cache = ShardedImageCache(folder)
    return [np.asarray(cache[k]) for k in range(len(cache))]


def built(*args):
    result = run_cli(*args, "--no-progress")
    assert result.returncode == 0, result.stderr
    return result


def tar_of(path, members: dict[str, bytes]):
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def hf_folder(path, blobs: list[bytes], labels: list[int] | None = None):
    """An HF `save_to_disk` folder whose Image column holds these encoded bytes as they are."""
    import datasets

    columns = {"image": [{"bytes": b, "path": None} for b in blobs]}
    features = {"image": datasets.Image()}
    if labels is not None:
        columns["label"], features["label"] = labels, datasets.ClassLabel(names=["a", "b"])
    datasets.Dataset.from_dict(columns, features=datasets.Features(features)).save_to_disk(str(path))
    return path


# ============================================================================ one EXIF policy


@pytest.mark.parametrize("size", [None, 24])
def test_an_exif_rotated_jpeg_gives_the_same_pixels_through_every_source(tmp_path, size):
    """Orientation 6 (a phone held upright): a folder, a --labels folder, a wds tar, Parquet and an HF
    save_to_disk folder each cache ImageOps.exif_transpose's pixels, resized by the stated policy.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    blobs = [jpeg_bytes(photo(48, 32, k), orientation) for k, orientation in enumerate([6, 8, 5, 7])]
    expected = [stated_policy(b, size) for b in blobs]
    assert expected[0].shape[:2] == ((48, 32) if size is None else (size, size))   # rotated: 32 wide
    (tmp_path / "dir").mkdir()
    for k, blob in enumerate(blobs):
        (tmp_path / "dir" / f"{k}.jpg").write_bytes(blob)
    (tmp_path / "labels.csv").write_text("".join(f"{k}.jpg,{k % 2}\n" for k in range(4)))
    tar_of(tmp_path / "s.tar", {f"{k}.{ext}": blob for k, b in enumerate(blobs)
                               for ext, blob in (("jpg", b), ("cls", b"%d" % (k % 2)))})
    pq.write_table(pa.table({"image": [{"bytes": b, "path": None} for b in blobs]}), tmp_path / "x.parquet")
    hf_folder(tmp_path / "hf", blobs, [k % 2 for k in range(4)])
    sized = ("--size", size) if size else ()
    inputs = {"dir": ("--images", tmp_path / "dir"), "labelled": ("--images", tmp_path / "dir", "--labels",
                                                                   tmp_path / "labels.csv"),
              "wds": ("--wds", tmp_path / "s.tar"), "parquet": ("--images", tmp_path / "x.parquet"),
              "hf": ("--hf", tmp_path / "hf", "--label-column", "label"), "hf_images": ("--images", tmp_path / "hf")}
    for name, args in inputs.items():
        built(*args, "--out", tmp_path / f"out_{name}", *sized)
        got = cached(tmp_path / f"out_{name}")
        assert all(np.array_equal(g, e) for g, e in zip(got, expected)), name


def test_a_folder_of_phone_photos_mixing_orientations_is_one_size(tmp_path):
    """A landscape photo and a portrait one stored landscape with orientation 6 both display 32 x 24 ..."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a_plain.jpg").write_bytes(jpeg_bytes(photo(32, 24)))
    (tmp_path / "dir" / "b_exif6.jpg").write_bytes(jpeg_bytes(photo(24, 32, 1), orientation=6))
    built("--images", tmp_path / "dir", "--out", tmp_path / "c")
    cache = ShardedImageCache(tmp_path / "c")
    assert list(cache[0].shape) == [24, 32, 3] and list(cache[1].shape) == [24, 32, 3]


# ============================================================================ JPEG draft


def test_jpegs_with_size_are_drafted_then_resized_as_stated(tmp_path):
    """Sizes and aspects whose shorter side allows 1/1, 1/2, 1/4 and 1/8 scale at --size 32, one EXIF-rotated."""
    shapes = [(40, 33), (300, 70), (90, 400), (512, 300), (64, 64), (1100, 257)]
    blobs = [jpeg_bytes(photo(w, h, k), 6 if k == 3 else None) for k, (w, h) in enumerate(shapes)]
    (tmp_path / "dir").mkdir()
    for k, blob in enumerate(blobs):
        (tmp_path / "dir" / f"{k}.jpg").write_bytes(blob)
    tar_of(tmp_path / "s.tar", {f"{k}.jpg": blob for k, blob in enumerate(blobs)})
    hf_folder(tmp_path / "hf", blobs)               # decoded by nblib, not by datasets: drafted alike
    for name, args in (("dir", ("--images", tmp_path / "dir")), ("wds", ("--wds", tmp_path / "s.tar")),
                       ("hf", ("--hf", tmp_path / "hf"))):
        built(*args, "--out", tmp_path / f"out_{name}", "--size", 32)
        got = cached(tmp_path / f"out_{name}")
        for k, blob in enumerate(blobs):
            assert np.array_equal(got[k], stated_policy(blob, 32)), (name, shapes[k])
    undrafted = [stated_policy(b, 32, draft=False) for b in blobs]
    assert sum(not np.array_equal(g, u) for g, u in zip(got, undrafted)) >= 3   # the draft shows


# ============================================================================ what the labels are


def test_cache_images_prints_the_classes_and_counts_it_found(tmp_path):
    from PIL import Image

    for name, n in (("cat", 3), ("dog", 2), ("eel", 3)):
        (tmp_path / "tree" / name).mkdir(parents=True)
        for k in range(n):
            Image.fromarray(photo(8, 8, k)).save(tmp_path / "tree" / name / f"{k}.png")
    run = built("--images", tmp_path / "tree", "--out", tmp_path / "c")
    assert "labels: 3 classes from subfolders (cat, dog, eel), 2-3 images each" in run.stdout

    tar_of(tmp_path / "s.tar", {f"{k}.{ext}": data for k in range(4)
                               for ext, data in (("png", _png(photo(8, 8, k))), ("cls", b"%d" % (k // 2)))})
    run = built("--wds", tmp_path / "s.tar", "--out", tmp_path / "w")
    assert "labels: 2 classes from the samples' labels (0, 1), 2 images each" in run.stdout
    hf_folder(tmp_path / "hf", [_png(photo(8, 8, k)) for k in range(3)], [0, 1, 1])
    run = built("--hf", tmp_path / "hf", "--label-column", "label", "--out", tmp_path / "h")
    assert "labels: 2 classes from column 'label' (a, b), 1-2 images each" in run.stdout


def test_an_unlabelled_cache_says_train_needs_labels_and_the_advised_rerun_labels_it(tmp_path):
    from PIL import Image

    (tmp_path / "flat").mkdir()
    for k in range(4):
        Image.fromarray(photo(8, 8, k)).save(tmp_path / "flat" / f"{k}.png")
    run = built("--images", tmp_path / "flat", "--out", tmp_path / "c")
    line = next(x for x in run.stdout.splitlines() if x.startswith("labels:"))
    assert "labels: none; train needs labels" in line and "subfolder" in line and "--labels FILE" in line
    (tmp_path / "labels.csv").write_text("".join(f"{k}.png,{'ab'[k % 2]}\n" for k in range(4)))
    run = built("--images", tmp_path / "flat", "--labels", tmp_path / "labels.csv", "--out", tmp_path / "c")
    assert "labels: 2 classes from --labels labels.csv (a, b), 2 images each" in run.stdout
    assert source_labels(tmp_path / "c")["labels"] == [0, 1, 0, 1]


# ============================================================================ class folders


def _png(array) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def test_nfc_and_nfd_spellings_of_a_class_folder_are_one_class(tmp_path):
    root = tmp_path / "tree"
    for name in (unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café"), "tea"):
        (root / name).mkdir(parents=True)
        for k in range(2):
            (root / name / f"{name.encode().hex()}{k}.png").write_bytes(_png(photo(8, 8, k)))
    run = built("--images", root, "--out", tmp_path / "c")
    table = source_labels(tmp_path / "c")
    assert table["classes"] == ["café", "tea"] and sorted(table["labels"]) == [0, 0, 0, 0, 1, 1]
    assert "labels: 2 classes from subfolders (café, tea), 2-4 images each" in run.stdout


def test_a_symlinked_class_folder_is_refused_naming_both(tmp_path):
    root = tmp_path / "tree"
    (root / "ant").mkdir(parents=True)
    (root / "ant" / "0.png").write_bytes(_png(photo(8, 8)))
    (root / "bee").symlink_to(root / "ant", target_is_directory=True)
    line = one_error_line(run_cli("--images", root, "--out", tmp_path / "c", "--no-progress"))
    assert "'bee' and 'ant'" in line and "a link" in line and "twice" in line
    assert not (tmp_path / "c").exists()


def test_a_file_name_that_is_not_utf8_is_refused_at_cache_time_naming_its_bytes(tmp_path):
    folder = os.fsencode(tmp_path / "flat")
    os.mkdir(folder)
    for name in (b"ok.png", b"\xff\xfe.png"):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(_png(photo(8, 8)))
    line = one_error_line(run_cli("--images", tmp_path / "flat", "--out", tmp_path / "c", "--no-progress"))
    assert r"b'\xff\xfe.png'" in line and "not UTF-8" in line
    assert not (tmp_path / "c").exists()


# ============================================================================ bounds and labels files


def test_a_size_past_the_bound_is_one_line_before_any_image_is_read(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.png").write_bytes(_png(photo(5, 5)))
    line = one_error_line(run_cli("--images", tmp_path / "dir", "--out", tmp_path / "c", "--size", 100_000,
                                  "--no-progress"))
    assert "--size 100,000 is over 16,384 px" in line
    assert not (tmp_path / "c").exists()


def _flat(tmp_path, n=4):
    (tmp_path / "flat").mkdir()
    for k in range(n):
        (tmp_path / "flat" / f"{k}.png").write_bytes(_png(photo(8, 8, k)))
    return tmp_path / "flat"


def test_a_labels_csv_that_is_not_utf8_is_one_line_naming_the_file_and_line(tmp_path):
    flat = _flat(tmp_path, 2)
    (tmp_path / "l.csv").write_bytes("file,label\n0.png,tea\n1.png,café\n".encode("latin-1"))
    line = one_error_line(run_cli("--images", flat, "--labels", tmp_path / "l.csv", "--out", tmp_path / "c",
                                  "--no-progress"))
    assert "l.csv line 3 is not UTF-8" in line


def test_an_excel_bom_csv_without_a_header_keeps_its_first_row(tmp_path):
    flat = _flat(tmp_path)
    (tmp_path / "l.csv").write_bytes("".join(f"{k}.png,{'ab'[k % 2]}\r\n" for k in range(4)).encode("utf-8-sig"))
    built("--images", flat, "--labels", tmp_path / "l.csv", "--out", tmp_path / "c")
    assert source_labels(tmp_path / "c") == {"labels": [0, 1, 0, 1], "classes": ["a", "b"]}


def test_json_list_labels_are_refused_and_whole_floats_are_class_indices(tmp_path):
    flat = _flat(tmp_path)
    (tmp_path / "l.json").write_text(json.dumps({f"{k}.png": [k % 2] for k in range(4)}))
    line = one_error_line(run_cli("--images", flat, "--labels", tmp_path / "l.json", "--out", tmp_path / "c",
                                  "--no-progress"))
    assert "'0.png': label [0] is a list, not one class" in line
    (tmp_path / "l.json").write_text(json.dumps({f"{k}.png": float(k % 2) for k in range(4)}))
    built("--images", flat, "--labels", tmp_path / "l.json", "--out", tmp_path / "c")
    assert source_labels(tmp_path / "c") == {"labels": [0, 1, 0, 1], "classes": ["0", "1"]}
    (tmp_path / "l.json").write_text(json.dumps({f"{k}.png": k / 2 for k in range(4)}))
    line = one_error_line(run_cli("--images", flat, "--labels", tmp_path / "l.json", "--out", tmp_path / "d",
                                  "--no-progress"))
    assert "label 0.5 is not a whole number" in line


def test_pillows_bomb_warning_is_one_log_line_naming_the_file(tmp_path, monkeypatch):
    from PIL import Image

    flat = _flat(tmp_path, 2)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 40)      # 8 x 8 = 64 pixels: over it, under twice it
    run = built("--images", flat, "--out", tmp_path / "c")
    lines = [x for x in run.stderr.splitlines() if x.strip()]
    assert len(lines) == 2 and all("decoded anyway" in x for x in lines), run.stderr
    assert "0.png" in lines[0] and "warnings.warn" not in run.stderr


def test_a_jpeg_whose_exif_pillow_calls_corrupt_is_cached_with_one_log_line(tmp_path):
    from PIL import Image

    (tmp_path / "dir").mkdir()
    corrupt = b"Exif\x00\x00II*\x00\x08\x00\x00\x00\x01\x00\x12\x01\x03\x00\x01\x00\x00\x00\x06\x00"  # cut short
    Image.fromarray(photo(8, 8)).save(tmp_path / "dir" / "odd.jpg", "JPEG", exif=corrupt)
    run = built("--images", tmp_path / "dir", "--out", tmp_path / "c")
    lines = [x for x in run.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "odd.jpg" in lines[0] and "Corrupt EXIF" in lines[0], run.stderr
    assert len(ShardedImageCache(tmp_path / "c")) == 1


def test_a_resize_whose_intermediate_outgrows_the_ram_is_one_line_naming_the_image(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "strip.png").write_bytes(_png(photo(10_000, 1)))    # 16,384 px tall: 8 PB wide
    line = one_error_line(run_cli("--images", tmp_path / "dir", "--out", tmp_path / "c", "--size", 16_384,
                                  "--no-progress"))
    assert "strip.png (10000x1 px) resized to --size 16,384" in line and "of RAM free" in line


def test_a_labels_file_may_spell_a_name_in_nfd_where_the_file_is_nfc(tmp_path):
    (tmp_path / "flat").mkdir()
    for name in ("café.png", "tea.png"):
        (tmp_path / "flat" / unicodedata.normalize("NFC", name)).write_bytes(_png(photo(8, 8)))
    (tmp_path / "l.csv").write_text(unicodedata.normalize("NFD", "café.png,hot\ntea.png,cold\n"))
    built("--images", tmp_path / "flat", "--labels", tmp_path / "l.csv", "--out", tmp_path / "c")
    assert source_labels(tmp_path / "c") == {"labels": [1, 0], "classes": ["cold", "hot"]}   # café hot


def test_an_hf_image_column_with_a_mode_is_converted_to_it_as_datasets_does(tmp_path):
    """Read undecoded, an Image(mode='L') column still gives grey, as datasets' own decode gave it."""
    import datasets
    from PIL import Image, ImageOps

    blob = jpeg_bytes(photo(16, 12), orientation=6)
    features = datasets.Features({"image": datasets.Image(mode="L")})
    datasets.Dataset.from_dict({"image": [{"bytes": blob, "path": None}]}, features=features) \
        .save_to_disk(str(tmp_path / "hf"))
    built("--hf", tmp_path / "hf", "--out", tmp_path / "c")
    grey = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(blob))).convert("L"))
    assert np.array_equal(cached(tmp_path / "c")[0], np.repeat(grey[:, :, None], 3, axis=2))
