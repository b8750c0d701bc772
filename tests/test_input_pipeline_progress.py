"""Notebook 05's TF-in-workers cell (~45 s) shows the suite's progress bar, one step per setup measured (P22).

The measurement itself is stood in for (it needs TensorFlow and tens of seconds; tests/test_pipeline.py and
notebook 05 run it): what is checked is the bar around it.
"""
from __future__ import annotations

from nblib.lab import input_pipeline


class Measured:
    def as_dict(self) -> dict:
        return {"samples_per_s": 1.0, "rss_added_bytes": 0, "peak_rss_bytes": 0}


def test_the_worker_trap_and_its_remedy_each_show_a_bar_that_completes(monkeypatch, capsys):
    monkeypatch.setattr(input_pipeline, "measure_pipeline", lambda make, **options: Measured())
    rows = input_pipeline.tf_worker_trap([], (0, 1, 2), progress=True)
    rows += input_pipeline.native_remedy(None, progress=True)
    err = capsys.readouterr().err
    assert len(rows) == 4 and "TF in workers: 100%" in err and "3/3" in err, err
    assert "remedy: 100%" in err and "1/1" in err, err


def test_where_time_goes_and_the_224_px_render_rate_each_show_a_bar_over_their_runs(monkeypatch, capsys):
    """Notebook 05's cells [8] and [26] ran ~30 s each on a busy machine with no bar (newcomer C10)."""
    class Run(Measured):
        data_wait, samples_per_s = 0.0, 1.0

    monkeypatch.setattr(input_pipeline, "measure_pipeline", lambda make, **options: Run())
    input_pipeline.where_time_goes([], 100.0, repeats=3, progress=True)
    input_pipeline.render_loader_rate(["a"], 32, num_workers=0, repeats=3, progress=True)
    err = capsys.readouterr().err
    assert "fed, alone: 100%" in err and "6/6" in err, err
    assert "render at 32 px: 100%" in err and "3/3" in err, err


def test_without_progress_the_worker_trap_prints_no_bar(monkeypatch, capsys):
    monkeypatch.setattr(input_pipeline, "measure_pipeline", lambda make, **options: Measured())
    input_pipeline.tf_worker_trap([], (0, 1), progress=False)
    assert capsys.readouterr().err == ""


def test_the_smoke_grids_sweep_every_knob_and_every_value_the_findings_read():
    """Notebook 05 sweeps the smaller grids on the smoke profile: each must keep every knob of the full grid, its
    base, and the configs section 8's findings read, so that every finding the full grid gives is still given.
    """
    from nblib.lab.input_pipeline import (
        TF_GRID,
        TF_GRID_SMALL,
        TORCH_GRID,
        TORCH_GRID_SMALL,
        MixingResult,
        needle_table,
    )
    from nblib.pipeline import SweepTable, plan_configs

    runs = (1.0, 1.01, 0.99, 1.0, 1.02)

    def table(grid):
        rows = [{**config, "varied": varied, "samples_per_s": 100.0, "data_wait": 0.1, "startup_s": 0.1,
                 "peak_rss_bytes": 1e8, "runs": tuple(100 * r for r in runs), "base_runs": tuple(100 * r for r in runs),
                 "rss_runs": runs, "base_rss_runs": runs, "startup_runs": runs, "base_startup_runs": runs}
                for varied, config in plan_configs(grid)]
        return SweepTable(knobs=tuple(grid), rows=rows, planned=len(rows))

    def findings(grid):
        share = {"data_wait": 0.1, "encoder_samples_per_s": 94, "pipeline_samples_per_s": 100}
        mixing = MixingResult(2, 100, 100, 100, 5, {k: runs for k in ("single", "mixed", "fixed")})
        trap = [{"num_workers": 0, "rss_added_bytes": 0}, {"num_workers": 1, "rss_added_bytes": 5e8}]
        return [r["finding"] for r in needle_table(share, table(grid), mixing, trap, ncores=2)]

    assert findings(TF_GRID_SMALL) == findings(TF_GRID) and len(findings(TF_GRID)) == 8
    for small, full in ((TF_GRID_SMALL, TF_GRID), (TORCH_GRID_SMALL, TORCH_GRID)):
        assert small.keys() == full.keys()
        assert all(small[k][0] == full[k][0] and 2 <= len(small[k]) <= len(full[k]) and set(small[k]) <= set(full[k])
                   for k in full)
    assert len(plan_configs(TF_GRID_SMALL)) < len(plan_configs(TF_GRID))
