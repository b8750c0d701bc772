"""One answer to "how much do the activations of an encode job hold at the peak on a GPU": the trace of the encode
loop (predict_budget's VRAM line), asked through every surface that prints it (issue 53's census item: the GPU
activation closed form beside the trace).

The surfaces: `reference_comparison` (the rows), `reference_table` (what notebook 01 and `budget --reference` print),
the CLI in-process, notebook 01's recorded output (its nbval reference, which nbval holds the notebook to), the
budget's own table, and notebook 01's predicted-vs-measured forward peak (`memory_budgeting.forward_peak`).
"""
from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
from cli_runner import run_nblib

from nblib import budget
from nblib.config import preset
from nblib.lab import memory_budgeting
from nblib.units import fmt_bytes

REFERENCES = Path(__file__).resolve().parent / "nbval_references" / "01_memory_budgeting.json"
TRACED = "input batch and activations at the peak"


@pytest.fixture(scope="module")
def answers():
    """The trace's answers for seed_t4 on a T4: the default kernel's activations and what math SDPA adds."""
    seed = preset("seed_t4")
    default, math = (budget.predict_budget(seed, "t4", sdpa_backend=s) for s in (None, "math"))
    line = {b.sdpa_backend: next(ln.bytes for ln in b.lines["vram"] if ln.name == TRACED) for b in (default, math)}
    return {"activation peak": line[default.sdpa_backend],
            "attention scores (math)": line["math"] - line[default.sdpa_backend], "budget": default}


def _row_figures(text: str) -> dict[str, str]:
    """item -> the 'ours' column of a printed reference table."""
    found = {}
    for item in ("activation peak", "attention scores (math)"):
        m = re.search(rf"^{re.escape(item)}\s+\S+ \S+\s+(\S+ \S+)\s", text, re.M)
        assert m, f"{item!r} is missing from:\n{text}"
        found[item] = m.group(1)
    return found


def test_every_surface_prints_the_traces_activations(answers):
    rows = {row.item: row for row in memory_budgeting.reference_comparison("t4")}
    expected = {item: fmt_bytes(answers[item]) for item in ("activation peak", "attention scores (math)")}
    for item in expected:
        assert rows[item].ours == answers[item], item
    assert _row_figures(memory_budgeting.reference_table("t4")) == expected
    cli = run_nblib("budget", "--reference")
    assert cli.returncode == 0, cli.stderr
    assert _row_figures(cli.stdout) == expected
    recorded = "".join(o.get("text", "") for ref in json.loads(REFERENCES.read_text()).values()
                       for o in ref["outputs"] if "activation peak" in o.get("text", ""))
    assert _row_figures(recorded) == expected, "notebook 01's recorded table: scripts/nbtools.py refresh it"
    assert f"{TRACED:<34} {expected['activation peak']:>11}" in answers["budget"].table()


def test_notebook_01s_predicted_forward_peak_on_a_gpu_is_the_trace():
    """01 §3 on a GPU compares CUDA's max-allocated increase with the trace less the input batch, not a formula."""
    for b in (16, 64):
        cfg = preset("smoke").replace(batch_size=b)
        traced = budget.predict_budget(cfg, "t4")
        line = next(ln.bytes for ln in traced.lines["vram"] if ln.name == TRACED)
        assert memory_budgeting.forward_peak(cfg, "t4") == line - b * cfg.model.image_size ** 2 * 3
        assert memory_budgeting.forward_peak(cfg, "cpu") == budget.forward_peak_delta(cfg)


def test_the_closed_form_answers_a_cpus_ram_only():
    """The live-buffer formula is the CPU's RAM answer (predict_budget on a CPU prints it); it has no GPU branch
    that a surface could print beside the trace.
    """
    for fn in (budget.model_memory_lines, budget.forward_peak_delta):
        assert "on_gpu" not in inspect.signature(fn).parameters, fn.__name__
    cfg = preset("smoke").replace(batch_size=32)
    on_cpu = budget.predict_budget(cfg, "cpu")
    assert memory_budgeting.activations_at_peak(on_cpu) == budget.forward_peak_delta(cfg)
    assert not any(ln.name == "activations at peak" for ln in budget.predict_budget(cfg, "t4").lines["vram"])
