"""Colab's shipped packages stay: nblib's dependency ranges against Colab-like older pins, in a separate venv.

    python scripts/colab_pins_check.py [--venv DIR] [pytest args...]

Creates a venv (a temporary one unless --venv names a folder to reuse) without torch or
TensorFlow, installs the pins below, asks pip what `pip install -e .` (what the Colab setup
cell runs) would change (it must change nothing but nblib), installs nblib with --no-deps, runs
`pip check`, checks the pins are still the installed versions, and runs the light tests: every
test of tests/ except the browser and Colab ones, where a test that needs torch or TensorFlow
(ModuleNotFoundError for them, at import or at run time) is skipped by this file acting as a
pytest plugin. Exit status 0 only when all of that holds.

The pins are the versions Colab shipped when its Python was 3.11 (ipywidgets 7.7.1, numpy 1.26.4,
Pillow 9.4.0, matplotlib 3.7.1); each has a cp311 wheel, so none had to be moved.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PINS = {"ipywidgets": "7.7.1", "numpy": "1.26.4", "pillow": "9.4.0", "matplotlib": "3.7.1"}
# what the light tests need besides nblib's own dependencies (Colab ships these too)
TEST_TOOLS = ["pytest", "hypothesis", "nbformat", "psutil", "tqdm"]
# nblib's own small dependencies (pyproject.toml): installed fresh where Colab lacks them, and their ranges are wide
# enough not to replace a version Colab ships; installed here first, as a Colab that has them
ADDED = ["xxhash>=3.0", "zstandard>=0.19"]
HEAVY = ("torch", "tensorflow")
NOT_LIGHT = ["tests/test_browser.py", "tests/test_colab.py"]
MISSING_HEAVY = re.compile(r"No module named \\?'(torch|tensorflow)[.'\\]")   # also as repr() escapes it


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, help="venv folder to create or reuse (default: a temporary one)")
    args, pytest_args = parser.parse_known_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="colab-pins-") as tmp:
        venv = args.venv or Path(tmp) / "venv"
        python = _venv(venv)
        pins = [f"{name}=={version}" for name, version in PINS.items()]
        _quiet(_pip(python, "install", "-q", *pins, *TEST_TOOLS, *ADDED, capture=True))
        problems = _would_change(python) + _pip_check(python) + _moved_pins(python)
        status = _light_tests(python, pytest_args)
    for problem in problems:
        print("PROBLEM:", problem)
    print(f"colab pins check: {'ok' if not problems and status == 0 else 'FAILED'} "
          f"(pytest exit {status}, {len(problems)} problems) in {time.monotonic() - started:.0f} s")
    return 1 if problems or status else 0


# ---------------------------------------------------------------------------------- pytest plugin


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails on a missing torch or TensorFlow (here or in its subprocess) is skipped."""
    outcome = yield
    _skip_if_heavy(outcome.get_result(), str(item.path), item.location[1] or 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A test module that imports torch or TensorFlow is skipped as a whole."""
    outcome = yield
    _skip_if_heavy(outcome.get_result(), str(collector.path), 0)


# ---------------------------------------------------------------------------------- helpers


def _venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
        _quiet(_pip(python, "install", "-q", "--upgrade", "pip", capture=True))
    return python


def _pip(python: Path, *args: str, capture: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "pip", *args], check=not capture, capture_output=capture, text=True,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})


def _quiet(done: subprocess.CompletedProcess) -> None:
    """Raise with pip's output when it failed; stay silent when it worked."""
    if done.returncode:
        sys.exit(f"{' '.join(map(str, done.args))} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def _would_change(python: Path) -> list[str]:
    """What `pip install -e .` (the Colab setup cell) would install besides nblib: each one a problem."""
    done = _pip(python, "install", "--dry-run", "--quiet", "--report", "-", "-e", str(ROOT), capture=True)
    if done.returncode:
        return [f"pip cannot resolve nblib against the pins: {done.stderr.strip()[-800:]}"]
    report = json.loads(done.stdout)
    changes = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in report["install"]
               if i["metadata"]["name"].lower() != "nblib"]
    return [f"installing nblib in Colab would install or replace {change} (Colab ships "
            f"{PINS.get(change.split('==')[0].lower(), 'another version or none')}): widen the range in "
            f"pyproject.toml" for change in changes]


def _pip_check(python: Path) -> list[str]:
    _quiet(_pip(python, "install", "-q", "--no-deps", "-e", str(ROOT), capture=True))
    done = _pip(python, "check", capture=True)
    return [] if done.returncode == 0 else [f"pip check: {line}" for line in done.stdout.splitlines()]


def _moved_pins(python: Path) -> list[str]:
    code = ("import importlib.metadata as md, json; "
            f"print(json.dumps({{n: md.version(n) for n in {list(PINS)!r}}}))")
    have = json.loads(subprocess.run([str(python), "-c", code], check=True, capture_output=True,
                                     text=True).stdout)
    return [f"{name} is {have[name]}, the pin is {want}" for name, want in PINS.items() if have[name] != want]


def _light_tests(python: Path, pytest_args: list[str]) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "scripts")}
    env.pop("NBLIB_PROFILE", None)
    ignore = [f"--ignore={path}" for path in NOT_LIGHT]
    command = [str(python), "-m", "pytest", "-q", "-p", "colab_pins_check", "-p", "no:cacheprovider",
               "tests", *ignore, *pytest_args]
    print("+", " ".join(command), flush=True)
    return subprocess.run(command, cwd=ROOT, env=env).returncode


def _skip_if_heavy(report, path: str, line: int) -> None:
    """Turn a failure whose traceback or output says torch / TensorFlow is missing into a skip."""
    if report.failed:
        missing = MISSING_HEAVY.search(str(report.longrepr))
        if missing:
            report.outcome, report.longrepr = "skipped", (path, line, f"needs {missing.group(1)}")


if __name__ == "__main__":
    sys.exit(main())
