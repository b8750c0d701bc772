"""The in-process CLI runner (tests/cli_runner.py) reports what a real `python -m nblib` would, and leaves the
test's process as it found it.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

from cli_runner import run_nblib

from conftest import subprocess_env


def test_help_and_usage_errors_exit_as_a_process_does_and_print_the_same(tmp_path):
    for argv in (["cache", "--help"], ["cache", "--no-such-flag"], ["no-such-verb"]):
        real = subprocess.run([sys.executable, "-m", "nblib", *argv], env=subprocess_env(), capture_output=True,
                              text=True, timeout=120)
        here = run_nblib(*argv)
        assert (here.returncode, here.stdout, here.stderr) == (real.returncode, real.stdout, real.stderr), argv


def test_a_run_gets_its_own_environment_and_cwd_and_the_test_gets_its_own_back(tmp_path, monkeypatch):
    monkeypatch.setenv("NBLIB_PROFILE", "smoke")
    here, handlers = os.getcwd(), list(logging.getLogger().handlers)
    refused = run_nblib("info", cwd=tmp_path, NBLIB_PROFILE="huge")
    assert refused.returncode == 2 and refused.stderr.startswith("error: NBLIB_PROFILE='huge'"), refused
    assert os.environ["NBLIB_PROFILE"] == "smoke" and os.getcwd() == here
    assert logging.getLogger().handlers == handlers


def test_a_file_left_open_by_an_earlier_test_is_not_the_runs_output(tmp_path, monkeypatch):
    """A process starts with CPython's default filters (ResourceWarning ignored): a file another test left open,
    collected while the run is in progress, printed a ResourceWarning into the run's one error line.
    """
    import gc

    import nblib.cli

    real_main = nblib.cli.main

    def main_collecting_a_leak(argv):
        leaked = open(tmp_path / "left-open.txt", "w")     # noqa: SIM115 - left open on purpose
        del leaked
        gc.collect()
        warnings_seen.append(True)
        return real_main(argv)

    warnings_seen = []
    monkeypatch.setattr(nblib.cli, "main", main_collecting_a_leak)
    refused = run_nblib("info", NBLIB_PROFILE="huge")
    assert warnings_seen and refused.returncode == 2
    assert refused.stderr.splitlines() == [refused.stderr.strip()] and refused.stderr.startswith("error: "), refused
