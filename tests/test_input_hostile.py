"""Hostile round 3 for image input: 16-bit images scaled, not clipped; a decompression bomb and a NaN
Drive quota end in one `error:` line; a FIFO among the images is refused instead of hanging the build.
"""
from __future__ import annotations

import os
import re
import struct
import threading
import zlib

import numpy as np
import pytest
from cli_runner import run_nblib
from test_cache_cli import one_error_line, run_cli
from test_cache_images import image_source

from nblib.cache import ShardedImageCache, write_images
from nblib.errors import InputError

Image = pytest.importorskip("PIL.Image")


def grey16_gradient(size=256) -> np.ndarray:
    """A full-range 16-bit grey gradient, 0 at the left edge to 65535 at the right."""
    row = np.round(np.linspace(0, 65535, size)).astype(np.uint16)
    return np.tile(row, (size, 1))


def png_header_only(path, width, height):
    """A PNG whose header claims width x height 1-bit grey pixels (a bomb is refused on the header)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


def test_a_16_bit_grey_gradient_is_scaled_to_8_bit_not_clipped(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    image = Image.fromarray(grey16_gradient())
    assert image.mode == "I;16"
    image.save(folder / "gradient.png")
    result = run_cli("--images", str(folder), "--out", str(tmp_path / "cache"), "--shard-mb", "1")
    assert result.returncode == 0, result.stderr
    pixels = ShardedImageCache(tmp_path / "cache")[0]
    assert abs(float(pixels.mean()) - 127.5) < 0.6  # clipped, it was 254
    assert pixels[:, 0].max() == 0 and pixels[:, -1].min() == 255
    assert np.all(np.diff(pixels[0, :, 0].astype(int)) >= 0)  # monotone, no plateau at 255


def test_a_16_bit_pil_image_in_write_images_is_scaled_too(tmp_path):
    arrays = [Image.fromarray(grey16_gradient(32))] * 2
    write_images(arrays, tmp_path, shard_mb=1, progress=False)
    assert abs(float(ShardedImageCache(tmp_path)[1].mean()) - 127.5) < 1.0


def test_a_float_image_is_refused_with_its_file_and_mode(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    Image.fromarray(np.ones((8, 8), dtype=np.float32)).save(folder / "f.tiff")
    images, _ = image_source(folder)
    with pytest.raises(InputError, match=r"f\.tiff is a floating-point image \(mode F\)"):
        next(iter(images))


def test_a_decompression_bomb_is_one_error_line_naming_the_file_and_the_limit(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(folder / "a.png")
    png_header_only(folder / "bomb.png", 20_000, 20_000)
    result = run_cli("--images", str(folder), "--out", str(tmp_path / "cache"))
    line = one_error_line(result)
    assert "bomb.png" in line and "decompression bomb" in line
    assert f"{2 * Image.MAX_IMAGE_PIXELS:,}" in line


def test_a_decompression_bomb_in_a_parquet_input_is_named_by_its_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    good = tmp_path / "good.png"
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(good)
    bomb = png_header_only(tmp_path / "bomb.png", 20_000, 20_000)
    pq.write_table(pa.table({"image": [good.read_bytes(), bomb.read_bytes()]}), tmp_path / "in.parquet")
    result = run_cli("--images", str(tmp_path / "in.parquet"), "--out", str(tmp_path / "cache"))
    line = one_error_line(result)
    assert "in.parquet row 1" in line and "decompression bomb" in line


def test_a_decompression_bomb_in_an_hf_dataset_is_named_by_its_row(tmp_path):
    datasets = pytest.importorskip("datasets")
    good = tmp_path / "good.png"
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(good)
    bomb = png_header_only(tmp_path / "bomb.png", 20_000, 20_000)
    dataset = datasets.Dataset.from_dict({"image": [{"bytes": good.read_bytes(), "path": None},
                                                    {"bytes": bomb.read_bytes(), "path": None}]},
                                         features=datasets.Features({"image": datasets.Image()}))
    dataset.save_to_disk(str(tmp_path / "hf"))
    result = run_cli("--images", str(tmp_path / "hf"), "--out", str(tmp_path / "cache"))
    line = one_error_line(result)
    assert "row 1 of the dataset" in line and "decompression bomb" in line


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0"])
def test_budget_refuses_a_drive_quota_that_is_not_a_finite_positive_number_in_one_line(value):
    result = run_nblib("budget", f"--drive-quota-gb={value}")
    line = one_error_line(result)
    assert "--drive-quota-gb" in line and value in line


def test_a_fifo_named_like_an_image_is_refused_at_once_not_waited_on(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(folder / "a.png")
    os.mkfifo(folder / "x.png")
    (folder / "d.png").mkdir()
    result = run_cli("--images", str(folder), "--out", str(tmp_path / "cache"), timeout=60)  # hung before
    line = one_error_line(result)
    assert "x.png (a named pipe (FIFO))" in line and "d.png (a folder)" in line
    assert not (tmp_path / "cache").exists()


def test_a_file_that_turns_into_a_fifo_after_the_listing_is_refused_not_waited_on(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(folder / "x.png")
    images, _ = image_source(folder)
    (folder / "x.png").unlink()
    os.mkfifo(folder / "x.png")
    box = {}

    def first():
        try:
            next(iter(images))
        except InputError as exc:
            box["error"] = str(exc)

    thread = threading.Thread(target=first, daemon=True)  # a regression blocks here, not the test run
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "reading the image folder blocked on a FIFO"
    assert re.search(r"x\.png is not a regular file \(a named pipe", box["error"])


def test_a_read_that_outlasts_the_deadline_is_refused_with_the_file_and_the_knob(tmp_path, monkeypatch):
    from nblib.cache import sources as module

    gate = threading.Event()
    folder = tmp_path / "in"
    folder.mkdir()
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(folder / "slow.png")
    monkeypatch.setenv("NBLIB_READ_DEADLINE_S", "0.2")
    real_open = os.open
    monkeypatch.setattr(module.os, "open", lambda *a, **k: (gate.wait(30), real_open(*a, **k))[1])
    images, _ = image_source(folder)
    try:
        with pytest.raises(InputError, match=r"slow\.png could not be read within 0\.2 s.*NBLIB_READ_DEADLINE_S"):
            next(iter(images))
    finally:
        gate.set()
