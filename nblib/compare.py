"""Measurement discipline: repeated, interleaved runs, a median and a spread, and a paired verdict
that says "not distinguishable here" when noise covers the difference.

One sample on a shared machine says little: a busy moment can halve a rate. Every notebook
measurement that feeds a verdict goes through here. `interleaved` runs each configuration
`MIN_REPEATS` times, alternating the order every round (A B, B A, A B ...) so a burst of load
hits both; `Spread` keeps every value, in run order, with its median and its range (min to max);
`compare` judges the runs of one round as a pair with `nblib.verdict` (per-pair ratios, a 95%
interval of their median, a minimum effect of 1.15x), so slow drift in the machine's load cancels
inside a pair. Trade-off: differences under 15% are never called on this shared CPU. Runs against a
fixed figure (a projection, a limit) are judged by `nblib.verdict.verdict_of_runs`, the same method on
each run's ratio to the figure; a Spread's range is for reading, never for a verdict.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from nblib.verdict import MAX_PAIRS, MIN_PAIRS, PairedVerdict, verdict_of_pairs

MIN_REPEATS = MIN_PAIRS   # runs of each configuration: fewer pairs than this give no firm verdict


@dataclass(frozen=True)
class Spread:
    """Repeated measurements of one quantity: every value, its median and its range."""

    values: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def median(self) -> float:
        return float(statistics.median(self.values))

    @property
    def low(self) -> float:
        return float(min(self.values))

    @property
    def high(self) -> float:
        return float(max(self.values))

    def text(self, fmt: str = ",.0f", unit: str = "") -> str:
        """'1,234/s (1,100-1,300, 3 runs)': the median, the range and the count."""
        u = f" {unit}" if unit else ""
        if self.n == 1:
            return f"{self.median:{fmt}}{u} (1 run)"
        return f"{self.median:{fmt}}{u} ({self.low:{fmt}}-{self.high:{fmt}}, {self.n} runs)"

    def __str__(self) -> str:
        return self.text()


def spread(values: Iterable[float]) -> Spread:
    """A Spread of `values` (at least one)."""
    got = tuple(float(v) for v in values)
    if not got:
        raise ValueError("a spread needs at least one value")
    return Spread(got)


def interleaved(runs: Mapping[str, Callable[[], float]], repeats: int = MIN_REPEATS,
                progress: bool | str = False, *, decide: Sequence[tuple[str, str]] = (),
                budget_s: float | None = None, max_repeats: int = MAX_PAIRS) -> dict[str, Spread]:
    """Run every callable `repeats` times, alternating the order each round; a Spread per name.

    Round 0 runs A, B, C; round 1 runs C, B, A; and so on, so a slow stretch of the machine lands
    on every configuration alike. `progress` (True or a label) shows a tqdm bar over all runs.
    Adaptive repeats: with `decide` (pairs of names, (a, b) judged as `compare` does) and
    `budget_s`, more rounds run after the first `repeats` while one of those verdicts is undecided
    (`PairedVerdict.undecided`), for at most `budget_s` seconds and `max_repeats` rounds: what the
    budget cannot decide stays "not distinguishable here". Those rounds get a second bar, with no total (a
    total that grew made the bar fall back from 100%: newcomer P8).
    """
    names = list(runs)
    got: dict[str, list[float]] = {name: [] for name in names}

    def measure_round(r: int, bar) -> None:
        for name in interleaved_order(names, r + 1)[-len(names):]:
            got[name].append(float(runs[name]()))
            bar.update(1)

    rounds(measure_round, repeats, len(names), progress if isinstance(progress, str) else "measuring",
           lambda: any(verdict_of_pairs(got[a], got[b]).undecided for a, b in decide),
           budget_s=budget_s, max_repeats=max_repeats, progress=bool(progress))
    return {name: Spread(tuple(values)) for name, values in got.items()}


def rounds(measure_round: Callable[[int, object], None], repeats: int, runs_per_round: int, desc: str,
           undecided: Callable[[], bool], *, budget_s: float | None = None, max_repeats: int = MAX_PAIRS,
           progress: bool = True) -> int:
    """Call `measure_round(round, bar)` `repeats` times, then again while `undecided()` and a round fits.

    The added rounds run for at most `budget_s` seconds (a round that would end past it is not begun) and up to
    `max_repeats` rounds in all. `measure_round` updates the suite's bar once per run: `runs_per_round` runs a
    round on a bar with their total, then the added rounds on a second bar with none (a total that grew made the
    bar fall back from 100%: newcomer P8). Returns the rounds run.
    """
    bar = progress_bar(repeats * runs_per_round, desc, "run", disable=not progress)
    done, deadline, per_round = 0, None, 0.0
    try:
        while done < repeats or (budget_s is not None and done < max_repeats and (
                deadline is None or time.perf_counter() + per_round <= deadline) and undecided()):
            if done == repeats:           # the added rounds, on a bar of their own (the verdicts decide how many)
                deadline = time.perf_counter() + budget_s
                bar.close()
                bar = progress_bar(None, f"{desc}, more repeats while undecided (up to {budget_s:g} s)", "run",
                                   disable=not progress)
            start = time.perf_counter()
            measure_round(done, bar)
            per_round, done = time.perf_counter() - start, done + 1
    finally:
        bar.close()
    return done


def interleaved_order(names: Sequence, repeats: int) -> list:
    """The run order of `interleaved`: forward, backward, forward ... `repeats` rounds."""
    order = []
    for round_ in range(repeats):
        order += list(names) if round_ % 2 == 0 else list(reversed(names))
    return order


Verdict = PairedVerdict   # what `compare` returns: the paired method of nblib.verdict


def compare(a: Spread, b: Spread, names: tuple[str, str] = ("a", "b")) -> Verdict:
    """Compare two Spreads measured together by `interleaved`: their i-th runs are a pair (one round).

    The verdict is `nblib.verdict.verdict_of_pairs` on the per-round ratios b/a (a minimum effect of
    MIN_EFFECT, a 95% interval of the median ratio, MIN_PAIRS pairs for a firm call), never a
    comparison of two ranges. Spreads of unequal length are paired over their first common runs.
    """
    n = min(a.n, b.n)
    return verdict_of_pairs(a.values[:n], b.values[:n], names)


def progress_bar(total: int, desc: str, unit: str, *, initial: int = 0, disable: bool = False,
                 widget: bool = False, **options):
    """The suite's one progress bar (tqdm): every loop of nblib that shows progress uses it.

    Text on stderr by default; `widget=True` gives tqdm.auto's Jupyter widget (text outside Jupyter)
    for a bar updated from the calling thread only. Never tqdm's monitor thread: it outlives the
    bar (notebook 06's training cell left one running) and refreshes bars from its own thread, and a
    bar that sends widget messages from a thread while a panel redraws its Output area was seen to
    stall a notebook kernel under load. `options` go to tqdm (unit_scale, smoothing, ...).
    """
    if widget:
        from tqdm.auto import tqdm
    else:
        from tqdm.std import tqdm

    tqdm.monitor_interval = 0                   # the class attribute: no TMonitor thread is started
    return tqdm(total=total, desc=desc, unit=unit, initial=initial, disable=disable,
                mininterval=options.pop("mininterval", 1.0), **options)
