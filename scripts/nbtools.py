"""Build, refresh and clean the suite's notebooks (a developer tool; not part of nblib).

    from nbtools import header_cells, md, code, write_notebook     # build a notebook
    python scripts/nbtools.py refresh notebooks/01_memory_budgeting.ipynb
    python scripts/nbtools.py strip notebooks/*.ipynb
    python scripts/nbtools.py setup notebooks/*.ipynb     # rewrite every setup cell from SETUP_CELL

Notebooks are committed without outputs or execution counts. The reference output nbval
compares a `# NBVAL_CHECK_OUTPUT` cell against lives beside them instead, in
`tests/nbval_references/<notebook>.json` (keyed by cell id, with a hash of the cell's source);
the root `conftest.py` hands it to nbval at collection time. `refresh` executes the notebook in
the smoke profile, writes that file, and strips the notebook.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import nbformat
from colab_setup import REPO_URL  # the repository's one URL (scripts/ is on sys.path beside this file)

COLAB_URL = REPO_URL.replace("https://github.com/", "https://colab.research.google.com/github/") + "/blob/main"
CHECK_MARK = "# NBVAL_CHECK_OUTPUT"
REFERENCES = Path(__file__).resolve().parents[1] / "tests" / "nbval_references"
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}

# The setup cell, the same in every notebook and shown in full everywhere (no Colab form): outside Colab it imports
# nblib; in Colab it reaches scripts/colab_setup.py (a clone of NBLIB_REPO, else inside MyDrive/nblib-suite.zip) and
# runs it. Relative paths: Colab runs a notebook in /content (the clone: /content/nblib-suite, Drive: /content/drive).
SETUP_CELL = f"""\
# Setup, the same in every notebook. Outside Colab nblib is installed already (README). In Colab this fetches the
# repository once, a git clone of NBLIB_REPO or else the zip `make drive-zip` writes, uploaded to your Drive as
# MyDrive/nblib-suite.zip, and its scripts/colab_setup.py installs nblib (docs/colab.md).
import importlib, os, sys
if "google.colab" in sys.modules:
    REPO = os.getenv("NBLIB_REPO", "{REPO_URL}")
    !test -d nblib-suite || GIT_TERMINAL_PROMPT=0 git clone -q --depth=1 {{REPO}} nblib-suite
    from google.colab import drive; os.path.isdir("nblib-suite") or drive.mount(os.path.abspath("drive"))
    sys.path[:0] = ["nblib-suite/scripts", "drive/MyDrive/nblib-suite.zip/nblib-suite/scripts"]
    # "No module named 'colab_setup'" here: the clone failed (git's reason above) and MyDrive has no nblib-suite.zip
    importlib.invalidate_caches(); import colab_setup; colab_setup.setup_nblib()
import nblib; WORKSPACE = nblib.env.workspace()  # Google Drive in Colab, a local folder elsewhere"""


def md(text: str) -> nbformat.NotebookNode:
    """A markdown cell."""
    return nbformat.v4.new_markdown_cell(text.strip("\n"))


def code(text: str, tags: tuple[str, ...] = ()) -> nbformat.NotebookNode:
    """A code cell, optionally tagged (e.g. tags=("parameters",))."""
    cell = nbformat.v4.new_code_cell(text.strip("\n"))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def header_cells(filename: str, title: str, learn: list[str]) -> list[nbformat.NotebookNode]:
    """The four cells every notebook starts with: title, Colab badge, what you will learn, setup."""
    badge = (f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
             f"({COLAB_URL}/notebooks/{filename})")
    bullets = "\n".join(f"- {item}" for item in learn)
    return [md(f"# {title}"), md(badge), md(f"## What you will learn\n{bullets}"), setup_cell()]


def setup_cell() -> nbformat.NotebookNode:
    """The setup cell: SETUP_CELL, a plain code cell (it reads the same in Colab, JupyterLab, VS Code, GitHub)."""
    return code(SETUP_CELL)


def write_notebook(path: str | Path, cells: list[nbformat.NotebookNode]) -> Path:
    """Write a clean notebook (no outputs, kernelspec python3) to `path`."""
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    strip(nb)
    path = Path(path)
    nbformat.write(nb, path)
    return path


def strip(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Remove every output, execution count and widget state."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.execution_count = None
            cell.outputs = []
    nb.metadata.pop("widgets", None)
    return nb


def checked_references(nb: nbformat.NotebookNode) -> dict:
    """The text outputs of the NBVAL_CHECK_OUTPUT cells of an executed notebook, by cell id."""
    return {cell.id: {"source_sha256": source_hash(cell.source),
                      "outputs": [o for o in map(_text_only, cell.outputs) if o is not None]}
            for cell in nb.cells if cell.cell_type == "code" and cell.source.startswith(CHECK_MARK)}


def source_hash(source: str) -> str:
    """sha256 of a cell's source: a reference is stale once its cell changes."""
    return hashlib.sha256(source.encode()).hexdigest()


def references_path(notebook: str | Path) -> Path:
    """Where the nbval references of a notebook live."""
    return REFERENCES / f"{Path(notebook).stem}.json"


def refresh(path: str | Path, timeout: int = 900) -> Path:
    """Execute the notebook (smoke profile), write its checked cells' references, strip it."""
    from nbclient import NotebookClient

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    os.environ.setdefault("NBLIB_PROFILE", "smoke")
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    REFERENCES.mkdir(parents=True, exist_ok=True)
    references_path(path).write_text(json.dumps(checked_references(nb), indent=1, sort_keys=True) + "\n")
    nbformat.write(strip(nb), path)
    return path


def _text_only(output):
    """A checked cell's output reduced to text (streams and text/plain), or None."""
    if output.output_type == "stream":
        return nbformat.v4.new_output("stream", name=output.name, text=output.text)
    if output.output_type in ("execute_result", "display_data") and "text/plain" in output.get("data", {}):
        kind = output.output_type
        kwargs = {"execution_count": None} if kind == "execute_result" else {}
        return nbformat.v4.new_output(kind, data={"text/plain": output.data["text/plain"]}, **kwargs)
    return None


if __name__ == "__main__":
    verb, *paths = sys.argv[1:] or ["help"]
    if verb == "refresh":
        for p in paths:
            print("refreshed", refresh(p))
    elif verb == "setup":
        for p in paths:
            nb = nbformat.read(p, as_version=4)
            cell = setup_cell()
            nb.cells[3].source = cell.source
            nb.cells[3].metadata = cell.metadata
            nbformat.write(strip(nb), p)
            print("setup cell written", p)
    elif verb == "strip":
        for p in paths:
            nb = nbformat.read(p, as_version=4)
            nbformat.write(strip(nb), p)
            print("stripped", p)
    else:
        print(__doc__)
        sys.exit(2)
