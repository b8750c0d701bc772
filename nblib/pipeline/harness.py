"""Measure one input pipeline: samples/s, the share of time the consumer waits for data, startup, peak RSS.

`measure_pipeline` builds the pipeline, takes `warmup` batches (the first one's arrival is the
startup time, buffer fill included), then times `steps` batches: each `next()` is data-wait, each
consumer call is compute. The consumer is a calibrated stand-in for a device step (it sleeps to a
deadline, so it holds no core, as a GPU step does not) or any callable, such as the real encoder
step. Trade-off: the stand-in models a device-bound step; a CPU-bound consumer competes with the
pipeline for cores, which only the real callable shows. Works with anything iterable: a tf.data
`Dataset`, a torch `DataLoader`, a generator.
"""
from __future__ import annotations

import contextlib
import numbers
import time
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass

import psutil

from nblib.errors import ConfigError, EmptyPipelineError
from nblib.measure import PeakMemory
from nblib.units import fmt_bytes, fmt_duration, fmt_rate


@dataclass(frozen=True)
class PipelineReport:
    """What one measured run of a pipeline gave: rate, data-wait share, startup and memory."""

    samples_per_s: float
    data_wait: float          # share of the timed wall spent in next(), 0..1
    startup_s: float          # building the pipeline + the first batch (buffer fill included)
    peak_rss_bytes: int       # peak RSS of this process + its children's private memory (USS)
    rss_added_bytes: int      # of it, above the RSS when the measurement began
    batch_size: int           # samples in the first batch
    steps: int                # batches timed (after warm-up)
    step_ms: float            # mean wall per timed batch

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (f"{fmt_rate(self.samples_per_s)}, data-wait {self.data_wait:.0%}, startup "
                f"{fmt_duration(self.startup_s)}, peak RSS {fmt_bytes(self.peak_rss_bytes)} "
                f"(+{fmt_bytes(self.rss_added_bytes)}); batch {self.batch_size}, {self.steps} steps "
                f"of {fmt_duration(self.step_ms / 1e3)}")


def measure_pipeline(make_pipeline: Callable[[], Iterable], consumer_ms: float = 0.0, *,
                     consumer: Callable | None = None, steps: int = 20, warmup: int = 2) -> PipelineReport:
    """Build `make_pipeline()`, warm it up, then time `steps` batches through a consumer.

    `consumer_ms`: the stand-in device step per batch (0: consume instantly); `consumer`: a
    callable taking each batch instead (e.g. the encoder step). Batch size is the first dimension
    of the batch (of a tuple's or dict's first array). A pipeline that ends early is measured
    over the batches it gave; one that gives no batch after warm-up raises EmptyPipelineError.
    """
    _check_counts(consumer_ms, consumer, steps, warmup)
    consume = consumer if consumer is not None else ComputeStandIn(consumer_ms)
    with TreePeakMemory() as memory:
        built = time.perf_counter()
        iterator = iter(make_pipeline())
        try:
            first = _first_batch(iterator)
            startup_s = time.perf_counter() - built
            batch_size = batch_size_of(first)
            consume(first)
            for _ in range(warmup - 1):
                consume(next(iterator))
            waited, samples, timed, wall = _timed_steps(iterator, consume, steps)
        except StopIteration:
            raise EmptyPipelineError(f"the pipeline ended during its {warmup} warm-up batches; give it more "
                                f"batches (e.g. .repeat()) or lower warmup") from None
        finally:
            if isinstance(iterator, types.GeneratorType):   # stop a generator now (its finally blocks run)
                iterator.close()
    if timed == 0:
        raise EmptyPipelineError(f"the pipeline ended right after its {warmup} warm-up batches; give it "
                            f"at least {warmup + 1} batches (e.g. .repeat()) or lower warmup")
    return PipelineReport(samples_per_s=samples / wall, data_wait=min(1.0, waited / wall),
                          startup_s=startup_s, peak_rss_bytes=int(memory.peak),
                          rss_added_bytes=int(memory.delta), batch_size=batch_size, steps=timed,
                          step_ms=1e3 * wall / timed)


class TreePeakMemory(PeakMemory):
    """`PeakMemory` counting this process's RSS plus its children's private memory (USS), listed sparingly.

    A forked DataLoader worker shares its parent's pages; RSS would count them again for every
    worker, so children count only the pages they own (USS; a spawned worker's own imports are
    private to it, so they count). Listing children scans all of /proc (~25 ms with 130
    processes on a busy 2-core host); at 100 Hz that scan holds the GIL often enough to stretch
    a 30 ms step by 40%, so the list is refreshed every `list_every_s` (a worker counts from at
    most that long after it starts).
    """

    def __init__(self, list_every_s: float = 0.5):
        super().__init__()
        self.list_every_s = list_every_s
        self._me = psutil.Process()
        self._children: list = []
        self._listed = -float("inf")

    def rss(self) -> int:
        now = time.monotonic()
        if now - self._listed >= self.list_every_s:
            self._children, self._listed = self._me.children(recursive=True), now
        total = self._me.memory_info().rss
        for child in self._children:
            with contextlib.suppress(psutil.Error):
                total += child.memory_full_info().uss
        return total


class ComputeStandIn:
    """A device step of `ms` per batch plus `per_sample_ms` per sample that holds no core.

    It sleeps to a deadline and spins the last 0.3 ms, so the time Python spends around the call
    is part of the step, not added to it. A per-sample cost makes larger batches as costly as a
    GPU makes them; `ms` alone is the fixed cost of launching a step.
    """

    SPIN_S = 3e-4

    def __init__(self, ms: float, per_sample_ms: float = 0.0):
        if not (ms >= 0 and per_sample_ms >= 0):
            raise ConfigError(f"a step of {ms} ms + {per_sample_ms} ms/sample: both must be >= 0")
        self.ms, self.per_sample_ms = float(ms), float(per_sample_ms)

    def __call__(self, batch=None) -> None:
        per_sample = self.per_sample_ms * batch_size_of(batch) if self.per_sample_ms and batch is not None else 0.0
        seconds = (self.ms + per_sample) / 1e3
        if seconds <= 0:
            return
        deadline = time.perf_counter() + seconds
        remaining = deadline - time.perf_counter()
        if remaining > self.SPIN_S:
            time.sleep(remaining - self.SPIN_S)
        while time.perf_counter() < deadline:
            pass


def check_knobs(*knobs: tuple[str, object, int]) -> None:
    """ConfigError unless every (name, value, low) holds an integer value >= low (-1: tf.data.AUTOTUNE)."""
    for name, value, low in knobs:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ConfigError(f"{name}={value!r} must be an integer >= {low}" +
                              (" (-1 is tf.data.AUTOTUNE)" if low == -1 else ""))


def batch_size_of(batch) -> int:
    """Samples in a batch: the first dimension of the array (of a tuple's or dict's first array)."""
    while isinstance(batch, (tuple, list, Mapping)):
        if not batch:
            raise EmptyPipelineError("the pipeline yielded an empty tuple/dict as a batch; yield arrays")
        batch = next(iter(batch.values())) if isinstance(batch, Mapping) else batch[0]
    shape = getattr(batch, "shape", None)
    if shape is None:
        raise ConfigError(f"cannot read a batch size from a {type(batch).__name__}; yield arrays or "
                          f"tensors (or tuples/dicts of them) whose first dimension is the batch")
    return int(shape[0]) if len(shape) else 1


# ------------------------------------------------------------------------------ helpers


def _check_counts(consumer_ms: float, consumer, steps: int, warmup: int) -> None:
    if consumer is not None and consumer_ms:
        raise ConfigError(f"give consumer_ms ({consumer_ms}) or a consumer callable, not both")
    if not consumer_ms >= 0:
        raise ConfigError(f"consumer_ms={consumer_ms} must be >= 0 (milliseconds of device step per batch)")
    if steps < 1 or warmup < 1:
        raise ConfigError(f"steps={steps} and warmup={warmup} must both be >= 1 (warm-up includes the "
                          f"first batch, whose arrival is the startup time)")


def _first_batch(iterator):
    try:
        return next(iterator)
    except StopIteration:
        raise EmptyPipelineError("the pipeline yielded nothing: check its source is not empty and its "
                            "filters keep something (an empty cache, a take(0), a batch with "
                            "drop_remainder larger than the data)") from None


def _timed_steps(iterator, consume, steps: int) -> tuple[float, int, int, float]:
    """(seconds in next(), samples, batches, wall) over up to `steps` batches."""
    waited = 0.0
    samples = timed = 0
    started = ended = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            break
        t1 = time.perf_counter()
        consume(batch)
        t2 = time.perf_counter()
        waited += t1 - t0
        samples, timed, ended = samples + batch_size_of(batch), timed + 1, t2
    return waited, samples, timed, ended - started
