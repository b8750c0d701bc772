"""Pick the config that beats the base by the most under a RAM cap, and say which knob mattered most.

Every knob value is judged against the base on interleaved pairs (`SweepTable.versus_base`, `nblib.verdict`: a 95%
interval of the median pair ratio and a minimum effect of 1.15x). The pick is, among the rows that fit the cap and
are faster than the base by that verdict, the one with the largest median ratio, unless others are not told apart
from it (their intervals reach its and their medians are within the minimum effect of its): then the first of those
in the sweep's order, the others named beside it, so that two runs do not pick different rows on the noise of two
medians (a row whose one noisy pair widened its interval up to the fastest's, its median far below, is not one of
them); when none is faster, the base stays the pick (picking the fastest of a dozen noisy medians would crown
noise). A knob "mattered" when one of its values is firmly faster or slower than the base; the one that mattered
most has the largest such effect. Trade-off: the pick is a measured row, not a model's optimum between rows, so it
is only as good as the grid.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from nblib.compare import Verdict
from nblib.errors import BudgetExceeded, ConfigError
from nblib.pipeline.sweep import SweepTable, knob_text, sort_key
from nblib.units import fmt_bytes, fmt_rate
from nblib.verdict import MIN_EFFECT


@dataclass(frozen=True)
class Recommendation:
    """The chosen row, the base row it beats, the speed-up, the knob that mattered, and why, in one line."""

    row: dict
    base: dict
    speedup: float
    rss_cap_bytes: float
    knob_that_mattered: str | None   # None when no knob's effect stood out of the noise
    reason: str
    against_base: Verdict | None = None   # the pick against the base, with the spread

    def __str__(self) -> str:
        return self.reason


def recommend(table: SweepTable, rss_cap_bytes: float) -> Recommendation:
    """The row under `rss_cap_bytes` that beats the base by the most (paired verdict), else the base."""
    if not table.rows:
        raise ConfigError("the sweep table has no rows (interrupted before its first config?); sweep again")
    fitting = [r for r in table.rows if r["peak_rss_bytes"] <= rss_cap_bytes]
    if not fitting:
        smallest = min(table.rows, key=lambda r: r["peak_rss_bytes"])
        raise BudgetExceeded(
            f"the RSS cap {fmt_bytes(rss_cap_bytes)} is below the smallest config's peak "
            f"{fmt_bytes(smallest['peak_rss_bytes'])} ({_knobs_text(smallest, table.knobs)}); raise the "
            f"cap to at least that, or sweep smaller buffers and fewer workers")
    base = table.base
    verdicts = knob_verdicts(table)
    mattered = most_effective_knob(verdicts)
    faster = [(r, table.versus_base(r)) for r in fitting if r is not base]
    faster = [(r, v) for r, v in faster if v.direction == "higher"]
    tied: list = []
    if faster:
        fastest = max(faster, key=lambda rv: rv[1].ratio)[1]
        tied = [(r, v) for r, v in faster                              # not told apart from the fastest:
                if v.high >= fastest.low and fastest.ratio < v.ratio * MIN_EFFECT]   # reached, and within 1.15x
        (best, versus), tied = tied[0], tied[1:]
    elif base in fitting:
        best, versus = base, None
    else:
        best = max(fitting, key=lambda r: r["samples_per_s"])
        versus = table.versus_base(best)
    speedup = versus.ratio if versus is not None else 1.0
    over = len(table.rows) - len(fitting)
    head = (f"{_knobs_text(best, table.knobs)}: {fmt_rate(best['samples_per_s'])}"
            + (" (the base: no config under the cap was faster than the base beyond the noise)" if versus is None
               else f" = x{speedup:.2f} the base over {versus.n} pairs ({_versus_text(versus)})"))
    ties = ("" if not tied else "not told apart from it (their 95% intervals overlap; the first in the sweep's "
            "order is picked): " + ", ".join(f"{v.b} x{v.ratio:.2f}" for _, v in tied) + "; ")
    reason = (head + f", data-wait {best['data_wait']:.0%}, peak RSS {fmt_bytes(best['peak_rss_bytes'])} under the "
              f"{fmt_bytes(rss_cap_bytes)} cap{f' ({over} configs over the cap left out)' if over else ''}; "
              + ties + _mattered_text(mattered, verdicts))
    return Recommendation(row=best, base=base, speedup=speedup, rss_cap_bytes=rss_cap_bytes,
                          knob_that_mattered=mattered, reason=reason, against_base=versus)


def value_verdicts(table: SweepTable) -> dict[str, list[Verdict]]:
    """Each knob's values other than the base's, each against the base on its pairs (`SweepTable.versus_base`).

    For a product sweep the rows compared are those whose other knobs are as in the base row.
    """
    base = table.base
    out: dict[str, list[Verdict]] = {}
    if base is None:
        return out
    for knob in table.knobs:
        rows = [r for r in table.rows if r is not base and r[knob] != base[knob]
                and all(r[k] == base[k] for k in table.knobs if k != knob)]
        if rows:
            out[knob] = [table.versus_base(r) for r in sorted(rows, key=lambda r: sort_key(r[knob]))]
    return out


def knob_verdicts(table: SweepTable) -> dict[str, Verdict]:
    """Each knob's strongest value against the base: the firm verdict with the largest effect, else the largest."""
    return {knob: max(vs, key=lambda v: (v.distinguishable, abs(math.log(v.ratio))))
            for knob, vs in value_verdicts(table).items()}


def most_effective_knob(verdicts: dict[str, Verdict]) -> str | None:
    """The knob whose value moved samples/s firmly by the most against the base (None if none did)."""
    real = [k for k, v in verdicts.items() if v.distinguishable]
    return max(real, key=lambda k: abs(math.log(verdicts[k].ratio))) if real else None


def _mattered_text(mattered: str | None, verdicts: dict[str, Verdict]) -> str:
    if mattered is None:
        return ("no knob's effect stood out of the noise: no knob value is faster or slower than the base "
                f"beyond the noise (a call needs the whole 95% interval beyond x{MIN_EFFECT:.2f})")
    v = verdicts[mattered]
    return f"{mattered} mattered most ({v.b} vs {v.a}: {v.short('faster', 'slower')})"


def _versus_text(v: Verdict) -> str:
    if not v.enough_runs:
        return "too few pairs to tell it from the base"
    interval = f"95% interval x{v.low:.2f}-{v.high:.2f}"
    if not v.distinguishable:
        return f"not distinguishable from the base here, {interval}"
    return f"{'faster' if v.ratio > 1 else 'slower'} than the base, {interval}"


def _knobs_text(row: dict, knobs) -> str:
    return ", ".join(f"{k}={knob_text(row[k])}" for k in knobs)

