"""torch-side measuring: the exact peak bytes of live tensors, and a device sync before reading a clock.

torch is imported inside the functions only, so `import nblib.measure` never loads torch.
Trade-off of `TensorPeak`: exact and allocator-independent, but blind to a kernel's internal scratch.
"""
from __future__ import annotations

import weakref


class TensorPeak:
    """Context manager: exact peak bytes of torch tensors created inside it and still alive.

    A TorchDispatchMode sees every tensor an op returns and a finalizer sees its storage freed,
    so the peak is exact and independent of the allocator (no RSS noise, no CUDA cache). It
    misses buffers a kernel allocates internally and frees before returning.
    """

    def __init__(self):
        self.current = self.peak = 0
        self._live: dict[int, int] = {}
        self._mode = None

    def __enter__(self) -> TensorPeak:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self

        class _Track(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if hasattr(t, "untyped_storage"):
                        tracker._add(t.untyped_storage())
                return out

        self._mode = _Track()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def _add(self, storage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._live:
            return
        self._live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)


def synchronize(device) -> None:
    """Wait for `device`'s queued kernels (CUDA), so a clock read after it times the work; no-op on CPU.

    `device`: a torch.device or its name ("cuda:0", "cpu").
    """
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
