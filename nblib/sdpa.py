"""The attention (SDPA) backends by one set of names, shared by trm, measure, the budget and --sdpa.

PyTorch's scaled_dot_product_attention picks a kernel per call; forcing one (`sdpa_context`)
makes a measurement or a run reproducible. "math" materializes the scores; "efficient"
(memory-efficient), "flash" and "cudnn" do not. Flash and cuDNN attention need sm_80 or newer,
so a T4 (sm_75) runs "efficient" or "math". Importing this module does not import torch.
"""
from __future__ import annotations

SDPA_BACKENDS = ("math", "efficient", "flash", "cudnn")
# the oldest CUDA compute capability (sm_XY as XY) each backend's CUDA kernel runs on
SDPA_MIN_COMPUTE_CAPABILITY = {"math": 0, "efficient": 50, "flash": 80, "cudnn": 80}
_TORCH_NAMES = {"math": "MATH", "efficient": "EFFICIENT_ATTENTION", "flash": "FLASH_ATTENTION",
                "cudnn": "CUDNN_ATTENTION"}


def sdpa_context(name: str | None):
    """A fresh context manager forcing backend `name` (torch's sdpa_kernel), or a no-op for None."""
    import contextlib

    if name is None:
        return contextlib.nullcontext()
    from nblib.errors import require_choice

    require_choice("sdpa_backend", name, SDPA_BACKENDS)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, _TORCH_NAMES[name]))


def runs_on(name: str, compute_capability: int) -> bool:
    """True when backend `name` has a CUDA kernel for a GPU of this compute capability."""
    return compute_capability >= SDPA_MIN_COMPUTE_CAPABILITY[name]
