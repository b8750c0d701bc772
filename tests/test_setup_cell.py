"""The Colab setup cell fails clearly (issue 19): a clone that fails stops the cell with ONE line that
names NBLIB_REPO and what to set it to, before a failed install or `import nblib` can add two more errors.

The kernel looks like Colab's (the `google.colab` stand-in imported at start-up, as in test_colab.py);
NBLIB_REPO points at a folder that is not a repository, so the real `git clone` fails.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from nbtools import SETUP_CELL  # noqa: E402

KERNEL = "colab-setup-stub"


@pytest.mark.skipif(shutil.which("git") is None, reason="the setup cell clones with git; install git")
def test_a_failed_clone_stops_the_setup_cell_with_one_line_naming_nblib_repo(tmp_path, monkeypatch):
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    startup = tmp_path / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-colab.py").write_text("import google.colab  # the stand-in: this kernel is 'in Colab'\n")
    missing = tmp_path / "no-such-repository"
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Colab setup stand-in", "language": "python",
        "env": {"PYTHONPATH": str(ROOT / "tests" / "colab_stub"), "IPYTHONDIR": str(tmp_path / "ipython"),
                "COLAB_STUB_HOME": str(tmp_path / "stub"), "NBLIB_REPO": f"file://{missing}",
                "NBLIB_CLONE_DIR": str(tmp_path / "clone")}}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SETUP_CELL),
                                         nbformat.v4.new_code_cell("print('the next cell ran')")])
    client = NotebookClient(nb, kernel_name=KERNEL, timeout=120, allow_errors=False,
                            resources={"metadata": {"path": str(tmp_path)}})
    with pytest.raises(CellExecutionError):       # Run all stops at the setup cell
        client.execute()
    errors = [o for o in nb.cells[0].outputs if o.output_type == "error"]
    assert len(errors) == 1 and errors[0].ename == "SetupFailed"
    shown = errors[0].traceback
    assert len(shown) == 1 and "\n" not in shown[0], shown
    assert "git clone" in shown[0] and "NBLIB_REPO" in shown[0] and "os.environ['NBLIB_REPO']" in shown[0]
    assert not [o for o in nb.cells[0].outputs if o.output_type == "stream"], "nothing else is printed"
    assert not nb.cells[1].outputs and not (tmp_path / "clone").exists()
