"""`python -m nblib train --drive-quota-gb`: the disk watch counts a mirror folder against its quota and
warns with the numbers before it runs out; a folder under the Colab Drive mount gets the free 15 GB by
default, any other mirror none; bad values get one `error:` line and exit 2.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import run_nblib
from test_train import labelled_cache

from nblib.errors import ConfigError
from nblib.train.command import mirror_quota_bytes


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return labelled_cache(tmp_path_factory.mktemp("quota"), 120)


def _train(cache_dir, out, *extra):
    return run_nblib("train", "--cache", cache_dir, "--out", out, "--steps", 4, "--batch-size", 16, "--save-every", 2,
                     "--backup-every", 2, "--no-progress", *extra, OMP_NUM_THREADS="1")


def test_a_mirror_folder_with_a_tiny_quota_warns_with_the_numbers_and_training_goes_on(cache_dir, tmp_path):
    done = _train(cache_dir, tmp_path / "run", "--mirror", str(tmp_path / "drive"), "--drive-quota-gb", "0.001")
    assert done.returncode == 0, done.stderr[-3000:]
    warned = [line for line in done.stderr.splitlines() if "quota (--drive-quota-gb)" in line]
    assert warned, done.stderr[-3000:]
    assert "mirror (" in warned[0] and "1.00 MB quota" in warned[0] and "the 3 states + best weights" in warned[0]
    assert "with a 10% margin" in warned[0]                  # the budget's retention rule and margin
    assert (tmp_path / "run/final.pt").exists()


def test_without_a_quota_a_roomy_mirror_folder_does_not_warn(cache_dir, tmp_path):
    done = _train(cache_dir, tmp_path / "run", "--mirror", str(tmp_path / "drive"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "quota" not in done.stderr and "free, less than" not in done.stderr


@pytest.mark.parametrize("extra, expected", [
    (["--drive-quota-gb", "0"], "not a finite number above 0"),
    (["--drive-quota-gb", "nan"], "not a finite number above 0"),
    (["--drive-quota-gb", "-2"], "not a finite number above 0"),
    (["--drive-quota-gb", "1"], "no --mirror"),
    (["--drive-quota-gb", "1", "--mirror", "s3://bucket/run"], "object storage"),
])
def test_bad_quota_settings_print_one_error_line_and_exit_2(cache_dir, tmp_path, extra, expected):
    done = _train(cache_dir, tmp_path / "run", *extra)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], done.stderr
    assert not (tmp_path / "run/checkpoints").exists()


def test_a_mirror_under_the_colab_drive_mount_gets_the_free_quota_by_default(tmp_path, monkeypatch):
    monkeypatch.setattr("nblib.env.COLAB_MOUNT_POINT", tmp_path / "content/drive")
    assert mirror_quota_bytes(str(tmp_path / "content/drive/MyDrive/run"), None) == 15 * 10 ** 9
    assert mirror_quota_bytes(str(tmp_path / "content/drive/MyDrive/run"), 100.0) == 100 * 10 ** 9
    assert mirror_quota_bytes(str(tmp_path / "elsewhere"), None) is None
    assert mirror_quota_bytes("s3://bucket/run", None) is None
    assert mirror_quota_bytes(None, None) is None
    with pytest.raises(ConfigError, match="applies to a mirror folder"):
        mirror_quota_bytes(None, 2.0)
