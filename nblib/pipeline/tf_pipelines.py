"""tf.data pipelines with the tuning log's knobs, and the 4-source mixing slowdown with its fix.

The pipeline is the reference's shape: sources (lists of PNG-encoded images held in RAM) ->
interleave(cycle_length) -> map(decode, num_parallel_calls) -> shuffle(buffer) -> batch ->
prefetch, repeated forever. A knob value of -1 is tf.data.AUTOTUNE. Trade-off: the encoded
images sit in RAM, so the sweep measures decode and tf.data's own overheads, not disk reads
(the torch sweep over the sharded cache reads disk). TensorFlow is imported inside functions.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from nblib.errors import ConfigError, require_choice
from nblib.pipeline.harness import check_knobs
from nblib.tfdata import tensorflow

AUTOTUNE = -1
MIXING_STRATEGIES = ("single", "sample_from_datasets", "interleave")


@dataclass(frozen=True)
class EncodedSources:
    """Images as PNG bytes in RAM, split into `n` contiguous sources (the "files" a pipeline reads)."""

    blobs: tuple[bytes, ...]
    bounds: tuple[int, ...]      # source k holds blobs[bounds[k]:bounds[k + 1]]
    image_size: int

    @property
    def n_sources(self) -> int:
        return len(self.bounds) - 1

    @property
    def stored_bytes(self) -> int:
        return sum(len(b) for b in self.blobs)

    def __len__(self) -> int:
        return len(self.blobs)


def encoded_sources(images: Iterable[np.ndarray], n_sources: int = 4) -> EncodedSources:
    """PNG-encode uint8 [H, W, 3] images and cut them into `n_sources` contiguous sources."""
    from nblib.cache import encode_image

    blobs = tuple(encode_image(np.asarray(im), "png") for im in images)
    if len(blobs) < n_sources:
        raise ConfigError(f"{len(blobs)} images cannot fill {n_sources} sources; give at least {n_sources}")
    bounds = tuple(int(b) for b in np.linspace(0, len(blobs), n_sources + 1).round())
    # the image size: the first PNG's width, bytes 16-20 of its IHDR chunk
    return EncodedSources(blobs=blobs, bounds=bounds, image_size=int.from_bytes(blobs[0][16:20], "big"))


def tf_pipeline_for(sources: EncodedSources, seed: int = 0):
    """A pipeline factory for `sweep`: knobs in, Dataset out (TensorFlow imported now, not in the first run)."""
    tensorflow()

    def make(batch_size: int = 32, prefetch: int = 2, num_parallel_calls: int = 2, cycle_length: int = 4,
             shuffle_buffer: int = 256, deterministic: bool = True):
        return tf_pipeline(sources, batch_size, prefetch, num_parallel_calls, cycle_length, shuffle_buffer,
                           deterministic, seed)

    return make


def tf_pipeline(sources: EncodedSources, batch_size: int = 32, prefetch: int = 2, num_parallel_calls: int = 2,
                cycle_length: int = 4, shuffle_buffer: int = 256, deterministic: bool = True, seed: int = 0):
    """The swept pipeline: interleave(cycle_length) -> decode(num_parallel_calls) -> shuffle -> batch -> prefetch."""
    check_knobs(("batch_size", batch_size, 1), ("cycle_length", cycle_length, 1), ("shuffle_buffer", shuffle_buffer, 0),
                ("prefetch", prefetch, -1), ("num_parallel_calls", num_parallel_calls, -1))
    tf = tensorflow()
    cycle = min(cycle_length, sources.n_sources)
    reading = _parallel(num_parallel_calls if num_parallel_calls == AUTOTUNE else min(num_parallel_calls, cycle), tf)
    decoding = _parallel(num_parallel_calls, tf)
    ds = tf.data.Dataset.range(sources.n_sources).repeat().interleave(
        _source_reader(sources, tf), cycle_length=cycle, block_length=1, num_parallel_calls=reading,
        **_order(reading, deterministic))
    ds = ds.map(_decode(tf), num_parallel_calls=decoding, **_order(decoding, deterministic))
    return _shuffle_batch_prefetch(ds, shuffle_buffer, batch_size, prefetch, seed, tf)


def mixed_pipeline(sources: EncodedSources, strategy: str = "sample_from_datasets", *, num_parallel_calls: int = 2,
                   batch_size: int = 32, prefetch: int = 2, seed: int = 0):
    """The same images as one dataset, as the reference mixed n sources, or as the fix mixes them.

    "single": all images in one dataset, decoded with the whole parallelism budget (the baseline).
    "sample_from_datasets": each source decodes with budget / n, then `sample_from_datasets`
    draws from them (the reference's setup: each source's parallelism divided by n).
    "interleave": the fix; the encoded records of the n sources are interleaved first (cheap),
    then decoded once with the whole budget.
    """
    require_choice("strategy", strategy, MIXING_STRATEGIES)
    tf = tensorflow()
    n, decode, budget = sources.n_sources, _decode(tf), _parallel(num_parallel_calls, tf)
    read = None if strategy == "single" else _source_reader(sources, tf)   # its copy of the blobs
    if strategy == "single":
        everything = tf.data.Dataset.from_tensor_slices(tf.constant(list(sources.blobs), dtype=tf.string))
        ds = everything.repeat().map(decode, num_parallel_calls=budget)
    elif strategy == "sample_from_datasets":
        share = _parallel(max(1, num_parallel_calls // n) if num_parallel_calls > 0 else num_parallel_calls, tf)
        decoded = [read(k).repeat().map(decode, num_parallel_calls=share) for k in range(n)]
        ds = tf.data.Dataset.sample_from_datasets(decoded, weights=[1 / n] * n, seed=seed)
    else:
        ds = tf.data.Dataset.range(n).repeat().interleave(read, cycle_length=n, block_length=1)
        ds = ds.map(decode, num_parallel_calls=budget)
    return _shuffle_batch_prefetch(ds, 0, batch_size, prefetch, seed, tf)


# ------------------------------------------------------------------------------ helpers


def _parallel(value: int, tf):
    """A num_parallel_calls knob as tf.data takes it: -1 AUTOTUNE, 0 or 1 sequential (None)."""
    return tf.data.AUTOTUNE if value == AUTOTUNE else (int(value) if value > 1 else None)


def _order(parallel, deterministic: bool) -> dict:
    """tf.data takes `deterministic` only beside a num_parallel_calls (it warns otherwise)."""
    return {} if parallel is None else {"deterministic": bool(deterministic)}


def _source_reader(sources: EncodedSources, tf):
    """index k (a tensor) -> the records of source k, sliced out of one constant of all blobs."""
    blobs = tf.constant(list(sources.blobs), dtype=tf.string)
    bounds = tf.constant(sources.bounds, dtype=tf.int64)
    return lambda k: tf.data.Dataset.from_tensor_slices(blobs[bounds[k]:bounds[k + 1]])


def _decode(tf):
    return lambda blob: tf.io.decode_png(blob, channels=3)


def _shuffle_batch_prefetch(ds, shuffle_buffer: int, batch_size: int, prefetch: int, seed: int, tf):
    if shuffle_buffer:
        ds = ds.shuffle(shuffle_buffer, seed=seed)
    ds = ds.batch(batch_size, drop_remainder=True)
    if prefetch:
        ds = ds.prefetch(tf.data.AUTOTUNE if prefetch == AUTOTUNE else prefetch)
    return ds
