"""A deferred asynchronous save: the weights and moments are copied on the writer thread, the optimizer's next
step waits for that copy, and what is saved is the state of the moment `save` was called.

The writer's copy is held back with a gate (a real thread, a real AdamW step), so each test shows the
race it guards against: without the step pre-hook, the step would change the weights before the copy.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from nblib.store.staging import Staged
from nblib.train.store import TrainStore


def job(batch_norm: bool = False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 8)] + ([torch.nn.BatchNorm1d(8)] if batch_norm else []) + [torch.nn.Linear(8, 3)]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    step(model, optimizer)                     # the optimizer holds its moments
    return model, optimizer


def step(model, optimizer) -> None:
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(torch.randn(4, 6)), torch.tensor([0, 1, 2, 0])).backward()
    optimizer.step()


def snapshot(model, optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def cloned(state: dict) -> dict:
    return {"model": {k: v.clone() for k, v in state["model"].items()},
            "exp_avg": [s["exp_avg"].clone() for s in state["optimizer"]["state"].values()]}


def assert_saved_is(loaded: dict, expected: dict) -> None:
    for key, value in expected["model"].items():
        assert torch.equal(loaded["model"][key], value), key
    saved = [s["exp_avg"] for s in loaded["optimizer"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(saved, expected["exp_avg"], strict=True))


@pytest.fixture
def gate(monkeypatch):
    """Hold every deferred copy until the test sets the event."""
    opened = threading.Event()
    original = Staged.copy_after

    def held(self, event, keys):
        assert opened.wait(30), "the test never opened the gate"
        return original(self, event, keys)

    monkeypatch.setattr(Staged, "copy_after", held)
    return opened


def test_the_next_optimizer_step_waits_for_the_deferred_copy_and_the_save_holds_the_state_of_its_call(tmp_path, gate):
    model, optimizer = job()
    store = TrainStore(tmp_path / "run")
    store.guard(optimizer)
    state = snapshot(model, optimizer)
    expected = cloned(state)
    store.save(state, 1, backup=False)
    assert not store.manager._ready.is_set()              # save returned; the copy has not run
    stepping = threading.Thread(target=step, args=(model, optimizer))
    stepping.start()
    time.sleep(0.3)
    assert stepping.is_alive()                            # the step waits at its pre-hook
    assert_saved_is(snapshot(model, optimizer), expected)  # and has changed nothing yet
    gate.set()
    stepping.join(30)
    assert not stepping.is_alive()
    store.wait_saves()
    assert store.fence_seconds > 0.2
    assert not torch.equal(model[0].weight, expected["model"]["0.weight"])   # the step did run
    loaded, source = store.load_latest()
    assert source == "local"
    assert_saved_is(loaded, expected)
    store.close()


def test_a_model_buffer_the_next_forward_changes_is_saved_as_it_was_at_the_save(tmp_path, gate):
    model, optimizer = job(batch_norm=True)
    store = TrainStore(tmp_path / "run")
    store.guard(optimizer)
    state = snapshot(model, optimizer)
    expected = cloned(state)
    store.save(state, 1, backup=False)
    model(torch.randn(4, 6) * 5 + 3)                       # train mode: running_mean and running_var move now
    assert not torch.equal(model[1].running_mean, expected["model"]["1.running_mean"])
    gate.set()
    store.wait_saves()
    loaded, _ = store.load_latest()
    assert_saved_is(loaded, expected)
    store.close()


def test_a_failed_deferred_copy_lets_the_step_run_and_its_error_reaches_the_next_wait(tmp_path, monkeypatch):
    def broken(self, event, keys):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(Staged, "copy_after", broken)
    model, optimizer = job()
    store = TrainStore(tmp_path / "run")
    store.guard(optimizer)
    store.save(snapshot(model, optimizer), 1, backup=False)
    stepping = threading.Thread(target=step, args=(model, optimizer))
    stepping.start()
    stepping.join(30)
    assert not stepping.is_alive()                        # the fence opened on the failure
    with pytest.raises(OSError, match="Cannot allocate memory"):
        store.wait_saves()
    assert store.local_versions() == []
    store.close()


def test_a_synchronous_store_or_an_unguarded_one_copies_everything_before_save_returns(tmp_path, gate):
    for sync, guarded in ((True, True), (False, False)):
        model, optimizer = job()
        store = TrainStore(tmp_path / f"run-{sync}-{guarded}", sync_save=sync)
        if guarded:
            store.guard(optimizer)
        state = snapshot(model, optimizer)
        expected = cloned(state)
        store.save(state, 1, backup=False)                 # the gate would hold a deferred copy forever
        step(model, optimizer)
        store.wait_saves()
        assert_saved_is(store.load_latest()[0], expected)
        store.close()


def test_closing_the_store_removes_its_step_hook(tmp_path):
    model, optimizer = job()
    store = TrainStore(tmp_path / "run")
    store.guard(optimizer)
    store.save(snapshot(model, optimizer), 1, backup=False)
    store.close()

    def closed():
        raise AssertionError("a closed store's fence was called")

    store.manager.fence = closed
    step(model, optimizer)                                 # no hook left to call it
