"""One training step of the real loop on a simulated GPU: forward, backward, GradScaler, AdamW.

`simulate_train_step(model, batch_size, gpu="t4", precision="fp16")` builds the model as the loop does
(`nblib.train.task.loop_module`) and runs the one traced training step, the VRAM budget's own
(`nblib.train.traced.traced_train_step`: the loop's `training_objects` and `train_step`, `steps`
times; 3: AdamW's moments exist from the first step on, so steps 2 and 3 are the steady state) on a
fake `cuda:0`, at the batch itself where the budget extrapolates from two small batches. Every device
storage is replayed through the caching-allocator model; the last step's kernels are kept for the
roofline, the step-time ceiling of `nblib.t4_speed`'s projection.

Stock torch 2.13 (CPU build) runs the forward on fake CUDA tensors but cannot record it for
backward: each autograd node asks the CUDA device guard for its stream, and a CPU build has no
CUDA guard ("PyTorch is not linked with support for cuda devices", thrown where the process can
only abort); backward then asks `at::accelerator` for the current stream ("Cannot access
accelerator device when none is available"). What is added: the fake-CUDA shim (nblib.budget.shim),
torch's own `FakeGuardImpl<CUDA>` (what `c10::impl::ensureCUDADeviceGuardSet` installs on a CUDA build
without a device) and CUDA hooks; it changes global torch state, so the simulation always runs in a subprocess.
Reads of device values (the loss the loop logs, GradScaler's found-inf flag) have no value on a
fake device: they read 0 (finite gradients, the optimizer steps: the steady state). The autograd
engine runs single-threaded. bf16 autocast asks `torch.cuda.is_bf16_supported()`, True on every
GPU of `budget.DEVICES` (a T4, sm_75, emulates bf16); it is answered so. Without a C++ compiler
or torch's headers, `SimulationUnavailable` says the backward pass cannot be simulated here.
Every figure is simulated: the CUDA context, kernel scratch and real timing are outside it.
"""
from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass, field

from nblib.budget.devices import Device, gpu_preset
from nblib.budget.shim import SHIM_SOURCE, SimulationUnavailable, backward_capability, run_child, shim_path
from nblib.config import ModelConfig
from nblib.errors import ConfigError, require_choice

LABEL = "simulated"
PRECISIONS = ("fp16", "bf16", "fp32")
STEPS = 3
__all__ = ["SHIM_SOURCE", "STEPS", "SimulatedStep", "SimulationUnavailable", "backward_capability", "shim_path",
           "simulate_train_step"]


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
    kernels: tuple = field(default=(), repr=False)   # the last step's kernels (budget.trace.Kernel)
    label: str = LABEL

    def step_seconds(self, device: str | Device | None = None) -> float:
        """The last step's roofline time on `device` (default: the simulated GPU); simulated."""
        from nblib.simulate.roofline import roofline

        return roofline(self.kernels, self.batch_size, device or self.gpu).seconds


def simulate_train_step(model: ModelConfig, batch_size: int, gpu: str | Device = "t4", *,
                        precision: str = "fp16", n_classes: int = 12, steps: int = STEPS,
                        audit: bool = False, timeout_s: float = 600.0) -> SimulatedStep:
    """Run the loop's `train_step` `steps` times on a simulated `gpu` (in a fresh process)."""
    from nblib.budget.trace import Kernel

    dev = gpu_preset(gpu)
    require_choice("precision", precision, PRECISIONS)
    if steps < 2:
        raise ConfigError(f"steps={steps}: AdamW's moments exist only after the first step; use >= 2")
    shim_path()                            # SimulationUnavailable here (a CUDA build, no compiler) names why
    payload = {"model": model.__dict__, "batch": batch_size, "gpu": dev.name, "cc": dev.compute_capability,
               "precision": precision, "classes": n_classes, "steps": steps, "audit": audit,
               "train": True}         # a training step: the CUBLAS_WORKSPACE_CONFIG training runs with, as the budget's
    out = run_child(__name__, payload, timeout_s=timeout_s)
    kernels = tuple(Kernel(*k) for k in out.pop("kernels"))
    return SimulatedStep(model=model, batch_size=batch_size, gpu=dev.name, precision=precision, steps=steps,
                         kernels=kernels, peak_shape=tuple(out.pop("peak_shape")), **out)


# ---------------------------------------------------------------- the child process
def _child(payload: dict) -> dict:
    """In a fresh process: load the shim, then torch, then run the steps. The result as JSON-able data."""
    from nblib.budget.shim import load_shim

    load_shim(payload)                     # before torch: its CUDA hooks are chosen when torch starts
    from nblib.train.task import loop_module
    from nblib.train.traced import traced_train_step

    model, b = ModelConfig(**payload["model"]), payload["batch"]
    net = loop_module(model, payload["classes"])            # as the loop builds it
    last: dict = {}

    def before_last(trace, optimizer, scaler):           # the last step: its kernels, and the audit around it
        last["kernels"] = len(trace.kernels)
        last["audit"] = _Audit(trace, net, optimizer, scaler, b) if payload["audit"] else None
        return last["audit"] or contextlib.nullcontext()

    trace, weights, _ = traced_train_step(net, b, model.image_size, payload["precision"], payload["cc"],
                                          payload["steps"], before_last)
    audit = last["audit"]
    resident = trace.live                  # live at the end of the last step (its optimizer still held)
    backend = max(trace.sdpa_used, key=trace.sdpa_used.get) if trace.sdpa_used else "none"
    return {"sdpa_backend": backend, "max_live": trace.max_live, "max_allocated": trace.allocator.max_allocated,
            "max_reserved": trace.allocator.max_reserved, "weights": weights, "resident": resident,
            "peak_op": trace.peak.op, "peak_shape": list(trace.peak.shape),
            "audit_traced": audit.traced if audit else 0, "audit_counted": audit.counted if audit else 0,
            "audit_saved": audit.saved_bytes if audit else 0,
            "kernels": [[k.op, k.flops, k.bytes, k.dtype, k.tensor_core] for k in trace.kernels[last["kernels"]:]]}


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
        self.counted = sum(held.values()) + labels + self.trace.workspace_bytes   # one per cuBLAS handle


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
