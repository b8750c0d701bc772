"""What a training run prints about its speed: the bar's rate names its window, the summary's names its own,
and a slow rate keeps its digits (newcomer P19, P27).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from nblib.train.loop import TrainReport, _show
from nblib.units import fmt_rate


class Bar:
    def __init__(self):
        self.postfix, self.n = "", 0

    def set_postfix_str(self, text, refresh=True):
        self.postfix = text

    def update(self, n):
        self.n += n


def report(step_seconds: list[float], batch: int) -> TrainReport:
    r = TrainReport(Path("run"), len(step_seconds), 0, "nothing", [], None, None, sum(step_seconds))
    r.step_seconds, r.samples, r.save_seconds = list(step_seconds), batch * len(step_seconds), [0.01]
    return r


def test_the_bar_and_the_summary_each_say_which_steps_their_rate_covers():
    r = report([2.0] * 5 + [0.1] * 20, batch=32)         # a slow start, then fast steps
    bar = Bar()
    _show(bar, r, None, 0.5)
    assert f"{fmt_rate(20 * 32 / 2.0)} (last 20 steps)" in bar.postfix, bar.postfix
    summary = str(r)
    assert "on average over all steps" in summary and fmt_rate(r.samples / sum(r.step_seconds)) in summary


@pytest.mark.parametrize("per_second", [0.23, 0.0412])
def test_a_slow_training_rate_is_not_printed_as_zero(per_second):
    bar = Bar()
    _show(bar, report([32 / per_second] * 3, batch=32), None, 0.5)
    number = bar.postfix.split("  ")[1].split()[0]
    assert float(number) == pytest.approx(per_second, rel=0.01), bar.postfix
