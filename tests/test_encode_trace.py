"""The VRAM of a TRM encode job has one answer: the trace of the encode loop (nblib.budget.encode_trace), which
predict_budget, its panel, plan and advice print from a table of traced allocation streams shipped in the repo.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nblib import budget
from nblib.budget import encode_trace
from nblib.config import preset


@pytest.fixture(scope="module")
def can_trace():
    from nblib.budget.shim import backward_capability

    ok, why = backward_capability()
    if not ok:
        pytest.skip(why)


@pytest.mark.slow
def test_the_shipped_trace_table_is_the_live_trace_to_the_byte(can_trace):
    """Every file of nblib/trace_seed is what tracing its spec gives now, byte for byte, and no other
    file is there: a change to the TRM, the encode loop, the offload or the trace fails here until
    `tests/trace_table.py` writes the table again.
    """
    from trace_table import entry_path, table_entries

    entries = table_entries()
    shipped = sorted(encode_trace.TABLE.glob("*.json"))
    assert sorted(entry_path(e["spec"]) for e in entries) == shipped, "stale or missing table files"
    for entry in entries:
        path = entry_path(entry["spec"])
        assert path.read_text(encoding="utf-8") == encode_trace.entry_text(entry), f"{path.name} is stale"


def test_the_budget_prints_the_traces_vram_lines_to_the_byte(can_trace):
    """predict_budget's VRAM on a T4 is `budget --model trm`'s trace (model_vram) line for line, plus the
    workspace placement margin as a line: its total is the trace's high end. A model outside the table is
    traced (the small profile's model, one dim wider), one inside it is replayed: both equal the live trace.
    """
    for cfg in (preset("seed_t4").replace(batch_size=96), preset("smoke").replace(dim=96, batch_size=40)):
        b = budget.predict_budget(cfg, "t4")
        traced = budget.model_vram(cfg.model, cfg.run.batch_size, "t4", find_largest=False)
        lines = [(ln.name, ln.bytes) for ln in b.lines["vram"]]
        assert lines[:-1] == [(ln.name, ln.bytes) for ln in traced.lines]
        assert lines[-1] == ("workspace placement margin", traced.workspace_margin)
        assert b.totals["vram"] == traced.high


def test_the_budget_of_consolidate_follows_the_loops_hostpart(can_trace):
    """The offload is traced through the run's own HostPart: consolidate_every=10 batches of outputs held on
    the device for their torch.cat need more VRAM than async, which copies each batch out at once.
    """
    cfg = preset("t4").replace(batch_size=192)
    held = budget.predict_budget(cfg, "t4", offload="consolidate")
    assert held.totals["vram"] > budget.predict_budget(cfg, "t4").totals["vram"]
    assert "trace_cache" not in budget.encode_vram(cfg, "t4", offload="consolidate").label   # traced, not cached


def test_the_widget_path_replays_the_table_without_torch():
    """seed_t4 on a T4, as notebook 01's panel and plan ask it: from the table (labelled so), torch never
    imported, the largest batch searched by replays alone.
    """
    code = ("import json, sys\nfrom nblib import budget\nfrom nblib.config import preset\n"
            "b = budget.predict_budget(preset('seed_t4').replace(batch_size=200), 't4')\n"
            "largest = budget.max_batch_size(preset('seed_t4'), 't4')\n"
            "v = budget.encode_vram(preset('seed_t4'), 't4')\n"
            "print(json.dumps({'torch': 'torch' in sys.modules, 'label': v.label, 'largest': largest}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["torch"] is False and "replayed from nblib/trace_seed" in out["label"]
    assert out["largest"] > 0


def test_the_trace_table_ships_in_the_package():
    """Every data file under nblib/ (the trace table the budget replays without torch) matches pyproject.toml's
    package-data, so a wheel carries it: without it an installed nblib would trace where the repo replays.
    """
    import fnmatch
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")           # Python 3.11+
    root = Path(encode_trace.__file__).resolve().parents[2]
    package_data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    data = [p for p in (root / "nblib").rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert any(p.parent == encode_trace.TABLE for p in data)
    for path in data:
        shipped = [fnmatch.fnmatch(str(path.relative_to(folder)), pattern) for pkg, patterns in package_data.items()
                   if path.is_relative_to(folder := root / pkg.replace(".", "/")) for pattern in patterns]
        assert any(shipped), f"{path} is not in pyproject.toml's package-data"
