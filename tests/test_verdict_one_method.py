"""One verdict method, and prose that says what the cells did (issue 37).

Runs against a fixed figure are judged by the paired method's twin (`verdict.verdict_of_runs`); a firm
call never prints an interval that reaches 1; tables print the verdict's ratio and interval, never a
ratio of medians; and a notebook's markdown neither describes another method nor types a count of runs
or pairs that its cells compute.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from nblib import verdict
from nblib.compare import spread

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PRINTED = re.compile(r"x(?P<ratio>[\d.]+) \(95% interval (?P<low>[\d.]+)-(?P<high>[\d.]+), (?P<n>\d+) (pairs|runs)\)")

# ------------------------------------------------------------------------------ the one-sample twin


def test_runs_against_a_figure_are_judged_as_pairs_against_a_constant_would_be():
    rng = np.random.default_rng(7)
    for _ in range(40):
        runs = 100 * rng.lognormal(rng.normal(0, 0.3), 0.2, size=int(rng.integers(3, 12)))
        twin, paired = verdict.verdict_of_runs(runs, 100.0), verdict.verdict_of_pairs([100.0] * len(runs), runs)
        assert (twin.ratio, twin.low, twin.high, twin.direction) == (paired.ratio, paired.low, paired.high,
                                                                      paired.direction)
        assert twin.short().replace(" runs)", " pairs)").replace("too few runs", "too few pairs") == paired.short()


def test_runs_clear_of_the_figure_by_the_minimum_effect_are_firm_and_say_runs():
    got = verdict.verdict_of_runs([130, 125, 140, 135, 128], 100, ("the encoder", "rendering"))
    assert got.direction == "higher" and got.short("faster", "slower").endswith("5 runs): faster")
    assert verdict.verdict_of_runs([70, 72, 69, 71, 73], 100).direction == "lower"


def test_runs_all_above_the_figure_by_less_than_the_minimum_effect_are_not_called():
    got = verdict.verdict_of_runs([105, 108, 112, 114, 120], 100)
    assert got.low > 1 and got.direction == "same"
    assert "minimum effect" in got.reason and "x1.15" in got.reason


def test_too_few_runs_against_a_figure_give_no_call_whatever_their_ratio():
    got = verdict.verdict_of_runs([300, 310, 320], 100)
    assert got.direction == "same" and "too few runs" in got.short() and got.reason == "3 runs: a call needs 5"


def test_runs_against_a_figure_refuse_what_has_no_ratio():
    with pytest.raises(ValueError, match="positive"):
        verdict.verdict_of_runs([1.0, 2.0], 0.0)
    with pytest.raises(ValueError, match="at least one run"):
        verdict.verdict_of_runs([], 1.0)
    with pytest.raises(ValueError, match="above 1"):
        verdict.verdict_of_runs([1.0], 1.0, min_effect=1.0)


# ------------------------------------------------------------------------------ C10: what is judged is what is printed


def test_a_firm_call_never_prints_an_interval_that_reaches_one():
    # five pairs whose smallest ratio is 1.003: the interval is their min-max, printed 1.00-...
    a = [100.0] * 5
    b = [100.3, 128.0, 131.0, 140.0, 160.0]
    got = verdict.verdict_of_pairs(a, b)
    assert "95% interval 1.00-1.60" in got.short() and got.direction == "same"
    assert "reaches 1" in got.reason


def test_every_printed_firm_verdict_is_firm_by_its_printed_numbers():
    rng = np.random.default_rng(11)
    edge = round(verdict.MIN_EFFECT, verdict.DIGITS)

    def higher(ratio, low, high):     # the whole interval at or beyond x edge, and past it
        return low >= edge and ratio >= edge and high > edge

    def lower(ratio, low, high):      # the mirror: 1/high, 1/ratio and 1/low against x edge (x0.87 is x1/1.149)
        return high * edge <= 1 + 1e-12 and ratio * edge <= 1 + 1e-12 and low * edge < 1 - 1e-12

    firm = 0
    for _ in range(600):
        n = int(rng.integers(5, 12))
        ratios = rng.lognormal(rng.normal(0, 0.25), rng.uniform(0.01, 0.3), size=n)
        for got in (verdict.verdict_of_pairs([1.0] * n, ratios), verdict.verdict_of_runs(ratios, 1.0)):
            m = PRINTED.search(got.short())
            ratio, low, high = (float(m.group(k)) for k in ("ratio", "low", "high"))
            assert low <= ratio <= high, got.short()
            assert (got.direction == "higher") == higher(ratio, low, high), got.short()
            assert (got.direction == "lower") == lower(ratio, low, high), got.short()
            firm += got.direction != "same"
    assert firm > 100          # the check saw firm calls, not only undecided ones


# ------------------------------------------------------------------------------ tables print the verdict


def test_the_scaling_table_prints_the_paired_verdicts_speed_up_not_a_ratio_of_medians():
    from nblib.compare import compare
    from nblib.lab.cache_population import Scaling

    one = spread([100, 200, 300, 400, 500])
    two = spread([180, 230, 330, 420, 900])      # ratio of medians x1.10; pair ratios 1.8, 1.15, 1.1, 1.05, 1.8
    table = Scaling({1: one, 2: two}, n_texts=4000, cores=2, load=1.0).table()
    assert f"speed-up {compare(one, two).head}" in table and "x1.15 (95% interval" in table
    assert "x1.10" not in table


def test_the_mixing_table_prints_the_verdicts_and_the_fix_works_only_by_its_interval():
    from nblib.lab.input_pipeline import MixingResult

    single = (1000, 1100, 900, 1050, 950)
    fixed = (700, 1100, 880, 1150, 960)        # median 960: 96% of one dataset's median; pair ratios 0.70-1.10
    result = MixingResult(2, 1000, 600, 960, 5, {"single": single, "mixed": tuple(0.6 * v for v in single),
                                                  "fixed": fixed})
    table = result.table()
    assert result.mixing.head in table and result.fix.head in table and "medians:" not in table
    assert not result.fix_works and "reaches below x0.80" in table
    steady = MixingResult(2, 1000, 600, 960, 5, {"single": single, "mixed": single,
                                                  "fixed": tuple(0.95 * v for v in single)})
    assert steady.fix_works and "at or above x0.80" in steady.table()
    assert "x0.72" in table                      # the reference, 148 vs 205 samples/s, as the same ratio


def test_the_builtins_table_prints_the_paired_verdict_beside_each_shuffle():
    from nblib import tfdata
    from nblib.lab.shuffle_checkpoints import BuiltinRow, builtins_table

    versus = verdict.verdict_of_pairs([100, 300, 200, 250, 150], [600, 650, 1000, 1500, 800])
    rows = [BuiltinRow(tfdata.TF_SHUFFLE, 100, 200, 10_000, 9_000, True, True, 3111.0, None),
            BuiltinRow(tfdata.TF_GLOBAL_SHUFFLE, 100, 200, 400, 300, True, True, 6015.0, None, versus_tf=versus)]
    table = builtins_table(rows)
    assert versus.head in table and "the base" in table


def test_the_sweep_header_gives_the_pair_counts_its_lines_show():
    from nblib.lab.input_pipeline import sweep_verdict
    from nblib.pipeline import SweepTable

    base = {"batch_size": 32, "varied": "base", "samples_per_s": 100, "runs": (100.0,) * 10,
            "data_wait": 0.5, "startup_s": 0.1, "peak_rss_bytes": 1e8}
    rows = [base, {**base, "batch_size": 8, "varied": "batch_size", "base_runs": (100.0,) * 5, "runs": (50.0,) * 5},
            {**base, "batch_size": 128, "varied": "batch_size", "base_runs": (100.0,) * 10, "runs": (101.0,) * 10}]
    text = sweep_verdict(SweepTable(knobs=("batch_size",), rows=rows, planned=3))
    assert "(5-10 pairs, each next to a base run" in text
    assert "5 pairs): slower" in text and "10 pairs): not distinguishable" in text


def test_a_findings_why_names_what_kept_it_from_a_call():
    from nblib.lab.input_pipeline import MixingResult, needle_table
    from nblib.pipeline import SweepTable

    def table(batch_runs):
        rows = [{"batch_size": b, "varied": "base" if i == 0 else "batch_size", "samples_per_s": float(np.median(r)),
                 "runs": tuple(r), "data_wait": 0.5, "startup_s": 0.1, "peak_rss_bytes": 1e8}
                for i, (b, r) in enumerate(batch_runs)]
        return SweepTable(knobs=("batch_size",), rows=rows, planned=len(rows))

    share = {"data_wait": 0.8, "encoder_samples_per_s": 94, "pipeline_samples_per_s": 100}
    mixing = MixingResult(2, 200, 140, 190, 1)
    trap = [{"num_workers": 0, "rss_added_bytes": 0}, {"num_workers": 1, "rss_added_bytes": 5e8}]
    base = [100, 101, 99, 100, 100.5]
    short_of_effect = needle_table(share, table([(32, base), (128, [v * 1.12 for v in base])]), mixing, trap)[1]
    assert short_of_effect["why"].startswith("the 95% interval is clear of 1, but x1.12 is short of the minimum")
    noisy = needle_table(share, table([(32, base), (128, [80, 130, 95, 140, 101])]), mixing, trap)[1]
    assert noisy["why"].startswith("the 95% interval reaches 1")
    slower_short = needle_table(share, table([(32, base), (128, [v * 0.92 for v in base])]), mixing, trap)[1]
    assert "x0.92 is short of the minimum effect, x1.15 either way," in slower_short["why"]


# ------------------------------------------------------------------------------ prose says what the cells did

# a verdict method the cells do not use: ranges of runs, or a range against a value
OLD_METHOD = re.compile(r"ranges?\s+(?:of\s+[^.]{0,60}?)?overlap|compares?\s+the\s+ranges|range\s+covers"
                        r"|ratio\s+of\s+(?:the\s+)?medians\s+decides", re.I)
# a count of runs or pairs typed in prose: "3 interleaved runs", "5 pairs", "three runs", "run 5 times"
NUMBER = r"(?:\d+|one|two|three|four|five|six|seven|eight|nine|ten)"
TYPED_COUNT = re.compile(rf"\b{NUMBER}\s+(?:interleaved\s+|paired\s+|repeated\s+)?(?:runs|pairs|repeats|rounds)\b"
                         rf"|\bruns?\s+{NUMBER}\s+times\b", re.I)
STATED_EFFECT = re.compile(r"minimum effect (?:of )?(?P<a>\d+\.\d+)x|(?P<b>\d+\.\d+)x minimum effect", re.I)


def markdown_problems(nb: dict) -> list[str]:
    """(cell, what) of each markdown line that describes another verdict method or types a run count."""
    found = []
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"])
        found += [f"[{index}] another method: {m.group(0)!r}" for m in OLD_METHOD.finditer(text)]
        found += [f"[{index}] a typed count: {m.group(0)!r}" for m in TYPED_COUNT.finditer(text)]
        found += [f"[{index}] minimum effect {m.group('a') or m.group('b')}x, the code's is {verdict.MIN_EFFECT}x"
                  for m in STATED_EFFECT.finditer(text) if float(m.group("a") or m.group("b")) != verdict.MIN_EFFECT]
    return found


def _markdown_notebook(*cells: str) -> dict:
    return {"cells": [{"cell_type": "markdown", "source": [c]} for c in cells]}


def test_the_prose_scan_finds_the_old_method_typed_counts_and_a_wrong_minimum_effect():
    bad = _markdown_notebook("the verdict compares the ranges of three\ninterleaved runs of each",
                             "| not distinguishable | the repeated runs' ranges overlap |",
                             "Both measurements run 5 times, interleaved.", "(10 pairs, each next to a base run)",
                             "a minimum effect of 1.25x on this CPU")
    got = markdown_problems(bad)
    assert len(got) == 6, got
    good = _markdown_notebook("the verdict judges the runs of each round as pairs; the line prints how many",
                              "a minimum effect of 1.15x on this shared CPU", "The table shows each config's range.")
    assert markdown_problems(good) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_notebooks_prose_describes_the_verdict_method_its_cells_use_and_types_no_run_count(path):
    problems = markdown_problems(json.loads(path.read_text()))
    hint = "say 'pairs' and let a cell print the count; the method is nblib/verdict.py"
    assert not problems, f"{path.name}: {hint}\n" + "\n".join(problems)
