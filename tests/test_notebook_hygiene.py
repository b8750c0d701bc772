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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_setup_cell_is_the_one_from_nbtools(path):
    """Every setup cell is scripts/nbtools.py's SETUP_CELL: the install source lives in one place."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import nbtools
    finally:
        sys.path.pop(0)
    assert _source(_load(path)["cells"][3]) == nbtools.SETUP_CELL, (
        f"{path.name}: the setup cell differs; run scripts/nbtools.py setup {path}")


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
    stdlib = set(sys.stdlib_module_names)
    for cell in _code_cells(_load(path)):
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
    """Reusable code lives in nblib. The setup cell is the exception: it runs before nblib is installed
    (its one-line SetupFailed and its step runner), and it is scripts/nbtools.py's SETUP_CELL, checked above.
    """
    import nbtools

    for cell in _code_cells(_load(path)):
        if _source(cell) == nbtools.SETUP_CELL:
            continue
        tree = ast.parse(_python(_source(cell)))
        defs = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert not defs, f"{path.name} defines {defs}: put reusable code in nblib"
