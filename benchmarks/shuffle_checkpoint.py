"""Shuffle checkpoints and throughput: tf.data's shuffle buffer against the resumable shuffle, side by side.

For buffers of 100, 1,000 and 10,000 samples of 150 kB (224 x 224 x 3 uint8, random bytes):
  - tf.data: iterator checkpoint bytes and save seconds (plain and symbolic), via tf.train.Checkpoint;
  - resumable: the JSON state of ResumableShuffleBuffer (bytes, save seconds, atomic write) and
    the tf.train.Checkpoint of the resumable tf.data pipeline (nblib.tfdata.indexed_dataset);
  - the ratios, and the check "state <= 8 bytes x buffer + 4 KB" (the state holds indices, never
    samples, so the sample size does not enter it).
Then shuffle throughput (samples/s) of the resumable shuffle and of tf.data's shuffle over the same in-memory
source, one sample at a time and in batches, with their ratio (reported, not asserted).
Measurements run one at a time; the largest tf.data buffer holds 1.5 GB in RAM.

    .venv/bin/python benchmarks/shuffle_checkpoint.py            # the full run (~2-4 min)
    .venv/bin/python benchmarks/shuffle_checkpoint.py --quick    # small sizes, for a smoke check
"""
from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nblib import shuffle, tfdata
from nblib.lab import shuffle_checkpoints as lab


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buffers", type=int, nargs="+", default=[100, 1_000, 10_000])
    parser.add_argument("--sample-kb", type=float, default=150.0)
    parser.add_argument("--throughput-n", type=int, default=4_000, help="samples in the in-memory source")
    parser.add_argument("--throughput-buffer", type=int, default=1_000)
    parser.add_argument("--quick", action="store_true", help="buffers 100 and 1,000, 16 kB samples")
    args = parser.parse_args(argv)
    if args.quick:
        args.buffers, args.sample_kb, args.throughput_n = [100, 1_000], 16.0, 2_000
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nblib-bench-") as folder:
        checkpoints(args.buffers, args.sample_kb, Path(folder))
        throughput(args.throughput_n, args.throughput_buffer, args.sample_kb)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


def checkpoints(buffers: list[int], sample_kb: float, folder: Path) -> None:
    """Print tf.data vs resumable, bytes and seconds, with ratios and the 8 B x buffer + 4 KB check."""
    spec = tfdata.PipelineSpec(sample_kb=sample_kb)
    print(f"== checkpoints: samples {spec.image_shape} uint8 = {spec.sample_bytes:,} B, random content")
    tf_rows, resumable_rows = [], []
    for b in buffers:  # one buffer at a time: the largest holds buffer x sample bytes in RAM
        tf_rows += lab.measure_checkpoint([b], sample_kb, symbolic=(False, True), folder=folder)
        resumable_rows += lab.measure_checkpoint([b], sample_kb, resumable="buffer", folder=folder)
    state_rows = lab.measure_state_checkpoint(buffers, folder=folder)
    print(lab.checkpoint_table(tf_rows + resumable_rows))
    print()
    print(lab.checks_table(lab.disk_model_checks(tf_rows)))
    print()
    print(f"{'buffer':>7} | {'tf.data B':>14} {'save s':>7} | {'JSON B':>11} {'save s':>7} | "
          f"{'bytes ratio':>11} {'save ratio':>10} | {'resumable B':>14} | {'<= 8B x buffer + 4KB':>20}")
    for b in buffers:
        tf_row = next(r for r in tf_rows if r.buffer_size == b and not r.symbolic)
        resumable = next(r for r in resumable_rows if r.buffer_size == b)
        state = next(r for r in state_rows if r.buffer_size == b)
        print(f"{b:>7,} | {tf_row.bytes_on_disk:>14,} {tf_row.save_s:>7.3f} | {state.state_bytes:>11,} "
              f"{state.save_s:>7.3f} | {tf_row.bytes_on_disk / state.state_bytes:>10,.0f}x "
              f"{tf_row.save_s / state.save_s:>9.1f}x | {resumable.bytes_on_disk:>14,} | "
              f"{state.state_bytes:,} <= {state.bound_bytes:,}: {'OK' if state.within_bound else 'FAIL'}")
    print(f"exact resume, every row: {all(r.exact_resume for r in tf_rows + resumable_rows + state_rows)}")
    print("the resumable state holds indices, never samples: its bytes do not depend on the sample size")


def throughput(n: int, buffer_size: int, sample_kb: float) -> None:
    """Print samples/s of the resumable shuffle and of tf.data's shuffle over one in-memory source, and ratios."""
    print(f"\n== throughput: {n:,} samples of {sample_kb:g} kB in memory, buffer {buffer_size:,}")
    for batch_size in (0, 64):
        rows = shuffle_throughput(n, buffer_size, sample_kb, batch_size=batch_size)
        by = {r.name: r for r in rows}
        mode = "one sample at a time" if not batch_size else f"batches of {batch_size}"
        print(f"{mode}:")
        for r in rows:
            print(f"  {r.name:<20} {r.samples_per_s:>12,.0f} samples/s  ({r.samples:,} in {r.seconds:.2f} s)")
        base = by["tf.data shuffle"].samples_per_s
        print(f"  ratio resumable (Python) / tf.data shuffle: {by['resumable (Python)'].samples_per_s / base:.1f}x;"
              f" resumable in tf.data / tf.data shuffle: {by['resumable in tf.data'].samples_per_s / base:.2f}x")


@dataclass(frozen=True)
class ThroughputRow:
    """Samples per second of one shuffle over the same in-memory source, iterated from Python."""

    name: str
    buffer_size: int
    sample_bytes: int
    samples: int
    seconds: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else float("nan")


def in_memory_shuffles(source: np.ndarray, buffer_size: int, seed: int, batch_size: int = 0) -> dict:
    """tf.data's shuffle and nblib's buffer shuffle (indices gathered in TF) over one in-memory uint8 array."""
    tf = tfdata.tensorflow()
    with tf.device("/CPU:0"):
        constant = tf.constant(source)
    tf_ds = tf.data.Dataset.from_tensor_slices(constant).shuffle(buffer_size, seed=seed)
    indexed_ds = tfdata.index_dataset(tfdata.make_shuffle(len(source), buffer_size, seed, "buffer"))
    if batch_size:
        tf_ds, indexed_ds = tf_ds.batch(batch_size), indexed_ds.batch(batch_size)
    return {tfdata.TF_SHUFFLE: tf_ds, "resumable in tf.data": indexed_ds.map(lambda i: tf.gather(constant, i))}


def shuffle_throughput(n: int, buffer_size: int, sample_kb: float, *, batch_size: int = 0,
                       seed: int = 0) -> list[ThroughputRow]:
    """ResumableShuffleBuffer from Python, tf.data's shuffle, and it in tf.data over one in-memory source.

    The source is a uint8 array [n, sample bytes] of random bytes, iterated from Python one
    sample at a time (`batch_size=0`) or in batches. Unbatched, the Python shuffle yields
    `source[i]` (a view, as a memory-mapped cache would) while tf.data copies each sample into its
    buffer and into an EagerTensor, so the ratio is mostly per-element overhead; batched, both copy
    every sample. Dataset construction is not timed; the first element is.
    """
    sample_bytes = tfdata.PipelineSpec(sample_kb=sample_kb).sample_bytes
    source = np.random.default_rng(seed).integers(0, 256, size=(n, sample_bytes), dtype=np.uint8)
    order = tfdata.make_shuffle(n, buffer_size, seed, "buffer")
    t0 = time.perf_counter()
    if batch_size:
        count = sum(len(source[chunk]) for chunk in _chunks(iter(order), batch_size))
    else:
        count = sum(1 for _ in shuffle.iter_samples(source, order))
    rows = [ThroughputRow("resumable (Python)", buffer_size, sample_bytes, count, time.perf_counter() - t0)]
    datasets = in_memory_shuffles(source, buffer_size, seed, batch_size)
    del source
    for name, ds in datasets.items():
        t0 = time.perf_counter()
        count = sum(int(x.shape[0]) if batch_size else 1 for x in ds)
        rows.append(ThroughputRow(name, buffer_size, sample_bytes, count, time.perf_counter() - t0))
    return rows


def _chunks(iterator, size: int):
    """Lists of up to `size` items from `iterator`."""
    while chunk := [x for _, x in zip(range(size), iterator)]:
        yield chunk


if __name__ == "__main__":
    raise SystemExit(main())
