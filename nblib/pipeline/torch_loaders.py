"""torch DataLoaders over an image source with the knobs a sweep turns, and the per-worker TF trap.

`cache_loader_for(source)` is a sweep factory: (batch_size, num_workers, prefetch_factor,
pin_memory, persistent_workers) -> an endless iterator of uint8 batches, epoch after epoch, as
a training loop sees them (so `persistent_workers` shows what it saves: respawning workers at
every epoch). Batches are contiguous slices read by `get_batch` in the workers (encode's
`BatchDataset`), as encode reads.
`tf_in_workers_loader` is the trap the tuning log hit: every worker builds its own tf.data
pipeline (its own TensorFlow, its own buffers), so RAM grows with num_workers. This module
imports torch (`nblib.pipeline` itself does not); TensorFlow only runs in the workers that build it.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from nblib.encode.offload import batch_loader
from nblib.pipeline.harness import check_knobs


def cache_loader_for(source):
    """A pipeline factory for `sweep` over an ImageSource (a ShardedImageCache, a rendered source)."""

    def make(batch_size: int = 32, num_workers: int = 0, prefetch_factor: int = 2, pin_memory: bool = False,
             persistent_workers: bool = False):
        return repeated(cache_loader(source, batch_size, num_workers, prefetch_factor, pin_memory,
                                     persistent_workers))

    return make


def cache_loader(source, batch_size: int = 32, num_workers: int = 0, prefetch_factor: int = 2,
                 pin_memory: bool = False, persistent_workers: bool = False, context: str | None = None):
    """A DataLoader of the source's contiguous batches of `batch_size` (the last one may be short)."""
    check_knobs(("batch_size", batch_size, 1), ("num_workers", num_workers, 0), ("prefetch_factor", prefetch_factor, 1))
    batches = [(s, min(s + batch_size, len(source))) for s in range(0, len(source), batch_size)]
    return batch_loader(source, batches, num_workers, prefetch_factor, bool(pin_memory) and torch.cuda.is_available(),
                        bool(persistent_workers), context)


def repeated(loader, epochs: int | None = None):
    """The loader's batches, epoch after epoch (forever when epochs is None)."""
    for _ in itertools.count() if epochs is None else range(epochs):
        yield from loader


class TFPipelineInWorker(torch.utils.data.IterableDataset):
    """An iterable dataset whose every DataLoader worker builds its own tf.data pipeline: the trap.

    `build()` runs inside each worker (importing TensorFlow there); the worker then yields its
    pipeline's first `batches_per_worker` batches as tensors. Use the "spawn" context: TensorFlow
    does not survive a fork of a process that already runs it.
    """

    def __init__(self, build, batches_per_worker: int):
        self.build, self.batches_per_worker = build, batches_per_worker

    def __iter__(self):
        for batch in itertools.islice(self.build(), self.batches_per_worker):
            yield torch.from_numpy(np.array(batch))   # a writable copy of the TF tensor


def tf_in_workers_loader(build, num_workers: int, batches_per_worker: int = 8, prefetch_factor: int = 2):
    """A DataLoader whose `num_workers` spawned workers each build and run their own tf.data pipeline."""
    kwargs = {"num_workers": num_workers, "batch_size": None}
    if num_workers > 0:
        kwargs.update(prefetch_factor=prefetch_factor, multiprocessing_context="spawn")
    return torch.utils.data.DataLoader(TFPipelineInWorker(build, batches_per_worker), **kwargs)
