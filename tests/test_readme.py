"""The README gets a user started (issue 41): short, its command lines run as typed after `make run`, its links
to docs/ resolve, and `make drive-zip` writes a clean copy the notebooks' setup cell can install from.

The zip check runs the Makefile's own recipe (`make -n drive-zip` prints it) in a temporary clone of this
repository's HEAD, so it sees what a user's `make drive-zip` writes: tracked files only.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 350
VENV_PYTHON = re.compile(r"(?:^|\s)\.venv/bin/python\s+-m\s+nblib\b")
ACTIVATE = re.compile(r"(?:^|\s)(?:source|\.)\s+\.venv/bin/activate\b")
DOCS_LINK = re.compile(r"\]\((docs/[^)#\s]+)(?:#[^)]*)?\)")


def code_blocks(text: str) -> list[list[str]]:
    """The lines of each fenced code block, in order."""
    blocks, block = [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if block is None:
                block = []
            else:
                blocks.append(block)
                block = None
        elif block is not None:
            block.append(line)
    return blocks


def unrunnable_nblib_lines(text: str) -> list[str]:
    """Command lines that run `python -m nblib` with whatever `python` is on the PATH: neither the venv's
    interpreter nor after an activation line earlier in the same block (a bare python lacks nblib's
    dependencies: ModuleNotFoundError 'xxhash'). Inline mentions in prose (`python -m nblib <verb>`) are names,
    not command lines, and are not checked.
    """
    bad = []
    for block in code_blocks(text):
        activated = False
        for line in block:
            activated = activated or bool(ACTIVATE.search(line))
            if re.search(r"\bpython3?\s+-m\s+nblib\b", line) and not VENV_PYTHON.search(line) and not activated:
                bad.append(line.strip())
    return bad


def test_the_readme_is_at_most_350_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move reference material to docs/"


def test_every_nblib_command_line_in_the_readme_runs_with_the_venv():
    text = README.read_text()
    assert VENV_PYTHON.search(text) and ACTIVATE.search(text), "the README no longer says how to use the venv"
    assert unrunnable_nblib_lines(text) == []


def test_the_command_line_check_catches_a_bare_python():
    """The check's own test: C5's line fails it, the venv's and an activated block's pass."""
    bare = "```bash\npython -m nblib cache --images my_pngs/ --out x\n```\n"
    assert unrunnable_nblib_lines(bare) == ["python -m nblib cache --images my_pngs/ --out x"]
    assert unrunnable_nblib_lines("```bash\n.venv/bin/python -m nblib info\n```\n") == []
    assert unrunnable_nblib_lines("```bash\nsource .venv/bin/activate\npython -m nblib info\n```\n") == []
    assert unrunnable_nblib_lines("```bash\nsource .venv/bin/activate\n```\n```bash\npython -m nblib info\n```\n")


def test_every_docs_link_in_the_readme_resolves_to_a_file():
    text = README.read_text()
    links = DOCS_LINK.findall(text)
    assert len(links) >= 5, "the README links no docs/ pages"
    missing = sorted({link for link in links if not (ROOT / link).is_file()})
    assert missing == [], f"README links to missing docs/ files: {missing}"
    pages = sorted(str(page.relative_to(ROOT)) for page in (ROOT / "docs").glob("*.md"))
    assert [page for page in pages if page not in links] == [], "a docs/ page the README does not link"


def test_the_readme_layout_names_every_lab_module():
    """P24: the lab/ list names every module in nblib/lab/."""
    text = README.read_text()
    layout = text[text.index("## Layout"):]
    modules = sorted(p.stem if p.is_file() else p.name for p in (ROOT / "nblib" / "lab").iterdir()
                     if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file())
    assert modules and [m for m in modules if not re.search(rf"\b{m}\b", layout)] == []


@pytest.mark.skipif(shutil.which("git") is None or shutil.which("make") is None, reason="needs git and make")
def test_make_drive_zip_holds_the_repository_under_one_folder_and_no_venv_or_outputs(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--shared", str(ROOT), str(clone)], check=True)
    shutil.copy(ROOT / "Makefile", clone / "Makefile")          # this tree's target, on the committed files
    (clone / ".venv").mkdir()
    (clone / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (clone / "outputs" / "figures").mkdir(parents=True)
    (clone / "outputs" / "figures" / "a.png").write_bytes(b"png")
    done = subprocess.run(["make", "-s", "drive-zip"], cwd=clone, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with zipfile.ZipFile(clone / "outputs" / "nblib-suite.zip") as z:
        names = z.namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"nblib-suite"}, tops
    inner = {n.split("/", 1)[1] for n in names}
    # what the setup cell installs from (scripts/colab_setup.py `repository_in`): pyproject.toml beside nblib/
    assert "pyproject.toml" in inner and "nblib/__init__.py" in inner and "scripts/colab_setup.py" in inner
    assert [n for n in inner if n.startswith((".venv/", "outputs/", ".git/"))] == []

