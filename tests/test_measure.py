"""Measurement tools: peak RSS (children included), disk deltas, encoder peaks; and a samples/s meter."""
from __future__ import annotations

import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field

import pytest

from conftest import fresh_touched_bytes
from nblib import budget, measure
from nblib.config import preset


def test_peak_memory_sees_a_short_lived_allocation():
    start = time.perf_counter()
    with measure.PeakMemory(interval_s=0.01) as pm:
        block = fresh_touched_bytes(200_000_000)   # 200 MB, touched
        first = pm.samples
        deadline = time.monotonic() + 60                # the sampler keeps going while the body runs,
        while pm.samples < first + 3 and time.monotonic() < deadline:  # however slowly it is scheduled
            time.sleep(0.005)
        del block
    elapsed = time.perf_counter() - start
    assert 180e6 < pm.delta < 260e6
    assert pm.samples >= first + 3, (first, pm.samples)
    # it waits its interval between samples: never more than elapsed / interval (+ the first one)
    assert pm.samples <= elapsed / 0.01 + 1, (pm.samples, elapsed)


def test_peak_memory_catches_a_spike_shorter_than_one_sample():
    with measure.PeakMemory(interval_s=0.05) as pm:
        fresh_touched_bytes(150_000_000).sum()      # lives for a few milliseconds
    assert pm.delta > 140e6


def test_peak_memory_counts_children():
    code = "import numpy as np, time; a = np.ones(150_000_000, np.uint8); time.sleep(1.0)"
    with measure.PeakMemory() as pm:
        subprocess.run([sys.executable, "-c", code], check=True)
    assert pm.delta > 140e6


def test_peak_memory_refuses_slow_sampling():
    with pytest.raises(ValueError, match="20 Hz"):
        measure.PeakMemory(interval_s=0.2)


def test_disk_usage_counts_the_bytes_of_every_file_under_a_folder(tmp_path):
    (tmp_path / "old").write_bytes(b"x" * 1000)
    before = measure.disk_usage(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "new").write_bytes(b"y" * 12_345)
    assert before == 1000 and measure.disk_usage(tmp_path) - before == 12_345
    assert measure.disk_usage(tmp_path / "missing") == 0


@dataclass
class Throughput:
    """Samples/s over time: call `tick(n)` after each batch; `rate()` and `series()` read it."""

    window: int = 20
    start: float = field(default_factory=time.perf_counter)
    times: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def tick(self, n_samples: int) -> None:
        self.times.append(time.perf_counter())
        self.counts.append((self.counts[-1] if self.counts else 0) + int(n_samples))

    @property
    def total(self) -> int:
        return self.counts[-1] if self.counts else 0

    def rate(self) -> float:
        """Samples/s over the last `window` ticks (over all ticks since start when fewer)."""
        if not self.times:
            return 0.0
        if len(self.times) <= self.window:
            elapsed, done = self.times[-1] - self.start, self.counts[-1]
        else:
            i = -self.window - 1
            elapsed, done = self.times[-1] - self.times[i], self.counts[-1] - self.counts[i]
        return done / elapsed if elapsed > 0 else 0.0

    def overall(self) -> float:
        """Samples/s since start."""
        elapsed = (self.times[-1] - self.start) if self.times else 0.0
        return self.total / elapsed if elapsed > 0 else 0.0

    def series(self) -> tuple[list[float], list[float]]:
        """(seconds since start, samples/s of each interval) for a throughput-over-time plot."""
        xs, ys, prev_t, prev_n = [], [], self.start, 0
        for t, n in zip(self.times, self.counts):
            if t > prev_t:
                xs.append(t - self.start)
                ys.append((n - prev_n) / (t - prev_t))
            prev_t, prev_n = t, n
        return xs, ys


def test_throughput_reports_samples_per_second():
    tp = Throughput(window=3)
    for _ in range(5):
        time.sleep(0.02)
        tp.tick(10)
    assert tp.total == 50
    # the rates are the known counts over the times it recorded (exact, whatever the load) ...
    t = tp.times
    assert tp.overall() == pytest.approx(50 / (t[-1] - tp.start), rel=1e-12)
    assert tp.rate() == pytest.approx(30 / (t[-1] - t[-4]), rel=1e-12)   # the last 3 ticks only
    # ... and a sleep lasts at least its time, so no rate can exceed 10 samples per 0.02 s
    assert 0 < tp.rate() <= 500 and 0 < tp.overall() <= 500
    xs, ys = tp.series()
    assert len(xs) == 5 and all(0 < y <= 500 for y in ys)
    assert ys == pytest.approx([10 / (b - a) for a, b in zip([tp.start, *t[:-1]], t)], rel=1e-12)


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


MID = preset("seed_t4").replace(image_size=128, dim=256, heads=4, capsules=8)


@pytest.mark.parametrize("change", [
    {}, {"H_cycles": 1}, {"H_cycles": 1, "L_cycles": 1}, {"layers": 1},
    {"layers": 3, "H_cycles": 3}, {"mlp_ratio": 2}, {"image_size": 64, "batch_size": 64},
], ids=str)
def test_live_tensor_peak_equals_the_budget_for_model_variants(change):
    torch = pytest.importorskip("torch")
    from nblib.trm import TRMVisionEncoder

    cfg = MID.replace(batch_size=8).replace(**change)
    model = TRMVisionEncoder(cfg.model).eval()
    size = cfg.model.image_size
    images = torch.zeros((cfg.run.batch_size, size, size, 3), dtype=torch.uint8)
    with torch.inference_mode(), TensorPeak() as tp:
        model(images)
    # exact up to per-token statistics (LayerNorm mean/rstd: B*T floats, 1/dim of a stream)
    assert tp.peak == pytest.approx(budget.forward_peak_delta(cfg), rel=2e-3)


# A forward's peak does not grow with the recursion (test_recursion_depth_does_not_raise_the_measured_peak): the
# measured peaks below run one outer and one inner cycle where the depth is not the point, at a third of the CPU.
ONE_CYCLE = {"H_cycles": 1, "L_cycles": 1}


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [preset("smoke").replace(batch_size=512),   # peak: patchify
                                 MID.replace(batch_size=32, **ONE_CYCLE)],  # peak: block MLP
                         ids=["smoke-patchify-peak", "mid-block-peak"])
def test_encoder_peak_rss_matches_the_budget_within_15_percent(cfg):
    predicted = budget.forward_peak_delta(cfg)
    measured = measure.encoder_peak(cfg, cfg.run.batch_size)["rss_delta"]
    assert 0.85 <= measured / predicted <= 1.15, (measured, predicted)


@pytest.mark.slow
def test_math_attention_scores_are_measured_as_predicted():
    many_tokens = preset("smoke").replace(image_size=256, patch=8, dim=64, heads=4, batch_size=8, **ONE_CYCLE)
    predicted = budget.forward_peak_delta(many_tokens, sdpa_backend="math")
    flash = budget.forward_peak_delta(many_tokens, sdpa_backend="flash")
    assert predicted > 5 * flash                      # the scores dominate this config
    measured = measure.encoder_peak(many_tokens, 8, sdpa_backend="math")["rss_delta"]
    assert 0.85 <= measured / predicted <= 1.15, (measured, predicted)


@pytest.mark.slow
def test_recursion_depth_does_not_raise_the_measured_peak():
    shallow = MID.replace(batch_size=32, H_cycles=2, L_cycles=1)
    deep = MID.replace(batch_size=32, H_cycles=2, L_cycles=4)
    a = measure.encoder_peak(shallow, 32)["rss_delta"]
    b = measure.encoder_peak(deep, 32)["rss_delta"]
    assert abs(b - a) < 0.1 * a, (a, b)
