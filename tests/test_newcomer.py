"""What a newcomer meets first (issue 19): TF's start-up logs silenced, 00's table of notebooks current,
every term defined, no markdown conclusion typed over a measured direction.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
TERMS = ("TRM", "H / L cycles", "capsules", "sketches", "checksums", "children", "SDPA", "MFU",
         "symbolic checkpoint", "Feistel", "Spearman", "Hamming", "the published analysis", "the tuning log")


def _markdown(name: str) -> str:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    return "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


@pytest.mark.slow
def test_tensorflow_prints_no_start_up_logs_through_nblib():
    code = ("import nblib\nfrom nblib.tfdata import tensorflow\ntf = tensorflow()\n"
            "print(sum(int(b.numpy().sum()) for b in tf.data.Dataset.range(6).map(lambda x: x * 2).batch(2)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == "30"
    assert "oneDNN" not in done.stderr and "absl::InitializeLog" not in done.stderr, done.stderr


def test_the_setup_notebook_lists_every_notebook_by_its_real_name():
    table = _markdown("00_setup.ipynb").split("## Where to go next", 1)[1]
    for path in sorted(NOTEBOOKS.glob("0[1-9]_*.ipynb")):
        assert f"[{path.stem}]({path.name})" in table, path.name
    assert "planned" not in table


def test_every_term_is_defined_in_the_setup_notebook():
    terms = _markdown("00_setup.ipynb").split("## Terms used in the suite", 1)[1]
    for term in TERMS:
        assert re.search(rf"^\| {re.escape(term)}", terms, re.M), term


@pytest.mark.parametrize("name", ["02_cache_population.ipynb", "05_input_pipeline_tuning.ipynb"])
def test_no_markdown_types_a_measured_direction(name):
    text = _markdown(name)
    for typed in ("Rendering scales with cores", "mattered most here", "rendering keeps up",
                  "nothing fits a free 15 GB Drive", "which is why it matches one dataset"):
        assert typed.lower() not in text.lower(), typed


# issue 30: 06 used these without defining them, and cited an unnamed "sharding guide"
TERMS_06 = ("AdamW", "AMP", "master weights", "GradScaler", "RLIMIT_AS", "FakeTensorMode", "cuBLAS", "BatchNorm")


@pytest.mark.parametrize("term", TERMS_06)
def test_notebook_06_defines_each_term_in_the_cell_where_it_first_appears(term):
    nb = nbformat.read(NOTEBOOKS / "06_training.ipynb", as_version=4)
    first = next(c.source for c in nb.cells if c.cell_type == "markdown" and term in c.source)
    # a definition: the term in italics (*term* is ...), or followed by a parenthesis that says what it is
    assert re.search(rf"\*{re.escape(term)}\*|{re.escape(term)}`? \(", first), (term, first[:300])


def test_notebook_06_names_no_unnamed_guide():
    assert "sharding guide" not in _markdown("06_training.ipynb")


def test_the_shard_table_says_its_ram_holds_two_shards():
    """Newcomer P4 (2026-12-01): 'RAM one at a time 0.10 GB' for 50 MB shards is one shard plus the prefetched one."""
    from nblib import budget
    from nblib.lab.memory_budgeting import shard_table

    plan = budget.plan_shards(int(287e9), 50)
    line = shard_table([plan])
    assert plan.ram_one_at_a_time == 2 * plan.shard_bytes
    assert "RAM for one shard + one prefetched  0.10 GB" in line and "one at a time" not in line, line


def test_02s_stale_sentences_name_what_the_cells_do():
    """Newcomer W4 and P9: 02 named a 64-image measurement the cells beside it did not show, and 'a third of its
    shards' beside a kill after 3 listed of 12.
    """
    text = _markdown("02_cache_population.ipynb")
    assert "this notebook's cache" in text and "measured on its first 64 images" in text
    assert "once a third of" not in text and "DEMO_SHARDS // 3" in text


def test_05s_trap_table_prints_rates_as_every_other_rate_is():
    """Newcomer P20: '2,157.9' and '3,432.7' samples/s with a decimal, where every other rate is an integer."""
    from nblib.lab.input_pipeline import trap_table

    row = {"setup": "TF in each of 1 worker", "samples_per_s": 2157.9, "rss_added_bytes": 4e8, "peak_rss_bytes": 1.4e9}
    assert " 2,158 " in trap_table([row]) and "2,157.9" not in trap_table([row])
