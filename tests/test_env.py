"""Runtime, profile, workspace and the Drive shim, with real folders and a real subprocess."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from cli_runner import run_nblib

from conftest import REPO, subprocess_env
from nblib import env
from nblib.errors import ConfigError, DriveError


def test_runtime_is_local_without_ci_or_colab(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    assert env.runtime() == "local"


def test_runtime_is_ci_when_the_ci_variable_is_set(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert env.runtime() == "ci"


def test_runtime_is_colab_when_google_colab_is_loaded(monkeypatch):
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert env.runtime() == "colab"


def test_profile_defaults_to_smoke_without_cuda_and_t4_with_it(monkeypatch):
    monkeypatch.delenv("NBLIB_PROFILE", raising=False)
    assert env.profile() == ("t4" if env.cuda_available() else "smoke")


def test_profile_follows_nblib_profile(monkeypatch):
    monkeypatch.setenv("NBLIB_PROFILE", "full")
    assert env.profile() == "full"


def test_unknown_profile_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv("NBLIB_PROFILE", "huge")
    with pytest.raises(ConfigError, match="smoke, t4, full"):
        env.profile()


def test_drive_falls_back_to_nblib_drive_dir_and_is_writable(tmp_path, monkeypatch):
    monkeypatch.setenv("NBLIB_DRIVE_DIR", str(tmp_path / "my drive"))
    root = env.mount_drive()
    assert root == tmp_path / "my drive" and root.is_dir()
    (root / "probe.txt").write_text("ok")
    assert list(root.iterdir()) == [root / "probe.txt"], "the write probe must not be left behind"


def test_drive_fallback_defaults_to_outputs_drive(tmp_path, monkeypatch):
    monkeypatch.delenv("NBLIB_DRIVE_DIR")
    monkeypatch.setenv("NBLIB_OUTPUTS", str(tmp_path / "out"))
    assert env.mount_drive() == tmp_path / "out" / "drive"


def test_unwritable_drive_folder_is_a_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("NBLIB_DRIVE_DIR", str(blocker / "drive"))
    with pytest.raises(DriveError, match="not writable.*NBLIB_DRIVE_DIR"):
        env.mount_drive()


class ColabDriveStandIn:
    """Stands in for google.colab.drive, which exists only inside Colab: mounts a real folder."""

    def __init__(self, fail_first_with: int | None = None):
        self.calls: list[dict] = []
        self.fail_first_with = fail_first_with

    def mount(self, mount_point: str, force_remount: bool = False):
        self.calls.append({"mount_point": mount_point, "force_remount": force_remount})
        if self.fail_first_with is not None and len(self.calls) == 1:
            raise OSError(self.fail_first_with, os.strerror(self.fail_first_with))
        (Path(mount_point) / "MyDrive").mkdir(parents=True, exist_ok=True)


def test_colab_drive_is_mounted_and_the_workspace_lives_in_my_drive(tmp_path):
    drive = ColabDriveStandIn()
    root = env.mount_drive(tmp_path / "drive", _drive=drive)
    assert root == tmp_path / "drive" / "MyDrive" / "nblib" and root.is_dir()
    assert drive.calls == [{"mount_point": str(tmp_path / "drive"), "force_remount": False}]


def test_transport_endpoint_not_connected_triggers_a_forced_remount(tmp_path):
    drive = ColabDriveStandIn(fail_first_with=errno.ENOTCONN)
    root = env.mount_drive(tmp_path / "drive", _drive=drive)
    assert [c["force_remount"] for c in drive.calls] == [False, True]
    assert root.is_dir()


def test_other_mount_failures_are_a_clear_drive_error(tmp_path):
    with pytest.raises(DriveError, match="mounting Google Drive"):
        env.mount_drive(tmp_path / "drive", _drive=ColabDriveStandIn(fail_first_with=errno.EACCES))


def test_workspace_creates_the_named_folders(tmp_path):
    ws = env.workspace(drive=tmp_path / "d")
    for name in ("cache", "runs", "checkpoints"):
        assert getattr(ws, name) == tmp_path / "d" / name and getattr(ws, name).is_dir()
    assert ws.staging.is_dir() and ws.figures.is_dir()
    assert ws.local == Path(os.environ["NBLIB_OUTPUTS"]).resolve()


def test_hardware_report_reads_this_machine(tmp_path):
    import numpy
    import psutil
    import torch

    report = env.hardware_report(drive=tmp_path, local=tmp_path)
    assert report.cpu_count == os.cpu_count()
    assert report.ram_total_bytes == psutil.virtual_memory().total
    assert 0 < report.ram_available_bytes <= report.ram_total_bytes
    assert 0 < report.local_disk_free_bytes <= report.local_disk_total_bytes
    assert report.drive_disk_total_bytes == report.local_disk_total_bytes
    if env.cuda_available():
        assert report.gpu_name and report.vram_total_bytes > 0
    else:
        assert report.gpu_name is None and report.vram_total_bytes is None and not report.fp16_tensor_cores
    assert (report.numpy, report.torch) == (numpy.__version__, torch.__version__)
    text = str(report)
    assert "RAM total / available" in text and "torch" in text and "GPU" in text


def test_info_cli_prints_the_report(tmp_path):
    out = run_nblib("info", cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "CPU cores" in out.stdout
    rows = dict(line.split(None, 1) for line in out.stdout.splitlines()[:9])     # runtime, profile, the folders
    assert rows["profile"] == "smoke" and rows["checkpoints"].endswith("checkpoints"), rows   # P12: a space each


def test_cli_bad_profile_is_one_line_without_traceback():
    out = run_nblib("info", cwd=REPO, NBLIB_PROFILE="huge")
    assert out.returncode == 2
    assert out.stderr.strip().startswith("error: NBLIB_PROFILE='huge'")
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_import_nblib_loads_neither_torch_nor_tensorflow():
    heavy = "('torch', 'tensorflow', 'matplotlib.pyplot', 'ipywidgets')"
    code = ("import sys, nblib; import nblib.config, nblib.env, nblib.budget, nblib.tfdata, nblib.reference; "
            f"print(sorted(m for m in {heavy} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env=subprocess_env(), timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
