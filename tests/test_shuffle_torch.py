"""nblib.shuffle with torch: DataLoader(num_workers=2) resumes exactly, by sampler or iterable dataset."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from nblib import shuffle as sh  # noqa: E402
from nblib.errors import StateError  # noqa: E402

N, BATCH = 203, 8  # 203: the last batch is partial


class TaggedSource(Dataset):
    """A random-access source whose sample i is a tensor that carries i."""

    def __len__(self):
        return N

    def __getitem__(self, index):
        return torch.tensor([index, 10 * index])


def _make(kind: str):
    if kind == "buffer":
        return sh.ResumableShuffleBuffer(n=N, buffer_size=37, seed=5)
    if kind == "global":
        return sh.GlobalShuffle(n=N, seed=5, epoch=1)
    return sh.ShardAwareShuffle(n=N, seed=5, shard_size=20, window_shards=3)


def _batches_to_indices(batches) -> list[int]:
    return [int(row[0]) for batch in batches for row in batch]


def _at_epoch(shuffle, epoch: int):
    """A fresh shuffle with the same arguments at another epoch (what set_epoch builds)."""
    return type(shuffle)(**{**{name: getattr(shuffle, name) for name in shuffle.identity_fields}, "epoch": epoch})


@pytest.mark.parametrize("kind", ["buffer", "global", "shard"])
def test_sampler_with_two_workers_resumes_exactly_at_the_consumed_count(kind):
    expected = list(_make(kind))
    sampler = sh.ShuffleSampler(_make(kind))
    loader = DataLoader(TaggedSource(), batch_size=BATCH, sampler=sampler, num_workers=2)
    head, consumed = [], 0
    for step, batch in enumerate(loader):
        head.append(batch)
        consumed += len(batch)
        if step == 9:
            break
    assert sampler.shuffle.remaining < N - consumed  # the workers prefetched ahead of training
    state = json.loads(json.dumps(sampler.state_dict(consumed=consumed)))
    del loader

    resumed = sh.ShuffleSampler(_make(kind))
    resumed.load_state_dict(state)
    tail = list(DataLoader(TaggedSource(), batch_size=BATCH, sampler=resumed, num_workers=2))
    assert _batches_to_indices(head) + _batches_to_indices(tail) == expected
    assert all(torch.equal(row[1], 10 * row[0]) for batch in tail for row in batch)


@pytest.mark.parametrize("kind", ["buffer", "global"])
def test_iterable_dataset_with_two_workers_yields_the_shuffle_order_and_resumes(kind):
    expected = list(_make(kind))
    dataset = sh.ShuffledIterableDataset(TaggedSource(), _make(kind), batch_size=BATCH)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=2)
    assert _batches_to_indices(loader) == expected  # two workers, one order

    head = []
    for step, batch in enumerate(DataLoader(dataset, batch_size=BATCH, num_workers=2)):
        head.append(batch)
        if step == 6:
            break
    state = dataset.state_dict(consumed=7 * BATCH)
    resumed = sh.ShuffledIterableDataset(TaggedSource(), _make(kind), batch_size=BATCH)
    resumed.load_state_dict(json.dumps(state))
    tail = list(DataLoader(resumed, batch_size=BATCH, num_workers=2))
    assert _batches_to_indices(head) + _batches_to_indices(tail) == expected


# Exact resume after every step (state_dict() and state_dict(consumed=k) read ahead) is checked for
# every shuffle by tests/test_state_roundtrip.py; here: what the harness does not look at.


def test_a_resumed_sampler_has_the_rest_of_its_epoch_as_len():
    sampler = sh.ShuffleSampler(_make("buffer"))
    iterator = iter(sampler)
    for _ in range(50):
        next(iterator)
    fresh = sh.ShuffleSampler(_make("buffer"))
    fresh.load_state_dict(sampler.state_dict())
    assert len(fresh) == N - 50


def test_a_state_before_the_previous_checkpoint_is_refused():
    sampler = sh.ShuffleSampler(_make("buffer"))
    list(sampler)  # ran to the end of the epoch ahead of training
    fresh = sh.ShuffleSampler(_make("buffer"))
    fresh.load_state_dict(sampler.state_dict(consumed=64))
    assert list(fresh) == list(_make("buffer"))[64:]
    with pytest.raises(StateError, match="consumed=20"):
        sampler.state_dict(consumed=20)  # before the last checkpoint


def test_set_epoch_starts_a_new_permutation():
    sampler = sh.ShuffleSampler(sh.GlobalShuffle(n=100, seed=1, epoch=0))
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert sorted(first) == sorted(second) == list(range(100)) and first != second
    assert second == list(sh.GlobalShuffle(n=100, seed=1, epoch=1))


@pytest.mark.parametrize("kind", ["buffer", "global", "shard"])
def test_iterating_a_sampler_again_moves_on_to_the_next_epoch(kind):
    sampler = sh.ShuffleSampler(_make(kind))
    first = list(sampler)
    assert len(sampler) == N  # what the next iteration yields, not the 0 left of this epoch
    second = list(sampler)
    assert sorted(first) == sorted(second) == list(range(N)) and first != second
    assert second == list(_at_epoch(_make(kind), sampler.shuffle.epoch))
    assert sampler.shuffle.epoch == _make(kind).epoch + 1


def test_set_epoch_before_every_epoch_gives_the_same_orders_as_moving_on_by_itself():
    by_itself = sh.ShuffleSampler(_make("buffer"))
    explicit = sh.ShuffleSampler(_make("buffer"))
    for epoch in range(3):
        explicit.set_epoch(epoch)
        assert list(explicit) == list(by_itself)


@pytest.mark.parametrize("kind", ["buffer", "global"])
def test_sampler_resumes_exactly_in_the_middle_of_its_second_epoch(kind):
    """Two workers prefetch ahead; the state at what was consumed resumes epoch 2 at the next index."""
    expected_epoch_2 = list(_at_epoch(_make(kind), _make(kind).epoch + 1))
    sampler = sh.ShuffleSampler(_make(kind))
    list(DataLoader(TaggedSource(), batch_size=BATCH, sampler=sampler, num_workers=2))  # epoch 1
    head, consumed = [], 0
    for step, batch in enumerate(DataLoader(TaggedSource(), batch_size=BATCH, sampler=sampler, num_workers=2)):
        head.append(batch)
        consumed += len(batch)
        if step == 9:
            break
    state = json.loads(json.dumps(sampler.state_dict(consumed=consumed)))
    assert state["body"]["epoch"] == _make(kind).epoch + 1

    resumed = sh.ShuffleSampler(_make(kind))  # built as at the start of training, in epoch 1
    resumed.load_state_dict(state)
    tail = list(DataLoader(TaggedSource(), batch_size=BATCH, sampler=resumed, num_workers=2))
    assert _batches_to_indices(head) + _batches_to_indices(tail) == expected_epoch_2
    assert list(resumed) == list(_at_epoch(_make(kind), _make(kind).epoch + 2))  # and on to epoch 3


def test_sampler_refuses_an_edited_state_and_keeps_its_place():
    sampler = sh.ShuffleSampler(_make("global"))
    iterator = iter(sampler)
    for _ in range(20):
        next(iterator)
    state = {**sampler.state_dict()}
    state["body"] = {**state["body"], "epoch": 7}  # an edited epoch would silently yield another order
    with pytest.raises(StateError, match="checksum"):
        sampler.load_state_dict(state)
    assert sampler.shuffle.epoch == _make("global").epoch
    assert list(sampler) == list(_make("global"))[20:]


def test_iterable_dataset_resumes_a_state_taken_after_set_epoch():
    dataset = sh.ShuffledIterableDataset(TaggedSource(), _make("global"), batch_size=BATCH)
    dataset.set_epoch(4)
    state = dataset.state_dict(consumed=3 * BATCH)
    resumed = sh.ShuffledIterableDataset(TaggedSource(), _make("global"), batch_size=BATCH)
    resumed.load_state_dict(state)
    tail = list(DataLoader(resumed, batch_size=BATCH, num_workers=2))
    assert _batches_to_indices(tail) == list(_at_epoch(_make("global"), 4))[3 * BATCH:]


@pytest.mark.parametrize("style", ["sampler", "iterable"])
@pytest.mark.parametrize("kind", ["buffer", "global"])
def test_torchdata_stateful_dataloader_resumes_exactly_with_two_workers(kind, style):
    """Runs where torchdata is installed (it is not a dependency); checked with torchdata 0.11.0."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def loader():
        if style == "sampler":
            return stateful.StatefulDataLoader(TaggedSource(), batch_size=BATCH,
                                               sampler=sh.ShuffleSampler(_make(kind)), num_workers=2)
        dataset = sh.ShuffledIterableDataset(TaggedSource(), _make(kind), batch_size=BATCH)
        return stateful.StatefulDataLoader(dataset, batch_size=BATCH, num_workers=2)

    head = []
    first = loader()
    for step, batch in enumerate(first):
        head.append(batch)
        if step == 8:
            state = first.state_dict()
            break
    del first
    second = loader()
    second.load_state_dict(state)
    assert _batches_to_indices(head) + _batches_to_indices(second) == list(_make(kind))
