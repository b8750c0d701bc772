"""The widget panels rerun the same pure functions when a control changes."""
from __future__ import annotations

import pytest

from nblib import config, widgets


def _control(panel, key):
    rows = [child for child in panel.children if hasattr(child, "children")]
    for row in rows:
        for control in row.children:
            if getattr(control, "description_key", None) == key:
                return control
    raise KeyError(key)


def test_budget_panel_redraws_the_verdict_when_a_knob_changes(capsys):
    panel = widgets.budget_panel(config.preset("seed_t4"), "t4", drive_quota_gb=15)
    first = capsys.readouterr().out
    assert "does NOT fit on t4" in first
    _control(panel, "device").value = "h200"
    assert "on h200" in capsys.readouterr().out
    _control(panel, "outputs").value = ("checksums",)
    _control(panel, "n_samples").value = 1000
    assert "fits on h200" in capsys.readouterr().out


def test_budget_panel_reports_an_invalid_combination_instead_of_raising(capsys):
    panel = widgets.budget_panel(config.preset("seed_t4"), "t4")
    capsys.readouterr()
    _control(panel, "consolidate_every").value = 7   # 200 is not a multiple of 7
    assert "not a valid config: run.checkpoint_every=200 is not a multiple" in capsys.readouterr().out


@pytest.mark.parametrize("key", ["batch_size", "H_cycles", "L_cycles", "workers", "out_dtype"])
def test_budget_panel_has_the_promised_controls(key):
    assert _control(widgets.budget_panel(config.preset("smoke"), "cpu"), key) is not None


def test_budget_panel_prints_exactly_predict_budgets_verdict_naming_ram_and_drive_at_batch_900(capsys):
    from nblib import budget

    seed = config.preset("seed_t4")
    panel = widgets.budget_panel(seed, "t4", drive_quota_gb=15)
    capsys.readouterr()
    _control(panel, "batch_size").value = 900
    shown = capsys.readouterr().out.strip().splitlines()[-1]
    expected = budget.predict_budget(seed.replace(batch_size=900), "t4", drive_quota_gb=15).verdict
    assert shown == expected
    assert f"run.batch_size={budget.max_batch_size(seed, 't4')}" in shown and "RAM 33.29 > 11.00 GB" in shown
    assert "Drive 658.46 > 15.00 GB" in shown and "run.out_dtype" not in shown     # float16 already


def test_panels_and_controls_carry_css_classes_for_the_browser():
    from nblib.lab.shuffle_checkpoints import BytesFit

    panel = widgets.budget_panel(config.preset("smoke"), "cpu")
    assert "nblib-budget-panel" in panel._dom_classes
    assert "nblib-knob-batch_size" in _control(panel, "batch_size")._dom_classes
    fit = BytesFit(bytes_per_element=16_100.0, fixed_bytes=1_000.0, sample_bytes=16_000, symbolic=True)
    shuffle = widgets.shuffle_checkpoint_panel(fit)
    assert "nblib-shuffle-panel" in shuffle._dom_classes
    assert "nblib-knob-buffer_size" in _control(shuffle, "buffer_size")._dom_classes
