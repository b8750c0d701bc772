"""The simulated T4: the real encoder code on a fake CUDA device, an allocator model, a roofline.

No GPU is lent to this project, so the GPU half is checked here by the most faithful means a CPU
has: `simulate_encode` runs nblib.trm and the encode loop's device-side steps under
FakeTensorMode on a fake `cuda:0` (CUDA autocast rules included), counts every device storage,
replays allocations through a model of PyTorch's caching allocator (`nblib.budget.allocator`,
shared with the budget's VRAM replay), and times each kernel on a roofline of any GPU in
`nblib.budget.DEVICES` (`roofline`). Every figure it returns is labelled "simulated". What a
simulation cannot see: the CUDA context (300-500 MB on a T4), kernel-internal scratch besides
cuBLAS's workspace, launch overheads and real clocks.
`simulate_train_step` runs the training loop's own step (forward, backward, GradScaler, AdamW)
the same way, in a fresh process with a small C++ shim (see `nblib.simulate.train`).
`simulate_model` does both for any model (nblib.models): the encode loop's HostPart or nblib.train's
train_step on the model with a head. The tracing machinery itself lives in nblib.budget.trace (the
budget traces models with it and may not import the simulation); `fake_cuda` and `DeviceTrace` are its.
Importing this package is light; torch loads with `simulate_encode`.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "simulate_encode": "nblib.simulate.encode", "SimulatedRun": "nblib.simulate.encode",
    "LABEL": "nblib.simulate.encode",
    "simulate_train_step": "nblib.simulate.train", "SimulatedStep": "nblib.simulate.train",
    "SimulationUnavailable": "nblib.simulate.train",
    "simulate_model": "nblib.simulate.model", "SimulatedModelRun": "nblib.simulate.model",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nblib.simulate' has no attribute {name!r}")
