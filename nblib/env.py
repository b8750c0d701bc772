"""Where am I: runtime (Colab / local / CI), a hardware report, the profile, and the workspace.

Also the Colab shim: `mount_drive()` uses `google.colab.drive` when it is importable and a local
folder otherwise (`NBLIB_DRIVE_DIR`, default `outputs/drive`). It replaces the
`google-colab-shim` package of early plans, which does not exist on PyPI.
"""
from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import platform
import shutil
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from nblib.config import PROFILES
from nblib.errors import ConfigError, DriveError
from nblib.units import fmt_gb

COLAB_MOUNT_POINT = Path(os.environ.get("NBLIB_COLAB_MOUNT_POINT", "/content/drive"))  # tests point it elsewhere


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity, else the machine's count): the parallelism budget of
    a render pool, a loader's workers, a sweep, the writer thread's spare core.
    """
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def runtime() -> str:
    """'colab' inside Google Colab, 'ci' when the CI variable is set, else 'local'."""
    if "google.colab" in sys.modules or os.environ.get("COLAB_RELEASE_TAG"):
        return "colab"
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        return "ci"
    return "local"


def cuda_available() -> bool:
    """True when torch is installed and sees a CUDA device (torch imported only if a driver is there).

    Without an NVIDIA driver torch is never imported, so a CPU TensorFlow notebook stays torch-free.
    """
    if importlib.util.find_spec("torch") is None:
        return False
    if not (os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi")):
        return False
    import torch

    return bool(torch.cuda.is_available())


def profile() -> str:
    """smoke | t4 | full: NBLIB_PROFILE if set, else t4 with CUDA and smoke without."""
    name = os.environ.get("NBLIB_PROFILE", "").strip()
    if name:
        if name not in PROFILES:
            raise ConfigError(
                f"NBLIB_PROFILE={name!r} is not a profile; set it to one of: {', '.join(PROFILES)}")
        return name
    return "t4" if cuda_available() else "smoke"


PROFILE_MEANING = {
    "smoke": "tiny model, 512 images at 64 px: every mechanism runs in minutes on 2 CPU cores, "
             "none of a T4's numbers",
    "t4": "the seed_t4 model on 20,000 images at 224 px, sized for a Colab T4",
    "full": "the whole 1,907,747-image job",
}


def profile_note(profile_name: str, runtime_name: str, cuda: bool) -> str:
    """What the profile means here and, in Colab without a GPU, how to get a T4 (pure; 00 prints it)."""
    why = "NBLIB_PROFILE" if os.environ.get("NBLIB_PROFILE") else ("a GPU is present" if cuda else "no GPU")
    line = f"profile: {profile_name} ({why}): {PROFILE_MEANING.get(profile_name, '')}"
    if runtime_name == "colab" and not cuda:
        line += ("\nThis Colab runtime has no GPU. For the T4 numbers: Runtime > Change runtime type > "
                 "T4 GPU > Save, then Runtime > Run all (the setup cell reinstalls nblib in seconds).")
    return line


def repo_root() -> Path | None:
    """The source checkout nblib runs from (editable install or Colab clone), if any."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").exists() else None


def outputs_dir() -> Path:
    """Fast local folder for everything a run writes: NBLIB_OUTPUTS, else <repo>/outputs."""
    if os.environ.get("NBLIB_OUTPUTS"):
        return Path(os.environ["NBLIB_OUTPUTS"]).expanduser().resolve()
    root = repo_root()
    return (root / "outputs") if root else (Path.cwd() / "outputs").resolve()


def mount_drive(mount_point: str | Path = COLAB_MOUNT_POINT, *, _drive=None) -> Path:
    """Mount Google Drive in Colab (remounting on Errno 107) or use the local fallback folder.

    Returns the durable workspace root: `MyDrive/nblib` in Colab, `NBLIB_DRIVE_DIR` (default
    `outputs/drive`) elsewhere. Raises DriveError when the folder cannot be created or written.
    """
    drive = _drive if _drive is not None else _colab_drive()
    if drive is None:
        root = Path(os.environ.get("NBLIB_DRIVE_DIR") or outputs_dir() / "drive").expanduser()
    else:
        mount_point = Path(mount_point)
        try:
            if not os.path.isdir(mount_point / "MyDrive"):  # mounted already (the setup cell): a mount only prints
                drive.mount(str(mount_point))
            os.listdir(mount_point)       # a dead FUSE mount raises here (Errno 107)
        except OSError as exc:
            if exc.errno != errno.ENOTCONN and "Transport endpoint is not connected" not in str(exc):
                raise DriveError(f"mounting Google Drive at {mount_point} failed: {exc}; "
                                 f"rerun the cell, or Runtime > Restart and run again") from None
            drive.mount(str(mount_point), force_remount=True)
        root = mount_point / "MyDrive" / "nblib"
    return _require_writable(root)


def remount_drive() -> Path:
    """Force a remount after 'Transport endpoint is not connected' (Colab only; else a no-op)."""
    drive = _colab_drive()
    if drive is not None:
        drive.mount(str(COLAB_MOUNT_POINT), force_remount=True)
    return mount_drive()


@dataclass(frozen=True)
class Workspace:
    """The named folders a run uses: durable ones on Drive, fast ones on local disk."""

    drive: Path        # durable root: Google Drive (or its local fallback)
    cache: Path        # drive/cache: image caches
    runs: Path         # drive/runs: encode runs (parts, manifests, consolidated outputs)
    checkpoints: Path  # drive/checkpoints: model, optimizer and iterator checkpoints
    local: Path        # fast local disk: outputs/ (or NBLIB_OUTPUTS)
    staging: Path      # local/staging: parts written here first, then mirrored to Drive
    figures: Path      # local/figures: PNGs the notebooks save

    def as_dict(self) -> dict[str, Path]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def workspace(drive: str | Path | None = None) -> Workspace:
    """The workspace folders under `drive` (default: `mount_drive()`), created."""
    drive_root = Path(drive) if drive is not None else mount_drive()
    local = outputs_dir()
    ws = Workspace(drive=drive_root, cache=drive_root / "cache", runs=drive_root / "runs",
                   checkpoints=drive_root / "checkpoints", local=local,
                   staging=local / "staging", figures=local / "figures")
    for folder in ws.as_dict().values():
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DriveError(f"cannot create workspace folder {folder}: {exc.strerror}; "
                             f"point NBLIB_DRIVE_DIR / NBLIB_OUTPUTS at a writable folder") from None
    return ws


@dataclass(frozen=True)
class HardwareReport:
    """What this machine has: GPU, RAM, CPUs, disks and library versions."""

    runtime: str
    gpu_name: str | None
    vram_total_bytes: int | None
    vram_free_bytes: int | None
    compute_capability: str | None
    fp16_tensor_cores: bool
    ram_total_bytes: int
    ram_available_bytes: int
    cpu_count: int
    local_disk_total_bytes: int
    local_disk_free_bytes: int
    drive_disk_total_bytes: int | None
    drive_disk_free_bytes: int | None
    python: str
    numpy: str | None
    torch: str | None
    tensorflow: str | None

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs, human-readable."""
        gb = fmt_gb
        return [
            ("runtime", self.runtime),
            ("GPU", self.gpu_name or "none"),
            ("VRAM total / free", f"{gb(self.vram_total_bytes)} / {gb(self.vram_free_bytes)}"),
            ("compute capability", self.compute_capability or "-"),
            ("fp16 tensor cores", "yes" if self.fp16_tensor_cores else "no"),
            ("RAM total / available", f"{gb(self.ram_total_bytes)} / {gb(self.ram_available_bytes)}"),
            ("CPU cores", str(self.cpu_count)),
            ("local disk total / free", f"{gb(self.local_disk_total_bytes)} / {gb(self.local_disk_free_bytes)}"),
            ("Drive disk total / free", f"{gb(self.drive_disk_total_bytes)} / {gb(self.drive_disk_free_bytes)}"),
            ("python", self.python),
            ("numpy", self.numpy or "not installed"),
            ("torch", self.torch or "not installed"),
            ("tensorflow", self.tensorflow or "not installed"),
        ]

    def __str__(self) -> str:
        rows = self.rows()
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def hardware_report(drive: str | Path | None = None, local: str | Path | None = None) -> HardwareReport:
    """Measure this machine. Imports torch (if installed) to read the GPU, never TensorFlow."""
    import psutil  # here, not at module level: psutil costs 50-100 ms of `import nblib.env`

    from nblib.disk import disk_space

    gpu = dict(gpu_name=None, vram_total_bytes=None, vram_free_bytes=None, compute_capability=None,
               fp16_tensor_cores=False)
    if cuda_available():
        import torch

        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        gpu = dict(gpu_name=props.name, vram_total_bytes=int(total), vram_free_bytes=int(free),
                   compute_capability=f"{props.major}.{props.minor}", fp16_tensor_cores=props.major >= 7)
    local_path = Path(local) if local is not None else outputs_dir()
    local_total, local_free = disk_space(local_path)
    drive_total, drive_free = disk_space(drive) if drive is not None else (None, None)
    vm = psutil.virtual_memory()
    return HardwareReport(
        runtime=runtime(), **gpu,
        ram_total_bytes=vm.total, ram_available_bytes=vm.available,
        cpu_count=os.cpu_count() or 1,
        local_disk_total_bytes=local_total, local_disk_free_bytes=local_free,
        drive_disk_total_bytes=drive_total, drive_disk_free_bytes=drive_free,
        python=platform.python_version(), numpy=installed_version("numpy"), torch=installed_version("torch"),
        tensorflow=installed_version("tensorflow"),
    )


# ---------------------------------------------------------------------------------- helpers


def on_google_drive(folder: str | Path) -> bool:
    """True when `folder` lies under Colab's Drive mount point."""
    try:
        return Path(folder).resolve().is_relative_to(COLAB_MOUNT_POINT)
    except OSError:
        return False


def _colab_drive():
    """google.colab.drive when running in Colab, else None (the local fallback is used)."""
    if importlib.util.find_spec("google") is None or importlib.util.find_spec("google.colab") is None:
        return None
    from google.colab import drive  # type: ignore[import-not-found]

    return drive


def _require_writable(root: Path) -> Path:
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".nblib-write-probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise DriveError(
            f"the workspace folder {root} is not writable ({exc.strerror or exc}); set "
            f"NBLIB_DRIVE_DIR to a folder you can write, or fix its permissions") from None
    return root


def installed_version(module: str) -> str | None:
    """The installed version of package `module` (tensorflow: or tensorflow-cpu); None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in {"tensorflow": ("tensorflow", "tensorflow-cpu")}.get(module, (module,)):
        with contextlib.suppress(PackageNotFoundError):
            return version(dist)
    return None
