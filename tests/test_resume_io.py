"""Resume reads metadata, not data: a completed run resumed reads under 1% of its parts' bytes.

The resume runs in a fresh process (as after a restart) that imports what encode needs first,
then counts the bytes it reads with /proc/self/io `rchar` (every read() of every thread: the
mirror's too) and, through an audit hook, every part data file it opens (memory maps included).
A part whose bytes changed behind the store's back (same size, mtime put back) passes that cheap
check; it is still never used: consolidation hashes what it reads and the part is recomputed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import subprocess_env
from nblib.atomic import sha256_file
from nblib.cache import populate

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/self/io")]

N_IMAGES = 2048
RUN = r'''
import json, os, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
import ctypes.util, tqdm.auto  # noqa: F401  (imports are not the resume's reads)
import nblib.encode.consolidate, nblib.encode.offload, nblib.env, nblib.measure, nblib.store, nblib.trm  # noqa
from nblib import encode as enc
from nblib.cache import ShardedImageCache
from nblib.config import preset

cache_dir, run_dir, mirror_dir = sys.argv[1], Path(sys.argv[2]), sys.argv[3] or None
opened = []
watched = tuple(str(Path(p).resolve()) for p in (run_dir / "parts", mirror_dir) if p)
def audit(event, args):
    if event == "open" and isinstance(args[0], (str, os.PathLike)):
        path = os.path.abspath(os.fspath(args[0]))
        if path.endswith(".npy") and path.startswith(watched):
            opened.append(path)
sys.addaudithook(audit)
def rchar():
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["rchar"])
config = preset("smoke").replace(batch_size=64, checkpoint_every=8, consolidate_every=1, out_dtype="float32",
                                capsules=16)  # 4 parts of 6.5 MB: a few MB each, as real parts are large
cache = ShardedImageCache(cache_dir)
before = rchar()
report = enc.encode(cache, run_dir, config, mirror_dir=mirror_dir, progress=False, preflight=False)
read = rchar() - before
print(json.dumps({"rchar": read, "parts_encoded": report.parts_encoded, "parts_total": report.parts_total,
                  "opened": opened, "mirror_caught_up": report.mirror_caught_up}))
'''


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cache") / "c"
    texts = [f"#{i} resume reads metadata not data, part {i % 7}" for i in range(N_IMAGES)]
    populate(texts, folder, image_size=64, shard_mb=0.5, workers=0, progress=False)
    return folder


@pytest.fixture(scope="module")
def completed(cache_dir, tmp_path_factory) -> tuple[Path, Path, dict]:
    """A completed run mirrored to a second folder: (run dir, mirror dir, the first run's report)."""
    root = tmp_path_factory.mktemp("run")
    run_dir, mirror = root / "run", root / "mirror"
    first = run_encode(cache_dir, run_dir, mirror)
    assert first["parts_encoded"] == first["parts_total"] > 1
    return run_dir, mirror, first


def test_resuming_a_completed_run_reads_under_one_percent_of_its_parts(cache_dir, completed):
    run_dir, mirror, _ = completed
    parts_bytes = sum(p.stat().st_size for p in (run_dir / "parts").glob("part-*/*.npy"))
    assert parts_bytes > 2_000_000, "the run must hold a few MB of parts for 1% to mean something"
    outputs = {p.name: sha256_file(p) for p in run_dir.glob("*.npy")}

    resumed = run_encode(cache_dir, run_dir, mirror)

    assert resumed["parts_encoded"] == 0 and resumed["mirror_caught_up"]
    assert resumed["opened"] == [], f"the resume opened part data files: {resumed['opened'][:5]}"
    assert resumed["rchar"] < 0.01 * parts_bytes, (
        f"the resume read {resumed['rchar']:,} bytes, {resumed['rchar'] / parts_bytes:.1%} of the "
        f"{parts_bytes:,} bytes of parts")
    assert {p.name: sha256_file(p) for p in run_dir.glob("*.npy")} == outputs


def test_a_flipped_byte_with_its_mtime_put_back_is_recomputed_before_consolidation_ends(cache_dir, completed,
                                                                                     tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(completed[0], run_dir, copy_function=shutil.copy2)   # local staging only, no mirror
    reference = {p.name: sha256_file(p) for p in run_dir.glob("*.npy")}
    victim = sorted((run_dir / "parts").glob("part-*/sketches.npy"))[1]
    st = victim.stat()
    with open(victim, "r+b") as f:                 # same size, one byte flipped, mtime put back
        f.seek(st.st_size - 5)
        byte = f.read(1)
        f.seek(st.st_size - 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    for output in run_dir.glob("*.npy"):           # consolidation must run again and read the part
        output.unlink()

    resumed = run_encode(cache_dir, run_dir, None, expect_warning="damaged")

    assert resumed["parts_encoded"] == 1, resumed
    assert {p.name: sha256_file(p) for p in run_dir.glob("*.npy")} == reference


# ---------------------------------------------------------------------------------- helpers


def run_encode(cache_dir: Path, run_dir: Path, mirror: Path | None, expect_warning: str | None = None) -> dict:
    """Encode (or resume) in a fresh process; what it read, opened and encoded."""
    done = subprocess.run([sys.executable, "-c", RUN, str(cache_dir), str(run_dir), str(mirror or "")],
                          capture_output=True, text=True, timeout=600,
                          env=subprocess_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    if expect_warning is not None:
        assert expect_warning in done.stderr, done.stderr[-3000:]
    else:
        assert "Warning" not in done.stderr, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
