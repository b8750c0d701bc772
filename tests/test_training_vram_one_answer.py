"""One answer for the VRAM of a training step: `model_vram(train=True)`, a trace of the module the loop runs.

The TRM trains as `nblib.train.model.Classifier` (its first H_cycles-1 outer cycles under no_grad); the budget
used to trace the encoder with every cycle differentiable (6.69 GB at batch 64 on a T4 where the loop's step
holds 3.84 GB), and TRM training on CUDA was never VRAM-checked. Skipped, with the reason, where this machine
cannot trace a backward pass (no C++ compiler or torch headers for the fake-CUDA shim).
"""
from __future__ import annotations

import importlib
import re

import pytest

from nblib.config import preset
from nblib.errors import BudgetExceeded
from nblib.simulate.train import backward_capability
from nblib.units import GB, fmt_bytes

CAN, WHY = backward_capability()
pytestmark = pytest.mark.skipif(not CAN, reason=f"cannot trace a backward pass here: {WHY}")
T4 = preset("t4").model


@pytest.fixture(scope="module")
def at_128():
    from nblib.budget.model_vram import model_vram

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("NBLIB_PROFILE", raising=False)       # as conftest does for each test: one job, one trace
        return model_vram("trm:t4", 128, train=True)


def test_the_trm_training_budget_is_the_loops_own_step_the_simulation_runs_at_the_batch_itself(monkeypatch):
    from nblib.budget.model_vram import model_vram
    from nblib.simulate.model import simulate_model
    from nblib.simulate.train import simulate_train_step

    budget = model_vram("trm:t4", 64, train=True, find_largest=False)     # traced at batches 2, 3 and 64
    # the same traced step at batch 64 itself, built from the shape and from the spec
    assert budget.reserved == simulate_train_step(T4, 64).max_reserved
    assert budget.reserved == simulate_model("trm:t4", 64, train=True).max_reserved
    # a ModelConfig is the same job (model_vram keeps one stream for both), and traced afresh the same answer
    assert model_vram(T4, 64, train=True, find_largest=False).lines == budget.lines
    monkeypatch.setattr(importlib.import_module("nblib.budget.model_vram"), "_STREAMS", {})   # none kept: a new trace
    assert model_vram(T4, 64, train=True, find_largest=False).lines == budget.lines


def test_the_cli_and_the_train_preflight_print_the_budgets_vram_for_the_same_batch(at_128, tmp_path, monkeypatch):
    from cli_runner import run_nblib
    from test_train import labelled_cache

    from nblib.train import TrainConfig
    from nblib.train.task import ImageTask, vram_preflight

    done = run_nblib("budget", "--model", "trm:t4", "--train", "--batch-size", "128")
    assert done.returncode == 0, done.stderr
    total = re.search(r"^\s+total\s+(.+?)\s+of", done.stdout, re.M).group(1)
    assert total == fmt_bytes(at_128.total)
    assert f"largest batch that fits: {at_128.largest_batch:,}" in done.stdout

    _on_a_t4(monkeypatch)
    config = TrainConfig(steps=2, batch_size=128, device="cuda", precision="fp16")
    task = ImageTask(labelled_cache(tmp_path, 48), config, model="trm:t4")
    checked = vram_preflight(task, config)               # the TRM on CUDA is checked (it was None)
    assert checked is not None and checked.total == at_128.total and checked.largest_batch == at_128.largest_batch


def test_trm_training_on_cuda_is_refused_with_the_numbers_and_the_batch_that_fits(at_128, tmp_path, monkeypatch):
    from test_train import labelled_cache

    from nblib.train import TrainConfig
    from nblib.train.task import ImageTask, vram_preflight

    _on_a_t4(monkeypatch)
    largest = at_128.largest_batch
    config = TrainConfig(steps=2, batch_size=2 * largest, device="cuda", precision="fp16")
    task = ImageTask(labelled_cache(tmp_path, 48), config, model="trm:t4")
    allowed = at_128.limit * 0.9 / GB
    with pytest.raises(BudgetExceeded, match=rf"at batch {2 * largest} \(fp16, training\) needs [\d.]+ GB of VRAM.*"
                                             rf"allows {allowed:.2f} GB.*use --batch-size {largest} or less"):
        vram_preflight(task, config)


def _on_a_t4(monkeypatch) -> None:
    """This process "has" an idle Tesla T4 (only the GPU's name and its free memory are faked)."""
    pf = importlib.import_module("nblib.budget.preflight")
    monkeypatch.setattr(pf, "_gpu_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(pf, "_free_vram", lambda device=None: int(15.8 * GB))
