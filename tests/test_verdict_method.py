"""The paired verdict method (nblib.verdict): noise cannot reverse it, and it calls no winner where there is none."""
from __future__ import annotations

import math
import multiprocessing
import time

import numpy as np
import pytest

from nblib import verdict


def _fabricated_pairs(rng, true_ratio: float, pairs: int, noise: float = 0.25, drift: float = 0.6):
    """Timings with log-normal noise and a slow load drift that both configurations share inside a pair."""
    load = np.exp(np.cumsum(rng.normal(0, drift / math.sqrt(pairs), pairs)))
    a = load * np.exp(rng.normal(0, noise, pairs))
    b = true_ratio * load * np.exp(rng.normal(0, noise, pairs))
    return a, b


@pytest.mark.parametrize("noise", [0.1, 0.25, 0.5])
def test_no_winner_called_at_a_true_ratio_of_one_in_more_than_5_percent_of_trials(noise):
    rng = np.random.default_rng(1)
    trials = 400
    firm = 0
    for t in range(trials):
        a, b = _fabricated_pairs(rng, 1.0, pairs=verdict.MIN_PAIRS + t % 11, noise=noise)
        firm += verdict.verdict_of_pairs(a, b).distinguishable
    assert firm / trials <= 0.05, f"{firm} of {trials} trials called a winner at a true ratio of 1.0"


def test_the_median_interval_of_five_pairs_is_never_narrower_than_the_sign_test():
    values = [0.1, 0.2, 0.3, 0.4, 0.5]
    assert verdict.order_statistic_interval(values) == (0.1, 0.5)
    low, high = verdict.median_interval(values)
    assert low <= 0.1 and high >= 0.5
    assert verdict.order_statistic_interval(list(range(20))) == (5.0, 14.0)


def test_a_real_effect_beyond_the_minimum_is_called_in_its_direction():
    rng = np.random.default_rng(2)
    calls = [verdict.verdict_of_pairs(*_fabricated_pairs(rng, 1.6, pairs=12, noise=0.1)).direction
             for _ in range(50)]
    assert calls.count("higher") >= 45 and "lower" not in calls


def test_an_effect_below_the_minimum_is_not_distinguishable_however_tight():
    a = np.full(10, 100.0) * np.linspace(1, 1.001, 10)
    got = verdict.verdict_of_pairs(a, a * 1.08)
    assert got.low > 1 and got.direction == "same"
    assert "not distinguishable here" in got.short()


def test_the_interval_is_a_pure_function_of_the_measurements():
    a, b = [1.0, 1.2, 0.9, 1.1, 1.3], [1.5, 1.9, 1.2, 1.7, 2.0]
    assert verdict.verdict_of_pairs(a, b) == verdict.verdict_of_pairs(list(a), list(b))


def test_bad_inputs_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="above 1"):
        verdict.verdict_of_pairs([1.0], [1.0], min_effect=0.9)
    with pytest.raises(ValueError, match="as many a as b"):
        verdict.verdict_of_pairs([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        verdict.verdict_of_pairs([0.0], [1.0])


def test_memory_effects_smaller_than_the_rss_noise_are_too_small_to_see():
    noisy_a = [100e6, 104e6, 98e6, 103e6]
    assert verdict.memory_verdict(noisy_a, [v + 3e6 for v in noisy_a]).direction == "same"
    assert "too small to see here" in verdict.memory_verdict(noisy_a, [v + 3e6 for v in noisy_a]).short()
    assert verdict.memory_verdict(noisy_a, [v + 50e6 for v in noisy_a]).direction == "more"
    assert verdict.memory_verdict(noisy_a, [v - 50e6 for v in noisy_a]).direction == "less"


def _hog(stop):
    x = 0
    while not stop.is_set():
        x = (x * 31 + 7) % 1_000_003


def _work(n: int) -> float:
    """Seconds for a fixed amount of real CPU work (a time: larger is slower)."""
    data = np.arange(n, dtype=np.float64)
    start = time.perf_counter()
    for _ in range(20):
        np.sqrt(data + 1.0).sum()
    return time.perf_counter() - start


def _paired(a: int, b: int):
    """The notebooks' paired measurement of two work sizes: interleaved pairs, more while undecided (20 s)."""
    from nblib.compare import compare, interleaved

    got = interleaved({"a": lambda: _work(a), "b": lambda: _work(b)}, decide=(("a", "b"),), budget_s=20)
    return compare(got["a"], got["b"])


@pytest.mark.slow
def test_two_runs_beside_cpu_hogs_never_reach_opposite_verdicts():
    """Two independent measurement sets of the same comparisons, with two CPU hogs running: no reversal."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    hogs = [ctx.Process(target=_hog, args=(stop,), daemon=True) for _ in range(2)]
    for hog in hogs:
        hog.start()
    try:
        comparisons = {"same work": (200_000, 200_000), "1.6x the work": (200_000, 320_000)}
        calls = {name: [_paired(a, b).direction for _ in range(2)] for name, (a, b) in comparisons.items()}
    finally:
        stop.set()
        for hog in hogs:
            hog.join(5)
    for name, (first, second) in calls.items():
        assert {first, second} != {"higher", "lower"}, f"{name}: the verdict reversed between runs ({calls})"
    assert "lower" not in calls["1.6x the work"], calls
