"""Notebook 05's TF-in-workers cell (~45 s) shows the suite's progress bar, one step per setup measured (P22).

The measurement itself is stood in for (it needs TensorFlow and tens of seconds; tests/test_pipeline.py and
notebook 05 run it): what is checked is the bar around it.
"""
from __future__ import annotations

from nblib.lab import input_pipeline


class Measured:
    def as_dict(self) -> dict:
        return {"samples_per_s": 1.0, "rss_added_bytes": 0, "peak_rss_bytes": 0}


def test_the_worker_trap_and_its_remedies_each_show_a_bar_that_completes(monkeypatch, capsys):
    monkeypatch.setattr(input_pipeline, "measure_pipeline", lambda make, **options: Measured())
    rows = input_pipeline.tf_worker_trap([], (0, 1, 2), progress=True)
    rows += input_pipeline.trap_remedies([], None, progress=True)
    err = capsys.readouterr().err
    assert len(rows) == 5 and "TF in workers: 100%" in err and "3/3" in err, err
    assert "remedies: 100%" in err and "2/2" in err, err


def test_without_progress_the_worker_trap_prints_no_bar(monkeypatch, capsys):
    monkeypatch.setattr(input_pipeline, "measure_pipeline", lambda make, **options: Measured())
    input_pipeline.tf_worker_trap([], (0, 1), progress=False)
    assert capsys.readouterr().err == ""
