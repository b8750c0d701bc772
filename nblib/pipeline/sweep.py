"""Sweep a pipeline's knobs: measure each config of a grid and collect one tidy row per config.

The default sweep varies one knob at a time around a base config (each knob's first value), as a
tuning log does: n knobs of k values cost 1 + n(k - 1) runs instead of k^n, and each knob's curve
is read off directly. `product=True` measures every combination instead. Knobs are the keyword
parameters of `make_pipeline_for`; a grid naming another one is refused before anything runs.
Ctrl-C stops the sweep and returns the rows measured so far.

Noise: in a one-at-a-time sweep every non-base config runs `repeats` times
(`nblib.compare.MIN_REPEATS` by default), each run next to a run of the base (a pair: B c1 c2 B c3
c4 B ..., one base run shared by its two neighbours, the whole pass mirrored every other pass so
each config runs before and after its base alike), after one discarded warm-up run of the base. A
knob value is judged against the base on those pairs (`SweepTable.versus_base`, `nblib.verdict`), so
slow drift in the machine's load cancels inside a pair. With a time budget (`budget_s`, seconds
after those passes), a config whose verdict is still undecided (its interval straddles the minimum
effect, `nblib.verdict`) gets more pairs, round by round, until it is decided, reaches `max_repeats`
pairs, or the next round would overrun the budget; what the budget cannot decide stays "not
distinguishable here". A product sweep runs every config `repeats` times in passes of alternating
order. Each row keeps its median run and the range of all its runs (`runs`, `low`, `high`); a
non-base row also keeps the base run paired with each of its runs (`base_runs`). A knob that has no
effect where it would be tried (`inert`, e.g. prefetch_factor with num_workers=0) is not measured:
the table lists it in `skipped`, with why.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from nblib.compare import MIN_REPEATS, Spread, interleaved_order, progress_bar
from nblib.errors import ConfigError
from nblib.pipeline.harness import measure_pipeline
from nblib.units import fmt_bytes, fmt_duration
from nblib.verdict import MAX_PAIRS, PairedVerdict, paired_order, verdict_of_pairs

BASE = "base"   # the `varied` value of the base config's row


@dataclass
class SweepTable:
    """One row per measured config: its knobs, which knob it varies (or "base"), the report's fields."""

    knobs: tuple[str, ...]
    rows: list[dict] = field(default_factory=list)
    planned: int = 0
    interrupted: bool = False
    skipped: dict = field(default_factory=dict)   # knob -> why it was not swept

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    @property
    def base(self) -> dict | None:
        """The base config's row (the first row of a product sweep); None before it was measured."""
        return next((r for r in self.rows if r["varied"] == BASE), self.rows[0] if self.rows else None)

    def curve(self, knob: str) -> list[dict]:
        """The rows that vary `knob` alone (with the base row), sorted by the knob's value."""
        rows = [r for r in self.rows if r["varied"] in (knob, BASE)]
        return sorted(rows, key=lambda r: sort_key(r[knob]))

    def spread(self, row: dict) -> Spread:
        """A row's samples/s over all its runs."""
        return Spread(tuple(row.get("runs", (row["samples_per_s"],))))

    def versus_base(self, row: dict) -> PairedVerdict:
        """`row` against the base on their pairs (one-at-a-time sweeps), or on runs of the same pass (product)."""
        base = self.base
        names = ("the base", _knobs_diff(row, base, self.knobs))
        if "base_runs" in row:
            return verdict_of_pairs(row["base_runs"], row["runs"], names)
        a, b = self.spread(base).values, self.spread(row).values
        n = min(len(a), len(b))
        return verdict_of_pairs(a[:n], b[:n], names)

    def __str__(self) -> str:
        head = [*self.knobs, "samples/s", "range", "data-wait", "startup", "peak RSS"]
        body = [[knob_text(r[k]) for k in self.knobs] + [f"{r['samples_per_s']:,.0f}", _range_text(self.spread(r)),
                 f"{r['data_wait']:.0%}", fmt_duration(r['startup_s']), fmt_bytes(r["peak_rss_bytes"])]
                for r in self.rows]
        widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
        lines = ["  ".join(f"{c:>{w}}" for c, w in zip(line, widths)) for line in [head, *body]]
        counts = [self.spread(r).n for r in self.rows if r["varied"] != BASE] or [0]
        runs = f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"
        paired = any("base_runs" in r for r in self.rows)
        lines.append(f"(samples/s: median of {runs} runs per config"
                     + (", each next to a run of the base" if paired else ", interleaved") + "; range: min-max)")
        for knob, why in self.skipped.items():
            lines.append(f"(not swept: {knob}, {why})")
        if self.interrupted:
            lines.append(f"(interrupted: {len(self.rows)} of {self.planned} configs measured)")
        return "\n".join(lines)


def sweep(make_pipeline_for: Callable[..., Iterable], grid: Mapping[str, Sequence], *,
          product: bool = False, consumer_ms: float = 0.0,
          consumer: Callable | None = None, steps: int = 20, warmup: int = 2, repeats: int = MIN_REPEATS,
          budget_s: float | None = None, max_repeats: int = MAX_PAIRS,
          inert: Callable[[str, dict], str | None] | None = None, warm_start: bool = True,
          progress: bool | str = False) -> SweepTable:
    """Measure `make_pipeline_for(**config)` for each config of `grid` (see `measure_pipeline`).

    `grid` maps knob names to the values to try; the first value of each is the base. Every config
    runs `repeats` times in passes of alternating order, after one discarded run of the base
    (`warm_start`); a row keeps the median run and every run's samples/s (`runs`).
    With `budget_s` (one-at-a-time sweeps), configs whose verdict against the base is still
    undecided (`PairedVerdict.undecided`) get more pairs, round by round, for at most `budget_s`
    seconds after the `repeats` passes and up to `max_repeats` pairs a config: what the budget
    cannot decide stays "not distinguishable here".
    `inert(knob, config)` returns why a knob does nothing in `config` (or None): such configs are
    not measured. `progress` shows a tqdm bar. Ctrl-C returns the configs measured so far.
    """
    started = time.perf_counter()
    known = knob_names(make_pipeline_for)
    configs, skipped = _drop_inert(plan_configs(grid, product=product, known=known), grid, inert)
    table = SweepTable(knobs=tuple(k for k in grid if k not in skipped or product), planned=len(configs),
                       skipped=skipped)
    paired = not product and len(configs) > 1 and configs[0][0] == BASE
    order = paired_order(len(configs) - 1, max(1, repeats)) if paired else \
        [(i, None) for i in interleaved_order(range(len(configs)), max(1, repeats))]
    runs = _Runs(configs, functools.partial(measure_pipeline, consumer_ms=consumer_ms, consumer=consumer,
                                            steps=steps, warmup=warmup), make_pipeline_for,
                 progress_bar(len(order) + bool(warm_start and configs),
                              progress if isinstance(progress, str) else "sweep", "run", disable=not progress))
    try:
        if warm_start and configs:
            measure_pipeline(lambda: make_pipeline_for(**configs[0][1]), consumer_ms, consumer=consumer,
                             steps=max(1, steps // 2), warmup=warmup)
            runs.bar.update(1)
        for i, slot in order:
            runs.measure(i, slot)
        if paired and budget_s is not None:
            runs.more_pairs(started, time.perf_counter() + budget_s, max_repeats, first_pass=max(1, repeats))
    except KeyboardInterrupt:
        table.interrupted = True
    finally:
        runs.bar.close()
    table.rows = runs.rows(paired)
    if table.interrupted:
        warnings.warn(f"sweep interrupted: returning the {len(table.rows)} of {len(configs)} configs "
                      f"measured so far", stacklevel=2)
    return table


class _Runs:
    """A sweep's runs so far: each config's reports, the base slot each is paired with, the base run of each slot."""

    def __init__(self, configs: list, measure: Callable, make_pipeline_for: Callable, bar):
        self.configs, self._measure, self._make, self.bar = configs, measure, make_pipeline_for, bar
        self.reports: list[list] = [[] for _ in configs]
        self.slots: list[list] = [[] for _ in configs]     # the base slot each run of a config is paired with
        self.base_by_slot: dict = {}

    def measure(self, i: int, slot) -> None:
        config = self.configs[i][1]
        self.reports[i].append(self._measure(lambda: self._make(**config)))
        if slot is not None:
            self.slots[i].append(slot)
            if i == 0:
                self.base_by_slot[slot] = self.reports[i][-1]
        self.bar.update(1)

    def verdict(self, i: int) -> PairedVerdict:
        """Config i against the base on its pairs so far (samples/s)."""
        pairs = [(self.base_by_slot[s], r) for s, r in zip(self.slots[i], self.reports[i]) if s in self.base_by_slot]
        return verdict_of_pairs([b.samples_per_s for b, _ in pairs], [r.samples_per_s for _, r in pairs])

    def more_pairs(self, started: float, deadline: float, max_repeats: int, first_pass: int) -> None:
        """Rounds of pairs for the undecided configs (each next to a base run), while a round fits before `deadline`.

        A round's cost is estimated from the runs so far (since `started`); a round that would end past the
        deadline is not begun. The rounds continue the passes' alternation (`paired_order`, mirrored every other).
        """
        per_run = (time.perf_counter() - started) / max(1, sum(map(len, self.reports)))
        round_ = first_pass
        while True:
            todo = [i for i in range(1, len(self.configs))
                    if len(self.reports[i]) < max_repeats and self.verdict(i).undecided]
            if not todo:
                return
            order = paired_order(len(todo), round_ + 1)[-(len(todo) + len(todo) // 2 + 1):]
            start = time.perf_counter()
            if start + len(order) * per_run > deadline:
                return
            if not self.bar.disable and self.bar.total is not None:   # the added pairs on a bar with no total
                self.bar.close()                                      # (a grown total fell back from 100%: P8)
                self.bar = progress_bar(None, f"{self.bar.desc}, more pairs while undecided", "run")
            for j, slot in order:
                self.measure(0 if j == 0 else todo[j - 1], ("more", round_, slot))
            per_run = (time.perf_counter() - start) / len(order)
            round_ += 1

    def rows(self, paired: bool) -> list[dict]:
        """One row per measured config; a non-base row of a paired sweep keeps only runs whose base run exists."""
        rows = []
        for i, ((varied, config), reports) in enumerate(zip(self.configs, self.reports)):
            kept = [(s, r) for s, r in zip(self.slots[i], reports) if s in self.base_by_slot] \
                if paired and i else [(None, r) for r in reports]
            if not kept:
                continue
            row = _row(config, varied, [r for _, r in kept])
            if paired and i:
                paired_base = [self.base_by_slot[s] for s, _ in kept]
                row["base_runs"] = tuple(r.samples_per_s for r in paired_base)
                row["base_rss_runs"] = tuple(r.peak_rss_bytes for r in paired_base)
                row["base_startup_runs"] = tuple(r.startup_s for r in paired_base)
            rows.append(row)
        return rows


def _drop_inert(configs: list, grid: Mapping, inert) -> tuple[list, dict]:
    """The configs whose varied knob acts (`inert` returns None for it), and knob -> why for those left out."""
    if inert is None:
        return configs, {}
    kept, skipped = [], {}
    for varied, config in configs:
        why = inert(varied, config) if varied in grid else None
        if why:
            skipped[varied] = why
        else:
            kept.append((varied, config))
    return kept, skipped


def plan_configs(grid: Mapping[str, Sequence], *, product: bool = False,
                 known: Iterable[str] | None = None) -> list[tuple[str, dict]]:
    """The configs a sweep measures, each as (knob it varies or "base", {knob: value})."""
    values = _checked_grid(grid, known)
    start = {k: v[0] for k, v in values.items()}
    if product:
        combos = [dict(zip(values, combo)) for combo in itertools.product(*values.values())]
        return [(BASE if combo == start else "product", combo) for combo in combos]
    configs = [(BASE, dict(start))]
    for knob, options in values.items():
        configs += [(knob, {**start, knob: v}) for v in options if v != start[knob]]
    return configs


def knob_text(value) -> str:
    """A knob's value as a table shows it (-1, tf.data.AUTOTUNE, as "AUTOTUNE")."""
    return "AUTOTUNE" if value == -1 and not isinstance(value, bool) else str(value)


def knob_names(make_pipeline_for: Callable) -> tuple[str, ...] | None:
    """The keyword parameters of a pipeline factory (None when it takes **kwargs: any knob goes)."""
    params = inspect.signature(make_pipeline_for).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


# ------------------------------------------------------------------------------ helpers


def _row(config: dict, varied: str, reports: list) -> dict:
    """One table row: the knobs, the median run's report, every run's samples/s (peak RSS, startup) and their range."""
    rates = tuple(r.samples_per_s for r in reports)
    return {**config, "varied": varied, **_median_run(reports).as_dict(), "runs": rates,
            "low": min(rates), "high": max(rates), "rss_runs": tuple(r.peak_rss_bytes for r in reports),
            "startup_runs": tuple(r.startup_s for r in reports)}


def _knobs_diff(row: dict, base: dict, knobs) -> str:
    """The knobs where `row` differs from `base`, as 'cycle_length=1' (or 'the base')."""
    diff = [f"{k}={knob_text(row[k])}" for k in knobs if row[k] != base[k]]
    return ", ".join(diff) or "the base"


def _range_text(spread: Spread) -> str:
    return f"{spread.low:,.0f}-{spread.high:,.0f}" if spread.n > 1 else "1 run"


def _median_run(reports: list):
    """The run with the median samples/s (the lower middle one of an even count)."""
    ranked = sorted(reports, key=lambda r: r.samples_per_s)
    return ranked[(len(ranked) - 1) // 2]


def _checked_grid(grid: Mapping[str, Sequence], known: Iterable[str] | None) -> dict[str, list]:
    if not grid:
        raise ConfigError("the grid is empty; give at least one knob with its values, e.g. {'batch_size': [32, 128]}")
    values = {}
    for knob, options in grid.items():
        options = list(options) if isinstance(options, (list, tuple, range)) else [options]
        if not options:
            raise ConfigError(f"grid[{knob!r}] has no values; give at least one")
        values[knob] = options
    if known is not None:
        known = tuple(known)
        unknown = [k for k in values if k not in known]
        if unknown:
            raise ConfigError(f"unknown knob {unknown[0]!r} in the grid; known knobs: {', '.join(known)}")
    return values


def sort_key(value):
    """Numbers before anything else, in order; the rest by their text (a knob's values, sorted)."""
    return (0, value, "") if isinstance(value, (int, float)) and not isinstance(value, bool) else (1, 0, str(value))


