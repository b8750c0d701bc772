"""Getting batches onto the device and outputs off it: the fixed-batch loader and `HostPart`.

Outputs leave the device per batch (async copies into pinned host memory, `offload="async"`, the
default) or every `consolidate_every` batches (`offload="consolidate"`); either way the device
holds a bounded number of batches of outputs, whatever the run's length. The loader yields the
run's fixed batches in order, read ahead by worker processes and pinned on CUDA.
"""
from __future__ import annotations

import numpy as np
import torch

from nblib.encode.protocols import ImageSource


def batch_loader(cache: ImageSource, batches: list[tuple[int, int]], workers: int, prefetch: int,
                 pin_memory: bool) -> torch.utils.data.DataLoader:
    """A DataLoader yielding the given batches in order (workers read ahead, pinned on CUDA)."""
    kwargs = dict(num_workers=workers, pin_memory=pin_memory, batch_size=None, shuffle=False)
    if workers > 0:
        kwargs.update(prefetch_factor=prefetch, persistent_workers=False)
    return torch.utils.data.DataLoader(BatchDataset(cache, batches), **kwargs)


class BatchDataset(torch.utils.data.Dataset):
    """Item i is the uint8 tensor of the i-th (start, stop) batch of a cache: fixed batches."""

    def __init__(self, cache: ImageSource, batches: list[tuple[int, int]]):
        self.cache = cache
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> torch.Tensor:
        start, stop = self.batches[i]
        return torch.from_numpy(np.ascontiguousarray(self.cache.get_batch(start, stop)))


class HostPart:
    """Host buffers for one part's outputs, filled batch by batch from the device.

    "async": each batch's outputs are cast on the device and copied with non_blocking into
    pinned host memory; one event marks when the last copy landed. "consolidate": `every`
    batches are kept on the device, concatenated, then copied at once. Either way the device
    holds at most `every` batches of outputs, whatever the run's length.
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], part_samples: int, dtype: str,
                 device: torch.device, mode: str = "async", every: int = 1):
        self.mode, self.every, self.device = mode, max(1, every), device
        self.dtype = getattr(torch, dtype)
        pin = device.type == "cuda"
        self.host = {n: torch.empty((part_samples, *s), dtype=self.dtype, pin_memory=pin)
                     for n, s in shapes.items()}
        self.pending: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.event = None

    def add(self, outputs: dict[str, torch.Tensor], offset: int) -> None:
        """Take one batch's outputs, which belong at rows [offset, offset + batch) of the part."""
        cast = {n: outputs[n].to(self.dtype) for n in self.host}
        if self.mode == "async":
            self._copy(cast, offset)
        else:
            self.pending.append((offset, cast))
            if len(self.pending) >= self.every:
                self._flush_pending()

    def arrays(self, n: int) -> dict[str, np.ndarray]:
        """The first n rows of every output as numpy, once every copy has landed."""
        self._flush_pending()
        if self.event is not None:
            self.event.synchronize()
        return {name: buf[:n].numpy() for name, buf in self.host.items()}

    def _flush_pending(self) -> None:
        if not self.pending:
            return
        offset = self.pending[0][0]
        joined = {n: torch.cat([out[n] for _, out in self.pending]) for n in self.host}
        self.pending.clear()
        self._copy(joined, offset)

    def _copy(self, tensors: dict[str, torch.Tensor], offset: int) -> None:
        for name, t in tensors.items():
            self.host[name][offset:offset + t.shape[0]].copy_(t, non_blocking=True)
        if self.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()
