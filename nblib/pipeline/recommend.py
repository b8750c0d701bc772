"""Pick the fastest measured config that fits a RAM cap, and say which knob mattered most.

A knob's effect is the spread of samples/s across its values: along its own curve in a
one-knob-at-a-time sweep (the other knobs at base), or between the means of its values in a
product sweep. Trade-off: the pick is the fastest row measured, not a model's optimum between
rows, so it is only as good as the grid. Noise: each row carries the samples/s of every run
(`SweepTable.spread`); a knob "mattered" only when its best and worst values are distinguishable
(`nblib.compare.compare`: their ranges do not overlap), and the pick is "faster than the base" only
when it is distinguishable from the base. Otherwise the reason says so, with the spread.
"""
from __future__ import annotations

from dataclasses import dataclass

from nblib.compare import Verdict, compare
from nblib.errors import BudgetExceeded, ConfigError
from nblib.pipeline.sweep import BASE, SweepTable, knob_text
from nblib.units import fmt_bytes, fmt_rate


@dataclass(frozen=True)
class Recommendation:
    """The chosen row, the base row it beats, the speed-up, each knob's effect, and why, in one line."""

    row: dict
    base: dict
    speedup: float
    rss_cap_bytes: float
    effects: dict            # knob -> (spread of samples/s, its best value)
    knob_that_mattered: str | None   # None when no knob's effect stood out of the noise
    reason: str
    against_base: Verdict | None = None   # the pick against the base, with the spread

    @property
    def config(self) -> dict:
        """The knobs of the chosen row."""
        return {k: self.row[k] for k in self.effects}

    def __str__(self) -> str:
        return self.reason


def recommend(table: SweepTable, rss_cap_bytes: float) -> Recommendation:
    """The fastest row of `table` whose peak RSS is at most `rss_cap_bytes`, with a one-line reason."""
    if not table.rows:
        raise ConfigError("the sweep table has no rows (interrupted before its first config?); sweep again")
    fitting = [r for r in table.rows if r["peak_rss_bytes"] <= rss_cap_bytes]
    if not fitting:
        smallest = min(table.rows, key=lambda r: r["peak_rss_bytes"])
        raise BudgetExceeded(
            f"the RSS cap {fmt_bytes(rss_cap_bytes)} is below the smallest config's peak "
            f"{fmt_bytes(smallest['peak_rss_bytes'])} ({_knobs_text(smallest, table.knobs)}); raise the "
            f"cap to at least that, or sweep smaller buffers and fewer workers")
    best = max(fitting, key=lambda r: r["samples_per_s"])
    base = table.base
    effects = knob_effects(table)
    verdicts = knob_verdicts(table)
    mattered = most_effective_knob(effects, verdicts)
    speedup = best["samples_per_s"] / base["samples_per_s"] if base["samples_per_s"] > 0 else float("inf")
    over = len(table.rows) - len(fitting)
    versus = None if best is base else compare(table.spread(base), table.spread(best), ("the base", "the pick"))
    reason = (f"{_knobs_text(best, table.knobs)}: {fmt_rate(best['samples_per_s'])} = x{speedup:.2f} the "
              f"base's {fmt_rate(base['samples_per_s'])}"
              + ("" if versus is None else f" ({_versus_text(versus)})")
              + f", data-wait {best['data_wait']:.0%}, peak RSS {fmt_bytes(best['peak_rss_bytes'])} under the "
              f"{fmt_bytes(rss_cap_bytes)} cap{f' ({over} configs over the cap left out)' if over else ''}; "
              + _mattered_text(mattered, effects, verdicts))
    return Recommendation(row=best, base=base, speedup=speedup, rss_cap_bytes=rss_cap_bytes,
                          effects=effects, knob_that_mattered=mattered, reason=reason, against_base=versus)


def knob_verdicts(table: SweepTable) -> dict[str, Verdict]:
    """Each knob's slowest value against its fastest, by their spreads (one-at-a-time sweeps).

    For a product sweep (no curves) the verdicts are those of the rows whose knob takes each value
    with the other knobs as in the fastest row; knobs with a single measured value are left out.
    """
    out = {}
    for knob in table.knobs:
        curve = table.curve(knob)
        if any(r["varied"] == "product" for r in table.rows):
            best_row = max(table.rows, key=lambda r: r["samples_per_s"])
            curve = [r for r in table.rows if all(r[k] == best_row[k] for k in table.knobs if k != knob)]
        if len({str(r[knob]) for r in curve}) < 2:
            continue
        slow = min(curve, key=lambda r: r["samples_per_s"])
        fast = max(curve, key=lambda r: r["samples_per_s"])
        out[knob] = compare(table.spread(slow), table.spread(fast),
                            (f"{knob}={knob_text(slow[knob])}", f"{knob}={knob_text(fast[knob])}"))
    return out


def most_effective_knob(effects: dict, verdicts: dict[str, Verdict]) -> str | None:
    """The knob with the largest effect among those whose effect is distinguishable (None if none is)."""
    real = [k for k, v in verdicts.items() if v.distinguishable]
    return max(real, key=lambda k: effects[k][0]) if real else None


def _mattered_text(mattered: str | None, effects: dict, verdicts: dict[str, Verdict]) -> str:
    if mattered is None:
        widest = max((v.spread for v in verdicts.values()), default=0.0)
        return (f"no knob's effect stood out of the noise: every knob's slowest and fastest values are "
                f"not distinguishable on this machine (spread up to {widest:.0%})")
    return (f"{mattered} mattered most ({verdicts[mattered].b} x{verdicts[mattered].ratio:.2f} "
            f"{verdicts[mattered].a}, beyond the spread)")


def _versus_text(v: Verdict) -> str:
    if not v.enough_runs:
        return "too few runs to tell it from the base"
    if not v.distinguishable:
        return f"not distinguishable from the base on this machine, spread {v.spread:.0%}"
    return "faster than the base beyond the spread" if v.ratio > 1 else "slower than the base"


def knob_effects(table: SweepTable) -> dict[str, tuple[float, object]]:
    """Each knob's (spread of samples/s across its values, the value with the most samples/s)."""
    one_at_a_time = any(r["varied"] not in (BASE, "product") for r in table.rows)
    effects = {}
    for knob in table.knobs:
        rows = table.curve(knob) if one_at_a_time else table.rows
        means: dict = {}
        for row in rows:
            means.setdefault(row[knob], []).append(row["samples_per_s"])
        means = {value: sum(rates) / len(rates) for value, rates in means.items()}
        best = max(means, key=means.get)
        effects[knob] = (max(means.values()) - min(means.values()), best)
    return effects


def _knobs_text(row: dict, knobs) -> str:
    return ", ".join(f"{k}={knob_text(row[k])}" for k in knobs)
