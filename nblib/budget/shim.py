"""The fake-CUDA shim: what lets torch record and run backward on fake cuda:0 tensors, with no GPU.

Stock torch (CPU build) runs a forward on fake CUDA tensors but cannot record it for backward, nor
copy a permuted tensor (`contiguous`): both ask the CUDA device guard, and a CPU build has none. A CUDA
build (PyPI's default wheel, Colab's) has its own guard and hooks, which without a GPU count 0 devices and
throw in backward (`hasPrimaryContext expects a valid device index`).
A 20-line C++ shim, compiled once with the local C++ compiler against torch's own headers and
loaded before torch in a fresh process, installs torch's own `FakeGuardImpl<CUDA>` and CUDA hooks
that report "built, with a primary context", in either build (preferred over a CUDA build's own): a trace
is the same trace, and touches no GPU, on both. It changes global torch state, so whatever uses it
runs in a subprocess (`run_child`). Shared by the budget's trace (nblib.budget.model_vram) and the
simulated training step (nblib.simulate.train). `tests/test_cuda_build_torch.py` runs it under PyPI's CUDA build.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from nblib.budget import warm
from nblib.errors import NblibError

SHIM_SOURCE = r"""
// nblib.budget.shim: torch's own fake CUDA device guard and CUDA hooks that report "built, with a primary
// context", so autograd can record and run fake cuda:0 tensors without a GPU. No kernel runs.
#include <c10/core/impl/FakeGuardImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
struct NblibFakeCUDAHooks : at::CUDAHooksInterface {
  NblibFakeCUDAHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
};
static c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> guard;
// the guard: at load where none is (a CPU build), and again once torch is loaded (a CUDA build registers its
// own as it loads, whose device count is 0 without a GPU)
extern "C" void nblib_fake_cuda_guard() { c10::impl::registerDeviceGuard(c10::DeviceType::CUDA, &guard); }
namespace {
struct Install {
  Install() {
    if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) nblib_fake_cuda_guard();
  }
} install;
}
// the hooks: preferred over a CUDA build's own (registered at the default priority as torch loads, before
// anything asks for them), whose hasPrimaryContext(0) throws without a GPU
namespace at {
C10_REGISTER_TYPED_CLASS_WITH_PRIORITY(CUDAHooksRegistry, "CUDAHooks", c10::REGISTRY_PREFERRED, ::NblibFakeCUDAHooks)
}
"""

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"     # read by the trace's workspace (nblib.budget.trace.cublas_workspace_bytes)
TRAIN_CUBLAS_CONFIG = ":4096:8"           # what importing nblib.train sets unless set (nblib/train/__init__.py)


class SimulationUnavailable(NblibError):
    """This machine cannot simulate a backward pass (no torch, no C++ compiler, or no torch headers)."""


def backward_capability() -> tuple[bool, str]:
    """(True, "") where this machine can simulate a backward pass, else (False, the reason)."""
    try:
        shim_path()
    except SimulationUnavailable as exc:
        return False, str(exc)
    return True, ""


def shim_path() -> Path:
    """The compiled shim for this torch: built once into the per-user folder (mode 0700, refused when another user
    owns it: nblib.budget.user_cache.user_folder), keyed by source and torch; never a fixed name in the shared
    temp folder, where another local user could plant a library of that name for this process to load.
    """
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise SimulationUnavailable("torch is not installed: no training step to simulate")
    root = Path(spec.origin).parent
    include, lib = root / "include", root / "lib"
    if not (include / "c10" / "core" / "impl" / "FakeGuardImpl.h").exists():
        raise SimulationUnavailable(f"torch's C++ headers are missing under {include}: the backward pass "
                                    f"cannot be simulated here (install a torch wheel that ships include/)")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise SimulationUnavailable("no C++ compiler (c++, g++ or $CXX): the backward pass cannot be simulated "
                                    "here; install one (apt-get install g++) or read the closed-form budget")
    version = (root / "version.py").read_text(encoding="utf-8") if (root / "version.py").exists() else ""
    key = hashlib.sha256((SHIM_SOURCE + version + str(root)).encode()).hexdigest()[:16]
    from nblib.budget.user_cache import built_once, user_folder

    def command(tmp: Path, built: Path) -> list[str]:
        src = tmp / "shim.cpp"
        src.write_text(SHIM_SOURCE, encoding="utf-8")
        return [cxx, "-O1", "-std=c++17", "-shared", "-fPIC", f"-I{include}", str(src), f"-L{lib}", "-lc10",
                "-ltorch_cpu", f"-Wl,-rpath,{lib}", "-o", str(built)]

    return built_once(user_folder("shim") / f"nblib-fake-cuda-{key}.so", command, "the fake-CUDA shim",
                      SimulationUnavailable)


# nblib's variables that name where files go or how long to wait: a trace reads none of them, so a notebook that
# moves its outputs (or a test's own NBLIB_OUTPUTS) replays a job traced before instead of tracing it again
NOT_TRACED_ENV = frozenset(f"NBLIB_{name}" for name in (
    "OUTPUTS", "DRIVE_DIR", "COLAB_MOUNT_POINT", "CJK_FONT", "TRAIN_SAMPLE_LOG", "WARM_TRACES",
    "SUITE_INACTIVITY_S", "MIRROR_DEADLINE_S", "REMOUNT_TIMEOUT_S", "READ_DEADLINE_S", "DIST_TIMEOUT_S"))


def traced_environment() -> dict[str, str]:
    """This process's variables that shape a trace: NBLIB_ and PYTORCH_ ones (less `NOT_TRACED_ENV`) and PYTHONPATH
    (where a --model's module is found). A traced job is kept under them (model_vram.job_key), and a warm process
    traces only for the ones it started with.
    """
    return {k: v for k, v in os.environ.items()
            if (k.startswith(("NBLIB_", "PYTORCH_")) or k == "PYTHONPATH") and k not in NOT_TRACED_ENV}


def run_child(module: str, payload: dict, timeout_s: float = 600.0) -> dict:
    """`module._child(payload)` with the shim's path in the payload, in a fork of the warm process
    (nblib.budget.warm), else in a fresh `python -m module JSON`; its result.
    """
    payload = {**payload, "shim": str(shim_path()),
               "cublas_config": run_cublas_config(payload.get("train", False))}
    if warm.enabled():
        try:
            return warm.run_warm(module, payload, timeout_s, traced_environment())
        except warm.WarmUnavailable:
            pass                          # no warm process here: a fresh one, as below
        except RuntimeError as exc:
            raise child_failure(module, str(exc)) from None
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", module, json.dumps(payload)], capture_output=True, text=True,
                          timeout=timeout_s, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise child_failure(module, why)
    return json.loads(lines[-1])


def child_failure(module: str, why: str) -> NblibError:
    """The child's last error line as this process's error: an NblibError of the child (a --model that does not
    build, from nblib.models.load_model) as the same class and line a run in this process prints; else
    SimulationUnavailable.
    """
    from nblib import errors

    name, _, message = why.partition(": ")
    cls = getattr(errors, name.rsplit(".", 1)[-1], None) if name.startswith("nblib.") else None
    if isinstance(cls, type) and issubclass(cls, NblibError) and message:
        return cls(message)
    return SimulationUnavailable(f"the fake-CUDA trace failed in its process ({module}): {why}")


def run_cublas_config(train: bool) -> str | None:
    """The CUBLAS_WORKSPACE_CONFIG the traced job runs with: this process's, and for training the value
    importing nblib.train sets when none is (nblib/train/__init__.py: os.environ.setdefault).
    """
    value = os.environ.get(CUBLAS_ENV)
    return value or (TRAIN_CUBLAS_CONFIG if train else None)


def load_shim(payload: dict) -> None:
    """In the child, before torch is imported: load the shim (its CUDA hooks are chosen when torch starts),
    then tell the trace the run's CUBLAS_WORKSPACE_CONFIG (the child's own environment may differ: a warm fork).
    """
    import ctypes

    if payload.get("shim"):
        shim = ctypes.CDLL(payload["shim"])
        import torch  # noqa: F401  (a CUDA build registers its own CUDA guard as it loads: the shim's replaces it)

        shim.nblib_fake_cuda_guard()
    from nblib.budget.trace import set_run_cublas_config

    set_run_cublas_config(payload.get("cublas_config"))


def child_model(payload: dict):
    """In a child process: load the fake-CUDA shim, then the payload's model (spec, weights, TRM shape, the inputs
    it takes: nblib.budget.model_vram.token_length).
    """
    load_shim(payload)
    from nblib.models import load_model

    config = None
    if payload["trm_model"]:
        from nblib.config import ModelConfig

        config = ModelConfig(**payload["trm_model"])
    inputs = "tokens" if str(payload.get("inputs", "images")).startswith("tokens:") else "images"
    inputs = (payload.get("record") or {}).get("model_inputs", inputs)    # a train --records run's (records.py)
    loaded = load_model(payload["spec"], payload["weights"], config=config, inputs=inputs)
    from nblib.budget.trace import refuse_unmodelled

    refuse_unmodelled(loaded.module)
    return loaded
