"""Two exports into one folder: real `python -m nblib export` processes of two caches started together
into one `--out`. One wins with a solo export's files; the other gets one error line (the folder's
lock, naming the winner, or the winner's manifest when it came after). A folder whose files come
from two exports is never read as complete.
"""
from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest
from test_hostile import check_races

from nblib.cache import write_images
from nblib.errors import StateError
from nblib.export import export_cache, read_export

pytest.importorskip("pyarrow")

TRIALS = 4


def export_cmd(cache, out):
    # zstd 19 on noise: ~1 s of writing, so two exports started together overlap
    return [sys.executable, "-m", "nblib", "export", "--cache", str(cache), "--out", str(out),
            "--compression-level", "19"]


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """Two caches of 200 noise images (64 px) in 10 shards each, of other pixels, and each one's solo export."""
    root = tmp_path_factory.mktemp("race")
    folders = []
    for seed in (0, 1):
        rng = np.random.default_rng(seed)
        folder = root / f"cache-{seed}"
        write_images([rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(200)], folder,
                     shard_mb=20 * 64 * 64 * 3 / 1e6, progress=False)
        folders.append(folder)
    refs = []
    for seed, folder in enumerate(folders):
        export_cache(folder, root / f"solo-{seed}", "parquet", compression_level=19)
        refs.append(data_files(root / f"solo-{seed}"))
    return folders, refs


def data_files(folder):
    """The export's data files as read back complete (read_export refuses a mixed or unfinished folder)."""
    read_export(folder)
    return {p.name: p.read_bytes() for p in sorted(folder.glob("data-*.parquet"))}


def test_two_exports_into_one_folder_one_wins_whole_and_the_other_gets_one_line(caches, tmp_path):
    folders, refs = caches
    check_races(tmp_path, TRIALS, lambda out, seed: export_cmd(folders[seed], out), {"OMP_NUM_THREADS": "1"},
                refs, data_files, "export folder", "an export of something else")


def test_a_folder_holding_files_of_two_exports_is_refused_not_read_as_complete(caches, tmp_path):
    folders, _refs = caches
    a, b = tmp_path / "a", tmp_path / "b"
    export_cache(folders[0], a, "parquet")
    export_cache(folders[1], b, "parquet")
    for name in ("data-00000-of-00010.parquet", "data-00001-of-00010.parquet"):
        shutil.copyfile(b / name, a / name)        # same names: a complete manifest, other pixels
    with pytest.raises(StateError, match=r"not one whole export: 2 of 10 files \(data-00000-of-00010.parquet.*"
                                         r"another export"):
        read_export(a)
    again = export_cache(folders[0], a, "parquet")   # its own command rewrites the two, and only them
    assert again.files_written == 2
    export_cache(folders[0], tmp_path / "solo", "parquet")
    assert data_files(a) == data_files(tmp_path / "solo")
