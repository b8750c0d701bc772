"""Your own images in: `write_images` from lists, generators, torch and HF datasets; `cache --images`
from a folder, Parquet and an HF datasets folder; SIGKILLed three times, resumed to identical bytes.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from test_cache_cli import assert_three_kills_resume_to_the_reference, one_error_line, run_cli

from conftest import cache_folder_bytes
from nblib.cache import ShardedImageCache, read_cache_manifest, verify, write_images
from nblib.cache.images import as_image
from nblib.cache.sources import images_source
from nblib.errors import CacheError, InputError
from nblib.render import render_text

SIZE = 32


def images(n=40, size=SIZE, tag="img"):
    return [render_text(f"{tag} {i} " + "word " * (i % 9), size) for i in range(n)]


def write_png_folder(folder, arrays):
    from PIL import Image

    folder.mkdir()
    for k, array in enumerate(arrays):
        Image.fromarray(array).save(folder / f"{k:05d}.png")
    return folder


@pytest.mark.parametrize("codec", ["raw", "zlib", "zstd", "png"])
def test_write_images_round_trips_and_a_rerun_reuses_every_shard(tmp_path, codec):
    arrays = images()
    summary = write_images(arrays, tmp_path, shard_mb=0.01, codec=codec, progress=False)
    assert summary.n_images == 40 and summary.shards_written == summary.n_shards
    cache = ShardedImageCache(tmp_path)
    assert cache.complete and np.array_equal(cache.get_batch(0, 40), np.stack(arrays))
    again = write_images(arrays, tmp_path, shard_mb=0.01, codec=codec, progress=False)
    assert again.shards_reused == summary.n_shards and again.shards_written == 0
    assert verify(tmp_path).ok


def test_a_generator_of_unknown_length_gives_the_same_bytes_as_a_list(tmp_path):
    arrays = images()
    write_images(arrays, tmp_path / "list", shard_mb=0.01, progress=False)
    write_images((a for a in arrays), tmp_path / "gen", shard_mb=0.01, progress=False)
    assert cache_folder_bytes(tmp_path / "gen") == cache_folder_bytes(tmp_path / "list")


def test_torch_tensors_in_channel_first_and_a_map_style_dataset_give_the_same_cache(tmp_path):
    torch = pytest.importorskip("torch")
    arrays = images(12)

    class Pairs(torch.utils.data.Dataset):  # (image [C, H, W], label), as torchvision datasets give
        def __len__(self):
            return len(arrays)

        def __getitem__(self, k):
            return torch.from_numpy(arrays[k]).permute(2, 0, 1), k

    write_images(arrays, tmp_path / "a", shard_mb=0.01, progress=False)
    write_images(Pairs(), tmp_path / "b", shard_mb=0.01, progress=False)
    assert cache_folder_bytes(tmp_path / "b") == cache_folder_bytes(tmp_path / "a")


def test_an_hf_dataset_column_of_images_goes_in(tmp_path):
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    arrays = images(10)
    dataset = datasets.Dataset.from_dict({"picture": [Image.fromarray(a) for a in arrays], "id": list(range(10))},
                                         features=datasets.Features({"picture": datasets.Image(),
                                                                     "id": datasets.Value("int64")}))
    write_images(dataset, tmp_path, shard_mb=0.01, column="picture", progress=False)
    assert np.array_equal(ShardedImageCache(tmp_path).get_batch(0, 10), np.stack(arrays))
    with pytest.raises(InputError, match="no column 'image'.*picture.*column="):
        write_images(dataset, tmp_path / "x", progress=False)


def test_other_images_on_resume_are_refused_and_a_damaged_shard_is_rewritten(tmp_path):
    arrays = images()
    write_images(arrays, tmp_path, shard_mb=0.01, progress=False)
    with pytest.raises(CacheError, match="not the ones .* written from .*shard-00000.npy.*same order"):
        write_images(arrays[::-1], tmp_path, shard_mb=0.01, progress=False)
    before = cache_folder_bytes(tmp_path)
    victim = tmp_path / read_cache_manifest(tmp_path)["shards"][3]["file"]
    victim.write_bytes(victim.read_bytes()[:-50])
    summary = write_images(arrays, tmp_path, shard_mb=0.01, progress=False)
    assert summary.shards_repaired == 1 and cache_folder_bytes(tmp_path) == before


def test_images_of_two_sizes_or_floats_are_refused_naming_the_image(tmp_path):
    arrays = images(5)
    with pytest.raises(InputError, match=r"image 3 is 64x64 px, image 0 is 32x32 px .* pass --size N"):
        write_images(arrays[:3] + [render_text("x", 64)], tmp_path / "a", progress=False)
    assert not (tmp_path / "a").exists()            # the refused build left nothing behind
    with pytest.raises(InputError, match="image 0 has dtype float64, not uint8"):
        write_images([a / 255.0 for a in arrays], tmp_path / "b", progress=False)


def image_source(path):
    """(images, count) of what `cache --images PATH` takes, each decoded as write_images decodes it."""
    source = images_source(path)
    return (as_image(item, None, k) for k, item in enumerate(source.images)), source.count


def test_image_source_reads_a_folder_a_parquet_file_and_an_hf_folder(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    arrays = images(6)
    folder = write_png_folder(tmp_path / "pngs", arrays)
    found, n = image_source(folder)
    assert n == 6 and all(np.array_equal(a, b) for a, b in zip(found, arrays))
    table = pa.table({"image": [{"bytes": (folder / f"{k:05d}.png").read_bytes(), "path": None} for k in range(6)]})
    pq.write_table(table, tmp_path / "x.parquet")
    found, n = image_source(tmp_path / "x.parquet")
    assert n == 6 and all(np.array_equal(a, b) for a, b in zip(found, arrays))
    with pytest.raises(InputError, match="does not exist"):
        image_source(tmp_path / "missing")


@pytest.mark.slow
def test_cache_images_sigkilled_three_times_resumes_to_byte_identical_shards(tmp_path):
    folder = write_png_folder(tmp_path / "pngs", images(280, 64))
    args = lambda out: ("--images", folder, "--out", out, "--shard-mb", 0.05, "--no-progress")
    assert_three_kills_resume_to_the_reference(tmp_path, args, shards=70)


@pytest.mark.slow
def test_cache_images_errors_are_one_line(tmp_path):
    assert "does not exist" in one_error_line(run_cli("--images", tmp_path / "nope", "--out", tmp_path / "o"))
    (tmp_path / "empty").mkdir()
    assert "holds no image files" in one_error_line(run_cli("--images", tmp_path / "empty", "--out", tmp_path / "o"))


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_cache_images_prints_the_shards_bytes_beside_their_prediction_and_the_manifest_apart(tmp_path, codec):
    """Newcomer P14: `cache --images` printed 'predicted 56.98 KB' beside '79.86 KB on disk', the prediction of the
    shards against shards plus a manifest holding zstd's 16 KB dictionary. Now like for like, the manifest apart.
    """
    folder = write_png_folder(tmp_path / "pngs", images(300))
    done = run_cli("--images", folder, "--out", tmp_path / "c", "--codec", codec)
    assert done.returncode == 0, done.stderr
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("cache "))
    shards = sum(p.stat().st_size for p in (tmp_path / "c").glob("shard-*"))
    from nblib.units import fmt_bytes

    assert f"shards {fmt_bytes(shards)}, predicted " in line and ", and the manifest " in line, line
    value, unit = re.search(r", predicted ([\d.,]+) (B|KB|MB)", line).groups()
    predicted = float(value.replace(",", "")) * {"B": 1, "KB": 1e3, "MB": 1e6}[unit]
    assert abs(predicted - shards) / shards < 0.03, line
