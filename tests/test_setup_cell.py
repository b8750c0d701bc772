"""The Colab setup cell fails clearly and follows NBLIB_REPO (issues 19, 30 and 41), on a Colab-like kernel.

The kernel looks like Colab's (the `google.colab` stand-in imported at start-up, as in test_colab.py,
with its fake Drive under the test's folder), starts in the test's `content/` (Colab's /content) and runs in a
throwaway venv that sees this environment's packages but not nblib, so the cell's real `git clone` and
`pip install -e` change nothing outside it. The repositories are tiny git repositories holding a two-module
`nblib` (fast to install) and the real scripts/colab_setup.py, which the cell runs:
- no clone and no zip on Drive: the cell stops at its bootstrap's import, after git's reason, and leaves
  nothing behind (a rerun after an upload starts afresh);
- a zip on Drive that is not the repository: ONE line naming it;
- a `pip install` that fails: ONE line naming pip and its log, saying that NBLIB_REPO is not the fix;
- NBLIB_REPO changed and the cell rerun: nblib now comes from the new repository; changed to one that cannot
  be cloned, with no zip on Drive: ONE line naming NBLIB_REPO and where on Drive a copy would be, the old copy kept.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from nbtools import SETUP_CELL  # noqa: E402

KERNEL = "colab-setup-stub"
TINY_ENV = "def workspace():\n    return 'workspace of {name}'\n"
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="the setup cell clones with git; install git")


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A Colab-like kernel spec in a throwaway venv; `env` is its environment (edit it before `client`)."""
    from test_colab import _shipped_venv

    startup = tmp_path / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-colab.py").write_text("import google.colab  # the stand-in: this kernel is 'in Colab'\n")
    content = tmp_path / "content"                     # Colab's /content: the kernel starts there
    content.mkdir()
    venv = _shipped_venv(tmp_path / "venv")
    env = {"PYTHONPATH": str(ROOT / "tests" / "colab_stub"), "IPYTHONDIR": str(tmp_path / "ipython"),
           "COLAB_STUB_HOME": str(tmp_path / "stub"), "NBLIB_COLAB_MOUNT_POINT": str(content / "drive"),
           "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("COLAB_STUB_HOME", str(tmp_path / "stub"))

    def client(nb):
        from nbclient import NotebookClient

        spec = tmp_path / "jupyter" / "kernels" / KERNEL
        spec.mkdir(parents=True, exist_ok=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [str(venv / "bin" / "python"), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Colab setup stand-in", "language": "python", "env": env}))
        return NotebookClient(nb, kernel_name=KERNEL, timeout=300, allow_errors=False,
                              resources={"metadata": {"path": str(content)}})

    return SimpleNamespace(tmp=tmp_path, env=env, client=client, clone=content / "nblib-suite",
                           my_drive=tmp_path / "stub" / "drive" / "MyDrive")


def test_with_no_clone_and_no_drive_zip_the_cell_stops_at_its_bootstrap_after_gits_reason(stand_in):
    from nbclient.exceptions import CellExecutionError

    missing = stand_in.tmp / "no-such-repository"
    stand_in.env["NBLIB_REPO"] = f"file://{missing}"
    nb = _notebook()
    with pytest.raises(CellExecutionError):       # Run all stops at the setup cell
        stand_in.client(nb).execute()
    said = _text(nb.cells[0])
    assert "fatal: " in said and str(missing) in said, f"git's reason is shown: {said!r}"
    errors = [o for o in nb.cells[0].outputs if o.output_type == "error"]
    assert [e.ename for e in errors] == ["ModuleNotFoundError"] and "colab_setup" in errors[0].evalue, errors
    shown = "\n".join(errors[0].traceback)
    assert "MyDrive has no nblib-suite.zip" in shown, "the line that failed says what was missing"
    assert not nb.cells[1].outputs and not stand_in.clone.exists(), "nothing is left to block a rerun"


def test_a_drive_zip_that_is_not_the_repository_stops_with_one_line_naming_it(stand_in):
    from nbclient.exceptions import CellExecutionError

    stand_in.env["NBLIB_REPO"] = f"file://{stand_in.tmp / 'not-published'}"
    stand_in.my_drive.mkdir(parents=True)
    bad = stand_in.my_drive / "nblib-suite.zip"
    with zipfile.ZipFile(bad, "w") as z:          # the setup script, but no nblib/ beside a pyproject.toml
        z.write(ROOT / "scripts" / "colab_setup.py", "nblib-suite/scripts/colab_setup.py")
        z.writestr("nblib-suite/README.md", "only the README")
    nb = _notebook()
    with pytest.raises(CellExecutionError):
        stand_in.client(nb).execute()
    line = _one_error_line(nb.cells[0])
    assert "nblib-suite.zip holds no nblib-suite repository" in line and "make drive-zip" in line, line
    assert not stand_in.clone.exists() and not nb.cells[1].outputs


def test_a_failed_pip_install_names_pip_and_its_log_not_nblib_repo(stand_in):
    from nbclient.exceptions import CellExecutionError

    repo = _tiny_repository(stand_in.tmp / "broken", "broken", pyproject="[project\nname = 'nblib'\n")
    stand_in.env["NBLIB_REPO"] = f"file://{repo}"
    nb = _notebook()
    with pytest.raises(CellExecutionError):
        stand_in.client(nb).execute()
    line = _one_error_line(nb.cells[0])
    log = Path(f"{stand_in.clone}-pip.log")
    assert f"pip install -e {stand_in.clone} failed (" in line and str(log) in line, line
    assert "TOMLDecodeError" in line, "the line gives pip's reason"
    assert "the fix is not NBLIB_REPO" in line and "os.environ['NBLIB_REPO']" not in line, line
    assert log.is_file() and "TOMLDecodeError" in log.read_text(), "pip's own output is kept in the log"
    assert (stand_in.clone / "pyproject.toml").is_file(), "the clone itself succeeded and stays"
    assert not nb.cells[1].outputs


def test_changing_nblib_repo_and_rerunning_installs_from_the_new_repository_or_says_why_not(stand_in):
    from nbclient.exceptions import CellExecutionError

    first = _tiny_repository(stand_in.tmp / "first", "first")
    second = _tiny_repository(stand_in.tmp / "second", "second")
    missing = stand_in.tmp / "no-such-repository"
    stand_in.env["NBLIB_REPO"] = f"file://{first}"
    nb = _notebook()
    client = stand_in.client(nb)
    with client.setup_kernel():
        client.reset_execution_trackers()
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
        before = _text(nb.cells[1])
        rerun = _run(client, nb, SETUP_CELL)                    # same NBLIB_REPO: nothing fetched
        assert not _text(rerun), _text(rerun)
        _run(client, nb, f"import os; os.environ['NBLIB_REPO'] = 'file://{second}'")
        _run(client, nb, SETUP_CELL)                            # what the error line tells a user to do
        after = _text(_run(client, nb, nb.cells[1].source))
        _run(client, nb, f"os.environ['NBLIB_REPO'] = 'file://{missing}'")
        with pytest.raises(CellExecutionError):
            _run(client, nb, SETUP_CELL)
        line = _one_error_line(nb.cells[-1])
    init = str(stand_in.clone / "nblib" / "__init__.py")
    assert before.split() == ["first", "workspace", "of", "first", init], before
    assert after.split() == ["second", "workspace", "of", "second", init], after
    assert f"git clone file://{missing} failed (fatal: " in line, "the line gives git's reason"
    assert "os.environ['NBLIB_REPO']" in line and "no copy of the repository on your Drive" in line, line
    assert f"{stand_in.tmp / 'content' / 'drive' / 'MyDrive'}/nblib-suite*.zip" in line, "it names where it looked"
    assert json.loads((stand_in.clone / ".nblib-source").read_text())["repo"] == f"file://{second}", "old copy kept"
    assert not Path(f"{stand_in.clone}.new").exists()


# ---------------------------------------------------------------------------------- helpers


def _notebook():
    """The setup cell, then a cell that says which nblib the kernel imported."""
    probe = "print(nblib.ORIGIN, WORKSPACE, nblib.__file__)"
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SETUP_CELL), nbformat.v4.new_code_cell(probe)])


def _tiny_repository(path: Path, name: str, pyproject: str | None = None) -> Path:
    """A git repository with a minimal installable `nblib` (ORIGIN = name, env.workspace())."""
    (path / "nblib").mkdir(parents=True)
    (path / "pyproject.toml").write_text(pyproject or (
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "nblib"\nversion = "0.0.1"\n[tool.setuptools.packages.find]\ninclude = ["nblib*"]\n'))
    (path / "nblib" / "__init__.py").write_text(f"from . import env\nORIGIN = {name!r}\n")
    (path / "nblib" / "env.py").write_text(TINY_ENV.format(name=name))
    (path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "colab_setup.py", path / "scripts" / "colab_setup.py")
    git = ["git", "-C", str(path), "-c", "user.name=test", "-c", "user.email=test@localhost"]
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", name], check=True)
    return path


def _one_error_line(cell) -> str:
    errors = [o for o in cell.outputs if o.output_type == "error"]
    assert len(errors) == 1 and errors[0].ename == "SetupFailed", cell.outputs
    shown = errors[0].traceback
    assert len(shown) == 1 and "\n" not in shown[0], shown
    return shown[0]


def _run(client, nb, source: str):
    nb.cells.append(nbformat.v4.new_code_cell(source))
    return client.execute_cell(nb.cells[-1], len(nb.cells) - 1)


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
