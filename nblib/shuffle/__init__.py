"""Resumable shuffles whose checkpoints are tiny and exact, plus shuffle-quality metrics.

Every shuffle here runs over sample *indices* of a random-access source (`source[i]`), so a
checkpoint never holds samples, only integers. One algorithm or concern per module:

- `buffer`: `ResumableShuffleBuffer`, tf.data's streaming shuffle buffer over indices (state ~5.3
  bytes per buffered element; quality depends on the buffer size, as in tf.data).
- `global_shuffle`: `GlobalShuffle`, a keyed permutation of [0, n) per (seed, epoch) built on
  `feistel.FeistelPermutation`; O(1) state, random access, but fully random reads.
- `shard_aware`: `ShardAwareShuffle`, shard order shuffled, then samples within windows of
  `window_shards` shards; sequential reads, at a measured cost in neighbour locality.
- `positional`: what the two permutation shuffles share (state = identity + position).
- `state`: states as `nblib.manifest` records (kind, version, body, sha256); `save_state` / `load_state` files.
- `iterate`: `iter_samples`, `full_order`; `quality`: displacement, spearman, same-episode share.
- `torch_adapters`: `ShuffleSampler`, `ShuffledIterableDataset` (loaded, with torch, on first use).

The state contract (shared by all three): keyword-only constructors; iterating yields source
indices (Python ints); `state_dict()` taken between any two yielded indices lets a fresh object
built with the same arguments continue, after `load_state_dict(state)`, with exactly the next
index. States are JSON-serializable `nblib.manifest` records whose sha256 covers the body; a
state from another algorithm, n, seed, epoch, buffer_size or shard layout, one edited after
saving, or an unchecked version-1 state (unless `allow_unchecked=True`) is refused with a
`StateError` naming the field. `len(shuffle)` is what the epoch still yields.
"""
from __future__ import annotations

from nblib.shuffle.buffer import ResumableShuffleBuffer
from nblib.shuffle.feistel import FeistelPermutation
from nblib.shuffle.global_shuffle import GlobalShuffle
from nblib.shuffle.iterate import full_order, iter_samples
from nblib.shuffle.keyed_random import FEISTEL_ROUNDS, MAX_N
from nblib.shuffle.positional import PositionalShuffle
from nblib.shuffle.quality import displacements, same_episode_share, shuffle_quality, spearman
from nblib.shuffle.shard_aware import ShardAwareShuffle
from nblib.shuffle.state import STATE_VERSION, load_state, load_state_json, save_state, state_bytes, state_to_json

# Not in __all__: `from nblib.shuffle import *` must not import torch.
TORCH_NAMES = ("ShuffleSampler", "ShuffledIterableDataset")

__all__ = [
    "FEISTEL_ROUNDS", "MAX_N", "STATE_VERSION",
    "ResumableShuffleBuffer", "GlobalShuffle", "ShardAwareShuffle", "FeistelPermutation", "PositionalShuffle",
    "iter_samples", "full_order",
    "state_to_json", "load_state_json", "state_bytes", "save_state", "load_state",
    "displacements", "spearman", "same_episode_share", "shuffle_quality",
]


def __getattr__(name: str):
    """`ShuffleSampler` and `ShuffledIterableDataset` import torch, so they load on first use."""
    if name in TORCH_NAMES:
        from nblib.shuffle import torch_adapters

        return getattr(torch_adapters, name)
    raise AttributeError(f"module 'nblib.shuffle' has no attribute {name!r}")
