"""torch-side measuring: a device sync before reading a clock.

torch is imported inside the function only, so `import nblib.measure` never loads torch.
"""
from __future__ import annotations


def synchronize(device) -> None:
    """Wait for `device`'s queued kernels (CUDA), so a clock read after it times the work; no-op on CPU.

    `device`: a torch.device or its name ("cuda:0", "cpu").
    """
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
