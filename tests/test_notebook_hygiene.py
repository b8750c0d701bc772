"""Committed notebooks are clean, start the same way, and keep their logic in nblib."""
from __future__ import annotations

import ast
import hashlib
import json
import re
import sys
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
REFERENCES = Path(__file__).resolve().parent / "nbval_references"
CHECK_MARK = "# NBVAL_CHECK_OUTPUT"
# Logic comes from nblib; the standard library and numpy are allowed for glue.
ALLOWED_THIRD_PARTY = {"nblib", "numpy", "IPython"}
FORBIDDEN_HINT = "move the logic into nblib and call it from the notebook"


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _python(src: str) -> str:
    """A cell's source as the kernel runs it: IPython's `!` and `%` lines turned into calls."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(src)


def test_there_are_numbered_notebooks_starting_with_setup():
    names = [p.name for p in NOTEBOOKS]
    assert names and names[0] == "00_setup.ipynb", names
    assert all(re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", n) for n in names), names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs_or_execution_counts(path):
    for cell in _code_cells(_load(path)):
        src = _source(cell)
        assert cell["outputs"] == [], f"stored output in {path.name}: {src[:60]!r}"
        assert cell["execution_count"] is None, f"execution count in {path.name}: {src[:60]!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_checked_cell_has_a_current_text_reference(path):
    """nbval's references (tests/nbval_references) cover exactly the checked cells, as they are now."""
    refs_file = REFERENCES / f"{path.stem}.json"
    refs = json.loads(refs_file.read_text()) if refs_file.exists() else {}
    checked = {c["id"]: _source(c) for c in _code_cells(_load(path)) if _source(c).startswith(CHECK_MARK)}
    assert set(refs) == set(checked), (
        f"{path.name}: references and checked cells differ; run scripts/nbtools.py refresh {path}")
    for cell_id, src in checked.items():
        assert refs[cell_id]["source_sha256"] == hashlib.sha256(src.encode()).hexdigest(), (
            f"{path.name}: the reference of {src[:60]!r} is stale; run scripts/nbtools.py refresh {path}")
        outputs = refs[cell_id]["outputs"]
        assert outputs, f"{path.name}: checked cell {src[:60]!r} prints nothing to compare"
        for out in outputs:
            assert out["output_type"] in ("stream", "execute_result", "display_data"), src[:60]
            assert set(out.get("data", {})) <= {"text/plain"}, f"non-text reference in {src[:60]!r}"


def _nbtools():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import nbtools
    finally:
        sys.path.pop(0)
    return nbtools


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_setup_cell_is_the_one_from_nbtools(path):
    """Every setup cell is scripts/nbtools.py's SETUP_CELL: the install source lives in one place."""
    assert _source(_load(path)["cells"][3]) == _nbtools().SETUP_CELL, (
        f"{path.name}: the setup cell differs; run scripts/nbtools.py setup {path}")


def test_the_setup_cells_are_identical_short_and_shown_the_same_in_every_viewer():
    """Issue 41: at most 8 lines of code, the same in all notebooks, and a plain cell (no Colab form, not collapsed)."""
    cells = [_load(path)["cells"][3] for path in NOTEBOOKS]
    assert len({_source(c) for c in cells}) == 1, "the setup cells differ between notebooks"
    lines = [s for s in _source(cells[0]).splitlines() if s.strip() and not s.lstrip().startswith("#")]
    assert len(lines) <= 8, f"the setup cell has {len(lines)} lines of code: {lines}"
    for path, cell in zip(NOTEBOOKS, cells):
        assert cell["metadata"] == {}, f"{path.name}: the setup cell's metadata hides or folds it: {cell['metadata']}"
    assert "#@title" not in _source(cells[0]), "a Colab form shows one line in Colab and all of it elsewhere"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_kernelspec_is_python3(path):
    assert _load(path)["metadata"]["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_starts_with_title_badge_learn_and_setup(path):
    cells = _load(path)["cells"]
    kinds = [c["cell_type"] for c in cells[:4]]
    assert kinds == ["markdown", "markdown", "markdown", "code"], kinds
    title, badge, learn, setup = (_source(c) for c in cells[:4])
    assert title.startswith("# "), title[:40]
    assert "colab-badge.svg" in badge and f"/notebooks/{path.name}" in badge, badge
    assert learn.lower().startswith("## what you will learn"), learn[:40]
    assert '"google.colab" in sys.modules' in setup, "setup cell must install only in Colab"
    assert "env.workspace()" in setup, "setup cell must create the workspace (mounts Drive in Colab)"
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1 and cells.index(tagged[0]) == 4, "cell 5 must be the one `parameters` cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_imports_only_nblib_for_its_logic(path):
    """The setup cell is the exception: in Colab it imports google.colab and the repository's colab_setup."""
    stdlib = set(sys.stdlib_module_names)
    for cell in _code_cells(_load(path))[1:]:
        src = _source(cell)
        tree = ast.parse(_python(src))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            for root in roots:
                assert root in stdlib or root in ALLOWED_THIRD_PARTY, (
                    f"{path.name} imports {root!r}; {FORBIDDEN_HINT}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_widget_cells_are_ignored_by_nbval(path):
    for cell in _code_cells(_load(path)):
        src = _source(cell)
        if re.search(r"\bwidgets\.\w+\(", src):
            assert src.startswith("# NBVAL_IGNORE_OUTPUT"), f"widget cell without NBVAL_IGNORE_OUTPUT: {src[:60]!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_defines_no_functions_or_classes(path):
    """Reusable code lives in nblib (the setup cell's installer, which runs before nblib is, in scripts/)."""
    for cell in _code_cells(_load(path)):
        tree = ast.parse(_python(_source(cell)))
        defs = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert not defs, f"{path.name} defines {defs}: put reusable code in nblib"


# ------------------------------------------------------------------------------ numbers only from code (issue 30)

# A figure in prose: a number with a unit of size, share, rate or time, or a ratio (x1.2, 2x).
_UNIT = r"(?:GB|MB|KB|kB|GiB|MiB|TB|%|samples/s|images/s|img/s|bytes\b|(?<=\d) ms\b|(?<=\d) s\b|(?<=\d) h\b)"
PROSE_FIGURE = re.compile(r"(?<![\w.,])[~≈]?\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?(?: ?" + _UNIT
                          + r"|x(?!\w))|(?<!\w)x\d+(?:\.\d+)?")
REFERENCE = "a figure of nblib/reference.py, with its source there"
METHOD = "a constant of the method, set in code (nblib.verdict, a tolerance, a margin)"
FIXED = "fixed arithmetic on reference figures or on a constant the code sets; no run can change it"
# Prose may carry only these figures: each one a source figure or fixed arithmetic, never a result a cell
# computes (those are printed by the cell, or the prose says "see the table above"). Grow it with a reason.
SOURCE_FIGURES = {
    "00": {"~15 GB": REFERENCE, "~12.7 GB": REFERENCE, "70-100 GB": REFERENCE, "95%": METHOD, "1.15x": METHOD},
    "01": {"750 GB": REFERENCE, "8.9 GB": REFERENCE, "10%": METHOD, "236 MB": FIXED, "471 MB": REFERENCE,
           "2.04 s": REFERENCE, "2 TB": "the drive_quota_gb=2000 the next cell passes", "2 MiB": REFERENCE,
           "20 MiB": REFERENCE, "0.1 MB": "nblib.simulate's check against this machine's RSS (its tests)",
           "300-500 MB": REFERENCE, "0.4 GB": METHOD, "~500 KB": REFERENCE, "125 GB": REFERENCE,
           "1.5-2x": REFERENCE, "78 GB": "the t4 preset's free disk (nblib.budget.DEVICES)", "287 GB": FIXED,
           "400-500 MB": REFERENCE, "1 GB": FIXED, "177 GB": FIXED, "15 GB": REFERENCE},
    "02": {"287 GB": FIXED, "150,528 bytes": FIXED, "70-100 GB": REFERENCE, "1%": METHOD, "95%": METHOD,
           "1.15x": METHOD, "~287 GB": FIXED, "~400 MB": "the t4 profile's shard_mb"},
    "03": {"94 samples/s": REFERENCE, "5.6 h": REFERENCE},
    "04": {"500 kB": REFERENCE, "125 GB": REFERENCE, "1x": METHOD, "2x": METHOD, "~500 KB": REFERENCE,
           "1.5-2x": REFERENCE, "10%": METHOD, "4 kB": METHOD, "1%": METHOD,
           "8 bytes": "an int64 index: the resumable buffer's design",
           "150 kB": "the benchmark's sample size (benchmarks/shuffle_checkpoint.py)"},
    "05": {"75-83%": REFERENCE, "10.6 ms": FIXED, "94 samples/s": REFERENCE, "~9-16 GB": REFERENCE,
           "0.25 ms": "the STEP_MS_PER_IMAGE the parameters cell sets", "4,000 images/s": FIXED, "95%": METHOD,
           "1.15x": METHOD, "38%": REFERENCE, "80%": METHOD, "~6 GB": REFERENCE,
           "68 GB": REFERENCE, "400 MB": REFERENCE},
    "06": {"500 kB": REFERENCE, "300-500 MB": REFERENCE, "0.4 GB": METHOD},
}


def prose_figures(markdown: str) -> list[str]:
    """The figures a markdown cell states, outside code spans and fenced blocks."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    return PROSE_FIGURE.findall(re.sub(r"`[^`]*`", "``", text))


def test_prose_figures_are_found_and_code_spans_are_not():
    said = "A batch of 192 needs ~3 GB of 15 GB; RAM is at ~80%, x1.32 faster, 2x on disk; `x = 3 GB` 224 x 224"
    assert prose_figures(said) == ["~3 GB", "15 GB", "~80%", "x1.32", "2x"]
    # 01 §2's old prose, which its own table contradicted (2.03 GB, 87%), is refused
    refused = [f for f in prose_figures(said) if f not in SOURCE_FIGURES["01"]]
    assert "~3 GB" in refused and "~80%" in refused and "15 GB" not in refused


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_markdown_carries_no_figure_a_cell_computes(path):
    """Numbers only from code: prose states source figures and constants, never a computed result."""
    allowed = SOURCE_FIGURES.get(path.name[:2], {})
    found = [(i, f) for i, c in enumerate(_load(path)["cells"]) if c["cell_type"] == "markdown"
             for f in prose_figures(_source(c)) if f not in allowed]
    assert not found, (f"{path.name}: markdown states {found} (cell, figure); print it from a code cell or say "
                       f"'see the table above'; a source figure goes into SOURCE_FIGURES with its reason")
