"""The setup cell's installer in Colab: every notebook's setup cell (nbtools.SETUP_CELL) runs `setup_nblib` here.

It runs before nblib exists, so it uses the standard library and `google.colab` only. The cell, run in Colab's
working folder (/content), reaches this file first: in `nblib-suite/` (a `git clone` of NBLIB_REPO the cell made,
or an earlier copy), else inside `drive/MyDrive/nblib-suite.zip` (`make drive-zip`). Where nblib comes from:
1. a `git clone NBLIB_REPO` (default: the public repository) in `nblib-suite/`;
2. if the clone fails, a copy of the repository on the user's Drive: the newest zip `MyDrive/nblib-suite*.zip`
   that holds it (its top folder, as `make drive-zip` and GitHub's "Download ZIP" write it);
3. else it stops with one line naming both, and what to do.
The copy records where it came from (`.nblib-source`; a clone's own `origin` says so too): a rerun with the same
NBLIB_REPO fetches and installs nothing; a rerun after NBLIB_REPO changed fetches the new source (into a new
folder first: a failed fetch leaves the old copy). A failed `pip install` gets pip's advice, not the clone's.
"""
import glob
import importlib
import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

REPO_URL = "https://github.com/nblib-suite/nblib-suite"


class SetupFailed(Exception):
    """Shown by IPython as one line, not a traceback."""

    def _render_traceback_(self):
        return ["SetupFailed: " + " ".join(str(self).split())]


def setup_nblib():
    """Fetch nblib into ./nblib-suite once per NBLIB_REPO (a clone, else a Drive copy), pip install it, import it."""
    repo = os.environ.get("NBLIB_REPO", REPO_URL)
    dest = os.path.abspath("nblib-suite")
    previous = _recorded(dest)
    fetched = previous.get("repo") != repo
    source = _fetch(repo, dest) if fetched else previous.get("source", repo)
    if fetched or not _installed(dest):
        _pip_install(dest, source)
    if dest not in sys.path:
        sys.path.insert(0, dest)  # the editable install's .pth is read at the next start; this kernel imports now


def _reason(text, mark, first):
    """The line that says why: git's first `fatal:`, pip's last `ERROR:`."""
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    marked = [s for s in lines if s.startswith(mark) and not s.endswith(":")]
    return (marked[0] if first else marked[-1]) if marked else (lines[-1] if lines else "no output")


def _recorded(dest):
    """Where the copy in `dest` came from: its record, else the URL it was cloned from (the cell's clone)."""
    try:
        with open(os.path.join(dest, ".nblib-source")) as f:
            return json.load(f)
    except (OSError, ValueError):
        pass
    if not os.path.isdir(os.path.join(dest, ".git")):
        return {}
    origin = subprocess.run(["git", "-C", dest, "config", "--get", "remote.origin.url"], capture_output=True,
                            text=True).stdout.strip()
    return {"repo": origin, "source": origin} if origin else {}


def _repository_in(folder):
    """The folder itself, or its one subfolder (a zip's top folder), when it holds the repository."""
    for root in (folder, *sorted(glob.glob(os.path.join(folder, "*")))):
        if os.path.isfile(os.path.join(root, "pyproject.toml")) and os.path.isdir(os.path.join(root, "nblib")):
            return root
    return None


def _my_drive():
    """MyDrive under Colab's mount point, mounted unless it is already (a second mount only prints a line)."""
    mount = os.path.abspath("drive")
    if not os.path.isdir(os.path.join(mount, "MyDrive")):
        importlib.import_module("google.colab.drive").mount(mount)
    return os.path.join(mount, "MyDrive")


def _drive_zips(my_drive):
    """The zips MyDrive/nblib-suite*.zip, newest first."""
    return sorted(glob.glob(os.path.join(my_drive, "nblib-suite*.zip")), key=os.path.getmtime, reverse=True)


def _unzip(path, new):
    with zipfile.ZipFile(path) as z:
        z.extractall(new + ".unzip")
    root = _repository_in(new + ".unzip")
    if root is None:
        raise SetupFailed(f"{path} holds no nblib-suite repository (no pyproject.toml beside nblib/); "
                          f"upload the zip `make drive-zip` writes (outputs/nblib-suite.zip) and rerun this cell")
    shutil.move(root, new)
    shutil.rmtree(new + ".unzip", ignore_errors=True)


def _from_drive(repo, why, new):
    """Unzip the newest Drive copy into `new` after the clone failed (`why`); the copy's path."""
    try:
        my_drive = _my_drive()
        copies = _drive_zips(my_drive)
    except Exception as exc:  # a refused or failed Drive mount: say so, in the one line
        my_drive, copies, why = "MyDrive", [], f"{why}; and Google Drive could not be searched: {exc}"
    if not copies:
        raise SetupFailed(
            f"git clone {repo} failed ({why}), and there is no copy of the repository on your Drive (looked for "
            f"{my_drive}/nblib-suite*.zip). Either upload the zip `make drive-zip` writes (outputs/nblib-suite.zip) "
            f"to MyDrive/, or set os.environ['NBLIB_REPO'] = 'https://github.com/<you>/nblib-suite' (a reachable "
            f"fork); then rerun this cell") from None
    try:
        _unzip(copies[0], new)
    except (OSError, zipfile.BadZipFile) as exc:
        raise SetupFailed(f"git clone {repo} failed ({why}), and unzipping {copies[0]} from your Drive failed "
                          f"({exc}); upload it again (or delete it), then rerun this cell") from None
    return copies[0]


def _fetch(repo, dest):
    """Clone `repo` (else unzip the Drive copy) into a new folder, then put it in place of `dest`; the source."""
    new = dest + ".new"
    for leftover in (new, new + ".unzip"):
        shutil.rmtree(leftover, ignore_errors=True)
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}  # a private or missing repository fails, never asks
    done = subprocess.run(["git", "clone", "-q", "--depth=1", repo, new], capture_output=True, text=True, env=env)
    source = repo
    if done.returncode:
        why = _reason(done.stderr, "fatal:", first=True)
        source = _from_drive(repo, why, new)
        print(f"git clone {repo} failed ({why}); nblib comes from your Drive copy {source} "
              f"(to take a newer copy later: !rm -rf {dest}, then rerun this cell)")
    with open(os.path.join(new, ".nblib-source"), "w") as f:
        json.dump({"repo": repo, "source": source}, f)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(new, dest)
    for name in [m for m in sys.modules if m == "nblib" or m.startswith("nblib.")]:
        del sys.modules[name]  # a changed source is imported afresh
    return source


def _installed(dest):
    importlib.invalidate_caches()
    urls = [json.loads(d.read_text("direct_url.json") or "{}").get("url")
            for d in importlib.metadata.distributions(name="nblib")]
    return pathlib.Path(dest).as_uri() in urls


def _pip_install(dest, source):
    log = dest + "-pip.log"
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-color", "-e", dest], stdout=out,
                              stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        with open(log) as f:
            why = _reason(f.read(), "ERROR:", first=False)
        raise SetupFailed(
            f"pip install -e {dest} failed ({why}). The source is there (from {source}): the fix is not "
            f"NBLIB_REPO. pip's full output: {log}. Check that PyPI is reachable and the disk has room "
            f"(!df -h /content), then rerun this cell; if the copy is damaged, delete it (!rm -rf {dest}) "
            f"and rerun") from None
