"""An export keeps everything and loses nothing: no reader sees half an export (a real SIGKILL after 1, 3
or 6 of 10 files, or a damaged cache shard), the user's files are never deleted, every row carries its
text or key, and pyarrow, polars, duckdb and `datasets` read the images and texts back without nblib.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
from cli_runner import run_nblib
from test_cache_cli import one_error_line

from conftest import subprocess_env
from nblib.cache import ShardedImageCache, populate, write_images
from nblib.errors import StateError
from nblib.export import export_cache, read_export

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

N_FILES = 10
TEXTS = [f"text {i}: " + "keep me " * (i % 7) for i in range(30)]


def export_cmd(*args):
    return [sys.executable, "-m", "nblib", "export", *map(str, args)]


def run_export(*args):
    return run_nblib("export", *args)


def top_files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def staged(folder):
    return list((folder / ".nblib-staging").glob("*.part")) if (folder / ".nblib-staging").exists() else []


@pytest.fixture(scope="module")
def noise_cache(tmp_path_factory):
    """A cache of 200 noise images at 64 px in 10 shards (noise: zstd-19 is slow on it, so a kill lands
    between files), with one key per image.
    """
    folder = tmp_path_factory.mktemp("noise") / "cache"
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(200)]
    write_images(arrays, folder, shard_mb=20 * 64 * 64 * 3 / 1e6, progress=False,
                 keys=[f"img-{k:03d}.png" for k in range(200)])
    assert len(ShardedImageCache(folder).manifest["shards"]) == N_FILES
    return folder


@pytest.fixture(scope="module")
def text_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("texts")
    (root / "texts.txt").write_text("".join(t + "\n" for t in TEXTS))
    populate(root / "texts.txt", root / "cache", image_size=32, shard_mb=0.004, workers=0, progress=False)
    return root / "cache"


@pytest.fixture(scope="module")
def reference(noise_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "out"
    result = run_export("--cache", noise_cache, "--out", out, "--compression-level", 19)
    assert result.returncode == 0, result.stderr
    return out


def assert_no_reader_sees_rows(folder):
    with pytest.raises(StateError, match="unfinished export"):
        read_export(folder)
    try:
        assert pq.read_table(folder).num_rows == 0
    except (pa.ArrowInvalid, OSError):
        pass  # "no files": as good


@pytest.mark.slow
@pytest.mark.parametrize("after", [1, 3, 6])
def test_an_export_killed_after_n_of_10_files_reads_as_unfinished_and_its_command_finishes_it(
        noise_cache, reference, tmp_path, after):
    out = tmp_path / "out"
    process = subprocess.Popen(export_cmd("--cache", noise_cache, "--out", out, "--compression-level", 19),
                               env=subprocess_env(), start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while process.poll() is None and time.monotonic() < deadline and len(staged(out)) < after:
        time.sleep(0.001)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the export ended before the kill"
    assert after <= len(staged(out)) < N_FILES
    assert not list(out.glob("*.parquet"))  # nothing in place for a folder reader
    assert_no_reader_sees_rows(out)
    with pytest.raises(StateError) as refused:
        read_export(out)
    message = str(refused.value)
    assert f"{N_FILES} of {N_FILES} files are not in place (data-00000-of-00010.parquet" in message
    command = message.split("finish it with: ")[1]
    assert command.startswith("python -m nblib export --cache ")
    assert f"--out {out}" in command and "--compression-level 19" in command
    listed = len(json.loads((out / "_nblib-export.json").read_text())["body"]["files"])
    assert shlex.split(command)[:3] == ["python", "-m", "nblib"]
    finished = run_nblib(*shlex.split(command)[3:])
    assert finished.returncode == 0, finished.stderr
    assert int(re.search(r"reused (\d+)", finished.stdout).group(1)) == listed  # staged files resume
    assert top_files(out) == top_files(reference)
    back = read_export(out)
    assert np.array_equal(back["image"], ShardedImageCache(noise_cache).get_batch(0, 200))
    assert back["key"] == [f"img-{k:03d}.png" for k in range(200)]


def test_an_export_stopped_by_a_damaged_cache_shard_reads_as_unfinished(noise_cache, reference, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(noise_cache, cache)
    shard = cache / ShardedImageCache(cache).manifest["shards"][4]["file"]
    good, before = shard.read_bytes(), shard.stat()
    shard.write_bytes(good[:100] + bytes(255 - b for b in good[100:200]) + good[200:])
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))  # bit rot: same size, same mtime
    out = tmp_path / "out"
    line = one_error_line(run_export("--cache", cache, "--out", out, "--compression-level", 19))
    assert shard.name in line
    assert len(json.loads((out / "_nblib-export.json").read_text())["body"]["files"]) == 4  # stopped mid-way
    assert_no_reader_sees_rows(out)
    shard.write_bytes(good)
    assert run_export("--cache", cache, "--out", out, "--compression-level", 19).returncode == 0
    data = lambda folder: {k: v for k, v in top_files(folder).items() if k.endswith(".parquet")}  # noqa: E731
    assert data(out) == data(reference) and len(data(out)) == N_FILES
    assert read_export(out)["key"][-1] == "img-199.png"


def test_a_kill_between_the_hf_metadata_and_the_completion_record_resumes(text_cache, tmp_path):
    from nblib.export import VERSION
    from nblib.manifest import manifest_bytes, read_manifest

    export_cache(text_cache, tmp_path, "hf")
    record = read_manifest(tmp_path / "_nblib-export.json", "nblib.export", versions=(VERSION,))
    (tmp_path / "_nblib-export.json").write_bytes(manifest_bytes("nblib.export", {**record.body, "complete": False},
                                                                 version=VERSION, seq=record.seq))
    with pytest.raises(StateError, match="unfinished export"):
        read_export(tmp_path)
    again = export_cache(text_cache, tmp_path, "hf")  # state.json is ours: not refused as someone else's
    assert again.files_written == 0 and read_export(tmp_path)["text"] == TEXTS


def test_read_export_of_an_empty_or_foreign_folder_says_so(tmp_path):
    with pytest.raises(StateError, match="holds no nblib export"):
        read_export(tmp_path)
    pq.write_table(pa.table({"a": [1]}), tmp_path / "theirs.parquet")
    with pytest.raises(StateError, match="holds no nblib export"):
        read_export(tmp_path)


def test_a_users_parquet_is_never_deleted_with_or_without_overwrite(text_cache, tmp_path):
    precious = tmp_path / "precious.parquet"
    pq.write_table(pa.table({"a": list(range(5))}), precious)
    before = precious.read_bytes()
    for flags in ([], ["--overwrite"]):
        line = one_error_line(run_export("--cache", text_cache, "--out", tmp_path, *flags))
        assert "precious.parquet" in line and "never deletes" in line
        assert precious.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.parquet"]


def test_a_save_to_disk_folder_is_not_replaced(text_cache, tmp_path):
    theirs = tmp_path / "theirs"
    datasets.Dataset.from_dict({"x": [1, 2, 3]}).save_to_disk(str(theirs))
    before = top_files(theirs)
    for flags in ([], ["--overwrite"]):
        line = one_error_line(run_export("--cache", text_cache, "--out", theirs, "--format", "hf", *flags))
        assert "state.json" in line and "dataset_info.json" in line
    assert top_files(theirs) == before and datasets.load_from_disk(str(theirs))["x"] == [1, 2, 3]


def test_a_folder_of_other_files_needs_overwrite_and_keeps_them(text_cache, tmp_path):
    (tmp_path / "README.txt").write_text("mine")
    line = one_error_line(run_export("--cache", text_cache, "--out", tmp_path))
    assert "not empty" in line and "README.txt" in line and "--overwrite" in line
    assert run_export("--cache", text_cache, "--out", tmp_path, "--overwrite").returncode == 0
    assert (tmp_path / "README.txt").read_text() == "mine"
    assert read_export(tmp_path)["text"] == TEXTS


def test_files_get_the_users_umask_permissions_not_0600(text_cache, tmp_path):
    old = os.umask(0o022)
    try:
        for fmt in ("parquet", "hf"):
            export_cache(text_cache, tmp_path / fmt, fmt)
            for path in (tmp_path / fmt).iterdir():
                if path.is_file():
                    assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    finally:
        os.umask(old)


def test_the_compression_level_is_a_flag_and_is_checked(text_cache, tmp_path):
    sizes = {}
    for level in (1, 19):
        out = tmp_path / f"l{level}"
        assert run_export("--cache", text_cache, "--out", out, "--compression-level", level).returncode == 0
        sizes[level] = sum(p.stat().st_size for p in out.glob("*.parquet"))
    assert sizes[19] < sizes[1]
    assert "zstd level" in one_error_line(run_export("--cache", text_cache, "--out", tmp_path / "x",
                                                     "--compression-level", 40))
    assert "applies to --format parquet" in one_error_line(
        run_export("--cache", text_cache, "--out", tmp_path / "y", "--format", "hf", "--compression-level", 5))


def test_pyarrow_polars_duckdb_and_datasets_read_every_image_and_its_text(text_cache, tmp_path):
    polars = pytest.importorskip("polars")
    duckdb = pytest.importorskip("duckdb")
    export_cache(text_cache, tmp_path / "p", "parquet")
    pixels = ShardedImageCache(text_cache).get_batch(0, len(TEXTS))

    def images(blobs, heights, widths, channels):
        return np.stack([np.frombuffer(b, np.uint8).reshape(h, w, c)
                         for b, h, w, c in zip(blobs, heights, widths, channels)])

    glob = str(tmp_path / "p" / "*.parquet")
    table = pq.read_table(tmp_path / "p")  # the folder: no staging, no manifest rows
    frame = polars.read_parquet(glob).sort("index")
    rows = duckdb.sql(f"select text, image, height, width, channels from read_parquet('{glob}') "
                      f"order by index").fetchall()
    hf = datasets.Dataset.from_parquet(glob, cache_dir=str(tmp_path / "hf-cache"))
    read = {
        "pyarrow": (table.column("text").to_pylist(), [table.column(c).to_pylist() for c in
                                                        ("image", "height", "width", "channels")]),
        "polars": (frame["text"].to_list(), [frame[c].to_list() for c in ("image", "height", "width", "channels")]),
        "duckdb": ([r[0] for r in rows], [[r[k] for r in rows] for k in (1, 2, 3, 4)]),
        "datasets": (hf["text"], [hf[c] for c in ("image", "height", "width", "channels")]),
    }
    for reader, (texts, columns) in read.items():
        assert texts == TEXTS, reader
        assert np.array_equal(images(*columns), pixels), reader
    export_cache(text_cache, tmp_path / "h", "hf")
    loaded = datasets.load_from_disk(str(tmp_path / "h"))
    assert loaded["text"] == TEXTS
    assert np.array_equal(np.stack([np.asarray(r) for r in loaded.with_format("numpy")["image"]])
                          .transpose(0, 2, 3, 1), pixels)
    assert read_export(tmp_path / "h")["text"] == TEXTS


def test_an_image_folder_cache_exports_each_file_name_beside_its_image(tmp_path):
    from PIL import Image

    folder = tmp_path / "in"
    folder.mkdir()
    arrays = [np.full((8, 8, 3), k * 20, dtype=np.uint8) for k in range(5)]
    for k, array in enumerate(arrays):
        Image.fromarray(array).save(folder / f"cat-{k}.png")
    result = run_nblib("cache", "--images", folder, "--out", tmp_path / "cache", "--no-progress")
    assert result.returncode == 0, result.stderr
    export_cache(tmp_path / "cache", tmp_path / "out")
    table = pq.read_table(tmp_path / "out")
    assert table.column("key").to_pylist() == [f"cat-{k}.png" for k in range(5)]
    assert np.array_equal(read_export(tmp_path / "out")["image"], np.stack(arrays))
