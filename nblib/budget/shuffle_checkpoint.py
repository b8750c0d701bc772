"""tf.data shuffle checkpoints: their size, the disk a save peaks at, and the RAM a restore adds.

A tf.data iterator checkpoint of a pipeline shuffled with `Dataset.shuffle` writes every element
buffered in the shuffle and in prefetch: (buffer + prefetch x batch) x sample bytes (TensorFlow's
buffer-free shuffles and nblib's write a cursor instead: notebook 04). TensorFlow writes the data
file once and renames it, so a first save peaks at 1x the checkpoint on disk; a save that replaces
a previous checkpoint (CheckpointManager(max_to_keep=1)) holds both until the new one is complete:
2x. Notebook 04 measures both with real TensorFlow (`tests/test_tfdata.py` ties them to this
model). A restore rebuilds the buffer beside the loaded tensors: +1x the buffer in RAM while it runs.
"""
from __future__ import annotations

from dataclasses import dataclass

from nblib.budget._checks import require_positive

REFERENCE_BUFFERS = (100, 1_000, 10_000, 50_000, 100_000, 250_000, 400_000)
RESTORE_RAM_FACTOR = 1.0   # extra RAM while restoring, x the buffer (measured, TF 2.21, CPU)


def checkpoint_disk_peak(bytes_per_checkpoint: int, keep_previous: bool) -> int:
    """Peak disk during one checkpoint save: the new checkpoint, plus the previous one if it is kept."""
    require_positive("bytes_per_checkpoint", bytes_per_checkpoint, minimum=0)
    return bytes_per_checkpoint * (2 if keep_previous else 1)


def checkpoint_ram_peak(buffer_bytes: int) -> int:
    """Peak RAM of holding a shuffle buffer and restoring it: the buffer + RESTORE_RAM_FACTOR x it."""
    require_positive("buffer_bytes", buffer_bytes, minimum=0)
    return int(buffer_bytes * (1 + RESTORE_RAM_FACTOR))


@dataclass(frozen=True)
class ShuffleCheckpoint:
    """Size of a tf.data checkpoint that saves a shuffle buffer, and the disk its save needs."""

    buffer_size: int
    sample_bytes: int
    prefetch: int
    checkpoint_bytes: int
    peak_disk_first_save: int       # checkpoint_disk_peak(keep_previous=False): 1x
    peak_disk_keeping_previous: int  # checkpoint_disk_peak(keep_previous=True): 2x
    restore_ram_bytes: int          # checkpoint_ram_peak of the buffered elements


def shuffle_checkpoint(buffer_size: int, sample_bytes: int = 500_000, prefetch: int = 2,
                       batch_size: int = 1) -> ShuffleCheckpoint:
    """With `Dataset.shuffle`, tf.data saves every element buffered: (buffer + prefetch x batch) x sample."""
    require_positive("buffer_size", buffer_size)
    require_positive("sample_bytes", sample_bytes)
    require_positive("prefetch", prefetch, minimum=0)
    require_positive("batch_size", batch_size)
    ckpt = (buffer_size + prefetch * batch_size) * sample_bytes
    return ShuffleCheckpoint(buffer_size, sample_bytes, prefetch, ckpt,
                             checkpoint_disk_peak(ckpt, keep_previous=False),
                             checkpoint_disk_peak(ckpt, keep_previous=True),
                             checkpoint_ram_peak(ckpt))


def shuffle_checkpoint_table(buffers=REFERENCE_BUFFERS, sample_bytes: int = 500_000,
                             prefetch: int = 2) -> list[ShuffleCheckpoint]:
    """One `shuffle_checkpoint` per shuffle buffer size."""
    return [shuffle_checkpoint(b, sample_bytes, prefetch) for b in buffers]
