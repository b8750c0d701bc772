"""Notebook 06 draws what the run records (issue 51, newcomer C9): training and held-out loss and held-out accuracy
by step, beside chance; and 07's check says what it checks (C12).
"""
from __future__ import annotations

import math
from pathlib import Path

import nbformat

from nblib import plots

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
HISTORY = [{"step": 0, "train_loss": math.nan, "heldout_loss": 2.5, "heldout_accuracy": 0.10},
           {"step": 5, "train_loss": 1.7, "heldout_loss": 2.6, "heldout_accuracy": 0.11},
           {"step": 10, "train_loss": 1.1, "heldout_loss": 1.2, "heldout_accuracy": 0.64}]


def test_training_curves_draw_the_recorded_history_beside_chance(tmp_path):
    fig = plots.training_curves(HISTORY, 1 / 12, save_to=tmp_path / "curves.png")
    loss_ax, acc_ax = fig.axes
    lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
    trained = lines["training loss (the step's batch)"]
    assert list(trained.get_xdata()) == [5, 10] and list(trained.get_ydata()) == [1.7, 1.1]   # step 0: no batch yet
    assert list(lines["held-out loss"].get_ydata()) == [2.5, 2.6, 1.2]
    assert [round(y, 6) for y in lines["held-out"].get_ydata()] == [10, 11, 64]
    chance = lines["chance (8.3%)"].get_ydata()[0]
    low, high = acc_ax.get_ylim()
    assert low <= chance <= high                       # the chance line is on the axes, not below them
    assert (tmp_path / "curves.png").stat().st_size > 0
    plots.close(fig)


def test_notebook_06_plots_its_runs_history_and_saves_the_figure():
    nb = nbformat.read(NOTEBOOKS / "06_training.ipynb", as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "plots.training_curves(report.history" in code and 'WORKSPACE.figures / "06_training_curves.png"' in code


def test_notebook_07s_training_check_says_it_does_not_judge_learning():
    nb = nbformat.read(NOTEBOOKS / "07_your_model.ipynb", as_version=4)
    check = next(c.source for c in nb.cells if "held-out loss and accuracy evaluated" in c.source)
    assert "NBVAL_CHECK_OUTPUT" in check and "whether the model learned is not checked" in check


def _overlapping_tick_labels(fig) -> list[tuple[str, str]]:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    pairs = []
    for ax in fig.axes:
        labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()
                  and ax.get_xlim()[0] <= t.get_position()[0] <= ax.get_xlim()[1]]
        boxes = sorted(((t.get_window_extent(renderer), t.get_text()) for t in labels), key=lambda b: b[0].x0)
        pairs += [(a[1], b[1]) for a, b in zip(boxes, boxes[1:]) if a[0].x1 > b[0].x0]
    return pairs


def test_log_axis_tick_labels_do_not_run_into_each_other():
    """Newcomer P1: '1,0002,000' and '50,000100,000200,000500,000' on narrow log axes."""
    for low, high in ((500, 2_000), (40_000, 600_000), (900, 1_100_000)):
        fig, ax = plots.new_figure(ncols=4, width=3.0, height=3.0)
        ax[0].plot([low, high], [1, 2])
        ax[0].set_xscale("log")
        plots.finish(fig)
        assert _overlapping_tick_labels(fig) == [], (low, high, [t.get_text() for t in ax[0].get_xticklabels()])
        plots.close(fig)


def test_the_checksum_figures_counts_both_carry_thousands_separators():
    """Newcomer P21: '1264 colliding pairs among 130,816'."""
    from types import SimpleNamespace

    import numpy as np

    hamming = np.concatenate([np.zeros(1264, dtype=int), np.full(129_552, 16)])
    fig = plots.checksum_hamming(SimpleNamespace(hamming=hamming, bits=32))
    assert fig.axes[0].get_title() == "1,264 colliding pairs among 130,816"
    plots.close(fig)


def test_06s_t4_time_says_where_its_sample_count_comes_from():
    """Newcomer C9: '640,000 samples in 1.19 h', the 640,000 (10,000 steps x batch 64) only in the cell's source."""
    from nblib.config import for_profile
    from nblib.lab.training import t4_training_time_lines

    lines = t4_training_time_lines(for_profile("smoke").model, 10_000, 64, [])
    assert lines.startswith("T4 training time of 10,000 steps x batch 64 = 640,000 samples: "), lines
