"""run_until really SIGKILLs a process group on a condition; cli_command builds nblib commands."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from nblib.proc import cli_command, run_until, was_killed


def test_run_until_sigkills_the_process_and_its_children_once_ready(tmp_path):
    marker, child_pid = tmp_path / "started", tmp_path / "child.pid"
    script = (f"import subprocess, sys, time, pathlib; "
              f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"pathlib.Path({str(child_pid)!r}).write_text(str(c.pid)); "
              f"pathlib.Path({str(marker)!r}).write_text('x'); time.sleep(60)")
    start = time.monotonic()
    code = run_until([sys.executable, "-c", script], marker.exists, timeout=30)
    assert was_killed(code) and time.monotonic() - start < 20
    pid = int(child_pid.read_text())
    time.sleep(0.2)
    stat = f"/proc/{pid}/stat"
    status = Path(stat).read_text().split()[2] if os.path.exists(stat) else "gone"
    assert status in ("gone", "Z"), "the child in the same process group must die too"


def test_run_until_reports_a_command_that_ends_first():
    code = run_until([sys.executable, "-c", "raise SystemExit(3)"], lambda: False, timeout=30)
    assert code == 3 and not was_killed(code)


def test_cli_command_spells_flags_like_the_cli():
    assert cli_command("encode", cache="c", out="o", batch_size=8, outputs=("sketches", "checksums"),
                       no_progress=True, mirror=None, resume=False)[1:] == [
        "-m", "nblib", "encode", "--cache", "c", "--out", "o", "--batch-size", "8",
        "--outputs", "sketches,checksums", "--no-progress"]
