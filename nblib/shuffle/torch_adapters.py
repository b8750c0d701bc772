"""Any nblib shuffle in torch: a `Sampler` and an `IterableDataset` that resume exactly, with workers.

Both keep the shuffle's own small state and can rebuild it at what training consumed, by
replaying indices (never samples) from the previous checkpoint. Importing this module imports
torch; `nblib.shuffle` loads it only when `ShuffleSampler` or `ShuffledIterableDataset` is first used.
"""
from __future__ import annotations

import torch.utils.data

from nblib.errors import StateError
from nblib.shuffle.iterate import advance, fresh_like, outputs_done
from nblib.shuffle.state import as_state, int_field, state_fields


class _ReplayFromCheckpoint:
    """The shuffle's state after `consumed` outputs: replay a copy from the last checkpoint."""

    shuffle = None

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` afresh: same arguments, a new order (like DistributedSampler.set_epoch)."""
        self._set_shuffle(fresh_like(self.shuffle, epoch=epoch))

    def _set_shuffle(self, shuffle) -> None:
        self.shuffle = shuffle
        self._base_state = shuffle.state_dict()

    def _load_shuffle_state(self, state: dict, allow_unchecked: bool = False) -> None:
        """Continue from a shuffle state of any epoch of this shuffle (the epoch is progress here)."""
        epoch = state_fields(state).get("epoch")
        same_epoch = isinstance(epoch, bool) or not isinstance(epoch, int) or epoch == self.shuffle.epoch
        shuffle = self.shuffle if same_epoch else fresh_like(self.shuffle, epoch=epoch)
        shuffle.load_state_dict(state, allow_unchecked=allow_unchecked)  # refuses a foreign or edited state first
        self._set_shuffle(shuffle)

    def _shuffle_state_at(self, consumed: int) -> dict:
        base_done = outputs_done(self._base_state)
        if not base_done <= int(consumed) <= self.shuffle.n:
            raise StateError(f"consumed={consumed} is outside [{base_done}, {self.shuffle.n}]: pass the "
                             "number of samples this epoch has trained on (it cannot go back before "
                             "the previous checkpoint)")
        replay = fresh_like(self.shuffle)
        replay.load_state_dict(self._base_state)
        advance(replay, int(consumed) - base_done)
        self._base_state = replay.state_dict()
        return self._base_state


class ShuffleSampler(_ReplayFromCheckpoint, torch.utils.data.Sampler):
    """A `torch.utils.data.Sampler[int]` over a shuffle, with torchdata's state_dict protocol.

    Epochs: iterating again after a finished epoch moves on to the next epoch (`epoch + 1`, a new
    order) by itself, as torch's own samplers reshuffle; a partly consumed epoch (after
    `load_state_dict`, or a `break`) continues where it stopped. `set_epoch(e)` starts epoch `e`
    afresh (DistributedSampler's convention): calling it before every epoch gives the same orders.
    A state carries its epoch, so a state taken in epoch 2 resumes in epoch 2.

    `state_dict()` / `load_state_dict()` are the shuffle's, so torchdata's StatefulDataLoader
    (which snapshots its sampler as it dispatches batches) resumes it exactly. With a plain
    `DataLoader(num_workers>0)` the sampler runs ahead of training by the prefetched batches, so
    ask for the state at what was consumed: `state_dict(consumed=k)` replays the index stream
    (indices only, no samples) from the previous checkpoint up to output k of the current epoch.
    A ResumableShuffleBuffer's state costs O(buffer) to take (~50 ms at 250,000), so with
    StatefulDataLoader raise `snapshot_every_n_steps` for big buffers.
    """

    def __init__(self, shuffle):
        self._set_shuffle(shuffle)

    def __iter__(self):
        """The rest of this epoch, or the whole next epoch if this one is finished."""
        if self.shuffle.remaining == 0:
            self.set_epoch(self.shuffle.epoch + 1)
        return iter(self.shuffle)

    def __len__(self):
        """How many indices the next iteration yields."""
        return self.shuffle.remaining or self.shuffle.n

    def state_dict(self, consumed: int | None = None) -> dict:
        """The shuffle's state now (torchdata) or after `consumed` outputs of the current epoch."""
        return self.shuffle.state_dict() if consumed is None else self._shuffle_state_at(consumed)

    def load_state_dict(self, state: dict | str, *, allow_unchecked: bool = False) -> None:
        """Continue from `state` (a shuffle state, of any epoch); the next iteration starts at its next index.

        allow_unchecked: also load a version-1 shuffle state, which has no checksum (refused by default).
        """
        self._load_shuffle_state(as_state(state), allow_unchecked)


class ShuffledIterableDataset(_ReplayFromCheckpoint, torch.utils.data.IterableDataset):
    """A `torch.utils.data.IterableDataset` yielding `source[i]` in shuffle order across workers.

    Counting chunks of `batch_size` outputs from `chunk_origin` (where this run started), worker
    w of W takes the chunks j with j % W == w. The DataLoader collects batches round-robin from
    its workers, so with the same `batch_size` the batches come out in exactly the shuffle's
    order. Every worker replays the index stream (cheap) and fetches only its own samples.
    Resume with a plain DataLoader: `state_dict(consumed=k)` in the main process, then
    `load_state_dict` on a fresh dataset. torchdata's StatefulDataLoader instead calls
    `state_dict()` inside each worker: the state carries the worker's own position and the
    chunk origin, so each worker continues with its next own chunk. Start each epoch with
    `set_epoch(e)`.
    """

    def __init__(self, source, shuffle, *, batch_size: int):
        self._set_shuffle(shuffle)
        self.source, self.batch_size = source, int(batch_size)
        self.chunk_origin = outputs_done(self._base_state)

    def __iter__(self):
        """This worker's samples of the remaining epoch."""
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for index in self.shuffle:
            position = self.shuffle.n - self.shuffle.remaining - 1
            if ((position - self.chunk_origin) // self.batch_size) % workers == worker:
                yield self.source[index]

    def state_dict(self, consumed: int | None = None) -> dict:
        """{"shuffle": state, "chunk_origin": k}, now (torchdata, per worker) or after `consumed`."""
        if consumed is None:
            return {"shuffle": self.shuffle.state_dict(), "chunk_origin": self.chunk_origin}
        return {"shuffle": self._shuffle_state_at(consumed), "chunk_origin": int(consumed)}

    def load_state_dict(self, state: dict | str, *, allow_unchecked: bool = False) -> None:
        """Continue from a state of `state_dict` (dict or JSON text); allow_unchecked: as ShuffleSampler's."""
        state = as_state(state)
        if not isinstance(state.get("shuffle"), dict):
            raise StateError("dataset state has no field 'shuffle' (a shuffle state): pass what "
                             "ShuffledIterableDataset.state_dict() returned")
        chunk_origin = int_field(state, "chunk_origin", 0, self.shuffle.n)
        self._load_shuffle_state(state["shuffle"], allow_unchecked)
        self.chunk_origin = chunk_origin

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` afresh: same arguments, a new order, chunks counted from 0."""
        super().set_epoch(epoch)
        self.chunk_origin = 0
