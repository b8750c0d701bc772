"""A frozen Drive mount hangs stat() and statvfs() too, not only open(): encode's checks of the mirror
(the folder check, the preflight's free space) run within the mirror's deadline and never hang the run.

Stand-in: a FUSE mount that stops answering cannot be made here, so os.stat and shutil.disk_usage
block forever for paths under the mirror (as the kernel call would) until the test releases them.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from conftest import small_cache
from nblib import encode as enc
from nblib.atomic import sha256_file
from nblib.cache import ShardedImageCache
from nblib.config import preset
from nblib.encode.disks import check_disks
from nblib.store import MirrorWarning

DEADLINE_S = "1"


@pytest.fixture
def frozen_mount(tmp_path, monkeypatch):
    """A mirror folder whose stat() and statvfs() never return while the test runs."""
    mirror = tmp_path / "drive" / "mirror"
    mirror.mkdir(parents=True)
    release = threading.Event()
    real_stat, real_usage = os.stat, shutil.disk_usage

    def under_mirror(path) -> bool:
        try:
            return Path(os.fsdecode(path)).absolute().is_relative_to(mirror)
        except TypeError:                           # a file descriptor
            return False

    def stat(path, *args, **kwargs):
        if under_mirror(path):
            release.wait()
        return real_stat(path, *args, **kwargs)

    def disk_usage(path):
        if under_mirror(path):
            release.wait()
        return real_usage(path)

    monkeypatch.setenv("NBLIB_MIRROR_DEADLINE_S", DEADLINE_S)
    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    yield mirror
    release.set()                                   # the mount answers again: the blocked threads end


def test_the_preflight_leaves_a_frozen_mirror_disk_unchecked_and_says_so(tmp_path, frozen_mount):
    started = time.monotonic()
    needs = {"parts still to encode": (tmp_path / "run", 10), "mirrored parts": (frozen_mount, 10)}
    with pytest.warns(MirrorWarning, match=r"mirror=stalled.*free space was skipped"):
        check_disks(needs, mirror=frozen_mount)
    assert time.monotonic() - started < 60          # it hung forever before (no deadline on statvfs)


def test_the_preflight_still_refuses_a_full_local_disk_beside_a_frozen_mirror(tmp_path, frozen_mount):
    needs = {"parts still to encode": (tmp_path / "run", 1 << 62), "mirrored parts": (frozen_mount, 10)}
    with pytest.warns(MirrorWarning), pytest.raises(Exception, match="the encode run needs"):
        check_disks(needs, mirror=frozen_mount)


def test_encode_with_a_mirror_whose_stat_hangs_finishes_from_local_staging(tmp_path, frozen_mount):
    cache = small_cache(tmp_path / "cache", [f"#{i} a frozen mount" for i in range(48)])
    cfg = preset("smoke").replace(batch_size=16, checkpoint_every=1, consolidate_every=1)
    solo = enc.encode(ShardedImageCache(cache), tmp_path / "solo", cfg, progress=False)
    with pytest.warns(MirrorWarning, match="mirror=stalled"):
        report = enc.encode(ShardedImageCache(cache), tmp_path / "run", cfg, progress=False,
                            mirror_dir=frozen_mount)
    assert {n: sha256_file(p) for n, p in report.outputs.items()} == \
        {n: sha256_file(p) for n, p in solo.outputs.items()}
