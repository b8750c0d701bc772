"""Verdicts: a figure against what was expected, and configuration A against B measured on a busy machine.

Two kinds, one home. `within_tolerance` judges a value against an expected value or range with a
fixed relative band (default 10%). `verdict_of_pairs` judges two configurations timed (or sized) on
this machine, run in pairs with the order alternating (A B, B A, ...: `nblib.compare.interleaved`), by the ratio
b/a of each pair, so slow drift in the machine's load cancels inside a pair instead of landing on
one configuration. The verdict is firm ("higher", "lower") only when a 95% interval of the
median pair ratio (a seeded bootstrap, never narrower than the sign test's) lies wholly beyond a minimum effect
(MIN_EFFECT, 1.15x on a shared CPU) and reaches past it: x1.13-1.15 and x1.11-1.19 are not firm. Anything less
is "not distinguishable here", plus "cannot tell" where the interval reaches across the minimum effect
("0.42-8.75", "1.09-2.20": the difference may be smaller or larger than a call needs). While it straddles the
minimum effect and the time budget allows, `interleaved` runs more pairs: a firm call needs no further pair.
Memory works the same way on pair differences, against the noise of RSS itself (the spread of
repeated identical measurements): an effect smaller than that noise is "too small to see here".

Trade-off: the minimum effect hides real differences smaller than 15%, and a borderline effect
may read firm in one run and "not distinguishable" in the next; two runs reach opposite firm verdicts only when
the effect itself changed sign between them. Why the whole interval and not the median (the rule until
2026-12-08): on the median, 02's raw writes read x1.15 (1.11-1.19) "faster" idle and x0.55 (0.52-0.66) "slower"
beside two CPU hogs, a reversal; on those two runs of 01, 02 and 05 (42 verdicts) the whole-interval rule
changes that one call and no other. (On 2026-11-26, before pairs were added while an interval straddles, it had
moved 3 and 5 verdicts to the median's 1 and 0.)
The bootstrap is seeded, so a verdict is a pure function of its measurements.

Runs against a fixed figure (a projection, a limit) are judged the same way (`verdict_of_runs`): the
median of each run's ratio to the figure, its interval, the minimum effect, and MIN_PAIRS runs for a
call. What is judged is what is printed: the interval is rounded outward to the DIGITS decimals a
verdict prints, and the median to them, before the call (an interval printed "1.00-1.40" is never firm).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

TOLERANCE = 0.10
MIN_EFFECT = 1.15         # a shared 2-core CPU: smaller speed ratios are not called (state it with the verdict)
MIN_PAIRS = 5             # pairs before the first look at the interval
MAX_PAIRS = 15            # pairs at most, whatever the time budget says
CONFIDENCE = 0.95
BOOTSTRAP_DRAWS = 2000
BOOTSTRAP_SEED = 20261125
NOISE_FACTOR = 1.0        # a memory effect must exceed this many times the RSS noise
DIGITS = 2                # decimals a ratio and its interval print with, and are judged at


def within_tolerance(value: float, expected: float | tuple[float, float], tolerance: float = TOLERANCE) -> bool:
    """`value` lies within `tolerance` of `expected` (a value, or a (low, high) range's ends)."""
    low, high = expected if isinstance(expected, tuple) else (expected, expected)
    return low * (1 - tolerance) <= value <= high * (1 + tolerance)


def verdict(right: bool) -> str:
    """The word a table prints for a check: "right" or "wrong"."""
    return "right" if right else "wrong"


class _Call:
    """What both verdicts share: a call is firm unless its direction is "same", and its text names b and a."""

    @property
    def distinguishable(self) -> bool:
        return self.direction != "same"

    def text(self, *words: str) -> str:
        """'b vs a: ' and the call (`short(*words)`: a paired verdict's words for higher and lower)."""
        return f"{self.b} vs {self.a}: {self.short(*words)}"

    def __str__(self) -> str:
        return self.text()


@dataclass(frozen=True)
class PairedVerdict(_Call):
    """How `b` compares with `a` over paired runs (or runs against a fixed figure `a`): median ratio, interval, call."""

    a: str
    b: str
    ratios: tuple[float, ...]     # b/a of each pair (or each run / the figure), in run order
    low: float                    # the interval of the median ratio, rounded outward to DIGITS
    high: float
    min_effect: float
    min_pairs: int = 1            # fewer pairs than this: no firm call, whatever the interval says
    counted: str = "pairs"        # what `n` counts: "pairs", or "runs" against a fixed figure

    @property
    def n(self) -> int:
        return len(self.ratios)

    @property
    def enough_runs(self) -> bool:
        """At least `min_pairs` pairs: with fewer, a sign test cannot keep false winners under 5%."""
        return self.n >= self.min_pairs

    @property
    def spread(self) -> float:
        """The interval's width as a share: high / low - 1."""
        return self.high / self.low - 1 if self.low > 0 else float("inf")

    @property
    def ratio(self) -> float:
        return float(statistics.median(self.ratios))

    @property
    def direction(self) -> str:
        """'higher' or 'lower' (b against a) when firm; 'same' when not distinguishable here (or too few pairs)."""
        if not self.enough_runs:
            return "same"
        return firm_direction(self.ratio, self.low, self.high, self.min_effect)

    @property
    def within_effect(self) -> bool:
        """The whole interval lies inside the minimum effect, x1/min_effect to x min_effect: "no difference of
        that size" is earned. An interval reaching past it (0.42-8.75) cannot tell, and says so.
        """
        low, high, edge = round(self.low, DIGITS), round(self.high, DIGITS), round(self.min_effect, DIGITS)
        return self.enough_runs and low * edge >= 1 - 1e-12 and high <= edge     # 1/low and high within x edge

    @property
    def undecided(self) -> bool:
        """Too few pairs yet, or the interval straddles the minimum effect: more pairs could change the call."""
        return not self.enough_runs or straddles(self.low, self.high, self.min_effect)

    @property
    def head(self) -> str:
        """What the call is made on, as a table prints it: 'x1.32 (95% interval 1.21-1.40, 7 pairs)'."""
        d = DIGITS
        return f"x{self.ratio:.{d}f} (95% interval {self.low:.{d}f}-{self.high:.{d}f}, {self.n} {self.counted})"

    @property
    def reason(self) -> str:
        """Why the call is not firm, from its numbers ('' when it is firm)."""
        if self.distinguishable:
            return ""
        if not self.enough_runs:
            return f"{self.n} {self.counted}: a call needs {self.min_pairs}"
        if self.low <= 1 <= self.high:
            return f"the 95% interval reaches 1: the noise of the {self.counted} covers the difference"
        effect = f"the minimum effect, x{self.min_effect:.{DIGITS}f} either way, that a call needs on this shared CPU"
        ratio, edge = round(self.ratio, DIGITS), round(self.min_effect, DIGITS)
        if ratio < edge and ratio * edge > 1 + 1e-12:                   # x0.87 is x1/1.149: inside x1.15 either way
            return f"the 95% interval is clear of 1, but x{self.ratio:.{DIGITS}f} is short of {effect}"
        return f"the 95% interval is clear of 1, but it does not lie wholly beyond {effect}"

    def short(self, higher: str = "higher", lower: str = "lower") -> str:
        """'x1.32 (1.21-1.40, 7 pairs): higher' or '..., not distinguishable here (below x1.15 or ...)'."""
        head = self.head
        if self.direction == "higher":
            return f"{head}: {higher}"
        if self.direction == "lower":
            return f"{head}: {lower}"
        if not self.enough_runs:
            return f"{head}: too few {self.counted} for a verdict (a call needs {self.min_pairs})"
        if self.within_effect:
            return f"{head}: not distinguishable here (within x{self.min_effect:.2f} either way)"
        low, high, edge = round(self.low, DIGITS), round(self.high, DIGITS), round(self.min_effect, DIGITS)
        past = " and ".join([f"x{1 / edge:.2f} (1/{edge:.2f})"] * (low * edge < 1 - 1e-12)
                            + [f"x{edge:.2f}"] * (high > edge))          # the edge (or edges) it reaches across
        return (f"{head}: not distinguishable here, cannot tell (the interval reaches across {past}: the difference "
                f"may be smaller or larger than a call needs)")


@dataclass(frozen=True)
class MemoryVerdict(_Call):
    """How much more memory `b` holds than `a`, over paired runs, against the noise of RSS itself."""

    a: str
    b: str
    differences: tuple[float, ...]   # bytes, b - a of each pair
    low: float
    high: float
    noise: float                     # bytes: the spread of repeated identical measurements

    @property
    def difference(self) -> float:
        return float(statistics.median(self.differences))

    @property
    def direction(self) -> str:
        """'more', 'less' or 'same' ('too small to see here')."""
        floor = NOISE_FACTOR * self.noise
        if self.low > 0 and self.difference > floor:
            return "more"
        if self.high < 0 and -self.difference > floor:
            return "less"
        return "same"

    @property
    def reason(self) -> str:
        """Why the call is not firm, from its numbers ('' when it is firm)."""
        from nblib.units import fmt_bytes

        if self.distinguishable:
            return ""
        if self.low <= 0 <= self.high:
            return "the 95% interval of the paired differences reaches 0: the noise of RSS covers the difference"
        return (f"the difference, {fmt_bytes(abs(self.difference))}, is within the RSS noise of "
                f"{fmt_bytes(NOISE_FACTOR * self.noise)}")

    def short(self) -> str:
        """'+12.0 MB (95% interval +8.0 MB to +15.0 MB, 5 pairs, RSS noise 3.0 MB): more': a paired verdict's fields."""
        from nblib.units import fmt_bytes

        def signed(x: float) -> str:
            return f"{'+' if x >= 0 else '-'}{fmt_bytes(abs(x))}"

        head = (f"{signed(self.difference)} (95% interval {signed(self.low)} to {signed(self.high)}, "
                f"{len(self.differences)} pairs, RSS noise {fmt_bytes(self.noise)})")
        if self.direction == "same":
            return f"{head}: too small to see here"
        return f"{head}: {self.direction}"


def paired_order(n_others: int, passes: int) -> list[tuple[int, int]]:
    """Runs of several configurations, each paired with a base run, as (config index, base slot).

    Index 0 is the base's run of that slot; config i >= 1 is paired with the base run of its slot.

    One pass is B c1 c2 B c3 c4 B ...: each config next to a base run (c1 after it, c2 before the
    next, which c3 follows), so a pass costs n + n/2 + 1 runs. Every other pass is the same sequence
    mirrored, so each config runs after its base in one pass and before it in the next. Slots are
    numbered anew in each pass.
    """
    order: list[tuple[int, int]] = []
    for p in range(passes):
        slot = p * (n_others + 2)
        seq = [(0, slot)]
        for j in range(n_others):
            if j % 2 == 0:
                seq.append((j + 1, slot))
            else:
                slot += 1
                seq += [(j + 1, slot), (0, slot)]
        order += seq if p % 2 == 0 else seq[::-1]
    return order


def against_base(run_base: Callable[[], float], runs: dict[str, Callable[[], float]], base_name: str = "base",
                 passes: int = MIN_PAIRS, min_effect: float = MIN_EFFECT) -> tuple[dict, dict]:
    """Run every configuration of `runs` paired with a run of the base (`paired_order`), `passes` times.

    Returns (verdicts: name -> PairedVerdict of it against the base, values: name -> every run, the
    base's under `base_name`).
    """
    names = list(runs)
    values: dict[str, list[float]] = {base_name: [], **{n: [] for n in names}}
    by_slot: dict[int, float] = {}
    slots: dict[str, list[int]] = {n: [] for n in names}
    for i, slot in paired_order(len(names), passes):
        if i == 0:
            by_slot[slot] = float(run_base())
            values[base_name].append(by_slot[slot])
        else:
            values[names[i - 1]].append(float(runs[names[i - 1]]()))
            slots[names[i - 1]].append(slot)
    verdicts = {n: verdict_of_pairs([by_slot[s] for s in slots[n]], values[n], (base_name, n), min_effect)
                for n in names}
    return verdicts, values


def verdict_of_pairs(a_values: Sequence[float], b_values: Sequence[float], names: tuple[str, str] = ("a", "b"),
                     min_effect: float = MIN_EFFECT, min_pairs: int = MIN_PAIRS) -> PairedVerdict:
    """The verdict on measurements already taken in pairs (a_values[i] beside b_values[i]).

    Fewer than `min_pairs` pairs give no firm call: the sign test's interval of 3 pairs is their
    min-max, which excludes 1 by chance in 1 trial of 4 (measured: ~19% false winners at a true
    ratio of 1.0 with 25% noise), against ~5% at 5 pairs.
    """
    check_effect(min_effect)
    a_values, b_values = [float(v) for v in a_values], [float(v) for v in b_values]
    if len(a_values) != len(b_values) or not a_values:
        raise ValueError(f"paired measurements need as many a as b values, at least one: got {len(a_values)} "
                         f"and {len(b_values)}")
    if any(v <= 0 for v in (*a_values, *b_values)):
        raise ValueError("a ratio verdict needs positive measurements (rates, seconds, bytes)")
    return _judged(names, tuple(b / a for a, b in zip(a_values, b_values)), min_effect, min_pairs, "pairs")


def verdict_of_runs(values: Sequence[float], figure: float, names: tuple[str, str] = ("the figure", "the runs"),
                    min_effect: float = MIN_EFFECT, min_runs: int = MIN_PAIRS) -> PairedVerdict:
    """Runs against a fixed figure (a projection, a limit): the one-sample twin of `verdict_of_pairs`.

    Each run's ratio to `figure` takes the place of a pair's ratio: the median ratio, its 95% interval
    (`median_interval`), a firm call only with the whole interval beyond `min_effect`, and
    `min_runs` runs at least. "higher": the runs are above the figure.
    """
    check_effect(min_effect)
    values = [float(v) for v in values]
    if not values or not figure > 0 or any(v <= 0 for v in values):
        raise ValueError(f"runs against a figure need at least one run and positive values (rates, seconds, "
                         f"bytes): got {len(values)} runs against {figure!r}")
    return _judged(names, tuple(v / figure for v in values), min_effect, min_runs, "runs")


def _judged(names: tuple[str, str], ratios: tuple[float, ...], min_effect: float, min_n: int,
            counted: str) -> PairedVerdict:
    """The verdict of `ratios`: their median's interval (on logs), rounded outward to the printed DIGITS."""
    low, high = median_interval([math.log(r) for r in ratios])
    scale = 10 ** DIGITS
    low, high = math.floor(math.exp(low) * scale + 1e-9) / scale, math.ceil(math.exp(high) * scale - 1e-9) / scale
    return PairedVerdict(names[0], names[1], ratios, low, high, min_effect, min_n, counted)


def memory_verdict(a_values: Sequence[float], b_values: Sequence[float],
                   names: tuple[str, str] = ("a", "b")) -> MemoryVerdict:
    """Paired memory measurements (bytes) of a and b, judged against their own noise.

    The noise is the larger range (max - min) of each configuration's repeated values: what RSS
    moves when nothing changed. An effect must exceed it to be called.
    """
    if len(a_values) != len(b_values) or len(a_values) < 2:
        raise ValueError(f"a memory verdict needs at least 2 pairs (the noise is their spread): got "
                         f"{len(a_values)} and {len(b_values)} values")
    differences = tuple(float(b - a) for a, b in zip(a_values, b_values))
    low, high = median_interval(differences)
    noise = max(max(a_values) - min(a_values), max(b_values) - min(b_values))
    return MemoryVerdict(names[0], names[1], differences, low, high, float(noise))


def firm_direction(ratio: float, low: float, high: float, min_effect: float) -> str:
    """'higher' / 'lower' when the whole interval lies beyond the minimum effect (and reaches past it); else
    'same'. An interval that reaches the minimum effect from either side is not firm: at x1.13-1.15 the effect is
    at most the size a call needs, and at x1.11-1.19 it may be less (issue 53: 02's raw writes read x1.15
    (1.11-1.19) "faster" on an idle machine and x0.55 (0.52-0.66) "slower" beside two CPU hogs).

    Judged at the DIGITS decimals a verdict prints: an interval printed "1.00-1.40" or a ratio printed at
    the edge reads as it prints. "lower" is the mirror of "higher" (1/ratio and 1/low against the printed
    min_effect), never a rounded 1/min_effect: x0.87 (0.86-0.87) against x1.15 either way is 1/0.87 = x1.149,
    short of the minimum effect, as x1.13-1.15 is.
    """
    low, high, ratio = round(low, DIGITS), round(high, DIGITS), round(ratio, DIGITS)
    up, eps = round(min_effect, DIGITS), 1e-12
    if low >= up and ratio >= up and high > up:
        return "higher"
    if high * up <= 1 + eps and ratio * up <= 1 + eps and low * up < 1 - eps:
        return "lower"
    return "same"


def straddles(low: float, high: float, min_effect: float) -> bool:
    """The interval reaches across the minimum effect, either way: more pairs could still change the call.

    An interval inside the band (1/min_effect, min_effect) cannot become firm, and one beyond an edge already is.
    """
    return any(low < edge < high for edge in (1 / min_effect, min_effect))


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The interval of the median of `values`: the seeded bootstrap's, widened to the sign test's where wider.

    A percentile bootstrap of a median is too narrow for a handful of pairs (at 5 pairs it covers
    well under 95%); the order-statistic (sign test) interval is exact for any n but coarse. The union keeps
    the bootstrap's resolution at many pairs and the sign test's honesty at few.
    """
    boot_low, boot_high = bootstrap_median_interval(values, confidence)
    rank_low, rank_high = order_statistic_interval(values, confidence)
    return min(boot_low, rank_low), max(boot_high, rank_high)


def bootstrap_median_interval(values: Sequence[float], confidence: float = CONFIDENCE,
                              draws: int = BOOTSTRAP_DRAWS, seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """A percentile bootstrap interval of the median of `values` (seeded: the same values, the same interval)."""
    import numpy as np

    data = np.asarray(values, dtype=float)
    if data.size == 1:
        return float(data[0]), float(data[0])
    rng = np.random.default_rng(seed)
    medians = np.median(data[rng.integers(0, data.size, size=(draws, data.size))], axis=1)
    tail = (1 - confidence) / 2 * 100
    return float(np.percentile(medians, tail)), float(np.percentile(medians, 100 - tail))


def order_statistic_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The distribution-free interval of the median: the k-th smallest to the k-th largest value, with k the
    largest whose binomial(n, 1/2) tail stays within (1 - confidence) / 2 (the min and max when none does).
    """
    ordered = sorted(float(v) for v in values)
    n = len(ordered)
    tail, k, below = (1 - confidence) / 2, 0, 0.0
    while k < n // 2:
        below += math.comb(n, k) / 2 ** n       # P(fewer than k + 1 values below the median)
        if below > tail:
            break
        k += 1
    k = max(k, 1)
    return ordered[k - 1], ordered[n - k]


def check_effect(min_effect: float) -> None:
    if not (isinstance(min_effect, (int, float)) and math.isfinite(min_effect) and min_effect > 1):
        raise ValueError(f"min_effect={min_effect!r} must be a ratio above 1 (for example {MIN_EFFECT})")
