"""One training step of the real loop on a simulated GPU: forward, backward, GradScaler, AdamW.

`simulate_train_step(model, batch_size, gpu="t4", precision="fp16")` builds the model as the loop does and
AdamW, the LR schedule and the GradScaler with `nblib.train.loop.training_objects` and runs the loop's own
`train_step` `steps` times (3: AdamW's moments exist from the first step on, so steps 2 and 3
are the steady state) on a fake `cuda:0` (nblib.simulate.fake_cuda). Every device storage is
replayed through the caching-allocator model; the last step's kernels are kept for the roofline.

Stock torch 2.13 (CPU build) runs the forward on fake CUDA tensors but cannot record it for
backward: each autograd node asks the CUDA device guard for its stream, and a CPU build has no
CUDA guard ("PyTorch is not linked with support for cuda devices", thrown where the process can
only abort); backward then asks `at::accelerator` for the current stream ("Cannot access
accelerator device when none is available"). What is added: a 20-line C++ shim, compiled once
with the local C++ compiler against torch's own headers and loaded before torch in a fresh
process, installs torch's own `FakeGuardImpl<CUDA>` (what `c10::impl::ensureCUDADeviceGuardSet`
installs on a CUDA build without a device) and CUDA hooks that report "built, with a primary
context". That changes global torch state, so the simulation always runs in a subprocess.
Reads of device values (the loss the loop logs, GradScaler's found-inf flag) have no value on a
fake device: they read 0 (finite gradients, the optimizer steps: the steady state). The autograd
engine runs single-threaded. bf16 autocast asks `torch.cuda.is_bf16_supported()`, True on every
GPU of `budget.DEVICES` (a T4, sm_75, emulates bf16); it is answered so. Without a C++ compiler
or torch's headers, `SimulationUnavailable` says the backward pass cannot be simulated here.
Every figure is simulated: the CUDA context, kernel scratch and real timing are outside it.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from nblib.budget.devices import Device, gpu_preset
from nblib.config import ModelConfig
from nblib.errors import ConfigError, NblibError

LABEL = "simulated"
PRECISIONS = ("fp16", "bf16", "fp32")
STEPS = 3
SHIM_SOURCE = r"""
// nblib.simulate.train: a CPU-only torch build gets torch's own fake CUDA device guard and CUDA
// hooks that report "built", so autograd can record and run fake cuda:0 tensors. No kernel runs.
#include <c10/core/impl/FakeGuardImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
struct NblibFakeCUDAHooks : at::CUDAHooksInterface {
  NblibFakeCUDAHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
};
namespace {
struct Install {
  Install() {
    if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) {
      static c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> guard;
      c10::impl::registerDeviceGuard(c10::DeviceType::CUDA, &guard);
    }
  }
} install;
}
namespace at { C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", ::NblibFakeCUDAHooks) }
"""


class SimulationUnavailable(NblibError):
    """This machine cannot simulate a backward pass (no C++ compiler, no torch headers, or a CUDA build)."""


@dataclass(frozen=True)
class SimulatedStep:
    """What a training step holds on a simulated GPU; every byte figure is simulated."""

    model: ModelConfig
    batch_size: int
    gpu: str
    precision: str
    sdpa_backend: str
    steps: int
    max_live: int               # peak bytes of live device tensors (exact storage sizes)
    max_allocated: int          # simulated torch.cuda.max_memory_allocated()
    max_reserved: int           # simulated torch.cuda.max_memory_reserved()
    weights: int                # parameters and buffers on the device
    resident: int               # live between steps: weights, AdamW moments, scaler, cuBLAS workspace
    peak_op: str
    peak_shape: tuple
    audit_traced: int = 0       # with audit=True: the trace's live bytes at the end of the last forward
    audit_counted: int = 0      # ... and the same counted from what holds them (see _Audit)
    audit_saved: int = 0        # ... of which the storages autograd saved for backward (parameters excluded)
    kernels: tuple = field(default=(), repr=False)   # the last step's kernels (fake_cuda.Kernel)
    label: str = LABEL

    def step_seconds(self, device: str | Device | None = None) -> float:
        """The last step's roofline time on `device` (default: the simulated GPU); simulated."""
        from nblib.simulate.roofline import roofline

        return roofline(self.kernels, self.batch_size, device or self.gpu).seconds

    def summary(self) -> str:
        mb = 1e6
        return (f"{LABEL} {self.gpu} training step ({self.precision}, batch {self.batch_size}, "
                f"{self.sdpa_backend} attention, {self.steps} steps): max allocated "
                f"{self.max_allocated / mb:,.1f} MB, max reserved {self.max_reserved / mb:,.1f} MB, "
                f"peak at {self.peak_op} {list(self.peak_shape)}")


def simulate_train_step(model: ModelConfig, batch_size: int, gpu: str | Device = "t4", *,
                        precision: str = "fp16", n_classes: int = 12, steps: int = STEPS,
                        audit: bool = False, timeout_s: float = 600.0) -> SimulatedStep:
    """Run the loop's `train_step` `steps` times on a simulated `gpu` (in a fresh process)."""
    from nblib.simulate.fake_cuda import Kernel

    dev = gpu_preset(gpu)
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is unknown; choose one of {PRECISIONS}")
    if steps < 2:
        raise ConfigError(f"steps={steps}: AdamW's moments exist only after the first step; use >= 2")
    shim = shim_path()
    payload = {"model": model.__dict__, "batch": batch_size, "gpu": dev.name, "cc": dev.compute_capability,
               "precision": precision, "classes": n_classes, "steps": steps, "audit": audit,
               "shim": str(shim)}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "nblib.simulate.train", json.dumps(payload)],
                          capture_output=True, text=True, timeout=timeout_s, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise SimulationUnavailable(f"the simulated training step failed in its process: {why}")
    out = json.loads(lines[-1])
    kernels = tuple(Kernel(*k) for k in out.pop("kernels"))
    return SimulatedStep(model=model, batch_size=batch_size, gpu=dev.name, precision=precision, steps=steps,
                         kernels=kernels, peak_shape=tuple(out.pop("peak_shape")), **out)


def backward_capability() -> tuple[bool, str]:
    """(True, "") where this machine can simulate a backward pass, else (False, the reason)."""
    try:
        shim_path()
    except SimulationUnavailable as exc:
        return False, str(exc)
    return True, ""


def shim_path() -> Path:
    """The compiled shim for this torch (built once into the temp folder, keyed by source and torch)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise SimulationUnavailable("torch is not installed: no training step to simulate")
    root = Path(spec.origin).parent
    include, lib = root / "include", root / "lib"
    if any(lib.glob("libtorch_cuda*")):
        raise SimulationUnavailable(f"{root} is a CUDA build: the fake-CUDA shim is for CPU-only torch; "
                                    f"on a GPU machine measure the step with torch.cuda.max_memory_allocated()")
    if not (include / "c10" / "core" / "impl" / "FakeGuardImpl.h").exists():
        raise SimulationUnavailable(f"torch's C++ headers are missing under {include}: the backward pass "
                                    f"cannot be simulated here (install a torch wheel that ships include/)")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise SimulationUnavailable("no C++ compiler (c++, g++ or $CXX): the backward pass cannot be simulated "
                                    "here; install one (apt-get install g++) or read the closed-form budget")
    version = (root / "version.py").read_text(encoding="utf-8") if (root / "version.py").exists() else ""
    key = hashlib.sha256((SHIM_SOURCE + version + str(root)).encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"nblib-fake-cuda-{key}.so"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        src, built = Path(tmp) / "shim.cpp", Path(tmp) / "shim.so"
        src.write_text(SHIM_SOURCE, encoding="utf-8")
        done = subprocess.run([cxx, "-O1", "-std=c++17", "-shared", "-fPIC", f"-I{include}", str(src), f"-L{lib}",
                               "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}", "-o", str(built)],
                              capture_output=True, text=True)
        if done.returncode:
            why = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise SimulationUnavailable(f"the fake-CUDA shim did not compile with {cxx}: {why}")
        staged = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        shutil.copyfile(built, staged)
        os.replace(staged, out)            # same folder: atomic; a concurrent build writes the same bytes
    return out


# ---------------------------------------------------------------- the child process
def _child(payload: dict) -> dict:
    """In a fresh process: load the shim, then torch, then run the steps. The result as JSON-able data."""
    import ctypes

    ctypes.CDLL(payload["shim"])           # before torch: its CUDA hooks are chosen when torch starts
    from unittest import mock

    import torch

    from nblib.simulate.fake_cuda import fake_cuda
    from nblib.train.config import TrainConfig
    from nblib.train.loop import train_step, training_objects
    from nblib.train.model import Classifier

    model, b, steps = ModelConfig(**payload["model"]), payload["batch"], payload["steps"]
    config = TrainConfig(batch_size=b, precision=payload["precision"], device="cuda:0", steps=steps + 1,
                         warmup_steps=1)
    indices = torch.arange(b)              # real: the loop logs them with .tolist()
    net = Classifier(model, payload["classes"], seed=config.seed, dropout=config.dropout)   # as the loop builds it
    with fake_cuda(), mock.patch("torch.cuda.is_bf16_supported", return_value=True), \
            torch.autograd.set_multithreading_enabled(False):
        trace = _step_trace_class()(payload["cc"])
        with trace, _attention_as_on_gpu(trace):
            net.to(config.device)
            weights = trace.allocator.allocated
            optimizer, scheduler, scaler = training_objects(net, config)
            batches = _batches(model, b, indices)
            for _ in range(steps - 1):
                train_step(net, optimizer, scheduler, scaler, batches, config)
            kernels_before = len(trace.kernels)
            audit = _audit(trace, net, optimizer, scaler, b) if payload["audit"] else None
            with audit if audit is not None else contextlib.nullcontext():
                train_step(net, optimizer, scheduler, scaler, batches, config)
            resident = trace.live
    backend = max(trace.sdpa_used, key=trace.sdpa_used.get) if trace.sdpa_used else "none"
    return {"sdpa_backend": backend, "max_live": trace.max_live, "max_allocated": trace.allocator.max_allocated,
            "max_reserved": trace.allocator.max_reserved, "weights": weights, "resident": resident,
            "peak_op": trace.peak.op, "peak_shape": list(trace.peak.shape),
            "audit_traced": audit.traced if audit else 0, "audit_counted": audit.counted if audit else 0,
            "audit_saved": audit.saved_bytes if audit else 0,
            "kernels": [[k.op, k.flops, k.bytes, k.dtype, k.tensor_core] for k in trace.kernels[kernels_before:]]}


def _batches(model: ModelConfig, b: int, indices):
    """What the loop's DataLoader yields: uint8 images [B, H, W, 3], int64 labels, the sample indices."""
    import torch

    while True:
        yield (torch.empty((b, model.image_size, model.image_size, 3), dtype=torch.uint8),
               torch.zeros(b, dtype=torch.int64), indices)


class _Audit:
    """At the end of the last step's forward: the trace's live bytes, and the same counted independently.

    The independent count is the union of storages held at that moment by what holds them: the
    parameters and buffers, AdamW's state, the GradScaler, the tensors autograd saved for backward
    (torch.autograd.graph.saved_tensors_hooks), the input batch and the logits, plus the int64
    labels and the cuBLAS workspace (no tensor holds it).
    """

    def __init__(self, trace, net, optimizer, scaler, batch_size: int):
        import torch

        self.trace, self.net, self.optimizer, self.scaler, self.b = trace, net, optimizer, scaler, batch_size
        self.saved: dict[int, int] = {}
        self.traced = self.counted = self.saved_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def __enter__(self):
        self._handle = self.net.register_forward_hook(self._at_forward_end)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._handle.remove()

    def _pack(self, t):
        if t.device.type == "cuda":
            st = t.untyped_storage()
            self.saved[st._cdata] = st.nbytes()
        return t

    def _at_forward_end(self, module, inputs, output) -> None:
        from nblib.simulate.fake_cuda import CUBLAS_WORKSPACE

        held = dict(self.saved)
        params = {t.untyped_storage()._cdata for t in (*module.parameters(), *module.buffers())}
        self.saved_bytes = sum(n for key, n in held.items() if key not in params)
        state = [t for s in self.optimizer.state.values() for t in s.values() if hasattr(t, "untyped_storage")]
        scaler = [getattr(self.scaler, n, None) for n in ("_scale", "_growth_tracker")]
        scaler = [t for t in scaler if t is not None]
        for t in (*module.parameters(), *module.buffers(), *state, *scaler, *inputs, output):
            if t.device.type == "cuda":
                held[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        labels = self.b * 8
        self.traced = self.trace.live
        self.counted = sum(held.values()) + labels + CUBLAS_WORKSPACE[self.trace.cc >= 90]


def _audit(trace, net, optimizer, scaler, batch_size: int) -> _Audit:
    return _Audit(trace, net, optimizer, scaler, batch_size)


def _attention_as_on_gpu(trace):
    """A TorchFunctionMode that runs F.scaled_dot_product_attention as the simulated GPU would.

    With autograd on, SDPA decomposes before a dispatch mode sees it, and a CPU build's backend
    choice is always math; the GPU picks by architecture (a T4: memory-efficient). This calls that
    kernel's aten op, whose autograd formula saves what the GPU's saves (output and logsumexp).
    """
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    aten = torch.ops.aten

    class AttentionAsOnGPU(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is not F.scaled_dot_product_attention:
                return func(*args, **kwargs)
            q, k, v = args[:3]
            if q.device.type != "cuda":
                return func(*args, **kwargs)
            backend = trace.sdpa_backend()
            trace.sdpa_used[backend] = trace.sdpa_used.get(backend, 0) + 1
            if torch.is_autocast_enabled("cuda"):      # SDPA is on autocast's fp16 list
                dtype = torch.get_autocast_dtype("cuda")
                q, k, v = (t.to(dtype) for t in (q, k, v))
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            if backend == "efficient":
                return aten._scaled_dot_product_efficient_attention(q, k, v, None, grad)[0]
            if backend == "flash":
                return aten._scaled_dot_product_flash_attention(q, k, v)[0]
            if backend == "cudnn":
                return aten._scaled_dot_product_cudnn_attention(q, k, v, None, grad)[0]
            return func(q, k, v, *args[3:], **kwargs)

    return AttentionAsOnGPU()


def _step_trace_class():
    """DeviceTrace that answers a read of a device value (no data on a fake device) with 0."""
    import torch

    from nblib.simulate.fake_cuda import DeviceTrace

    scalar = torch.ops.aten._local_scalar_dense.default

    class StepTrace(DeviceTrace):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is scalar and getattr(args[0], "constant", None) is None:
                t = args[0]
                return 0.0 if t.dtype.is_floating_point else (False if t.dtype == torch.bool else 0)
            return super().__torch_dispatch__(func, types, args, kwargs)

    return StepTrace


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
