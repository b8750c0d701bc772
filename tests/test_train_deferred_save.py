"""An asynchronous save of a guarded optimizer: what is saved is the state of the moment `save` was called.

The host tensors (weights and moments alike) are copied before `save` returns (R5-9: a copy made later could
not see edits through `.data` or numpy); moments on CUDA are enqueued in stream order and the optimizer's next
step waits for them (`Staged.enqueue`). The writer's write is held back with a gate (a real thread, a real
AdamW step), so each test shows the race it guards against: the loop edits the state before the write.
"""
from __future__ import annotations

import threading

import pytest
import torch
from test_train import FAST, labelled_cache

from conftest import importable_models
from nblib.store.manager import CheckpointManager
from nblib.train import train
from nblib.train.store import TrainStore

RENORM_SOURCE = '''
import torch
from torch import nn


class Renorm(nn.Module):
    """Codes of a few pixels looked up in an nn.Embedding(max_norm=1): every forward renormalizes the rows it reads
    in place (the ones an optimizer step pushed past norm 1)."""

    preprocessing = {"size": [16, 16]}

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(64, 8, max_norm=1.0)
        self.head = nn.Linear(8, 12)

    def forward(self, x):
        codes = (x[:, :, ::4, ::4].flatten(1) * 16).long().clamp(0, 63)
        return {"logits": self.head(self.table(codes).mean(dim=1))}


def build():
    return Renorm()
'''


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
    """Hold every background write until the test sets the event."""
    opened = threading.Event()
    original = CheckpointManager._write

    def held(self, *args, **kwargs):
        assert opened.wait(30), "the test never opened the gate"
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointManager, "_write", held)
    return opened


def test_the_next_optimizer_step_does_not_wait_for_a_write_and_the_save_holds_the_state_of_its_call(tmp_path,
                                                                                                    gate):
    model, optimizer = job()
    store = TrainStore(tmp_path / "run")
    store.guard(optimizer)
    store.manager._cores.none_spare = lambda: False       # the writer thread's path, whatever the load
    state = snapshot(model, optimizer)
    expected = cloned(state)
    store.save(state, 1, backup=False)
    assert store.manager.writing                          # save returned; the write is held
    step(model, optimizer)                                # host moments were copied at the save: no wait
    assert store.fence_seconds == 0.0
    assert not torch.equal(model[0].weight, expected["model"]["0.weight"])   # the step did run
    gate.set()
    store.wait_saves()
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


def test_a_failed_background_write_lets_the_step_run_and_its_error_reaches_the_next_wait(tmp_path, monkeypatch):
    def broken(self, *args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(CheckpointManager, "_write", broken)
    model, optimizer = job()
    store = TrainStore(tmp_path / "run")
    store.guard(optimizer)
    store.save(snapshot(model, optimizer), 1, backup=False)
    stepping = threading.Thread(target=step, args=(model, optimizer))
    stepping.start()
    stepping.join(30)
    assert not stepping.is_alive()                        # the fence never holds a step for a host write
    with pytest.raises(OSError, match="Cannot allocate memory"):
        store.wait_saves()
    assert store.local.versions("state") == []
    store.close()


def test_a_synchronous_store_or_an_unguarded_one_copies_everything_before_save_returns(tmp_path):
    for sync, guarded in ((True, True), (False, False)):
        model, optimizer = job()
        store = TrainStore(tmp_path / f"run-{sync}-{guarded}", sync_save=sync)
        if guarded:
            store.guard(optimizer)
        state = snapshot(model, optimizer)
        expected = cloned(state)
        store.save(state, 1, backup=False)
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


def ema_pull(model, optimizer) -> None:
    """An EMA of the weights pulled back into them (Lookahead's slow weights)."""
    with torch.no_grad():
        for p in model.parameters():
            p.lerp_(torch.zeros_like(p), 0.5)


def clamp(model, optimizer) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.01, 0.01)


def load_other_weights(model, optimizer) -> None:
    model.load_state_dict({k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()})


def second_optimizer_step(model, optimizer) -> None:
    other = torch.optim.SGD(model.parameters(), lr=0.5)
    step(model, other)


@pytest.mark.parametrize("edit", [ema_pull, clamp, load_other_weights, second_optimizer_step],
                         ids=lambda f: f.__name__)
def test_a_weight_edited_in_place_between_the_save_and_the_next_step_is_saved_as_it_was(tmp_path, gate, edit):
    """A hand-written loop on TrainStore.guard edits the weights in place after `save` (their version counters
    move) and before the guarded optimizer's step: the state written is the one of the save's call.
    """
    model, optimizer = job()
    store = TrainStore(tmp_path / "run")
    store.guard(optimizer)
    state = snapshot(model, optimizer)
    expected = cloned(state)
    versions = [p._version for p in model.parameters()]
    store.save(state, 1, backup=False)
    edit(model, optimizer)
    assert [p._version for p in model.parameters()] != versions          # edited in place, not replaced
    assert not torch.equal(model[0].weight, expected["model"]["0.weight"])
    gate.set()
    step(model, optimizer)
    store.wait_saves()
    assert_saved_is(store.load_latest()[0], expected)
    store.close()


def test_a_moment_edited_in_place_before_the_write_is_saved_as_it_was(tmp_path, gate):
    model, optimizer = job()
    store = TrainStore(tmp_path / "run")
    store.guard(optimizer)
    state = snapshot(model, optimizer)
    expected = cloned(state)
    store.save(state, 1, backup=False)
    next(iter(optimizer.state.values()))["exp_avg"].zero_()             # before the step and the write
    gate.set()
    step(model, optimizer)
    store.wait_saves()
    assert_saved_is(store.load_latest()[0], expected)
    store.close()


def test_the_history_a_skipped_fp16_step_lets_the_loop_extend_is_saved_as_it_was(tmp_path, gate):
    """The loop's order with a step the GradScaler skips (inf gradients): no optimizer step, so no fence, and the
    next evaluation appends to the live history while the save is still in flight.
    """
    model, optimizer = job()
    scaler = torch.amp.GradScaler("cpu")
    store = TrainStore(tmp_path / "run")
    store.guard(optimizer)
    history = [{"step": 0, "heldout_loss": 2.0}, {"step": 1, "heldout_loss": 1.5}]
    store.save({**snapshot(model, optimizer), "history": history}, 1, backup=False)
    loss = model(torch.randn(4, 6)).sum() * float("inf")
    scaler.scale(loss).backward()
    scaler.step(optimizer)                                              # skipped: inf gradients
    scaler.update()
    assert store.fence_seconds == 0
    history.append({"step": 2, "heldout_loss": 1.4})
    gate.set()
    store.wait_saves()
    assert store.load_latest()[0]["history"] == history[:2]
    store.close()


@pytest.fixture
def renorm_model(tmp_path):
    (tmp_path / "specs").mkdir()
    with importable_models(tmp_path / "specs", {}, RENORM_SOURCE):
        yield "tinyfactory:build"


def test_a_deferred_save_of_a_model_that_renormalizes_its_weights_in_forward_equals_a_sync_save(
        tmp_path, renorm_model, monkeypatch, one_torch_thread):
    """`train --model` with nn.Embedding(max_norm=1): the forward after a save edits the table in place. Each
    background write is held until that forward ran (or 2 s, after the last save), and the async run's files are the
    --sync-save run's, byte for byte.
    """
    cache = labelled_cache(tmp_path / "data", 96)
    forwarded, renorms = threading.Event(), []
    original_write, original_save = CheckpointManager._write, TrainStore.save

    def held(self, *args, **kwargs):
        forwarded.wait(2)
        return original_write(self, *args, **kwargs)

    def save(self, *args, **kwargs):
        forwarded.clear()
        return original_save(self, *args, **kwargs)

    def before(module, args):
        if isinstance(module, torch.nn.Embedding):
            module.seen = module.weight._version

    def after(module, args, output):
        if module.training and isinstance(module, torch.nn.Embedding):
            renorms.append(module.weight._version != module.seen)
            forwarded.set()

    monkeypatch.setattr(TrainStore, "save", save)
    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(before),
             torch.nn.modules.module.register_module_forward_hook(after)]
    config = FAST.replace(keep_last=8, batch_size=8)
    try:
        train(cache, tmp_path / "sync", config, model=renorm_model, sync_save=True)
        renorms.clear()
        monkeypatch.setattr(CheckpointManager, "_write", held)
        train(cache, tmp_path / "async", config, model=renorm_model)
    finally:
        for hook in hooks:
            hook.remove()
    assert sum(renorms) >= config.steps // 2               # most training forwards edited the table in place
    names = sorted(p.name for p in (tmp_path / "sync/checkpoints").glob("*.pt"))
    assert len(names) >= 4 and names == sorted(p.name for p in (tmp_path / "async/checkpoints").glob("*.pt"))
    for name in names + ["../final.pt"]:
        assert (tmp_path / "async/checkpoints" / name).read_bytes() == \
            (tmp_path / "sync/checkpoints" / name).read_bytes(), name
