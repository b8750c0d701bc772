"""scripts/verdict_diff.py: the verdicts of two executed notebooks, paired, with reversals and moves counted.

The notebooks are fabricated (nbformat, outputs written by hand in the very formats nblib prints),
so each test knows which verdicts reverse, move or stay.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from nblib.verdict import memory_verdict, verdict_of_pairs, verdict_of_runs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "verdict_diff.py"


def _module():
    spec = importlib.util.spec_from_file_location("verdict_diff", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["verdict_diff"] = module
    spec.loader.exec_module(module)
    return module


vd = _module()


def _paired(ratio: float, spread: float = 0.02) -> str:
    """A real PairedVerdict's short text for five pairs around `ratio`."""
    b = [100 * ratio * (1 + spread * k) for k in (-2, -1, 0, 1, 2)]
    return verdict_of_pairs([100.0] * 5, b, ("the base", "b")).short("faster", "slower")


def _notebook(path: Path, cells: list[str]) -> Path:
    nb = nbformat.v4.new_notebook()
    for text in cells:
        cell = nbformat.v4.new_code_cell("print(...)")
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
        nb.cells.append(cell)
    nb.cells.insert(0, nbformat.v4.new_markdown_cell("# a title"))
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def _sweep_cell(batch8: float, batch128: float, cycle: float) -> str:
    return "\n".join([
        f"batch_size mattered most: batch_size=8 vs the base, {_paired(batch8)}",
        "each knob value against the base (5 pairs, each next to a base run; a call needs x1.15 either way):",
        f"  batch_size=8             {_paired(batch8)}",
        f"  batch_size=128           {_paired(batch128)}",
        f"  cycle_length=1           {_paired(cycle)}"])


def _needle(agrees: str, batch128: float) -> str:
    return "\n".join([f"larger batches helped: {agrees}", "    reference     24->128: x1.6",
                      f"    this machine  32->128: {_paired(batch128)}",
                      "larger shuffle buffers: more RAM: NOT DISTINGUISHABLE ON THIS MACHINE",
                      "    reference     RSS 9 GB -> 16 GB",
                      "    this machine  peak RSS +1.20 MB (5 pairs, RSS noise 3.00 MB): too small to see here"])


def test_a_reversal_and_a_move_are_found_and_counted(tmp_path):
    one = _notebook(tmp_path / "one" / "05_x.ipynb", [_sweep_cell(0.5, 1.30, 0.60),
                                                      "the prediction holds at 4 of 4 batch sizes: x0.98-1.02"])
    two = _notebook(tmp_path / "two" / "05_x.ipynb", [_sweep_cell(0.52, 1.02, 1.60),
                                                      "the prediction misses at 1 of 4 batch sizes: worst x0.62"])
    pairs = vd.compare_runs(vd.extract(one), vd.extract(two))
    states = {v.label: s for v, _, s in pairs}
    assert states == {"batch_size=8": "same", "batch_size=128": "move", "cycle_length=1": "REVERSAL",
                      "prediction vs measurement": "REVERSAL"}
    assert vd.summary(pairs) == {"verdicts": 4, "reversals": 2, "moves": 1, "restated moves": 0,
                                 "only in one run": 0}


def test_a_sentence_verdict_keeps_its_name_when_its_measurements_move(tmp_path):
    """05's "verdict: the encoder is the wall ...: data-wait 0.4%-1.0% ..." was 'only in run 1' and 'only in run 2'."""
    def line(wait: str, rate: str, ratio: float) -> str:
        return (f"verdict: the encoder is the wall, in every run: data-wait {wait} of each step over 5 runs; the "
                f"pipeline alone {rate} samples/s against the encoder's 363, {_paired(ratio)}")

    one = _notebook(tmp_path / "a.ipynb", [line("0.4%-1.0%", "8,890", 20.0)])
    two = _notebook(tmp_path / "b.ipynb", [line("0.6%-3.4%", "9,172", 22.0)])
    assert [s for *_, s in vd.compare_runs(vd.extract(one), vd.extract(two))] == ["same"]


def test_a_restated_verdict_counts_once_and_its_finding_is_not_a_second_move(tmp_path):
    one = _notebook(tmp_path / "a.ipynb", [_sweep_cell(0.5, 1.30, 1.0), _needle("AGREES", 1.30)])
    two = _notebook(tmp_path / "b.ipynb", [_sweep_cell(0.5, 1.02, 1.0),
                                           _needle("NOT DISTINGUISHABLE ON THIS MACHINE", 1.02)])
    first = vd.extract(one)
    # the head line and the needle's "this machine" line restate the sweep's verdicts: not extracted again
    assert [v.label for v in first] == ["batch_size=8", "batch_size=128", "cycle_length=1", "larger batches helped",
                                        "larger shuffle buffers: more RAM"]
    assert first[3].restated and not first[4].restated
    total = vd.summary(vd.compare_runs(first, vd.extract(two)))
    assert total["moves"] == 1 and total["restated moves"] == 1 and total["reversals"] == 0


def test_the_command_compares_folders_by_name_and_fails_on_a_reversal(tmp_path):
    for run, cycle in (("r1", 0.6), ("r2", 1.6)):
        _notebook(tmp_path / run / "05_x.ipynb", [_sweep_cell(0.5, 1.0, cycle)])
        _notebook(tmp_path / run / "02_y.ipynb", ["verdict: rendering speed-up 1 worker vs 2 workers: "
                                                  f"{_paired(1.01)} (2 cores, load average 3.0)"])
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "r1"), str(tmp_path / "r2")],
                         capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    assert "REVERSAL" in out.stdout and "05_x.ipynb cell 1: cycle_length=1" in out.stdout
    assert "02_y.ipynb cell 1: 1 worker vs 2 workers" in out.stdout
    assert "summary: verdicts 4, reversals 1, moves 0" in out.stdout


def test_the_same_verdicts_pass_and_a_wrong_argument_says_what_to_give(tmp_path):
    a = _notebook(tmp_path / "a.ipynb", [_sweep_cell(0.5, 1.02, 1.0)])
    b = _notebook(tmp_path / "b.ipynb", [_sweep_cell(0.55, 1.05, 0.98)])
    assert vd.main([str(a), str(b)]) == 0
    with pytest.raises(SystemExit, match="two executed notebooks or two folders"):
        vd.main([str(a), str(tmp_path)])


def test_a_verdict_of_runs_against_a_figure_is_read_like_a_paired_one(tmp_path):
    runs = verdict_of_runs([500, 520, 480, 510, 490], 345, ("the encoder", "rendering"))
    slow = verdict_of_runs([340, 350, 345, 342, 348], 345, ("the encoder", "rendering"))
    line = "the pipeline alone against the encoder's 345: "
    one = _notebook(tmp_path / "a.ipynb", [line + runs.short("faster", "slower")])
    two = _notebook(tmp_path / "b.ipynb", [line + slow.short("faster", "slower")])
    (v, w, state), = vd.compare_runs(vd.extract(one), vd.extract(two))
    assert (v.call, v.firm, w.firm, state) == ("faster", True, False, "move")


def test_a_memory_verdict_with_its_interval_is_read_and_paired(tmp_path):
    base = [100e6, 104e6, 98e6, 103e6, 101e6]
    more, same = memory_verdict(base, [b + 50e6 for b in base]), memory_verdict(base, [b + 1e6 for b in base])
    one = _notebook(tmp_path / "a.ipynb", [f"peak RSS {more.short()}"])
    two = _notebook(tmp_path / "b.ipynb", [f"peak RSS {same.short()}"])
    (v, w, state), = vd.compare_runs(vd.extract(one), vd.extract(two))
    assert "95% interval" in more.short() and (v.call, w.firm, state) == ("more", False, "move")
