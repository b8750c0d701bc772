"""Issue 30: the notebooks' verdicts add pairs while undecided, within a time budget (nblib.verdict's method).

The sweep of notebook 05, its mixing experiment (`compare.interleaved`) and notebook 02's formats
comparison run `repeats` pairs first; a comparison whose interval still straddles the minimum effect
gets more pairs, up to `max_repeats`, while the budget lasts. Measurements here are fabricated
(seeded noise, no wall clock in the numbers), so each test knows which comparison is undecided.
"""
from __future__ import annotations

import itertools
import sys

import numpy as np
import pytest

from nblib.compare import interleaved
from nblib.pipeline import sweep
from nblib.verdict import MAX_PAIRS, verdict_of_pairs


def _noisy_measure(effects: dict, noise: dict, log: list, seed: int = 3):
    """A stand-in for measure_pipeline: knob value -> true speed-up, with a seeded relative noise per value."""
    from nblib.pipeline.harness import PipelineReport

    rng = np.random.default_rng(seed)

    def measure(make, consumer_ms=0.0, consumer=None, steps=20, warmup=2):
        knob = make()
        log.append(knob)
        rate = 1000 * effects.get(knob, 1.0) * (1 + noise.get(knob, 0.01) * rng.standard_normal())
        return PipelineReport(max(rate, 1.0), 0.1, 0.01, 10**8, 0, 8, steps, 8e3 / max(rate, 1.0))
    return measure


@pytest.fixture
def sweep_module():
    return sys.modules["nblib.pipeline.sweep"]     # the package's `sweep` name is the function


def test_an_undecided_config_gets_more_pairs_and_a_decided_one_does_not(monkeypatch, sweep_module):
    log: list = []
    # knob 1 sits on the minimum effect with 20% noise: undecided at 5 pairs; knob 2 doubles the rate, clearly
    monkeypatch.setattr(sweep_module, "measure_pipeline", _noisy_measure({1: 1.15, 2: 2.0}, {1: 0.2}, log))
    table = sweep(lambda knob=0: knob, {"knob": [0, 1, 2]}, steps=4, warmup=1, repeats=5, warm_start=False,
                  budget_s=60.0)
    rows = {r["knob"]: r for r in table.rows}
    assert len(rows[2]["runs"]) == 5 and table.versus_base(rows[2]).direction == "higher"
    assert 5 < len(rows[1]["runs"]) <= MAX_PAIRS
    assert len(rows[1]["base_runs"]) == len(rows[1]["runs"])         # every added run has its own base run
    v = table.versus_base(rows[1])
    assert not v.undecided or v.n == MAX_PAIRS                      # it stopped because it was decided, or at the cap
    assert f"median of 5-{len(rows[1]['runs'])} runs per config" in str(table)


def test_added_pairs_put_each_run_next_to_a_base_run_and_alternate_the_order(monkeypatch, sweep_module):
    log: list = []
    monkeypatch.setattr(sweep_module, "measure_pipeline", _noisy_measure({1: 1.15}, {1: 0.2}, log))
    sweep(lambda knob=0: knob, {"knob": [0, 1]}, steps=4, warmup=1, repeats=5, warm_start=False, budget_s=60.0)
    added = log[10:]                                   # 5 passes of B c1 first
    assert added and len(added) % 2 == 0
    rounds = [tuple(added[i:i + 2]) for i in range(0, len(added), 2)]
    assert set(rounds) <= {(0, 1), (1, 0)}
    assert all(a != b for a, b in itertools.pairwise(rounds))       # B c, c B, B c ...: drift lands on both


def test_a_sweeps_added_pairs_go_on_a_second_bar_so_no_bar_falls_back_from_100(monkeypatch, sweep_module):
    """Newcomer P8 in 05's tf.data sweep: 56/56, then 56/58 97%, 58/60 ... as each round of pairs grew the total."""
    log, bars, original = [], [], sweep_module.progress_bar

    def recorded_bar(*args, **kwargs):
        bars.append(original(*args, **kwargs))
        return bars[-1]

    monkeypatch.setattr(sweep_module, "measure_pipeline", _noisy_measure({1: 1.15}, {1: 0.2}, log))
    monkeypatch.setattr(sweep_module, "progress_bar", recorded_bar)
    sweep(lambda knob=0: knob, {"knob": [0, 1]}, steps=4, warmup=1, repeats=5, warm_start=False, budget_s=60.0,
          progress="tf.data sweep")
    assert len(log) > 10 and len(bars) == 2
    assert bars[0].n == bars[0].total == 10 and bars[1].total is None and bars[1].n == len(log) - 10
    assert bars[1].desc == "tf.data sweep, more pairs while undecided"


def test_without_a_budget_or_with_none_left_no_pair_is_added(monkeypatch, sweep_module):
    for budget in (None, 0.0):
        log: list = []
        monkeypatch.setattr(sweep_module, "measure_pipeline", _noisy_measure({1: 1.15}, {1: 0.2}, log))
        table = sweep(lambda knob=0: knob, {"knob": [0, 1]}, steps=4, warmup=1, repeats=5, warm_start=False,
                      budget_s=budget)
        row = next(r for r in table.rows if r["knob"] == 1)
        assert len(row["runs"]) == 5 and len(log) == 10, budget


def test_interleaved_adds_rounds_only_while_a_named_verdict_is_undecided():
    rng = np.random.default_rng(5)
    calls = {"a": 0, "b": 0, "c": 0}

    def run(name, ratio, noise):
        def go():
            calls[name] += 1
            return 100 * ratio * (1 + noise * rng.standard_normal())
        return go

    got = interleaved({"a": run("a", 1.0, 0.01), "b": run("b", 1.15, 0.2), "c": run("c", 3.0, 0.01)}, 5,
                      decide=(("a", "b"),), budget_s=60.0)
    assert 5 < got["a"].n == got["b"].n == got["c"].n <= MAX_PAIRS      # whole rounds, every name in each
    v = verdict_of_pairs(got["a"].values, got["b"].values)
    assert not v.undecided or v.n == MAX_PAIRS
    assert interleaved({"a": run("a", 1.0, 0.01), "c": run("c", 3.0, 0.01)}, 5, decide=(("a", "c"),),
                       budget_s=60.0)["a"].n == 5                          # decided at 5 pairs: nothing added


def test_interleaved_shows_the_added_rounds_on_a_second_bar_so_no_bar_falls_back_from_100(monkeypatch):
    """Newcomer P8, in 02 [20] too: the bar ran 10/10 100%, then 10/12 83%, as each added round grew its total."""
    from nblib import compare

    rng, bars, original = np.random.default_rng(5), [], compare.progress_bar

    def recorded_bar(*args, **kwargs):
        bars.append(original(*args, **kwargs))
        return bars[-1]

    monkeypatch.setattr(compare, "progress_bar", recorded_bar)
    got = interleaved({"a": lambda: 100 * (1 + 0.01 * rng.standard_normal()),
                       "b": lambda: 115 * (1 + 0.2 * rng.standard_normal())}, 5, "timing", decide=(("a", "b"),),
                      budget_s=60.0)
    assert got["a"].n > 5 and len(bars) == 2
    assert bars[0].n == bars[0].total == 10 and bars[1].total is None and bars[1].n == 2 * (got["a"].n - 5)
    assert bars[1].desc.startswith("timing, more repeats while undecided")


def test_the_formats_comparison_repeats_while_a_verdict_against_the_reference_is_undecided(monkeypatch, tmp_path):
    from nblib.lab import cache_formats

    rates = {"zlib": 1.0, "raw": 1.15, "zstd": 3.0}
    rng = np.random.default_rng(7)
    current = ["zlib"]                  # the format being timed: its rate has 20% noise around `rates`

    def fake_functions(fmt, images, target, shard_mb, batch_size):
        current[0] = fmt
        target.mkdir(parents=True, exist_ok=True)
        (target / "x").write_bytes(b"x")
        return (lambda: None), (lambda: None), (lambda: (lambda i: None))

    def fake_seconds(fn):
        return 1.0 / (rates[current[0]] * (1 + 0.2 * rng.standard_normal()))

    monkeypatch.setattr(cache_formats, "_functions", fake_functions)
    monkeypatch.setattr(cache_formats, "_seconds", fake_seconds)
    monkeypatch.setattr(cache_formats, "_until", lambda deadline, picks, read: 10)
    images = np.zeros((4, 8, 8, 3), np.uint8)
    rows = cache_formats.compare_formats(images, tmp_path, formats=tuple(rates), repeats=5, reference="zlib",
                                         budget_s=60.0, random_s=0.0, min_read_s=0.0)
    assert 5 < len(rows[0]["write_runs"]) <= MAX_PAIRS
    fixed = cache_formats.compare_formats(images, tmp_path, formats=tuple(rates), repeats=5, random_s=0.0,
                                          min_read_s=0.0)
    assert len(fixed[0]["write_runs"]) == 5                           # no reference, no budget: the 5 repeats


def test_the_formats_comparison_shows_the_suites_bar_over_every_run_it_makes(monkeypatch, tmp_path):
    from nblib import compare
    from nblib.lab import cache_formats

    rates = {"zlib": 1.0, "raw": 1.15, "zstd": 3.0}
    rng = np.random.default_rng(7)
    current, bars, original = ["zlib"], [], compare.progress_bar

    def fake_functions(fmt, images, target, shard_mb, batch_size):
        current[0] = fmt
        target.mkdir(parents=True, exist_ok=True)
        (target / "x").write_bytes(b"x")
        return (lambda: None), (lambda: None), (lambda: (lambda i: None))

    def recorded_bar(*args, **kwargs):
        bars.append(original(*args, **kwargs))
        return bars[-1]

    monkeypatch.setattr(cache_formats, "_functions", fake_functions)
    monkeypatch.setattr(cache_formats, "_seconds",
                        lambda fn: 1.0 / (rates[current[0]] * (1 + 0.2 * rng.standard_normal())))
    monkeypatch.setattr(cache_formats, "_until", lambda deadline, picks, read: 10)
    monkeypatch.setattr(compare, "progress_bar", recorded_bar)        # the bars of `compare.rounds`
    rows = cache_formats.compare_formats(np.zeros((4, 8, 8, 3), np.uint8), tmp_path, formats=tuple(rates),
                                         repeats=5, reference="zlib", budget_s=60.0, random_s=0.0, min_read_s=0.0)
    runs = len(rates) * len(rows[0]["write_runs"])
    assert runs > 5 * len(rates)                                                       # repeats were added
    # newcomer P8: a total that grows made the bar fall back from 100%; the added repeats get a bar with no total
    assert len(bars) == 2 and bars[0].n == bars[0].total == 5 * len(rates) and bars[1].total is None
    assert bars[0].n + bars[1].n == runs


def test_a_median_beyond_the_minimum_effect_is_no_call_while_its_interval_reaches_back_inside_it():
    """Issue 53: 02's raw writes read x1.15 (1.11-1.19) "faster" idle and x0.55 "slower" beside two CPU hogs. A call
    needs the whole interval beyond the minimum effect; such an interval is undecided, so `interleaved` and the
    sweeps run more pairs for it while their budget lasts.
    """
    a = [100.0] * 9
    b = [100 * r for r in (0.62, 0.65, 0.68, 0.70, 0.71, 0.72, 0.80, 0.90, 0.95)]
    got = verdict_of_pairs(a, b)
    assert 1 / 1.15 < got.high < 1 and got.direction == "same" and got.undecided
    beyond = verdict_of_pairs(a, [100 * r for r in (0.62, 0.65, 0.68, 0.70, 0.71, 0.72, 0.74, 0.76, 0.80)])
    assert beyond.high <= 1 / 1.15 and beyond.direction == "lower" and not beyond.undecided
    near = verdict_of_pairs(a, [100 * r for r in (0.80, 0.84, 0.86, 0.88, 0.89, 0.90, 0.92, 0.95, 0.97)])
    assert near.ratio > 1 / 1.15 and near.direction == "same"        # the median inside the band: no call


def test_a_read_of_a_few_milliseconds_is_timed_over_passes_that_last_the_minimum(monkeypatch):
    import types

    from nblib.lab import cache_formats

    clock = [0.0]                          # a clock each pass moves by 1 ms: a loaded machine's sleeps vary
    monkeypatch.setattr(cache_formats, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    calls = []

    def read():                            # one pass over a small cache: 1 ms, a fraction of one time slice
        calls.append(1)
        clock[0] += 0.001

    rate = cache_formats._rate(read, 256, min_s=0.03)
    assert len(calls) == 30                # timed over as many passes as last 0.03 s, not one
    assert rate == pytest.approx(256 / 0.001)           # images per second over all the passes
