"""The setup cell's installer: every notebook's setup cell is `setup_nblib` below (see nbtools.SETUP_CELL).

It runs in Colab before nblib exists, so it uses the standard library and `google.colab` only, and
everything lives inside one function (a cell leaves one name behind). Where nblib comes from:
1. `git clone NBLIB_REPO` (default: the public repository) into NBLIB_CLONE_DIR (/content/nblib-suite);
2. if the clone fails, a copy of the repository on the user's Drive: the newest folder
   `MyDrive/nblib-suite*/` or zip `MyDrive/nblib-suite*.zip` (GitHub's "Download ZIP" works as is),
   so Colab works before the repository is public or without network to GitHub;
3. else it stops with one line naming both, and what to do.
The copy records where it came from (`.nblib-source`): a rerun with the same NBLIB_REPO fetches and
installs nothing; a rerun after NBLIB_REPO changed fetches the new source (into a new folder first: a
failed fetch leaves the old copy). A failed `pip install` gets pip's advice, not the clone's.
"""
import sys

REPO_URL = "https://github.com/nblib-suite/nblib-suite"


def setup_nblib():
    """Fetch nblib (a clone, else a Drive copy) into NBLIB_CLONE_DIR once per source, pip install it, import it."""
    import glob
    import importlib
    import importlib.metadata
    import json
    import os
    import pathlib
    import shutil
    import subprocess
    import zipfile

    class SetupFailed(Exception):  # shown as one line, not a traceback
        def _render_traceback_(self):
            return ["SetupFailed: " + " ".join(str(self).split())]

    repo = os.environ.get("NBLIB_REPO", "https://github.com/nblib-suite/nblib-suite")
    dest = os.path.abspath(os.environ.get("NBLIB_CLONE_DIR", "/content/nblib-suite"))
    new, mount = dest + ".new", os.environ.get("NBLIB_COLAB_MOUNT_POINT", "/content/drive")
    drive_dir = os.path.join(mount, "MyDrive")

    def reason(text, mark, first):  # the line that says why: git's first `fatal:`, pip's last `ERROR:`
        lines = [s.strip() for s in text.splitlines() if s.strip()]
        marked = [s for s in lines if s.startswith(mark) and not s.endswith(":")]
        return (marked[0] if first else marked[-1]) if marked else (lines[-1] if lines else "no output")

    def recorded():
        try:
            with open(os.path.join(dest, ".nblib-source")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def repository_in(folder):  # the folder itself, or its one subfolder (a zip's top folder)
        for root in (folder, *sorted(glob.glob(os.path.join(folder, "*")))):
            if os.path.isfile(os.path.join(root, "pyproject.toml")) and os.path.isdir(os.path.join(root, "nblib")):
                return root
        return None

    def drive_copies():
        drive = importlib.import_module("google.colab.drive")
        try:
            drive.mount(mount)
            names = os.listdir(drive_dir)
        except OSError:  # Errno 107: a mount that dropped is mounted again
            drive.mount(mount, force_remount=True)
            names = os.listdir(drive_dir)
        paths = [os.path.join(drive_dir, n) for n in names if n.startswith("nblib-suite")]
        ok = [p for p in paths if p.endswith(".zip") or (os.path.isdir(p) and repository_in(p))]
        return sorted(ok, key=os.path.getmtime, reverse=True)

    def copy_from_drive(path):
        if path.endswith(".zip"):
            with zipfile.ZipFile(path) as z:
                z.extractall(new + ".unzip")
            root = repository_in(new + ".unzip")
            if root is None:
                raise SetupFailed(f"{path} holds no nblib-suite repository (no pyproject.toml beside nblib/); "
                                  f"upload the repository's zip (GitHub: Code > Download ZIP) and rerun this cell")
            shutil.move(root, new)
            shutil.rmtree(new + ".unzip", ignore_errors=True)
        else:
            skip = shutil.ignore_patterns(".git", ".venv", "outputs", "__pycache__")
            shutil.copytree(repository_in(path), new, ignore=skip)

    def fetch():
        for leftover in (new, new + ".unzip"):
            shutil.rmtree(leftover, ignore_errors=True)
        env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}  # a private or missing repository fails, never asks
        done = subprocess.run(["git", "clone", "-q", "--depth=1", repo, new], capture_output=True, text=True, env=env)
        source = repo
        if done.returncode:
            why = reason(done.stderr, "fatal:", first=True)
            try:
                copies = drive_copies()
            except Exception as exc:  # a refused or failed Drive mount: say so, in the one line
                copies, why = [], f"{why}; and Google Drive could not be searched: {exc}"
            if not copies:
                raise SetupFailed(
                    f"git clone {repo} failed ({why}), and there is no copy of the repository on your Drive "
                    f"(looked for {drive_dir}/nblib-suite*/ and nblib-suite*.zip). Either upload the repository "
                    f"(its zip, e.g. GitHub: Code > Download ZIP) to MyDrive/ under a name starting with "
                    f"nblib-suite, or set os.environ['NBLIB_REPO'] = 'https://github.com/<you>/nblib-suite' "
                    f"(a reachable fork); then rerun this cell") from None
            source = copies[0]
            try:
                copy_from_drive(source)
            except (OSError, zipfile.BadZipFile) as exc:
                raise SetupFailed(f"git clone {repo} failed ({why}), and copying {source} from your Drive failed "
                                  f"({exc}); upload it again (or delete it), then rerun this cell") from None
            print(f"git clone {repo} failed ({why}); nblib comes from your Drive copy {source} "
                  f"(to take a newer copy later: !rm -rf {dest}, then rerun this cell)")
        with open(os.path.join(new, ".nblib-source"), "w") as f:
            json.dump({"repo": repo, "source": source}, f)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(new, dest)
        for name in [m for m in sys.modules if m == "nblib" or m.startswith("nblib.")]:
            del sys.modules[name]  # a changed source is imported afresh below
        return source

    def installed():
        importlib.invalidate_caches()
        urls = [json.loads(d.read_text("direct_url.json") or "{}").get("url")
                for d in importlib.metadata.distributions(name="nblib")]
        return pathlib.Path(dest).as_uri() in urls

    previous = recorded()
    fetched = previous.get("repo") != repo
    source = fetch() if fetched else previous.get("source", repo)
    if fetched or not installed():
        log = dest + "-pip.log"
        with open(log, "w") as out:
            done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-color", "-e", dest], stdout=out,
                                  stderr=subprocess.STDOUT, text=True)
        if done.returncode:
            with open(log) as f:
                why = reason(f.read(), "ERROR:", first=False)
            raise SetupFailed(
                f"pip install -e {dest} failed ({why}). The source is there (from {source}): the fix is not "
                f"NBLIB_REPO. pip's full output: {log}. Check that PyPI is reachable and the disk has room "
                f"(!df -h /content), then rerun this cell; if the copy is damaged, delete it (!rm -rf {dest}) "
                f"and rerun") from None
    if dest not in sys.path:
        sys.path.insert(0, dest)
