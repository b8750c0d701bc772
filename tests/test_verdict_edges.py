"""A difference whose interval only reaches the minimum effect is never called firm (issue 53), either way.

05 once called "x1.15 the base, 95% interval x1.13-1.15" firm; its mirror, "x0.87 (95% interval 0.86-0.87)", was
still called "lower" (0.87 is x1/1.149, short of x1.15). Over generated intervals and generated measurements, a call
is firm only when its printed interval reaches past the printed minimum effect, read both ways.
"""
from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from nblib import verdict

EDGE = round(verdict.MIN_EFFECT, verdict.DIGITS)
PRINTED = re.compile(r"^x(?P<ratio>[\d.]+) \(95% interval (?P<low>[\d.]+)-(?P<high>[\d.]+), \d+ (?:pairs|runs)\): "
                     r"(?P<call>.*)$")
hundredths = st.integers(min_value=50, max_value=200).map(lambda k: k / 100)


def _reaches_past_up(high: float) -> bool:
    return high > EDGE


def _reaches_past_down(low: float) -> bool:
    return low * EDGE < 1 - 1e-12          # 1/low beyond x EDGE


@given(st.lists(hundredths, min_size=3, max_size=3).map(sorted))
def test_a_printed_interval_is_firm_only_when_it_reaches_past_the_minimum_effect(three):
    low, ratio, high = three
    call = verdict.firm_direction(ratio, low, high, verdict.MIN_EFFECT)
    if call == "higher":
        assert low > 1 and ratio >= EDGE and _reaches_past_up(high), three
    if call == "lower":
        assert high < 1 and ratio * EDGE <= 1 + 1e-12 and _reaches_past_down(low), three
    if not _reaches_past_up(high):
        assert call != "higher", three
    if not _reaches_past_down(low):
        assert call != "lower", three


@settings(max_examples=150, deadline=None)
@given(n=st.integers(min_value=5, max_value=12), side=st.sampled_from(["up", "down"]), data=st.data())
def test_measurements_that_stop_at_the_minimum_effect_are_never_firm(n, side, data):
    """Ratios between 1 and exactly the minimum effect (x1.13-1.15, or x0.87-1/1.15): never a firm call, and the
    text says "not distinguishable" (with "cannot tell" where the printed interval reaches past the effect).
    """
    edge = verdict.MIN_EFFECT if side == "up" else 1 / verdict.MIN_EFFECT
    inside = st.floats(min_value=min(1.0, edge), max_value=max(1.0, edge), allow_nan=False)
    ratios = data.draw(st.lists(st.one_of(inside, st.just(edge)), min_size=n, max_size=n))
    for got in (verdict.verdict_of_pairs([1.0] * n, ratios), verdict.verdict_of_runs(ratios, 1.0)):
        assert got.direction == "same", got.short()
        m = PRINTED.match(got.short())
        assert m and m.group("call").startswith("not distinguishable here"), got.short()
        assert got.reason, got.short()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(min_value=0.5, max_value=2.0, allow_nan=False), min_size=5, max_size=12))
def test_every_firm_call_is_firm_by_the_numbers_it_prints(ratios):
    for got in (verdict.verdict_of_pairs([1.0] * len(ratios), ratios), verdict.verdict_of_runs(ratios, 1.0)):
        m = PRINTED.match(got.short())
        ratio, low, high = (float(m.group(k)) for k in ("ratio", "low", "high"))
        if got.direction == "higher":
            assert low > 1 and ratio >= EDGE and _reaches_past_up(high), got.short()
        elif got.direction == "lower":
            assert high < 1 and ratio * EDGE <= 1 + 1e-12 and _reaches_past_down(low), got.short()
        else:
            assert "not distinguishable" in m.group("call") or "too few" in m.group("call"), got.short()
            assert ("cannot tell" in m.group("call")) == (not got.within_effect and got.enough_runs), got.short()
            if "cannot tell" in m.group("call"):      # it names the edge it reaches across (02 said x1.15 of 0.85-0.95)
                assert (f"x{1 / EDGE:.2f} (1/{EDGE:.2f})" in m.group("call")) == _reaches_past_down(low), got.short()
                assert (f"across x{EDGE:.2f}" in m.group("call") or f"and x{EDGE:.2f}" in m.group("call")) == \
                    _reaches_past_up(high), got.short()


def test_the_two_edges_seen_in_the_notebooks():
    up = verdict.verdict_of_pairs([100.0] * 7, [113, 114, 115, 115, 115, 115, 115])
    down = verdict.verdict_of_pairs([1.0] * 7, [1 / 1.15] * 7)
    assert up.short().startswith("x1.15 (95% interval 1.13-1.15") and up.direction == "same"
    assert down.short().startswith("x0.87 (95% interval 0.86-0.87") and down.direction == "same"
    assert "x0.87 is short of the minimum effect" in down.reason
    assert verdict.verdict_of_pairs([1.0] * 7, [0.85] * 7).direction == "lower"
