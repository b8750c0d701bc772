"""Round 6 of "nothing lost, nothing silently wrong" for training (issue 52): R5-9, R5-10, R5-13 and round 4's
leftovers. Each test fails on the code before its fix.
"""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from nblib.train.store import TrainStore


@pytest.fixture
def cpu_hog():
    """A process spinning on a core beside the test, so the save's timing is the one of a busy machine."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait()


def _job():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, optimizer)
    return model, optimizer


def _step(model, optimizer) -> None:
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(torch.randn(8, 64)), torch.arange(8) % 3).backward()
    optimizer.step()


def _moments(optimizer) -> list[dict]:
    return list(optimizer.state.values())


EDITS = {
    "in_place": lambda per_param: per_param["exp_avg"].mul_(0),
    "through_data": lambda per_param: per_param["exp_avg"].data.mul_(0),
    "through_numpy": lambda per_param: per_param["exp_avg"].numpy().__setitem__(slice(None), 0),
    "step_through_data": lambda per_param: per_param["step"].data.__iadd__(100),
}


def _assert_equal(saved, expected, where: str = "state") -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(saved, expected), where
    elif isinstance(expected, dict):
        assert saved.keys() == expected.keys(), where
        for key in expected:
            _assert_equal(saved[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(saved) == len(expected), where
        for i, (a, b) in enumerate(zip(saved, expected)):
            _assert_equal(a, b, f"{where}[{i}]")
    else:
        assert saved == expected, where


@pytest.mark.parametrize("inline", [False, True], ids=["writer_thread", "loops_thread"])
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_r5_9_a_moment_edited_right_after_an_async_save_never_reaches_its_checkpoint(tmp_path, cpu_hog, edit,
                                                                                      inline):
    """The edit comes right after `save` returns, before the write ends (a busy core beside): the checkpoint is
    the deepcopy taken at the save, whether the save serializes on the writer's thread or the loop's.
    """
    model, optimizer = _job()
    store = TrainStore(tmp_path / "run")
    store.manager._cores.none_spare = lambda: inline         # which of the two async paths this save takes
    store.guard(optimizer)
    for version in (1, 2, 3):
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        expected = copy.deepcopy(state)
        store.save(state, version, backup=False)
        for per_param in _moments(optimizer):
            EDITS[edit](per_param)
        _step(model, optimizer)
        store.wait_saves()
        local = store.manager.local
        saved = local.load(local.record_bytes("state", version), "state", version)
        _assert_equal(saved, expected)
    store.close()
