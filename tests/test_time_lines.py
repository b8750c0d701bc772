"""No time line the suite cannot stand behind (issue 51, newcomer C8): the `cpu` preset's budget printed
"TIME 150 ms (3,408 samples/s)" beside 15 samples/s measured in notebook 03. A time is printed only from a
sourced range (the T4), a rate calibrated on a measured run, or a GPU's share of peak.
"""
from __future__ import annotations

from cli_runner import run_nblib

from nblib import budget, config


def _time_row(table: str) -> str:
    return next(line for line in table.splitlines() if line.startswith("TIME"))


def test_the_cpu_presets_budget_says_its_time_is_not_predicted():
    run = run_nblib("budget", "--preset", "smoke", "--device", "cpu")
    assert run.returncode == 0, run.stderr
    row = _time_row(run.stdout)
    assert "not predicted on cpu" in row and "samples/s" not in row and " ms" not in row, row
    verdict = next(line for line in run.stdout.splitlines() if line.startswith("VERDICT"))
    assert "time not predicted on cpu" in verdict, verdict


def test_a_time_is_printed_where_the_suite_stands_behind_it():
    smoke = config.preset("smoke")
    calibrated = budget.predict_budget(smoke, "cpu", efficiency=budget.calibrate("cpu", 15.3, smoke))
    assert "not predicted" not in _time_row(calibrated.table()) and "15 samples/s" in _time_row(calibrated.table())
    t4 = _time_row(budget.predict_budget(config.preset("seed_t4"), "t4").table())
    assert "projection" in t4 and "not predicted" not in t4, t4
    assert budget.predict_budget(smoke, "cpu").time_unknown.startswith("not predicted on cpu")


def test_this_machines_projection_reads_as_a_sentence():
    """Newcomer P10: notebook 03 printed '0.32 TFLOP/s on the this machine (cpu)'."""
    import dataclasses

    from nblib.budget.devices import device_preset

    here = dataclasses.replace(device_preset("cpu"), name="this machine (cpu)")
    method = budget.predict_budget(config.preset("smoke"), here).speed_method
    assert "TFLOP/s on this machine (cpu)" in method and "the this" not in method, method
    assert "TFLOP/s on the t4" in budget.predict_budget(config.preset("seed_t4"), "t4", efficiency=0.2).speed_method
