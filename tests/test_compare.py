"""Verdicts under noise (issue 19): each function that turns measurements into a printed conclusion,
fed synthetic noisy measurements. A difference the spread covers must read "not distinguishable".
"""
from __future__ import annotations

import numpy as np
import pytest

from nblib.compare import Spread, compare, interleaved, interleaved_order, spread
from nblib.pipeline import SweepTable
from nblib.pipeline.recommend import knob_verdicts, recommend

# ------------------------------------------------------------------------------ the discipline itself


def test_same_distribution_with_one_outlier_is_not_distinguishable():
    a = spread([100, 101, 99, 100, 100])
    b = spread([100, 102, 99, 160, 101])          # one lucky run
    v = compare(a, b, ("a", "b"))
    assert not v.distinguishable and v.direction == "same"
    assert "not distinguishable here" in v.text() and "95% interval" in v.text()


def test_separated_pairs_are_distinguishable_with_a_direction():
    v = compare(spread([100, 104, 98, 101, 99]), spread([150, 149, 158, 152, 151]))
    assert v.distinguishable and v.direction == "higher" and v.ratio == pytest.approx(1.5, rel=0.03)
    assert compare(spread([150, 149, 158, 152, 151]), spread([100, 104, 98, 101, 99])).direction == "lower"


def test_pairs_cancel_drift_that_makes_the_ranges_overlap():
    # the machine slows down run after run; every round, b is 1.5x a: the ranges overlap, the pairs agree
    a = spread([100, 200, 300, 400, 500])
    v = compare(a, spread([1.5 * x for x in a.values]))
    assert a.high > 1.5 * a.low and v.direction == "higher" and v.ratio == pytest.approx(1.5)


def test_a_difference_under_the_minimum_effect_is_never_called():
    v = compare(spread([100, 100, 100, 100, 100]), spread([110, 110, 110, 110, 110]))
    assert v.low > 1 and not v.distinguishable


def test_too_few_pairs_never_give_a_verdict_however_far_apart():
    v = compare(spread([100]), spread([1000]))
    assert not v.distinguishable and not v.enough_runs and "too few pairs" in v.text()
    three = compare(spread([100, 101, 99]), spread([200, 201, 199]))
    assert not three.distinguishable and "too few pairs" in three.text()


def test_interleaved_alternates_the_order_so_load_hits_every_configuration():
    assert interleaved_order(["a", "b"], 4) == ["a", "b", "b", "a", "a", "b", "b", "a"]
    calls = []
    clock = iter(range(100))

    def run(name):
        calls.append(name)
        return 100 + next(clock)      # a machine getting steadily slower (here: rates drift up)

    got = interleaved({"a": lambda: run("a"), "b": lambda: run("b")}, repeats=3)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert got["a"].values == (100, 103, 104) and got["b"].values == (101, 102, 105)
    # the drift lands on both alike: their ranges overlap, no verdict
    assert not compare(got["a"], got["b"]).distinguishable


def test_a_spread_reports_median_range_and_count():
    s = Spread((3.0, 1.0, 2.0))
    assert (s.median, s.low, s.high, s.n) == (2.0, 1.0, 3.0, 3)
    assert s.text(".0f", "MB") == "2 MB (1-3, 3 runs)"


# ------------------------------------------------------------------------------ item 1: 02 render scaling


def test_render_scaling_never_says_scales_when_more_workers_are_slower():
    from nblib.lab.cache_population import scaling_verdict

    slower = {1: spread([949, 900, 980, 950, 940]), 2: spread([240, 260, 300, 250, 270])}
    verdict = scaling_verdict(slower, n_texts=4000, cores=2, load=7.5)
    assert "scales" not in verdict.split(":")[0] and "slower" in verdict and "load average 7.5" in verdict


def test_render_scaling_with_overlapping_runs_is_not_distinguishable():
    from nblib.lab.cache_population import scaling_verdict

    noisy = {1: spread([900, 950, 1000, 960, 940]), 2: spread([700, 980, 1500, 950, 900])}   # one lucky run
    verdict = scaling_verdict(noisy, n_texts=4000, cores=2, load=1.0)
    assert "not distinguishable" in verdict and "no scaling shown" in verdict


def test_render_scaling_says_the_profile_cannot_show_it_when_a_run_is_start_up():
    from nblib.lab.cache_population import scaling_verdict

    tiny = {1: spread([949, 900, 980, 950, 940]), 2: spread([1700, 1800, 1750, 1720, 1760])}
    assert "cannot show scaling" in scaling_verdict(tiny, n_texts=512, cores=2, load=0.5)
    assert scaling_verdict(tiny, n_texts=4000, cores=2, load=0.5).startswith("rendering scales")


# ------------------------------------------------------------------------------ items 2 and 3: 05 sweeps


def _table(rates_by_value: dict, knob: str = "batch_size", other: dict | None = None) -> SweepTable:
    rows = []
    for i, (value, runs) in enumerate(rates_by_value.items()):
        rows.append({knob: value, **(other or {}), "varied": "base" if i == 0 else knob,
                     "samples_per_s": sorted(runs)[(len(runs) - 1) // 2], "runs": tuple(runs),
                     "data_wait": 0.5, "startup_s": 0.1, "peak_rss_bytes": 1e8})
    return SweepTable(knobs=(knob, *(other or {})), rows=rows, planned=len(rows))


def test_a_base_with_one_slow_run_makes_no_knob_matter():
    # the base's first run paid a one-time start-up: 1,539 against 3,240-3,356 in the others
    table = _table({32: [1539, 3240, 3275], 8: [2300, 3100, 3370], 128: [2900, 3200, 3300]})
    rec = recommend(table, rss_cap_bytes=1e9)
    assert rec.knob_that_mattered is None
    assert "no knob's effect stood out of the noise" in rec.reason
    assert rec.row["batch_size"] == 32   # with repeats the base is not the dip of a V


def test_a_knob_whose_values_separate_beyond_the_spread_mattered():
    table = _table({32: [1000, 1050, 980, 1010, 990], 8: [400, 420, 390, 410, 405],
                    128: [2000, 2100, 1950, 2050, 2010]})
    rec = recommend(table, rss_cap_bytes=1e9)
    assert rec.knob_that_mattered == "batch_size" and rec.row["batch_size"] == 128
    assert "faster than the base, 95% interval" in rec.reason
    assert knob_verdicts(table)["batch_size"].distinguishable


def test_the_sweep_verdict_cell_is_computed_from_the_pairs():
    from nblib.lab.input_pipeline import sweep_verdict

    noisy = _table({32: [1539, 3240, 3275, 3300, 3250], 8: [2300, 3100, 3370, 3200, 3280]})
    assert sweep_verdict(noisy).startswith("no knob's effect stood out")
    clear = _table({32: [1000, 1050, 980, 1010, 990], 128: [2000, 2100, 1950, 2050, 2010]})
    assert sweep_verdict(clear).startswith("batch_size mattered most")


def test_torch_knobs_that_need_workers_are_not_swept_without_workers():
    from nblib.pipeline.grids import torch_inert_knob

    no_workers = {"num_workers": 0, "batch_size": 32, "prefetch_factor": 4, "persistent_workers": False}
    assert "num_workers=0" in torch_inert_knob("prefetch_factor", no_workers, 512, 40)
    assert "num_workers=0" in torch_inert_knob("persistent_workers", no_workers, 512, 40)
    two = {**no_workers, "num_workers": 2}
    assert torch_inert_knob("prefetch_factor", two, 512, 40) is None
    assert "within one epoch" in torch_inert_knob("persistent_workers", two, 512, 15)   # 16 batches an epoch
    assert torch_inert_knob("persistent_workers", two, 512, 40) is None
    assert torch_inert_knob("num_workers", no_workers, 512, 40) is None


def test_a_sweep_skips_inert_configs_and_says_why():
    from nblib.pipeline import sweep

    built = []

    def family(batch_size=8, prefetch=2):
        built.append((batch_size, prefetch))
        return iter([np.zeros((batch_size, 2))] * 20)

    table = sweep(family, {"batch_size": [8, 16], "prefetch": [2, 4]}, steps=3, warmup=1, repeats=3,
                  inert=lambda knob, cfg: "does nothing here" if knob == "prefetch" else None)
    assert (8, 4) not in built and table.skipped == {"prefetch": "does nothing here"}
    assert "not swept: prefetch, does nothing here" in str(table)
    assert all(len(row["runs"]) == 3 for row in table.rows)


# ------------------------------------------------------------------------------ item 5: 05 like for like


def test_the_cacheless_verdict_judges_the_runs_interval_against_the_encoder_and_prints_it():
    from nblib.lab.input_pipeline import cacheless_verdict

    method = "projection: 3 GFLOP per 224 px image at 25% of the T4 peak"
    covers = cacheless_verdict(spread([300, 355, 420, 330, 360]), 345, method, 224, workers=2)
    assert "not distinguishable" in covers and "keeps up" not in covers and "projection" in covers
    assert "reaches 1" in covers and "at 224 px" in covers
    assert "keeps up" in cacheless_verdict(spread([500, 520, 480, 510, 490]), 345, method, 224, workers=2)
    assert "starve" in cacheless_verdict(spread([200, 220, 210, 205, 215]), 345, method, 224, workers=2)
    # W2: every run above the encoder, the median x1.16, the slowest run x1.01: the line prints the interval
    # it judged, never "x1.16 in every run"; an interval reaching back inside the minimum effect is no call
    w2 = cacheless_verdict(spread([345 * r for r in (1.01, 1.10, 1.16, 1.20, 1.30)]), 345, method, 224, workers=2)
    assert "not distinguishable" in w2 and "x1.16 (95% interval 1.01-1.30, 5 runs)" in w2 and "every run" not in w2
    assert "does not lie wholly beyond the minimum effect" in w2 and "not needed" not in w2
    # every run above the encoder, but the median under the minimum effect: no "not needed"
    near = cacheless_verdict(spread([345 * r for r in (1.05, 1.08, 1.12, 1.14, 1.20)]), 345, method, 224, workers=2)
    assert "not distinguishable" in near and "minimum effect" in near and "not needed" not in near
    too_few = cacheless_verdict(spread([500, 520, 480]), 345, method, 224, workers=2)
    assert "not distinguishable" in too_few and "3 runs: a call needs 5" in too_few


def test_the_time_share_verdict_judges_the_pipeline_against_the_encoder_by_its_interval():
    from nblib.lab.input_pipeline import time_share_verdict

    share = {"encoder_samples_per_s": 94, "data_wait": 0.02, "pipeline_samples_per_s": 3000,
             "data_wait_runs": (0.01, 0.02, 0.03, 0.02, 0.01), "pipeline_runs": (2500, 3000, 3300, 2900, 3100)}
    assert time_share_verdict(share).startswith("the encoder is the wall")
    assert "5 runs): faster" in time_share_verdict(share)
    assert time_share_verdict({**share, "data_wait_runs": (0.1, 0.2, 0.7, 0.2, 0.1)}).startswith("not distinguishable")
    assert time_share_verdict({**share, "data_wait_runs": (0.8, 0.7, 0.75, 0.8, 0.9)}).startswith("the input pipeline")
    assert time_share_verdict({**share, "data_wait_runs": (0.02,)}).startswith("too few runs")
    # every run of the pipeline alone above the encoder, by less than the minimum effect: not a firm wall
    near = {**share, "pipeline_runs": (96, 98, 100, 101, 103)}
    assert time_share_verdict(near).startswith("not distinguishable")


def test_the_offload_verdict_is_computed_from_the_pairs():
    from nblib.lab.streaming_encoding import offload_verdict

    noisy = {"async": spread([100, 120, 90, 105, 100]), "consolidate": spread([110, 95, 130, 100, 98])}
    assert "not distinguishable" in offload_verdict(noisy, on_gpu=False)
    clear = {"async": spread([100, 102, 99, 100, 101]), "consolidate": spread([70, 72, 69, 70, 71])}
    got = offload_verdict(clear, on_gpu=True)
    assert got.startswith("consolidate vs async: x0.70 (95% interval") and "slower" in got


def test_the_read_verdict_calls_a_pattern_fast_only_by_its_interval_and_the_minimum_effect():
    from nblib.lab.cache_population import read_verdict

    method = "projection"
    fast = {"raw: random": spread([5000, 5200, 4900, 5100, 5050]), "zlib: stream": spread([900, 1000, 950, 980, 920])}
    assert read_verdict(fast, 345, method).startswith("every read pattern beats")
    assert "zlib: stream, reads x2.75 (95% interval" in read_verdict(fast, 345, method)
    one_slow_run = {**fast, "zlib: random": spread([300, 900, 1000, 950, 980])}
    verdict = read_verdict(one_slow_run, 345, method)
    assert verdict.startswith("not every read pattern") and "zlib: random" in verdict and "raw" not in verdict
    just_above = {**fast, "zlib: random": spread([350, 360, 370, 380, 390])}   # every run above, median x1.07
    assert read_verdict(just_above, 345, method).startswith("not every read pattern")
    small = read_verdict(fast, 345, method, image_size=64)
    assert small.startswith("this profile cannot show it: the encoder's rate is for 224 px images")   # C6: verb first
    assert "this cache holds 64 px ones, 12x fewer bytes each; run the t4 profile" in small
