"""Getting batches onto the device and outputs off it: the fixed-batch loader and `HostPart`.

Outputs leave the device per batch (async copies into pinned host memory, `offload="async"`, the
default) or every `consolidate_every` batches (`offload="consolidate"`); either way the device
holds a bounded number of batches of outputs, whatever the run's length. The loader yields the
run's fixed batches in order, read ahead by worker processes and pinned on CUDA.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from nblib.encode.protocols import ImageSource


def batch_loader(cache: ImageSource, batches: list[tuple[int, int]], workers: int, prefetch: int,
                 pin_memory: bool, persistent: bool = False, context: str | None = None) -> torch.utils.data.DataLoader:
    """A DataLoader yielding the given batches in order (workers read ahead, pinned on CUDA)."""
    kwargs = dict(num_workers=workers, pin_memory=pin_memory, batch_size=None, shuffle=False)
    if workers > 0:
        kwargs.update(prefetch_factor=prefetch, persistent_workers=persistent, multiprocessing_context=context)
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
        self.host = self._host_buffers(shapes, part_samples)
        self.pending: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.event = None

    def add(self, outputs: dict[str, torch.Tensor], offset: int) -> None:
        """Take one batch's outputs, which belong at rows [offset, offset + batch) of the part."""
        # consolidate keeps the batch on the device: copy=True, because `.to` returns the very
        # tensor when the dtype already matches, and a CUDA-graph replay (compile_mode
        # "reduce-overhead") overwrites its outputs in place on the next batch
        keep = self.mode != "async"
        cast = {n: outputs[n].to(self.dtype, copy=keep) for n in self.host}
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
        self._mark_copied()

    def _host_buffers(self, shapes: dict[str, tuple[int, ...]], rows: int) -> dict[str, torch.Tensor]:
        """Every output's rows carved out of one host block.

        One block, not one per output: PyTorch's caching host allocator rounds each pinned
        allocation up to a power of two, so three buffers of a seed_t4 part (3.57 GB) would pin
        5.4 GB of RAM, one block of them 4.29 GB (nblib.budget.pinned_bytes).
        """
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        sizes = {n: rows * int(np.prod(s, dtype=np.int64)) * itemsize for n, s in shapes.items()}
        block = self._host_buffer((sum(sizes.values()),), torch.uint8)
        out, offset = {}, 0
        for name, shape in shapes.items():
            out[name] = block[offset:offset + sizes[name]].view(self.dtype).view(rows, *shape)
            offset += sizes[name]
        return out

    def _host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A part's host buffer: pinned on CUDA, so the device-to-host copies run asynchronously."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.device.type == "cuda")

    def _mark_copied(self) -> None:
        """Record an event after the copies just queued, on the stream of *this part's* device.

        `torch.cuda.Event().record()` with no stream records on the current device's stream:
        with --device cuda:1 and no torchrun that is cuda:0, and `arrays` would return before
        the copies landed.
        """
        if self.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(self.device))


class BatchClock:
    """When each batch's work finished: the encode timeline, true on CUDA too.

    On CUDA, work is queued: reading the clock after `encode` gives the time the batch was
    *enqueued*. So on CUDA each mark records a timing event on the device's stream, and the
    times are read once the events completed (`series`, called after a part's copies landed);
    on CPU a mark reads the clock at once. No mark synchronizes the device.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.started = time.perf_counter()
        self._marks: list[tuple[object, int]] = []
        if self.cuda:
            self._start = self._event()

    def mark(self, samples_done: int) -> None:
        """Note that the work queued so far covers `samples_done` samples."""
        self._marks.append((self._event() if self.cuda else time.perf_counter() - self.started, samples_done))

    def series(self) -> list[tuple[float, int]]:
        """(seconds since the clock started, samples done) per mark; waits for the last mark's event."""
        if not self.cuda:
            return list(self._marks)
        if self._marks:
            self._marks[-1][0].synchronize()
        return [(self._start.elapsed_time(event) / 1000.0, done) for event, done in self._marks]

    def _event(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event
