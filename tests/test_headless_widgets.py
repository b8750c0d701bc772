"""The widget panels run under a plain headless executor (nbclient: nbconvert, papermill) with no stall.

`make test` runs the notebooks under nbval, which does not mirror widget output (it cannot see the stall); this
file is CI's headless check instead: the panels' cells alone, under plain nbclient (what `jupyter nbconvert
--execute` runs) with a short cell timeout, and a check that every panel a notebook shows renders the way
those panels do. The whole notebooks under nbconvert: docs/testing.md.

A panel that prints inside `with Output():` gives the widget a msg_id; nbclient then mirrors each
captured message back to the kernel on the shell channel while it awaits the cell's reply there,
and that reply could go unseen until the cell timeout (nbclient issue #312). The panels set their
outputs in one state update instead, so nbclient never registers an output hook.
"""
from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import nbformat
import pytest

from nblib import config, widgets

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 120  # a stalled cell waits out the cell timeout with the kernel idle (900 s in issue 41)
REPLY_AFTER_IDLE_S = 5  # the stall itself: the kernel idle, its reply unseen; under 1 ms in a run without it

# The panels' cells, one panel a cell (each cell's work stays well under the timeout on a loaded machine)
PANEL_CELLS = ["""
from nblib import config, widgets
from nblib.lab.shuffle_checkpoints import BytesFit
from nblib.pipeline import SweepTable

rows = [{"batch_size": b, "prefetch": p, "varied": v, "samples_per_s": r, "runs": (r - 1, r, r + 1),
         "data_wait": 0.1, "startup_s": 0.1, "peak_rss_bytes": 1e8}
        for b, p, v, r in ((32, 2, "base", 100.0), (128, 2, "batch_size", 150.0), (32, 8, "prefetch", 90.0))]
fit = BytesFit(bytes_per_element=16_100.0, fixed_bytes=1_000.0, sample_bytes=16_000, symbolic=True)
""", 'widgets.budget_panel(config.preset("seed_t4"), "t4", drive_quota_gb=15)',
               'widgets.pipeline_sweep_panel(SweepTable(knobs=("batch_size", "prefetch"), rows=rows, planned=3))',
               "widgets.shuffle_checkpoint_panel(fit)", "print('after the panels')"]
PANELS = "\n".join(PANEL_CELLS)


@pytest.mark.slow
def test_panels_run_under_plain_nbclient_without_an_output_hook_or_a_wait():
    from datetime import datetime

    from nbclient import NotebookClient

    hooks = []

    class Client(NotebookClient):
        def register_output_hook(self, msg_id, hook):
            hooks.append(msg_id)
            super().register_output_hook(msg_id, hook)

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in PANEL_CELLS]
    Client(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", record_timing=True).execute()
    assert hooks == [], "a panel captured its output with `with Output():` (nbclient mirrors it on the shell channel)"
    assert nb.cells[-1].outputs[0]["text"] == "after the panels\n"
    shown = [o for c in nb.cells[:-1] for o in c.outputs]
    assert all(o["output_type"] != "error" for o in shown), shown
    for cell in nb.cells:
        times = {k: datetime.fromisoformat(v.replace("Z", "+00:00")) for k, v in cell.metadata.execution.items()}
        waited = (times["shell.execute_reply"] - times["iopub.status.idle"]).total_seconds()
        assert waited < REPLY_AFTER_IDLE_S, f"the reply came {waited:.1f} s after the kernel went idle: {cell.source}"


def test_a_panel_shows_its_figure_then_its_text_in_one_state_update():
    panel = widgets.budget_panel(config.preset("seed_t4"), "t4", drive_quota_gb=15)
    out = panel.children[-1]
    updates = []
    out.observe(lambda change: updates.append(change["new"]), names="outputs")
    row = next(c for c in panel.children if hasattr(c, "children") and any(
        getattr(k, "description_key", "") == "drive_quota_gb" for k in c.children))
    quota = next(k for k in row.children if getattr(k, "description_key", "") == "drive_quota_gb")
    quota.value = 16  # a knob that needs no new trace (H_cycles re-traces the model: minutes on a busy machine)
    assert len(updates) == 1 and out.msg_id == ""
    kinds = [o["output_type"] for o in updates[0]]
    assert kinds[-1] == "stream" and "does NOT fit on t4" in panel.text and "time " in panel.text


def test_every_panel_a_notebook_shows_renders_through_show_as_the_headless_run_checks():
    """A panel of the notebooks that the run above does not build (06's training panel: its traces take minutes)
    must still render through `widgets.show`, directly or by `_output_panel`: no `with Output():` capture.
    """
    used = set()
    for path in NOTEBOOKS:
        for cell in json.loads(path.read_text())["cells"]:
            used |= set(re.findall(r"\bwidgets\.(\w+_panel)\(", "".join(cell["source"])))
    built = set(re.findall(r"\bwidgets\.(\w+_panel)\(", PANELS))
    assert used and built <= used, (used, built)
    for name in sorted(used):
        source = inspect.getsource(getattr(widgets, name))
        assert re.search(r"\b(_output_panel|show)\(", source), f"widgets.{name} does not render through show()"
        assert not re.search(r"\bwith [^\n]*(out|Output)\b[^\n]*:", source), f"widgets.{name} captures output"
