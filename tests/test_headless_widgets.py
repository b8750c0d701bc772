"""The widget panels run under a plain headless executor (nbclient: nbconvert, papermill) with no stall.

A panel that prints inside `with Output():` gives the widget a msg_id; nbclient then mirrors each
captured message back to the kernel on the shell channel while it awaits the cell's reply there,
and that reply could go unseen until the cell timeout (nbclient issue #312). The panels set their
outputs in one state update instead, so nbclient never registers an output hook.
"""
from __future__ import annotations

import nbformat
import pytest

from nblib import config, widgets

PANELS = """
from nblib import config, widgets
from nblib.lab.shuffle_checkpoints import BytesFit
from nblib.pipeline import SweepTable

rows = [{"batch_size": b, "prefetch": p, "varied": v, "samples_per_s": r, "runs": (r - 1, r, r + 1),
         "data_wait": 0.1, "startup_s": 0.1, "peak_rss_bytes": 1e8}
        for b, p, v, r in ((32, 2, "base", 100.0), (128, 2, "batch_size", 150.0), (32, 8, "prefetch", 90.0))]
fit = BytesFit(bytes_per_element=16_100.0, fixed_bytes=1_000.0, sample_bytes=16_000, symbolic=True)
panels = [widgets.budget_panel(config.preset("seed_t4"), "t4", drive_quota_gb=15),
          widgets.pipeline_sweep_panel(SweepTable(knobs=("batch_size", "prefetch"), rows=rows, planned=3)),
          widgets.shuffle_checkpoint_panel(fit)]
panels[0]
"""


@pytest.mark.slow
def test_panels_run_under_plain_nbclient_without_an_output_hook_or_a_wait():
    from nbclient import NotebookClient

    hooks = []

    class Client(NotebookClient):
        def register_output_hook(self, msg_id, hook):
            hooks.append(msg_id)
            super().register_output_hook(msg_id, hook)

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(PANELS), nbformat.v4.new_code_cell("panels[1]"),
                nbformat.v4.new_code_cell("panels[2]"), nbformat.v4.new_code_cell("print('after the panels')")]
    Client(nb, timeout=120, kernel_name="python3").execute()
    assert hooks == [], "a panel captured its output with `with Output():` (nbclient mirrors it on the shell channel)"
    assert nb.cells[-1].outputs[0]["text"] == "after the panels\n"
    shown = [o for c in nb.cells[:3] for o in c.outputs]
    assert all(o["output_type"] != "error" for o in shown), shown


def test_a_panel_shows_its_figure_then_its_text_in_one_state_update():
    panel = widgets.budget_panel(config.preset("seed_t4"), "t4", drive_quota_gb=15)
    out = panel.children[-1]
    updates = []
    out.observe(lambda change: updates.append(change["new"]), names="outputs")
    row = next(c for c in panel.children if hasattr(c, "children") and any(
        getattr(k, "description_key", "") == "H_cycles" for k in c.children))
    next(k for k in row.children if getattr(k, "description_key", "") == "H_cycles").value = 6
    assert len(updates) == 1 and out.msg_id == ""
    kinds = [o["output_type"] for o in updates[0]]
    assert kinds[-1] == "stream" and "does NOT fit on t4" in panel.text and "time " in panel.text
