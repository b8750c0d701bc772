"""Measurement discipline: repeated, interleaved runs, a median and a spread, and a verdict that
says "not distinguishable on this machine" when the spread covers the difference.

One sample on a shared machine says little: a busy moment can halve a rate. Every notebook
measurement that feeds a verdict goes through here. `interleaved` runs each configuration at
least `MIN_REPEATS` times, alternating the order every round (A B, B A, A B ...) so a burst of
load hits both; `Spread` keeps every value with its median and its range (min to max); `compare`
calls two configurations different only when their ranges do not overlap. Trade-off: the
min-max range is conservative (one outlier widens it, so a real but small difference can read
"not distinguishable"), which is the right side to err on for a printed conclusion.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

MIN_REPEATS = 3      # fewer runs than this give no spread worth a verdict


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

    @property
    def relative(self) -> float:
        """(high - low) / median: the spread as a share of the typical value."""
        return (self.high - self.low) / abs(self.median) if self.median else float("inf")

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
                progress: bool | str = False) -> dict[str, Spread]:
    """Run every callable `repeats` times, alternating the order each round; a Spread per name.

    Round 0 runs A, B, C; round 1 runs C, B, A; and so on, so a slow stretch of the machine lands
    on every configuration alike. `progress` (True or a label) shows a tqdm bar over all runs.
    """
    names = list(runs)
    got: dict[str, list[float]] = {name: [] for name in names}
    bar = _bar(len(names) * repeats, progress)
    try:
        for name in interleaved_order(names, repeats):
            got[name].append(float(runs[name]()))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return {name: Spread(tuple(values)) for name, values in got.items()}


def interleaved_order(names: Sequence, repeats: int) -> list:
    """The run order of `interleaved`: forward, backward, forward ... `repeats` rounds."""
    order = []
    for round_ in range(repeats):
        order += list(names) if round_ % 2 == 0 else list(reversed(names))
    return order


@dataclass(frozen=True)
class Verdict:
    """How `b` compares with `a`: the ratio of medians and whether the ranges keep them apart."""

    a: str
    b: str
    ratio: float              # median(b) / median(a)
    distinguishable: bool     # the two ranges do not overlap, and each has MIN_REPEATS runs
    spread: float             # the larger of the two relative spreads
    enough_runs: bool

    @property
    def direction(self) -> str:
        """'higher', 'lower' (b against a) or 'same' when they cannot be told apart."""
        if not self.distinguishable:
            return "same"
        return "higher" if self.ratio > 1 else "lower"

    def text(self, higher: str = "higher", lower: str = "lower") -> str:
        """One line: 'b is x1.32 a: higher' or 'not distinguishable on this machine (spread 12%)'."""
        if not self.enough_runs:
            return (f"{self.b} vs {self.a}: x{self.ratio:.2f}, too few runs for a verdict "
                    f"(fewer than {MIN_REPEATS} each)")
        if not self.distinguishable:
            return (f"{self.b} vs {self.a}: x{self.ratio:.2f}, not distinguishable on this machine "
                    f"(spread {self.spread:.0%})")
        return f"{self.b} vs {self.a}: x{self.ratio:.2f}, {higher if self.ratio > 1 else lower}"

    def short(self) -> str:
        """The verdict without the names: 'x1.32' or 'x1.03, not distinguishable on this machine (spread 12%)'."""
        if not self.enough_runs:
            return f"x{self.ratio:.2f}, too few runs for a verdict"
        if not self.distinguishable:
            return f"x{self.ratio:.2f}, not distinguishable on this machine (spread {self.spread:.0%})"
        return f"x{self.ratio:.2f}, beyond the spread"

    def __str__(self) -> str:
        return self.text()


def compare(a: Spread, b: Spread, names: tuple[str, str] = ("a", "b")) -> Verdict:
    """Compare two Spreads: distinguishable only when their ranges do not overlap."""
    enough = a.n >= MIN_REPEATS and b.n >= MIN_REPEATS
    apart = a.high < b.low or b.high < a.low
    ratio = b.median / a.median if a.median else float("inf")
    return Verdict(a=names[0], b=names[1], ratio=ratio, distinguishable=enough and apart,
                   spread=max(a.relative, b.relative), enough_runs=enough)


def against_value(measured: Spread, value: float) -> str:
    """'above', 'below' or 'covers' a single figure (a projection, a limit): where the range lies."""
    if measured.low > value:
        return "above"
    if measured.high < value:
        return "below"
    return "covers"


def _bar(total: int, progress: bool | str):
    if not progress:
        return None
    return progress_bar(total, progress if isinstance(progress, str) else "measuring", "run")


def progress_bar(total: int, desc: str, unit: str):
    """A text progress bar (tqdm) for a measuring loop, on stderr.

    Plain text, not tqdm's notebook widget, and no monitor thread: a bar that sends widget
    messages from a thread while a panel redraws its Output area was seen to stall a notebook
    kernel under load; text bars cannot.
    """
    from tqdm.std import tqdm

    tqdm.monitor_interval = 0
    return tqdm(total=total, desc=desc, unit=unit, mininterval=1.0)
