"""The Colab path end to end without Colab: notebooks 00 and 03 on the google.colab stand-in.

A kernel looks like Colab's: tests/colab_stub is on its PYTHONPATH and an IPython startup file
imports `google.colab` (so `"google.colab" in sys.modules`). Its Python is a throwaway venv that
sees .venv's packages as "what Colab ships" (torch, TensorFlow, numpy...) and starts without
nblib; it starts in the test's `content/` (Colab's /content). The setup cell clones NBLIB_REPO (a git snapshot
of this working tree) into `content/nblib-suite`, runs its scripts/colab_setup.py, which `pip install -e`s it,
and mounts the stand-in's Drive. The test checks:
nblib is installed from the clone; no other distribution changes (torch and TensorFlow keep their
version and files); the workspace lives under the fake MyDrive; rerunning the cell, even after the
mount dropped with Errno 107, re-clones nothing, reinstalls nothing else and remounts.

Before the repository is public (NBLIB_REPO unreachable), the setup cell installs from the zip `make drive-zip`
writes, uploaded to the stand-in's Drive as `MyDrive/nblib-suite.zip` (tests/test_setup_cell.py has the
errors), and Drive is mounted once: no "Drive already mounted ... call drive.mount(...)" line (issue 41).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STUB = ROOT / "tests" / "colab_stub"
KERNEL = "colab-stub"
CHECK_TAG = "COLAB_CHECK "
CHECK_CELL = f'''\
import json, importlib.metadata as md, importlib.util as iu
print({CHECK_TAG!r} + json.dumps({{
    "colab": "google.colab" in sys.modules, "runtime": nblib.env.runtime(), "nblib": nblib.__file__,
    "workspace": str(WORKSPACE.drive), "mount_point": str(nblib.env.COLAB_MOUNT_POINT),
    "shipped": {{m: [md.version(d), iu.find_spec(m).origin] for m, d in
                (("torch", "torch"), ("tensorflow", "tensorflow-cpu"), ("numpy", "numpy"))}}}}))'''
DISTRIBUTIONS = '''\
import importlib.metadata as md, json
print(json.dumps(sorted({(d.metadata["Name"].lower(), d.version, str(d.locate_file("")))
                         for d in md.distributions()})))'''


@pytest.fixture(scope="module")
def colab(tmp_path_factory):
    """A Colab-like kernel (spec, env, venv) and a git snapshot of this checkout to install from."""
    if shutil.which("git") is None:
        pytest.skip("the setup cell clones with git; install git")
    tmp = tmp_path_factory.mktemp("colab")
    content = tmp / "content"
    content.mkdir()
    env = SimpleNamespace(tmp=tmp, content=content, src=_snapshot(tmp / "src"), venv=_shipped_venv(tmp / "venv"),
                          stub_home=tmp / "stub", clone=content / "nblib-suite",
                          mount_point=content / "drive")
    ipython = tmp / "ipython" / "profile_default" / "startup"
    ipython.mkdir(parents=True)
    (ipython / "00-colab.py").write_text("import google.colab  # the stand-in: this kernel is 'in Colab'\n")
    kernel_env = {"PYTHONPATH": str(STUB), "IPYTHONDIR": str(tmp / "ipython"),
                  "COLAB_STUB_HOME": str(env.stub_home), "NBLIB_REPO": f"file://{env.src}",
                  "NBLIB_COLAB_MOUNT_POINT": str(env.mount_point),
                  "NBLIB_PROFILE": "smoke", "NBLIB_OUTPUTS": str(content / "outputs"),
                  "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.kernel_env = kernel_env
    _write_kernel_spec(env, KERNEL, {
        "argv": [str(env.venv / "bin" / "python"), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Colab stand-in", "language": "python", "env": kernel_env})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(tmp / "jupyter"))
        mp.setenv("COLAB_STUB_HOME", str(env.stub_home))
        for var in ("NBLIB_DRIVE_DIR", "PYTHONPATH", "COLAB_RELEASE_TAG"):
            mp.delenv(var, raising=False)
        content_existed = Path("/content").exists()
        yield env
    _remove_default_mount(env.stub_home, content_existed)


def test_notebook_00_installs_nblib_in_the_colab_branch_keeps_shipped_packages_and_reruns(colab):
    before = _distributions(colab.venv)
    assert not _importable(colab.venv, "nblib"), "the venv must start without nblib"
    nb = _notebook("00_setup.ipynb")
    client = _client(nb, colab)
    with client.setup_kernel():
        client.reset_execution_trackers()
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
        first = _check(client, nb)
        installed = _distributions(colab.venv)

        (colab.clone / "marker-of-the-first-clone").write_text("kept")
        _stub_drive().control(disconnected=True)          # the mount drops; the rerun must remount
        rerun = _execute(client, nb, nb.cells[3].source)
        assert "Transport endpoint" not in _text(rerun)
        again = _check(client, nb)

    assert first["colab"] and first["runtime"] == "colab"
    assert Path(first["nblib"]).is_relative_to(colab.clone), "nblib must be imported from the clone"
    added = set(installed) - set(before)
    assert {name for name, _, _ in added} == {"nblib"}, f"the setup cell changed more than nblib: {added}"
    assert set(before) - set(installed) == set(), "the setup cell removed or changed shipped packages"
    for module, (version, origin) in first["shipped"].items():
        assert Path(origin).is_relative_to(sysconfig.get_paths()["purelib"]), (module, origin)
        assert version == _shipped_version(module), module
    _assert_workspace_on_fake_drive(first, colab)

    assert again == first, "rerunning the setup cell changed what the kernel uses"
    assert _distributions(colab.venv) == installed, "rerunning the setup cell changed installed packages"
    assert (colab.clone / "marker-of-the-first-clone").exists(), "rerunning the setup cell cloned again"
    assert "disconnected" not in _stub_drive().faults(), "the rerun did not remount the dropped Drive"


def test_notebook_03_runs_on_the_fake_colab_and_mirrors_its_run_to_the_fake_drive(colab):
    nb = _notebook("03_streaming_trm_encoding.ipynb")
    client = _client(nb, colab)
    with client.setup_kernel():
        client.reset_execution_trackers()
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
        check = _check(client, nb)
        mirror = _execute(client, nb, "print(MIRROR_DIR)")
    assert check["colab"] and Path(check["nblib"]).is_relative_to(colab.clone)
    _assert_workspace_on_fake_drive(check, colab)
    mirror_dir = Path(_text(mirror).strip())
    assert mirror_dir.is_relative_to(Path(check["workspace"])), mirror_dir
    cloud = colab.stub_home / "drive" / "MyDrive" / mirror_dir.relative_to(Path(check["mount_point"]) / "MyDrive")
    assert (cloud / "manifest.json").is_file() and list(cloud.glob("part-*/part.json")), \
        f"encode did not mirror its parts to the fake Drive ({cloud})"


def test_without_a_reachable_repository_the_setup_cell_installs_from_the_drive_zip_mounting_once(colab, tmp_path):
    """Before the repository is public: the clone fails, and nblib comes from MyDrive/nblib-suite.zip."""
    stub_home, content = tmp_path / "stub", tmp_path / "content"
    clone, my_drive = content / "nblib-suite", stub_home / "drive" / "MyDrive"
    my_drive.mkdir(parents=True)
    content.mkdir()
    copy = my_drive / "nblib-suite.zip"                 # as `make drive-zip` writes it: one top folder, nblib-suite/
    with zipfile.ZipFile(copy, "w") as z:
        for path in sorted(colab.src.rglob("*")):
            if path.is_file() and ".git" not in path.relative_to(colab.src).parts:
                z.write(path, Path("nblib-suite") / path.relative_to(colab.src))
    (my_drive / "nblib-suite-notes.txt").write_text("not a repository: ignored")
    kernel = _kernel_spec(colab, f"{KERNEL}-zip", NBLIB_REPO=f"file://{tmp_path / 'not-published'}",
                          COLAB_STUB_HOME=str(stub_home), NBLIB_COLAB_MOUNT_POINT=str(content / "drive"),
                          NBLIB_OUTPUTS=str(content / "outputs"))
    venv = _shipped_venv(tmp_path / "venv")
    kernel["argv"][0] = str(venv / "bin" / "python")
    _write_kernel_spec(colab, f"{KERNEL}-zip", kernel)
    nb = _notebook("00_setup.ipynb")
    nb.cells = nb.cells[:4]
    client = _client(nb, colab, kernel_name=f"{KERNEL}-zip", cwd=content)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLAB_STUB_HOME", str(stub_home))
        with client.setup_kernel():
            client.reset_execution_trackers()
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index)
            said = _text(nb.cells[3])
            check = _check(client, nb)
            rerun = _text(_execute(client, nb, nb.cells[3].source))
    assert f"nblib comes from your Drive copy {content / 'drive' / 'MyDrive' / copy.name}" in said, said
    assert "not-published failed (fatal: " in said, "the line says why the clone was not used"
    assert said.count("Mounted at") == 1 and "already mounted" not in said + rerun, said
    assert Path(check["nblib"]).is_relative_to(clone), "nblib is imported from the local copy, not from Drive"
    assert (clone / "pyproject.toml").is_file() and not (clone / ".git").exists()
    assert json.loads((clone / ".nblib-source").read_text())["source"].endswith(copy.name)
    workspace = Path(check["workspace"])
    assert workspace.resolve() == (my_drive / "nblib").resolve(), workspace
    assert not rerun.strip(), "a rerun with the same NBLIB_REPO fetches, mounts and prints nothing"
    assert not Path(f"{clone}.new").exists() and not Path(f"{clone}.new.unzip").exists()


# ---------------------------------------------------------------------------------- helpers


def _snapshot(src: Path) -> Path:
    """A git repository holding this working tree as it is (uncommitted edits included)."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    git = ["git", "-C", str(src), "-c", "user.name=test", "-c", "user.email=test@localhost"]
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "snapshot"], check=True)
    return src


def _shipped_venv(venv: Path) -> Path:
    """A venv that sees this environment's packages (Colab's "shipped" ones) and not nblib."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                   check=True)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True,
                               text=True).stdout.strip())
    # a plain path line: .venv's own .pth files (nblib's editable finder among them) stay unprocessed
    (site / "colab-shipped.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def _distributions(venv: Path) -> list[tuple[str, str, str]]:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", DISTRIBUTIONS], check=True,
                         capture_output=True, text=True, cwd=venv, env={**os.environ, "PYTHONPATH": ""}).stdout
    return [tuple(row) for row in json.loads(out)]


def _importable(venv: Path, module: str) -> bool:
    code = f"import importlib.util; print(importlib.util.find_spec({module!r}) is not None)"
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], check=True, capture_output=True, text=True,
                         cwd=venv, env={**os.environ, "PYTHONPATH": ""}).stdout
    return out.strip() == "True"


def _shipped_version(module: str) -> str:
    from importlib.metadata import version

    return version({"tensorflow": "tensorflow-cpu"}.get(module, module))


def _notebook(name: str) -> nbformat.NotebookNode:
    return nbformat.read(ROOT / "notebooks" / name, as_version=4)


def _client(nb, colab, kernel_name=KERNEL, cwd=None):
    from nbclient import NotebookClient

    return NotebookClient(nb, kernel_name=kernel_name, timeout=600, allow_errors=False,
                          resources={"metadata": {"path": str(cwd or colab.content)}})


def _kernel_spec(colab, name: str, **env: str) -> dict:
    """The stand-in kernel's spec with some of its environment replaced."""
    return {"argv": [str(colab.venv / "bin" / "python"), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": name, "language": "python", "env": {**colab.kernel_env, **env}}


def _write_kernel_spec(colab, name: str, spec: dict) -> None:
    folder = colab.tmp / "jupyter" / "kernels" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernel.json").write_text(json.dumps(spec))


def _execute(client, nb, source: str):
    nb.cells.append(nbformat.v4.new_code_cell(source))
    return client.execute_cell(nb.cells[-1], len(nb.cells) - 1)


def _check(client, nb) -> dict:
    line = next(s for s in _text(_execute(client, nb, CHECK_CELL)).splitlines() if s.startswith(CHECK_TAG))
    return json.loads(line[len(CHECK_TAG):])


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def _assert_workspace_on_fake_drive(check: dict, colab) -> None:
    workspace = Path(check["workspace"])
    assert workspace == Path(check["mount_point"]) / "MyDrive" / "nblib", workspace
    assert workspace.resolve() == (colab.stub_home / "drive" / "MyDrive" / "nblib").resolve()
    assert {p.name for p in workspace.iterdir()} >= {"cache", "runs", "checkpoints"}


def _stub_drive():
    """The stand-in's drive module, loaded under another name (this process stays non-Colab)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("colab_stub_drive", STUB / "google" / "colab" / "drive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _remove_default_mount(stub_home: Path, content_existed: bool) -> None:
    """Remove /content/drive if the stand-in made it (nblib ignored NBLIB_COLAB_MOUNT_POINT)."""
    default = Path("/content/drive")
    if default.is_symlink() and default.resolve() == (stub_home / "drive").resolve():
        default.unlink()
        if not content_existed and not any(default.parent.iterdir()):
            default.parent.rmdir()
