"""The fake CUDA device of the simulated T4: re-exported from nblib.budget.trace, where it lives.

The budget traces a model's own code with the same machinery (nblib.budget.model_vram), and the
budget may not import the simulation, so the machinery sits in the budget's layer.
"""
from __future__ import annotations

from nblib.budget.trace import (
    CUBLAS_WORKSPACE,
    SDPA_KERNELS,
    SDPA_PRIORITY,
    WORKSPACE_POSITIONS,
    DeviceTrace,
    Kernel,
    PeakOp,
    fake_cuda,
    replay_events,
)

__all__ = ["CUBLAS_WORKSPACE", "SDPA_KERNELS", "SDPA_PRIORITY", "WORKSPACE_POSITIONS", "DeviceTrace", "Kernel",
           "PeakOp", "fake_cuda", "replay_events"]
