"""The CLI runner's two doors (tests/cli_runner.py): the in-process door reports what a real, cold
`python -m nblib` does, starts as a fresh process would, and leaves the test's process as it found it.
"""
from __future__ import annotations

import ast
import importlib
import logging
import os
import sys
import tempfile
from pathlib import Path

import pytest
from cli_runner import PROCESS_STATE, CliRun, run_cli, run_nblib

ROOT = Path(__file__).resolve().parents[1]


def test_both_doors_give_the_same_result(tmp_path):
    """Help, usage errors, refusals and a verb's table (nothing timed): the same status, stdout and stderr."""
    for argv in (["cache", "--help"], ["cache", "--no-such-flag"], ["no-such-verb"], ["budget", "--reference"],
                 ["budget", "--device", "tpu"], ["cache", "--verify", tmp_path / "nope"]):
        cold, here = run_cli(argv, door="cold", timeout=300), run_cli(argv, door="inprocess")
        assert isinstance(cold, CliRun) and isinstance(here, CliRun)
        assert here == cold, argv


def test_a_door_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="door='warm'"):
        run_cli(["info"], door="warm")


def _report_what_the_run_sees(monkeypatch, module: str) -> None:
    """nblib.cli.main, for the next run: print the user module `module`'s VALUE, the temporary folder, and how
    full nblib's caches and per-process state are.
    """
    import nblib.cli
    from nblib.budget import allocator

    model_vram = importlib.import_module("nblib.budget.model_vram")

    def main(argv):
        print(importlib.import_module(module).VALUE, tempfile.gettempdir(), allocator._warn_once.cache_info().currsize,
              len(model_vram._STREAMS))
        return 0

    monkeypatch.setattr(nblib.cli, "main", main)


def test_the_in_process_door_starts_as_a_fresh_process_and_gives_the_test_its_own_back(tmp_path, monkeypatch):
    """Before: PYTHONPATH was set but not on sys.path (tests prepended it by hand), TMPDIR was read once per test
    process, and a user module, an lru_cache or a traced stream one run left was the next run's.
    """
    from nblib.budget import allocator

    model_vram = importlib.import_module("nblib.budget.model_vram")
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "users_model_file.py").write_text(f"VALUE = {name!r}\n")
    (tmp_path / "tmp").mkdir()
    allocator._warn_once("a setting the test warned about")
    monkeypatch.setattr(model_vram, "_STREAMS", {"a job the test traced": None})
    path, tempdir = list(sys.path), tempfile.gettempdir()
    _report_what_the_run_sees(monkeypatch, "users_model_file")
    first = run_nblib("info", PYTHONPATH=tmp_path / "one", TMPDIR=tmp_path / "tmp")
    second = run_nblib("info", PYTHONPATH=tmp_path / "two")
    assert first.stdout.split() == ["one", str(tmp_path / "tmp"), "0", "0"], first
    assert second.stdout.split() == ["two", tempdir, "0", "0"], second
    assert sys.path == path and "users_model_file" not in sys.modules and tempfile.gettempdir() == tempdir
    assert model_vram._STREAMS == {"a job the test traced": None}


def test_the_in_process_door_puts_its_cwd_first_on_sys_path_as_python_m_does(tmp_path, monkeypatch):
    (tmp_path / "model_in_the_cwd.py").write_text("VALUE = 'cwd'\n")
    _report_what_the_run_sees(monkeypatch, "model_in_the_cwd")
    assert run_nblib("info", cwd=tmp_path).stdout.split()[0] == "cwd"


def _empty_module_containers() -> set[tuple[str, str]]:
    """(module, name) of every module-level name of nblib bound to an empty dict, list or set: per-process state."""
    found = set()
    for path in sorted((ROOT / "nblib").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            empty = (isinstance(value, (ast.Dict, ast.List, ast.Set)) and not ast.unparse(value).strip("{}[]")) or \
                (isinstance(value, ast.Call) and ast.unparse(value) in ("dict()", "list()", "set()"))
            if empty:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found.update((module, ast.unparse(t)) for t in targets)
    return found


# filled at import, as in every process that imports the same packages (the jobs handed to the trace layer, which
# the CLI's main imports): an in-process run keeps it, since nothing would fill an emptied one again
FILLED_AT_IMPORT = {("nblib.budget.traced_jobs", "_JOBS")}


def test_every_per_process_container_of_nblib_is_emptied_for_an_in_process_run():
    listed = {(module, name) for module, names in PROCESS_STATE.items() for name in names}
    assert _empty_module_containers() - FILLED_AT_IMPORT == listed, \
        "list nblib's per-process state in tests/cli_runner.PROCESS_STATE"


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


def direct_cli_calls(path: Path) -> list[str]:
    """`file:line` of each call in `path` of nblib.cli's `main` (or a verb's `*_main`) other than through run_cli;
    code in a string (a cold process's `-c` program) is no call here.
    """
    tree = ast.parse(path.read_text(), str(path))
    mains = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and (node.module or "").startswith("nblib.cli") for alias in node.names if alias.name.endswith("main")}
    return [f"{path.name}:{node.lineno}" for node in ast.walk(tree) if isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id in mains)
        or (isinstance(node.func, ast.Attribute) and node.func.attr == "main"
            and ast.unparse(node.func.value) in ("cli", "nblib.cli")))]


def test_the_direct_call_finder_sees_both_spellings(tmp_path):
    (tmp_path / "t.py").write_text("from nblib import cli\nfrom nblib.cli.cache import cache_main\n"
                                   "cli.main(['x'])\ncache_main([])\ncode = 'cli.main([])'\n")
    assert direct_cli_calls(tmp_path / "t.py") == ["t.py:3", "t.py:4"]


def test_no_test_calls_the_cli_but_through_a_door():
    found = [hit for path in sorted((ROOT / "tests").glob("*.py")) if path.name != "cli_runner.py"
             for hit in direct_cli_calls(path)]
    assert found == [], "call these through cli_runner.run_cli (or run_nblib): " + ", ".join(found)
