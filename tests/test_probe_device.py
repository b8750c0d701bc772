"""Notebook 06's largest-batch probe runs on the device training uses: on a T4 the GPU, not the CPU.

The device choice is monkeypatched (no GPU here) and the probe's subprocess replaced by a recorder: what is
checked is the device each probe is asked to run on, and that on CUDA the prediction is the traced VRAM
budget's under the cap (the probe's cap there is the whole reservation), on CPU the closed-form step budget's.
"""
from __future__ import annotations

import pytest

from nblib.lab import training as lab
from nblib.train import device, probe
from nblib.train.loop import model_config

CAP = 200 * 2**20


@pytest.fixture
def probes(monkeypatch):
    seen = []

    def recorder(model, batch_size, **kwargs):
        seen.append((batch_size, kwargs.get("device", "cpu")))
        return probe.StepPeak(batch_size, 0, 0, True)

    monkeypatch.setattr(probe, "step_peak", recorder)
    return seen


@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_the_probe_runs_on_the_device_the_loop_would_train_on(monkeypatch, probes, where):
    from nblib.budget.training import largest_batch

    monkeypatch.setattr(device, "default_device", lambda: where)
    model = model_config("smoke").model
    predicted, results = lab.largest_batch_demo(model, CAP, progress=False)
    assert probes and {d for _, d in probes} == {where}
    assert probes[0][0] == predicted == results[0].batch_size
    if where == "cpu":
        assert predicted == largest_batch(model, CAP, step_only=True)
    else:
        assert predicted > 0        # the traced budget on a T4 whose memory is the cap
