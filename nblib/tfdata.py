"""tf.data pipelines, what their iterator checkpoints hold, and nblib's shuffles as tf.data datasets.

A tf.data iterator checkpoint of a pipeline that shuffles with `Dataset.shuffle` stores every
element its shuffle buffer holds: buffer x sample bytes. `tf.data.Options().experimental_symbolic_checkpoint`
drops the buffers of map, batch, prefetch and interleave (they are recomputed on restore) but
still writes the shuffle buffer. TensorFlow's own buffer-free shuffles are built here too, beside
nblib's (`shuffle_pipeline(spec, method)`, `SHUFFLE_METHODS` says what each needs):
`tf.random.experimental.index_shuffle` (public) mapped over `range(n)`, and the global shuffle of
random-access datasets (`global_shuffle_op._global_shuffle`, private, TF >= 2.17; `None` from
`global_shuffle_op()` where it is missing).
The alternative, `indexed_dataset`, shuffles *indices* with nblib.shuffle and fetches each
sample by index in a map: with symbolic checkpointing its checkpoint is a cursor, whatever the
buffer. Trade-off: it needs a random-access source (fetch by index); tf.data's own shuffle works
on any stream. `measure_iterator_checkpoint` saves, rotates and restores a real iterator and
measures bytes, seconds, peak disk and RSS; `preflight_checkpoint` refuses a save that cannot fit
(nblib.budget's checkpoint model).

Samples are random bytes by default: TensorFlow compresses the elements it writes, so constant
images would hide the cost. Sizes are decimal (a 150 kB sample is a 224 x 224 x 3 uint8 image).
TensorFlow is imported inside functions only: `import nblib.tfdata` stays light (and never
imports torch).
"""
from __future__ import annotations

import contextlib
import copy
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import psutil

from nblib import shuffle
from nblib.budget import checkpoint_disk_peak, checkpoint_ram_peak
from nblib.disk import DiskPeak, disk_free, disk_usage
from nblib.errors import BudgetExceeded, ConfigError
from nblib.malloc import release_free_heap
from nblib.measure import PeakMemory
from nblib.units import GB, fmt_exception

__all__ = [
    "CONTENTS", "SHUFFLE_ALGORITHMS", "TF_SHUFFLE", "TF_GLOBAL_SHUFFLE", "TF_INDEX_SHUFFLE", "GLOBAL_SHUFFLE_SINCE",
    "ShuffleMethod", "SHUFFLE_METHODS", "PipelineSpec", "image_shape", "tensorflow", "synthetic_image", "sample_at",
    "source_dataset", "shuffle_pipeline", "method_unavailable", "global_shuffle_op", "indexed_dataset", "index_dataset",
    "make_shuffle", "resumable_shuffle_pipeline", "tf_shuffle_order", "one_op_pipelines",
    "CheckpointRow", "measure_iterator_checkpoint", "RoundTrip", "checkpoint_round_trip", "iterator_checkpoint_bytes",
    "preflight_checkpoint", "same_element",
]

CONTENTS = ("random", "constant")
SHUFFLE_ALGORITHMS = ("buffer", "global")
TF_SHUFFLE = "tf.data shuffle"
TF_GLOBAL_SHUFFLE = "tf.data global_shuffle"
TF_INDEX_SHUFFLE = "tf index_shuffle"
GLOBAL_SHUFFLE_SINCE = "2.17"


@dataclass(frozen=True)
class ShuffleMethod:
    """One way to shuffle a tf.data pipeline, and what it needs from the source and from TensorFlow."""

    name: str
    random_access: bool        # the source must be read by index (every op before the shuffle, for global_shuffle)
    known_size: bool           # n must be known before the first element
    since_tf: str              # the first TensorFlow that has it ("any": every TF 2)
    public: bool               # part of TensorFlow's public API
    same_order_outside_tf: bool  # numpy and torch give the same order (nblib.shuffle)


SHUFFLE_METHODS = {m.name: m for m in (
    ShuffleMethod(TF_SHUFFLE, False, False, "any", True, False),
    ShuffleMethod(TF_GLOBAL_SHUFFLE, True, True, GLOBAL_SHUFFLE_SINCE, False, False),
    ShuffleMethod(TF_INDEX_SHUFFLE, True, True, "2.9", True, False),
    ShuffleMethod("resumable (buffer)", True, True, "any", True, True),
    ShuffleMethod("resumable (global)", True, True, "any", True, True),
)}


@dataclass(frozen=True)
class PipelineSpec:
    """A reference-like pipeline: synthetic images -> [interleave] -> shuffle -> batch -> prefetch."""

    n_samples: int = 2_000
    sample_kb: float = 16.0       # decimal kB per image: 150 -> 224 x 224 x 3 uint8
    buffer_size: int = 1_000      # shuffle buffer in samples; 0 = no shuffle
    seed: int = 0
    batch_size: int = 8           # 0 = unbatched
    prefetch: int = 2             # 0 = no prefetch
    sources: int = 1              # > 1: interleave over this many contiguous sources
    content: str = "random"       # "random" (incompressible) or "constant" (compresses to ~nothing)
    symbolic: bool = False        # tf.data.Options().experimental_symbolic_checkpoint

    def __post_init__(self):
        for name in ("n_samples", "sources"):
            if getattr(self, name) < 1:
                raise ConfigError(f"PipelineSpec.{name}={getattr(self, name)} must be >= 1")
        for name in ("buffer_size", "batch_size", "prefetch", "seed"):
            if getattr(self, name) < 0:
                raise ConfigError(f"PipelineSpec.{name}={getattr(self, name)} must be >= 0")
        if self.sample_kb <= 0:
            raise ConfigError(f"PipelineSpec.sample_kb={self.sample_kb} must be > 0")
        if self.content not in CONTENTS:
            raise ConfigError(f"PipelineSpec.content={self.content!r}: choose one of {CONTENTS}")

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return image_shape(self.sample_kb)

    @property
    def sample_bytes(self) -> int:
        return int(np.prod(self.image_shape))


def image_shape(sample_kb: float) -> tuple[int, int, int]:
    """The square uint8 RGB image closest to `sample_kb` decimal kB (150 -> 224 x 224 x 3)."""
    side = max(1, round((sample_kb * 1000 / 3) ** 0.5))
    return side, side, 3


def tensorflow():
    """Import TensorFlow quietly (TF_CPP_MIN_LOG_LEVEL=2) and return the module."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    import absl.logging
    import tensorflow as tf

    absl.logging.set_verbosity(absl.logging.ERROR)   # python-side absl warnings (e.g. on checkpoints)
    return tf


def synthetic_image(index, spec: PipelineSpec, tf=None):
    """The image of sample `index` (a tf.int64 scalar): a pure function of (seed, index)."""
    tf = tf or tensorflow()
    shape = spec.image_shape
    if spec.content == "constant":
        return tf.fill(shape, tf.cast(index % 256, tf.uint8))
    n_bytes = int(np.prod(shape))
    words = tf.random.stateless_uniform([-(-n_bytes // 4)], seed=tf.stack([index, tf.constant(spec.seed, tf.int64)]),
                                        minval=None, maxval=None, dtype=tf.int32)
    return tf.reshape(tf.reshape(tf.bitcast(words, tf.uint8), [-1])[:n_bytes], shape)


def sample_at(spec: PipelineSpec):
    """A map function: index -> {"index", "image"}, the element every pipeline here yields."""
    tf = tensorflow()
    return lambda index: {"index": index, "image": synthetic_image(index, spec, tf)}


def source_dataset(spec: PipelineSpec):
    """The unshuffled samples 0..n-1, interleaved over `spec.sources` contiguous slices if > 1."""
    tf = tensorflow()
    if spec.sources == 1:
        return tf.data.Dataset.range(spec.n_samples).map(sample_at(spec))
    per, fetch = -(-spec.n_samples // spec.sources), sample_at(spec)
    starts = tf.data.Dataset.range(0, spec.n_samples, per)
    return starts.interleave(
        lambda s: tf.data.Dataset.range(s, tf.minimum(s + per, spec.n_samples)).map(fetch),
        cycle_length=spec.sources, num_parallel_calls=spec.sources, deterministic=True)


def shuffle_pipeline(spec: PipelineSpec, method: str):
    """The reference pipeline (samples -> shuffle -> batch -> prefetch, spec.symbolic) with any of SHUFFLE_METHODS.

    "tf.data shuffle": `Dataset.shuffle(spec.buffer_size)` (none when it is 0); "tf.data global_shuffle": the private
    global shuffle over the random-access source (ConfigError where this TensorFlow lacks it);
    "tf index_shuffle": `range(n)` mapped through `tf.random.experimental.index_shuffle`;
    "resumable (buffer)" / "resumable (global)": nblib's shuffles (`index_dataset`). All share
    the seed, the samples (a pure function of the index) and the batch and prefetch knobs.
    """
    tf = tensorflow()
    if method == TF_SHUFFLE:
        ds = source_dataset(spec)
        if spec.buffer_size:
            ds = ds.shuffle(spec.buffer_size, seed=spec.seed, reshuffle_each_iteration=False)
        return _batch_prefetch(ds, spec)
    if method == TF_GLOBAL_SHUFFLE:
        op = global_shuffle_op()
        if op is None:
            raise ConfigError(f"{TF_GLOBAL_SHUFFLE} needs TensorFlow >= {GLOBAL_SHUFFLE_SINCE} "
                              f"(this is {tf.__version__}); use 'resumable (global)' instead")
        return _batch_prefetch(op(source_dataset(spec), seed=spec.seed, reshuffle_each_iteration=False), spec)
    if method == TF_INDEX_SHUFFLE:       # a stateless keyed permutation of range(n)
        key, last = tf.constant([spec.seed, 0], tf.int64), spec.n_samples - 1
        order = tf.data.Dataset.range(spec.n_samples).map(
            lambda i: tf.random.experimental.index_shuffle(i, seed=key, max_index=last))
        return _batch_prefetch(order.map(sample_at(spec)), spec)
    for algorithm in SHUFFLE_ALGORITHMS:
        if method == f"resumable ({algorithm})":
            shuffler = make_shuffle(spec.n_samples, spec.buffer_size, spec.seed, algorithm)
            return _batch_prefetch(index_dataset(shuffler).map(sample_at(spec)), spec)
    raise ConfigError(f"method={method!r}: choose one of {tuple(SHUFFLE_METHODS)}")


def global_shuffle_op():
    """tf.data's global shuffle (`global_shuffle_op._global_shuffle`, private, TF >= 2.17), or None where missing."""
    tensorflow()
    try:
        from tensorflow.python.data.experimental.ops.global_shuffle_op import _global_shuffle
    except ImportError:
        return None
    return _global_shuffle


def indexed_dataset(indices, fetch: Callable, *, batch_size: int = 0, prefetch: int = 0):
    """nblib's shuffle in tf.data: the indices of `indices`, each mapped through `fetch(index)`.

    `indices` is a nblib.shuffle object (its remaining indices, from its current position) or
    an array of indices. Symbolic checkpointing is on, so a `tf.train.Checkpoint` of the
    iterator stores cursors only (~0.5 kB): map, batch and prefetch are recomputed on restore.
    What keeps it small: no `.shuffle()` after the indices, and a `fetch` that is a pure
    function of the index (no Python state, random ops seeded from the index).
    """
    return _batch_prefetch(index_dataset(indices).map(fetch),
                           PipelineSpec(batch_size=batch_size, prefetch=prefetch, symbolic=True))


def index_dataset(indices):
    """A Dataset of int64 indices whose iterator state is one cursor.

    GlobalShuffle: `range(position, n)` mapped through its Feistel permutation in TF ops (O(1)
    memory, no Python in the loop). ResumableShuffleBuffer or any other shuffle: its remaining
    order precomputed (8 bytes per sample in RAM) and sliced. An array: sliced as is.
    """
    tf = tensorflow()
    if isinstance(indices, shuffle.GlobalShuffle):
        return _feistel_dataset(indices)
    if hasattr(indices, "state_dict"):
        indices = shuffle.full_order(copy.deepcopy(indices))  # a copy: the caller's shuffle keeps its place
    return tf.data.Dataset.from_tensor_slices(np.asarray(indices, dtype=np.int64))


def make_shuffle(n: int, buffer_size: int, seed: int, algorithm: str = "buffer"):
    """A fresh nblib.shuffle object: ResumableShuffleBuffer ("buffer") or GlobalShuffle ("global")."""
    if algorithm == "buffer":
        return shuffle.ResumableShuffleBuffer(n=n, buffer_size=max(1, buffer_size), seed=seed)
    if algorithm == "global":
        return shuffle.GlobalShuffle(n=n, seed=seed, epoch=0)
    raise ConfigError(f"algorithm={algorithm!r}: choose one of {SHUFFLE_ALGORITHMS}")


def resumable_shuffle_pipeline(spec: PipelineSpec, algorithm: str = "buffer"):
    """The reference pipeline with tf.data's shuffle replaced by nblib's (same samples, same knobs)."""
    shuffler = make_shuffle(spec.n_samples, spec.buffer_size, spec.seed, algorithm)
    return indexed_dataset(shuffler, sample_at(spec), batch_size=spec.batch_size, prefetch=spec.prefetch)


def tf_shuffle_order(n: int, buffer_size: int, seed: int) -> np.ndarray:
    """The order in which tf.data's `shuffle(buffer_size, seed)` emits 0..n-1."""
    tf = tensorflow()
    ds = tf.data.Dataset.range(n).shuffle(max(1, buffer_size), seed=seed, reshuffle_each_iteration=False)
    return np.concatenate([b.numpy() for b in ds.batch(65_536)]) if n else np.zeros(0, np.int64)


def _batch_prefetch(ds, spec: PipelineSpec):
    if spec.batch_size:
        ds = ds.batch(spec.batch_size)
    if spec.prefetch:
        ds = ds.prefetch(spec.prefetch)
    return _with_symbolic(ds, spec.symbolic)


def _with_symbolic(ds, symbolic: bool):
    """`ds` with tf.data's symbolic checkpointing on or off."""
    options = tensorflow().data.Options()
    options.experimental_symbolic_checkpoint = symbolic
    return ds.with_options(options)


def _feistel_dataset(shuffler, chunk: int = 4096):
    """GlobalShuffle's remaining indices computed by TF ops: range -> batch -> permute -> unbatch."""
    tf = tensorflow()
    permutation = shuffler.permutation  # nblib.shuffle.FeistelPermutation: n, bits, keys
    n, bits, keys = permutation.n, permutation.bits, permutation.keys

    def permute(positions):
        values = _feistel_tf(tf.cast(positions, tf.uint64), bits, keys, tf)
        values = tf.while_loop(  # cycle-walking: re-encrypt what lands outside [0, n)
            lambda v: tf.reduce_any(v >= n),
            lambda v: [tf.where(v >= n, _feistel_tf(v, bits, keys, tf), v)], [values])
        values = values[0] if isinstance(values, (list, tuple)) else values
        return tf.cast(values, tf.int64)

    return tf.data.Dataset.range(shuffler.position, n).batch(chunk).map(permute).unbatch()


def _feistel_tf(value, bits: int, keys, tf):
    """nblib.shuffle._feistel in uint64 TF ops (same rounds, same splitmix64 round function)."""
    high_bits, low_bits = bits - bits // 2, bits // 2
    for key in keys:
        high = tf.bitwise.right_shift(value, tf.constant(low_bits, tf.uint64))
        low = tf.bitwise.bitwise_and(value, tf.constant((1 << low_bits) - 1, tf.uint64))
        mask = tf.constant((1 << high_bits) - 1, tf.uint64)
        mixed = tf.bitwise.bitwise_xor(high, tf.bitwise.bitwise_and(_splitmix64_tf(low, key, tf), mask))
        value = tf.bitwise.bitwise_or(tf.bitwise.left_shift(low, tf.constant(high_bits, tf.uint64)), mixed)
        high_bits, low_bits = low_bits, high_bits
    return value


def _splitmix64_tf(value, key: int, tf):
    """splitmix64's finalizer of (value + key) mod 2^64 (uint64 arithmetic wraps in TF)."""
    def shift_xor(z, k):
        return tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, tf.constant(k, tf.uint64)))

    z = value + tf.constant(key, tf.uint64)
    z = shift_xor(z, 30) * tf.constant(0xBF58476D1CE4E5B9, tf.uint64)
    z = shift_xor(z, 27) * tf.constant(0x94D049BB133111EB, tf.uint64)
    return shift_xor(z, 31)


def method_unavailable(method: str) -> str:
    """Why `method` cannot run in this TensorFlow ("" when it can): the private global shuffle may be missing."""
    if method not in SHUFFLE_METHODS:
        raise ConfigError(f"method={method!r}: choose one of {tuple(SHUFFLE_METHODS)}")
    if method == TF_GLOBAL_SHUFFLE and global_shuffle_op() is None:
        return (f"skipped: TensorFlow {tensorflow().__version__} has no global_shuffle_op._global_shuffle "
                f"(added in {GLOBAL_SHUFFLE_SINCE})")
    return ""


def one_op_pipelines(spec: PipelineSpec) -> dict[str, Callable]:
    """Builders of small pipelines of one op each over `spec`'s samples (`spec.symbolic` applied).

    What they show: which ops keep an iterator checkpoint small (notebook 04's ops table).
    """
    tf = tensorflow()
    n, seed, fetch = spec.n_samples, spec.seed, sample_at(spec)
    order = np.random.default_rng(seed).permutation(n)
    builds = {
        "range -> map": lambda: tf.data.Dataset.range(n).map(fetch),
        "range -> map(parallel=4)": lambda: tf.data.Dataset.range(n).map(fetch, num_parallel_calls=4),
        "range -> map -> batch(8)": lambda: tf.data.Dataset.range(n).map(fetch).batch(8),
        "range -> map -> prefetch(8)": lambda: tf.data.Dataset.range(n).map(fetch).prefetch(8),
        "interleave(4 sources)": lambda: source_dataset(replace(spec, sources=4)),
        "from_tensor_slices(order) -> map": lambda: tf.data.Dataset.from_tensor_slices(order).map(fetch),
        "range -> map(numpy_function)": lambda: tf.data.Dataset.range(n).map(
            lambda i: tf.numpy_function(lambda x: x, [i], tf.int64)),
        "range -> map -> shuffle(32)": lambda: tf.data.Dataset.range(n).map(fetch).shuffle(32, seed=seed),
    }
    return {name: (lambda b=build: _with_symbolic(b(), spec.symbolic)) for name, build in builds.items()}


@dataclass(frozen=True)
class RoundTrip:
    """A tf.train.Checkpoint of an iterator after `cut_after` elements, restored into a fresh one."""

    checkpoint_bytes: int
    identical: bool                # the restored elements equal the expected ones (structure and values)
    restored: list                 # the elements the restored iterator yielded


def checkpoint_round_trip(build: Callable, folder, cut_after: int, compared: int, *, expected: list | None = None,
                          strict: bool = False) -> RoundTrip:
    """Cut `build()`'s iterator after `cut_after` elements, checkpoint it in `folder`, restore, compare `compared`.

    `expected`: what must follow the cut (default: what the saved iterator itself yields next).
    `strict`: every object of the checkpoint must be consumed on restore (`assert_consumed`).
    `folder` is emptied first and removed afterwards, also on an exception.
    """
    tf = tensorflow()
    with _scratch(folder) as folder:
        iterator = iter(build())
        for _ in range(cut_after):
            next(iterator)
        path = tf.train.Checkpoint(iterator=iterator).write(str(folder / "ckpt"))
        size = disk_usage(folder)
        if expected is None:
            expected = [e for _, e in zip(range(compared), iterator)]
        del iterator
        fresh = iter(build())
        status = tf.train.Checkpoint(iterator=fresh).read(path)
        status.assert_consumed() if strict else status.expect_partial()
        got = [e for _, e in zip(range(len(expected)), fresh)]
    identical = len(got) == len(expected) and all(same_element(a, b) for a, b in zip(expected, got))
    return RoundTrip(size, identical, got)


def iterator_checkpoint_bytes(dataset, consumed: int, folder) -> tuple[int, str]:
    """(bytes, "") of a tf.train.Checkpoint of `dataset`'s iterator after `consumed` elements, or (0, why).

    TensorFlow refuses to save some iterators (e.g. "PyFunc is stateful"): that refusal is the
    answer, returned as its first line; an error while iterating is raised. `folder` is removed
    afterwards, in every case.
    """
    tf = tensorflow()
    iterator = iter(dataset)
    for _ in range(consumed):
        next(iterator)
    with _scratch(folder) as folder:
        try:
            tf.train.Checkpoint(iterator=iterator).write(str(folder / "ckpt"))
            return disk_usage(folder), ""
        except Exception as exc:  # TF raises several types for an iterator it cannot save
            return 0, fmt_exception(exc, 160, with_type=True)


@contextlib.contextmanager
def _scratch(folder):
    """`folder` (a Path) emptied and created for a checkpoint, and removed afterwards, also on an exception."""
    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------- checkpoint measuring


@dataclass(frozen=True)
class CheckpointRow:
    """One measured iterator checkpoint: sizes, times, peaks, and whether resume was exact."""

    pipeline: str                  # "tf.data shuffle", "resumable (buffer)", ...
    buffer_size: int
    symbolic: bool
    sample_bytes: int
    bytes_on_disk: int
    save_s: float
    restore_s: float               # read the checkpoint + produce the first element
    peak_disk_bytes: int           # largest size of the checkpoint folder during a first save
    peak_disk_rotating_bytes: int  # ... during a save that replaces the previous checkpoint
    peak_rss_bytes: int            # process RSS peak during save and restore (holds the buffer)
    save_extra_rss_bytes: int      # RSS peak during the save minus RSS just before it
    restore_extra_rss_bytes: int   # RSS peak during the restore minus RSS just before it
    exact_resume: bool             # the element after restore == the uninterrupted next element
    error: str = ""                # set when TensorFlow refused to save (then sizes are 0)

    @property
    def buffer_bytes(self) -> int:
        """What the shuffle buffer holds: buffer x sample bytes."""
        return self.buffer_size * self.sample_bytes

    @property
    def temp_factor(self) -> float:
        """Peak disk during a first save / final checkpoint size (budget.checkpoint_disk_peak: 1x)."""
        return self.peak_disk_bytes / self.bytes_on_disk if self.bytes_on_disk else float("nan")

    @property
    def rotating_factor(self) -> float:
        """Peak disk during a save keeping the previous checkpoint / final size (the model: 2x)."""
        return self.peak_disk_rotating_bytes / self.bytes_on_disk if self.bytes_on_disk else float("nan")


def measure_iterator_checkpoint(label: str, spec: PipelineSpec, build: Callable, folder: Path,
                                steps: int = 3) -> CheckpointRow:
    """Save twice through a CheckpointManager(max_to_keep=1), restore into a fresh iterator, compare.

    `build()` makes the pipeline `spec` describes; `steps` elements are consumed first; `folder` is
    emptied before and removed after. The first save lands in an empty folder (its peak is the
    save's own temporary space); the second replaces it (the old checkpoint is deleted only once
    the new one is complete). RSS peaks come from nblib.measure.PeakMemory, disk peaks from
    `nblib.disk.DiskPeak`. A pipeline TensorFlow refuses to save gives a row with `error` set.
    """
    with _scratch(folder) as folder:
        tf = tensorflow()
        iterator = iter(build())
        for _ in range(steps):
            next(iterator)
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(iterator=iterator), str(folder), max_to_keep=1)
        release_free_heap()
        try:
            with PeakMemory(interval_s=0.005) as save_mem, DiskPeak(folder) as first:
                t0 = time.perf_counter()
                manager.save()
                save_s = time.perf_counter() - t0
        except Exception as exc:  # TF refuses some pipelines (e.g. stateful ops): report, don't crash
            return CheckpointRow(label, spec.buffer_size, spec.symbolic, spec.sample_bytes, 0, 0.0, 0.0, 0, 0,
                                 0, 0, 0, False, fmt_exception(exc, with_type=True))
        next(iterator)
        with DiskPeak(folder) as rotating, _sampled_before_sweep(manager, rotating):
            path = manager.save()
        expected = next(iterator)
        bytes_on_disk = disk_usage(folder)
        del iterator, manager
        fresh = iter(build())
        release_free_heap()
        with PeakMemory(interval_s=0.005) as restore_mem:
            t0 = time.perf_counter()
            tf.train.Checkpoint(iterator=fresh).read(path).expect_partial()
            got = next(fresh)
            restore_s = time.perf_counter() - t0
        exact = same_element(expected, got)
        del fresh
        return CheckpointRow(label, spec.buffer_size, spec.symbolic, spec.sample_bytes, bytes_on_disk, save_s,
                             restore_s, first.peak, rotating.peak, max(save_mem.peak, restore_mem.peak),
                             max(0, save_mem.delta), max(0, restore_mem.delta), exact)


@contextlib.contextmanager
def _sampled_before_sweep(manager, peak: DiskPeak):
    """Sample the folder when the new checkpoint is complete and the old one not yet deleted: the rotating
    save's peak, which lasts a few ms and a 2 ms sampler missed on a busy machine (CheckpointManager.save
    writes, then `_sweep`s the checkpoints past max_to_keep).
    """
    sweep = getattr(manager, "_sweep", None)
    if sweep is None:
        yield
        return

    def sampled():
        peak.sample()
        return sweep()

    manager._sweep = sampled
    try:
        yield
    finally:
        manager._sweep = sweep


def preflight_checkpoint(buffer_size: int, sample_bytes: int, folder) -> None:
    """Refuse, with the numbers, a tf.data checkpoint whose save would not fit RAM or disk.

    Disk: `nblib.budget.checkpoint_disk_peak` with the previous checkpoint kept (2x); RAM: the
    buffer plus what a restore adds (`nblib.budget.checkpoint_ram_peak`).
    """
    buffer_bytes = buffer_size * sample_bytes
    need_disk = checkpoint_disk_peak(buffer_bytes, keep_previous=True)
    need_ram = checkpoint_ram_peak(buffer_bytes)
    free_disk = disk_free(folder)
    free_ram = psutil.virtual_memory().available
    what = f"a tf.data checkpoint of a {buffer_size:,}-sample buffer of {sample_bytes:,} B"
    knob = "lower buffer_sizes or sample_kb, or checkpoint indices instead (nblib.tfdata.indexed_dataset)"
    if need_disk > free_disk:
        raise BudgetExceeded(f"{what} needs ~{need_disk / GB:.2f} GB of disk (new + previous checkpoint), "
                             f"{free_disk / GB:.2f} GB free in {folder}; {knob}")
    if need_ram > free_ram:
        raise BudgetExceeded(f"{what} needs ~{need_ram / GB:.2f} GB of RAM (the buffer, and as much again "
                             f"while restoring), {free_ram / GB:.2f} GB available; {knob}")


def same_element(a, b) -> bool:
    """Two pipeline elements (nested tensors) are equal, structure and values."""
    tf = tensorflow()
    flat_a, flat_b = tf.nest.flatten(a), tf.nest.flatten(b)
    return len(flat_a) == len(flat_b) and all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(flat_a, flat_b))
