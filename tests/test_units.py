"""nblib.units: the one home of the suite's duration and rate formats; a small figure keeps its digits."""
from __future__ import annotations

import pytest

from nblib.units import fmt_duration, fmt_duration_range, fmt_rate


@pytest.mark.parametrize("seconds", [7.96e-6, 0.0004, 0.0012, 0.85, 0.9996, 7.2, 119.0, 3000.0, 6336.0, 20000.0])
def test_a_duration_reads_back_to_its_value_in_the_unit_it_names(seconds):
    number, unit = fmt_duration(seconds).split()
    size = {"µs": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}[unit]
    assert float(number.replace(",", "")) * size == pytest.approx(seconds, rel=0.01)
    assert float(number.replace(",", "")) >= 1      # never '0.00 h', '0.0 s' or '0.00796 ms' (07's save wait)


def test_a_duration_range_shares_the_mids_unit_and_keeps_each_figure():
    low, mid, high = 6.0, 7.2, 8.7
    text = fmt_duration_range(low, mid, high)
    assert text.startswith(fmt_duration(mid) + " (") and text.endswith(" s)")
    said = [float(v) for v in text.replace("(", " ").replace(")", " ").replace("-", " ").split() if v != "s"]
    assert said == pytest.approx([mid, low, high], abs=0.05)


@pytest.mark.parametrize("per_second", [0.23, 0.0412, 5.25, 345.2, 12_345.0])
def test_a_rate_reads_back_to_its_value_slow_ones_included(per_second):
    number, unit = fmt_rate(per_second).split()
    assert unit == "samples/s" and float(number.replace(",", "")) == pytest.approx(per_second, rel=0.02)


def test_a_duration_range_below_a_minute_reads_in_seconds_never_0_0_min():
    text = fmt_duration_range(12.0, 18.0, 25.0)           # the training panel's lost-VM time of a small run
    assert text == "18.0 s (12.0-25.0 s)" and "min" not in text


def test_nblib_formats_no_duration_by_hand():
    """Every duration nblib prints goes through fmt_duration / fmt_duration_range (issue 53: the training panel's
    own '{x / 60:.1f} min' printed a 20 s loss as '0.3 min (0.2-0.4 min)', and 0.0 min for smaller ones).
    """
    import re
    from pathlib import Path

    import nblib

    by_hand = re.compile(r"\.[0-9]+f\} ?(ms|s|min|h)\b|/ ?(60|3600)(\.0)?:")
    root = Path(nblib.__file__).parent
    found = [f"{p.relative_to(root)}:{i}" for p in sorted(root.rglob("*.py")) if p.name != "units.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if by_hand.search(line)]
    assert not found, f"durations formatted by hand (use nblib.units.fmt_duration): {found}"
