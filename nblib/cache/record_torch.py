"""Record shards in torch: a map-style `RecordDataset` and a shuffled, resumable `RecordIterableDataset`.

Item i is `(inputs, target)` under a key mapping the user chooses (`inputs="hidden_states"` or a
tuple of fields, `target="target_routing"`), or the whole record as a dict of tensors when neither
is given: what a training loop over record shards needs from the data (the loop and the model
contract live in `nblib.train`). Arrays become tensors (no copy), numeric scalars 0-d tensors,
strings stay strings. Records may differ in shape, so batch them with `pad_collate` (or batch size 1).

Pair `RecordDataset` with `nblib.shuffle.ShuffleSampler(shards.shuffle(seed=...))` for a resumable
map-style loader, or use `RecordIterableDataset` (nblib's `ShuffledIterableDataset` over the same
shuffle): with `window_shards=1` each worker reads one shard at a time, and the state taken at any
consumed count resumes with exactly the next record. Importing this module imports torch.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.utils.data

from nblib.cache.record_format import dtype_code
from nblib.cache.record_reader import RecordShards
from nblib.errors import ConfigError
from nblib.shuffle.torch_adapters import ShuffledIterableDataset


class RecordDataset(torch.utils.data.Dataset):
    """Map-style dataset over record shards: item i is `(inputs, target)` or a dict of tensors.

    Args:
        folder: a complete folder of record shards.
        inputs: the field (or tuple of fields) the model takes; None with `target` None: the whole record.
        target: the field the loss compares with (None: items are `inputs` alone).
        transform: called on each item before it is returned.
        check: the reader's check ("first-touch" by default, as for training).
    """

    def __init__(self, folder: str | Path, *, inputs: str | tuple[str, ...] | None = None,
                 target: str | None = None, transform=None, check: str = "first-touch"):
        self.shards = RecordShards(folder, check=check)
        fields = self.shards.manifest["fields"]
        wanted = ([inputs] if isinstance(inputs, str) else list(inputs or ())) + ([target] if target else [])
        unknown = [name for name in wanted if name not in fields]
        if unknown:
            raise ConfigError(f"fields {unknown} are not in these records; their fields are {list(fields)}")
        self.inputs, self.target, self.transform = inputs, target, transform

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index: int):
        item = self.item(self.shards[index])
        return self.transform(item) if self.transform is not None else item

    def item(self, record: dict):
        """A decoded record as this dataset serves it (the key mapping applied, tensors made)."""
        if self.inputs is None and self.target is None:
            return {name: as_tensor(value) for name, value in record.items()}
        if isinstance(self.inputs, str):
            inputs = as_tensor(record[self.inputs])
        elif self.inputs is None:
            inputs = None
        else:
            inputs = tuple(as_tensor(record[name]) for name in self.inputs)
        if self.target is None:
            return inputs
        target = as_tensor(record[self.target])
        return target if inputs is None else (inputs, target)


class RecordIterableDataset(ShuffledIterableDataset):
    """Records in `RecordShardShuffle` order across DataLoader workers, resumable at any consumed count.

    `state_dict(consumed=k)` / `load_state_dict` and `set_epoch` are `ShuffledIterableDataset`'s.
    """

    def __init__(self, folder: str | Path, *, seed: int, batch_size: int, epoch: int = 0, window_shards: int = 1,
                 inputs: str | tuple[str, ...] | None = None, target: str | None = None, transform=None,
                 check: str = "first-touch"):
        dataset = RecordDataset(folder, inputs=inputs, target=target, transform=transform, check=check)
        shuffle = dataset.shards.shuffle(seed=seed, epoch=epoch, window_shards=window_shards)
        super().__init__(dataset, shuffle, batch_size=batch_size)


def as_tensor(value):
    """A record field as torch gives it: arrays as tensors (sharing memory; bf16 too), numbers as 0-d tensors."""
    if isinstance(value, np.ndarray):
        if dtype_code(value.dtype) == "bfloat16":
            return torch.from_numpy(value.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(value)
    if isinstance(value, (bool, int, float)):
        return torch.tensor(value)
    return value


def pad_collate(items: list):
    """Stack items whose tensors differ in their first dimension, zero-padding to the longest.

    Tensors of one field are padded along dim 0 (tokens, in traces) to the batch's longest; a
    dict/tuple structure is kept; strings become lists. The lengths are not returned: add a
    length field to the records (e.g. `n_tokens`) where the loss must mask the padding.
    """
    first = items[0]
    if isinstance(first, dict):
        return {name: pad_collate([item[name] for item in items]) for name in first}
    if isinstance(first, (tuple, list)):
        return type(first)(pad_collate(list(group)) for group in zip(*items))
    if not isinstance(first, torch.Tensor):
        return list(items)
    if first.ndim == 0:
        return torch.stack(items)
    longest = max(int(item.shape[0]) for item in items)
    out = first.new_zeros((len(items), longest, *first.shape[1:]))
    for k, item in enumerate(items):
        out[k, :item.shape[0]] = item
    return out
