"""The suite's runner (`python -m nblib suite`) fails a notebook that stops producing output, loudly and soon.

Issue 30: on a second `make run`, nbclient waited ~15 minutes on notebook 06 with the kernel idle, and the
table then said "ok". The runner now has an inactivity limit: no message from the kernel for that long and the
notebook is FAILED with a NotebookStalled naming the notebook and the cell, and the kernel (with whatever it
started) is killed. Tiny notebooks, real kernels.
"""
from __future__ import annotations

import os
import time

import nbformat
import pytest

from nblib import suite
from nblib.errors import ConfigError


def notebook(folder, name: str, *sources: str):
    path = folder / name
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                   # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_notebook_that_goes_silent_fails_naming_the_cell_and_its_kernel_is_killed(tmp_path):
    path = notebook(tmp_path, "07_hangs.ipynb",
                    "print('hello')",
                    "import os, subprocess, time\n"
                    "open('pids', 'w').write(f'{os.getpid()} {subprocess.Popen([\"sleep\", \"600\"]).pid}')\n"
                    "time.sleep(600)",
                    "print('never')")
    start = time.monotonic()
    result = suite.run_notebook(path, tmp_path / "out", timeout=900, inactivity_s=3)
    took = time.monotonic() - start
    assert result.status == "FAILED"
    assert result.error.startswith("NotebookStalled: 07_hangs.ipynb produced no output for ")
    assert "in cell 1 (`import os, subprocess, time`)" in result.error
    assert "NBLIB_SUITE_INACTIVITY_S" in result.error
    assert took < 120, took                 # not nbclient's 900 s per-cell timeout
    kernel, child = map(int, (tmp_path / "pids").read_text().split())
    deadline = time.monotonic() + 10
    while (alive(kernel) or alive(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(kernel) and not alive(child)
    executed = nbformat.read(tmp_path / "out" / path.name, as_version=4)
    assert executed.cells[0].outputs[0]["text"] == "hello\n"     # the executed copy is still written


def test_a_notebook_that_keeps_printing_runs_past_the_limit(tmp_path):
    # 8 s of output every 0.5 s against a 6 s limit: past the limit in all, never silent for it. (With a 2 s limit
    # the kernel's shutdown after the last cell, which prints nothing, took over 2 s on a loaded machine.)
    path = notebook(tmp_path, "08_slow.ipynb",
                    "import time\nfor i in range(16):\n    print(i, flush=True)\n    time.sleep(0.5)")
    result = suite.run_notebook(path, tmp_path / "out", inactivity_s=6)
    assert (result.status, result.error) == ("ok", "")
    assert result.seconds >= 8


def test_the_limit_comes_from_the_environment_and_a_bad_one_is_refused(monkeypatch):
    monkeypatch.setenv("NBLIB_SUITE_INACTIVITY_S", "42")
    assert suite.inactivity_limit() == 42.0
    assert suite.inactivity_limit(7) == 7.0
    monkeypatch.setenv("NBLIB_SUITE_INACTIVITY_S", "soon")
    with pytest.raises(ConfigError, match="NBLIB_SUITE_INACTIVITY_S"):
        suite.inactivity_limit()


def test_every_progress_bar_is_the_suites_one_helper_and_starts_no_monitor_thread():
    # tqdm's monitor thread outlived 06's training bar (the kernel kept it after the cell) and refreshes bars from
    # its own thread; a widget bar updated from a thread was seen to stall a kernel. One helper, no monitor.
    import ast
    import subprocess
    import sys
    from pathlib import Path

    root = Path(suite.__file__).resolve().parent
    importers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                       if any(isinstance(n, (ast.Import, ast.ImportFrom)) and "tqdm" in ast.unparse(n)
                              for n in ast.walk(ast.parse(p.read_text()))))
    assert importers == ["compare.py"], importers
    # in a fresh interpreter: a worker that ran other tests may hold a monitor that some library's bar started
    code = ("import threading, time\n"
            "from nblib.compare import progress_bar\n"
            "for widget in (False, True):\n"
            "    with progress_bar(3, 'test', 'it', widget=widget) as bar:\n"
            "        bar.update(3)\n"
            "time.sleep(0.2)\n"
            "print([t.name for t in threading.enumerate() if 'monitor' in t.name.lower()])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root.parent)})
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr[-2000:])


def test_a_kernel_that_will_not_shut_down_after_its_last_cell_fails_naming_that_phase(tmp_path):
    # the hang issue 30 saw: every cell done, and nbclient still waiting on the kernel
    path = notebook(tmp_path, "09_lingers.ipynb",
                    "import os, signal, threading, time\n"
                    "signal.signal(signal.SIGTERM, signal.SIG_IGN)   # what a stuck exit looks like to the runner\n"
                    "threading.Thread(target=time.sleep, args=(600,)).start()   # joined at exit: never ends\n"
                    "open('pid', 'w').write(str(os.getpid()))")
    result = suite.run_notebook(path, tmp_path / "out", inactivity_s=3)   # jupyter_client kills it at 5 s
    assert result.status == "FAILED", result
    assert "09_lingers.ipynb produced no output for" in result.error
    assert "after its last cell ran, while its kernel shut down (in cell 0 (`import os, signal" in result.error
    kernel = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 10
    while alive(kernel) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(kernel)


def test_the_notebooks_kernels_run_one_torch_thread_as_make_test_runs_them(tmp_path, monkeypatch):
    """`make run` (nblib suite) pins the kernels' threads as `make test` does: OMP/MKL_NUM_THREADS=1 where unset."""
    for name in suite.KERNEL_THREADS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "3")         # a value the user set is kept
    out = tmp_path / "threads.txt"
    path = notebook(tmp_path, "00_threads.ipynb", "import os\n"
                    f"open({str(out)!r}, 'w').write(os.environ.get('OMP_NUM_THREADS', '') + ' ' + "
                    "os.environ.get('MKL_NUM_THREADS', ''))")
    result = suite.run_notebook(path, tmp_path / "out")
    assert result.status == "ok", result.error
    assert out.read_text() == "1 3"
