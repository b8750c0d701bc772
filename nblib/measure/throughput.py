"""Samples per second over time: a meter ticked after each batch, read as a rate, an overall rate or a series.

Trade-off: the windowed `rate()` follows changes within `window` ticks but is noisy for small
windows; `overall()` is stable but hides a slowdown.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


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
