"""nblib.pipeline: the harness against pipelines whose timing is known by construction, sweeps, recommend."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import fresh_touched_bytes
from nblib.errors import BudgetExceeded, ConfigError
from nblib.pipeline import (
    ComputeStandIn,
    EmptyPipelineError,
    batch_size_of,
    measure_pipeline,
    plan_configs,
    recommend,
    sweep,
)

BATCH = 8


def serial_batches(produce_ms: float, batch: int = BATCH, first_ms: float = 0.0, n: int | None = None):
    """A generator that sleeps `produce_ms` before each batch: nothing overlaps with the consumer."""
    ComputeStandIn(first_ms)()
    produce, i = ComputeStandIn(produce_ms), 0
    while n is None or i < n:
        produce()
        yield np.zeros((batch, 4), np.uint8)
        i += 1


def prefetched_batches(produce_ms: float, depth: int = 4, batch: int = BATCH):
    """A producer thread making a batch every `produce_ms` into a queue of `depth`: it overlaps the consumer."""
    q: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def produce():
        ready = time.perf_counter()
        while not stop.is_set():
            ready = max(ready, time.perf_counter() - produce_ms / 1e3) + produce_ms / 1e3  # a fixed schedule
            time.sleep(max(0.0, ready - time.perf_counter()))
            item = np.zeros((batch, 4), np.uint8)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.05)
                    break
                except queue.Full:
                    pass

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        while True:
            yield q.get()
    finally:
        stop.set()
        thread.join()


# ------------------------------------------------------------------------------ harness accuracy


def timing_consumer(log: list[float], ms: float):
    """A consumer step that sleeps `ms` and logs how long it really took (a late wake-up included)."""
    def step(batch):
        t0 = time.perf_counter()
        ComputeStandIn(ms)()
        log.append(time.perf_counter() - t0)
    return step


# Speed-independent checks: under load a sleep lasts longer than asked, so the tests compare the
# harness's figures with the producer's and consumer's own measured intervals, and bound the rate
# by what the construction makes impossible to beat (no +-10% of a sleep; flaky on a busy machine).


def test_serial_producer_wait_share_and_rate_match_construction():
    produced, used = [], []
    report = measure_pipeline(lambda: timed_batches(40, produced), consumer=timing_consumer(used, 20),
                              steps=20, warmup=2)
    wall = report.steps * report.step_ms / 1e3
    waited, compute = report.data_wait * wall, sum(used[2:])
    assert sum(produced[2:]) <= waited <= wall - compute, (sum(produced[2:]), waited, wall, compute)
    assert waited >= 20 * 0.040 and compute >= 20 * 0.020         # a sleep lasts at least its time
    assert report.samples_per_s <= BATCH / 0.060                  # nothing overlaps: 60 ms a step at best
    assert report.batch_size == BATCH and report.steps == 20


def test_prefetching_producer_slower_than_consumer_waits_the_difference():
    used = []
    report = measure_pipeline(lambda: prefetched_batches(40), consumer=timing_consumer(used, 20), steps=20,
                              warmup=3)
    wall = report.steps * report.step_ms / 1e3
    waited, compute = report.data_wait * wall, sum(used[3:])
    assert waited <= wall - compute, (waited, wall, compute)       # compute is never counted as waiting
    # the producer's fixed 40 ms schedule bounds the rate: at most the queue's 4 (+1 in hand) ahead
    assert wall >= (20 - 5) * 0.040, wall
    # what the step did not spend computing it spent waiting (the harness's own overhead aside)
    assert waited >= 0.5 * (wall - compute), (waited, wall, compute)


def test_prefetching_producer_faster_than_consumer_hides_behind_compute():
    used = []
    report = measure_pipeline(lambda: prefetched_batches(10), consumer=timing_consumer(used, 40), steps=20,
                              warmup=3)
    wall = report.steps * report.step_ms / 1e3
    waited, compute = report.data_wait * wall, sum(used[3:])
    assert waited <= wall - compute, (waited, wall, compute)
    assert report.samples_per_s <= 20 * BATCH / compute             # never faster than the consumer itself
    assert report.data_wait < 0.25, report                          # a 4x faster producer keeps the queue full


def timed_batches(produce_ms: float, log: list[float], first_ms: float = 0.0):
    """`serial_batches` that logs how long each batch took to make (inside the harness's next())."""
    begun = time.perf_counter()
    ComputeStandIn(first_ms)()
    produce = ComputeStandIn(produce_ms)
    while True:
        t0 = time.perf_counter()
        produce()
        log.append(time.perf_counter() - (begun if not log else t0))  # the first: from the first next()
        yield np.zeros((BATCH, 4), np.uint8)


def test_a_consumer_callable_replaces_the_stand_in():
    # Speed-independent: the harness's intervals contain the producer's and the consumer's own
    # intervals, so produced <= waited <= wall - consumed, under any load (no +-10% of a sleep).
    calls, consumed, produced = [], [], []

    def step(batch):
        t0 = time.perf_counter()
        calls.append(len(batch))
        ComputeStandIn(30)()
        consumed.append(time.perf_counter() - t0)

    report = measure_pipeline(lambda: timed_batches(10, produced), consumer=step, steps=20, warmup=2)
    assert len(calls) == 22 and calls[0] == BATCH and len(produced) == 22
    wall = report.steps * report.step_ms / 1e3
    waited, used = report.data_wait * wall, sum(consumed[2:])      # the 20 timed steps, after warm-up
    assert sum(produced[2:]) <= waited <= wall - used, (sum(produced[2:]), waited, wall, used)
    assert used >= 20 * 0.030 and waited >= 20 * 0.010               # a sleep lasts at least its time
    assert report.samples_per_s == pytest.approx(20 * BATCH / wall, rel=1e-9)


def test_startup_counts_the_time_to_the_first_batch():
    produced: list[float] = []
    start = time.perf_counter()
    report = measure_pipeline(lambda: timed_batches(10, produced, first_ms=200), consumer_ms=0, steps=5, warmup=1)
    outside = time.perf_counter() - start
    # it contains the pipeline's own time to its first batch (200 + 10 ms of sleeps at least), and
    # not the timed steps after it
    assert produced[0] >= 0.210 and produced[0] <= report.startup_s, (produced[0], report)
    assert report.startup_s <= outside - report.steps * report.step_ms / 1e3, (outside, report)


def test_peak_rss_counts_buffers_the_pipeline_holds():
    def holding():
        buffer = fresh_touched_bytes(150_000_000)   # 150 MB, touched
        yield from serial_batches(1, n=5)
        del buffer

    report = measure_pipeline(holding, steps=3, warmup=1)
    assert report.rss_added_bytes >= 140e6, report


def test_peak_rss_includes_child_processes():
    def child_holding():
        code = "import time; b = bytearray(200_000_000); print('ready', flush=True); time.sleep(30)"
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            child.stdout.readline()
            yield from serial_batches(100, n=12)
        finally:
            child.kill()
            child.wait()

    report = measure_pipeline(child_holding, steps=10, warmup=1)
    assert report.rss_added_bytes >= 180e6, report


def test_batch_size_is_read_from_arrays_tuples_and_dicts():
    images = np.zeros((5, 2, 2))
    assert batch_size_of(images) == 5
    assert batch_size_of((images, np.zeros(5))) == 5
    assert batch_size_of({"image": images, "label": np.zeros(5)}) == 5
    with pytest.raises(ConfigError, match="batch size"):
        batch_size_of("not an array")


# ------------------------------------------------------------------------------ bad input


def test_a_pipeline_that_yields_nothing_is_refused_in_one_line():
    with pytest.raises(EmptyPipelineError, match="yielded nothing") as info:
        measure_pipeline(lambda: iter(()), steps=3)
    assert "\n" not in str(info.value)


def test_a_pipeline_that_ends_during_warmup_is_refused():
    with pytest.raises(EmptyPipelineError, match="warm-up"):
        measure_pipeline(lambda: serial_batches(0, n=2), steps=3, warmup=3)


def test_a_pipeline_that_ends_early_is_measured_over_what_it_gave():
    report = measure_pipeline(lambda: serial_batches(5, n=6), steps=50, warmup=2)
    assert report.steps == 4


def test_an_unknown_knob_names_itself_and_the_known_ones():
    def family(batch_size=8, prefetch=2):
        return serial_batches(0, batch=batch_size, n=5)

    with pytest.raises(ConfigError) as info:
        sweep(family, {"batch_size": [8, 16], "num_workres": [0, 2]})
    message = str(info.value)
    assert "'num_workres'" in message and "batch_size, prefetch" in message and "\n" not in message


def test_an_rss_cap_below_every_config_is_refused_with_the_smallest_peak():
    table = sweep(lambda batch_size=8: serial_batches(1, batch=batch_size, n=6),
                  {"batch_size": [4, 8]}, steps=3, warmup=1)
    with pytest.raises(BudgetExceeded, match="smallest config's peak") as info:
        recommend(table, rss_cap_bytes=1e6)
    assert "\n" not in str(info.value)


def test_ctrl_c_during_a_sweep_returns_the_rows_measured_so_far():
    built = []

    def family(batch_size=8):
        built.append(batch_size)
        if len(built) == 3:
            os.kill(os.getpid(), signal.SIGINT)    # a real Ctrl-C, delivered mid-measurement
        return serial_batches(5, batch=batch_size)

    # Python's own Ctrl-C handler: a shell starts a background job with SIGINT ignored, and pytest inherits that
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.warns(UserWarning, match="interrupted"):
            table = sweep(family, {"batch_size": [1, 2, 3, 4, 5]}, steps=10, warmup=1, warm_start=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert table.interrupted and len(table) == 2 and table.planned == 5
    assert [row["batch_size"] for row in table] == [1, 2]
    assert "interrupted" in str(table)


# ------------------------------------------------------------------------------ sweep and recommend


def test_one_at_a_time_grid_varies_each_knob_around_the_base():
    configs = plan_configs({"batch_size": [32, 128], "prefetch": [2, 1, 4]})
    assert configs == [("base", {"batch_size": 32, "prefetch": 2}), ("batch_size", {"batch_size": 128, "prefetch": 2}),
                       ("prefetch", {"batch_size": 32, "prefetch": 1}), ("prefetch", {"batch_size": 32, "prefetch": 4})]
    assert len(plan_configs({"a": [1, 2], "b": [1, 2, 3]}, product=True)) == 6


def test_recommend_picks_the_fastest_config_under_the_cap_and_the_knob_that_mattered():
    def family(batch_size=8, hold_mb=0, prefetch=2):
        buffer = np.ones(max(1, int(hold_mb * 1e6)), np.uint8)   # RAM this config holds while it runs

        def batches():
            for _ in range(12):
                time.sleep(0.01)                          # fixed cost per batch: bigger batches go faster
                yield np.zeros((batch_size, 2), np.uint8) + buffer[:1]
        return batches()

    table = sweep(family, {"batch_size": [8, 32], "hold_mb": [0, 100], "prefetch": [2, 4]}, product=True,
                  steps=6, warmup=1)            # 100 MB: far above RSS noise, and each run writes every page of it
    small = min(r["peak_rss_bytes"] for r in table.rows if r["hold_mb"] == 0)
    rec = recommend(table, rss_cap_bytes=small + 50e6)
    assert rec.row["batch_size"] == 32 and rec.row["hold_mb"] == 0
    assert rec.knob_that_mattered == "batch_size"
    assert rec.speedup > 2.5
    assert "batch_size mattered most" in str(rec) and "\n" not in str(rec)


# ------------------------------------------------------------------------------ render on the fly


@pytest.mark.slow
def test_a_cacheless_encode_gives_the_cached_encode_bytes_and_resumes(tmp_path):
    from nblib import config
    from nblib.cache import ShardedImageCache, populate, sample_texts
    from nblib.cache.rendered import RenderedImages
    from nblib.encode import encode

    cfg = config.preset("smoke").replace(n_samples=96, batch_size=16, checkpoint_every=2, consolidate_every=2)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(t.replace("\n", " ") for t in sample_texts(96)) + "\n", encoding="utf-8")
    populate(texts, tmp_path / "cache", image_size=64, shard_mb=0.05, workers=1, progress=False)
    cache = ShardedImageCache(tmp_path / "cache")
    rendered = RenderedImages.like(cache)
    assert len(rendered) == len(cache) and rendered.source_sha256 == cache.manifest["source"]["sha256"]
    assert np.array_equal(rendered.get_batch(0, len(rendered)), cache.get_batch(0, len(cache)))

    kwargs = {"device": "cpu", "progress": False, "preflight": False}
    cached = encode(cache, tmp_path / "cached", cfg, **kwargs)
    cacheless = encode(rendered, tmp_path / "cacheless", cfg.replace(workers=2), **kwargs)
    for name, path in cached.outputs.items():
        assert path.read_bytes() == cacheless.outputs[name].read_bytes(), name
    again = encode(RenderedImages.like(cache), tmp_path / "cacheless", cfg, **kwargs)
    assert again.parts_encoded == 0 and again.parts_total == cacheless.parts_total


def test_repeated_sweeps_keep_each_configs_median_run():
    # produce_ms per run, in measuring order: pass 1 (a, b), pass 2 (b, a), pass 3 (a, b); the three
    # values are 4x apart, so a late wake-up on a loaded machine cannot make one run pass for another
    rates = iter([10, 160, 10, 40, 160, 40])

    def family(batch_size=8):
        return serial_batches(next(rates), batch=batch_size, n=8)

    table = sweep(family, {"batch_size": [8, 16]}, steps=5, warmup=1, repeats=3, warm_start=False)
    assert len(table) == 2 and table.planned == 2
    # config a ran with 10, 40, 160 ms per batch; b with 160, 10, 40: both keep their 40 ms run
    for row in table:
        assert 35 <= row["step_ms"] < 120, row
        assert len(row["runs"]) == 3


def test_needle_verdicts_follow_the_measurements_not_the_text():
    from nblib.lab.input_pipeline import MixingResult, needle_table
    from nblib.pipeline import SweepTable

    noise = (0.99, 1.0, 1.01, 1.0, 0.995)   # five runs per config, 1% apart: pairs agree unless the medians are close

    def table(batch_rates):
        rows = [{"batch_size": b, "varied": "base" if i == 0 else "batch_size", "samples_per_s": r, "data_wait": 0.5,
                 "startup_s": 0.1, "peak_rss_bytes": 1e8, "runs": tuple(x * r for x in noise)}
                for i, (b, r) in enumerate(batch_rates)]
        return SweepTable(knobs=("batch_size",), rows=rows, planned=len(rows))

    def mixing(single, mixed, fixed):
        return MixingResult(2, single, mixed, fixed, 5, {k: tuple(x * v for x in noise) for k, v in
                                                         (("single", single), ("mixed", mixed), ("fixed", fixed))})

    share = {"data_wait": 0.8, "encoder_samples_per_s": 94, "pipeline_samples_per_s": 100}
    trap = [{"num_workers": 0, "rss_added_bytes": 0}, {"num_workers": 1, "rss_added_bytes": 5e8}]
    agree = needle_table(share, table([(32, 100), (128, 200)]), mixing(200, 140, 190), trap)
    assert [r["verdict"] for r in agree] == ["agrees"] * 4
    differ = needle_table({**share, "data_wait": 0.1}, table([(32, 100), (128, 80)]),
                          mixing(200, 260, 190), [{**trap[0]}, {**trap[1], "rss_added_bytes": 1e6}])
    assert [r["verdict"] for r in differ] == ["does not"] * 4
    noisy = needle_table(share, table([(32, 100), (128, 101)]), MixingResult(2, 200, 140, 190, 1), trap)
    assert [r["verdict"] for r in noisy][1:3] == ["not distinguishable on this machine"] * 2


def test_the_worker_trap_finding_states_its_basis_and_both_figures():
    from nblib.lab.input_pipeline import PER_WORKER_BYTES, _worker_trap, needle_text
    from nblib.reference import TUNING_LOG
    from nblib.units import fmt_bytes

    ref = TUNING_LOG["RAM per torch worker"].value
    small = _worker_trap([{"num_workers": 0, "rss_added_bytes": 0},
                          {"num_workers": 1, "rss_added_bytes": 4 * PER_WORKER_BYTES}])
    text = needle_text([small])
    assert small["verdict"] == "agrees" and "the direction, not the size" in text
    assert fmt_bytes(ref) in text and fmt_bytes(4 * PER_WORKER_BYTES) in text
    assert f"x{4 * PER_WORKER_BYTES / ref:.2f} the reference's" in text
