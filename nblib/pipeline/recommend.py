"""Pick the fastest measured config that fits a RAM cap, and say which knob mattered most.

A knob's effect is the spread of samples/s across its values: along its own curve in a
one-knob-at-a-time sweep (the other knobs at base), or between the means of its values in a
product sweep. Trade-off: the pick is the fastest row measured, not a model's optimum between
rows, so it is only as good as the grid (and as the run-to-run noise of a short sweep).
"""
from __future__ import annotations

from dataclasses import dataclass

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
    knob_that_mattered: str
    reason: str

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
    mattered = max(effects, key=lambda k: effects[k][0])
    speedup = best["samples_per_s"] / base["samples_per_s"] if base["samples_per_s"] > 0 else float("inf")
    over = len(table.rows) - len(fitting)
    reason = (f"{_knobs_text(best, table.knobs)}: {fmt_rate(best['samples_per_s'])} = x{speedup:.2f} the "
              f"base's {fmt_rate(base['samples_per_s'])}, data-wait {best['data_wait']:.0%}, peak RSS "
              f"{fmt_bytes(best['peak_rss_bytes'])} under the {fmt_bytes(rss_cap_bytes)} cap"
              f"{f' ({over} configs over the cap left out)' if over else ''}; {mattered} mattered most "
              f"(samples/s spread {effects[mattered][0]:,.1f} across its values)")
    return Recommendation(row=best, base=base, speedup=speedup, rss_cap_bytes=rss_cap_bytes,
                          effects=effects, knob_that_mattered=mattered, reason=reason)


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
