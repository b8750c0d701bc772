"""Issue 20, items 7 and 8 (shuffle parts): hostile states and inputs give one clear NblibError.

Each test failed on the code before the fix: an unchecked (version 1) edit was accepted, a float
seed was blamed on 'position', deep JSON raised RecursionError, `list()` of a huge shuffle near its
end asked for n slots, `indices(-5, 3)` returned garbage, and ShardAwareShuffle(n=2**34,
shard_size=1) tried to allocate ~128 GiB.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from nblib import shuffle as sh
from nblib.errors import ConfigError, NblibError, StateError


def _positional(kind: str):
    if kind == "global":
        return sh.GlobalShuffle(n=1000, seed=3, epoch=1)
    return sh.ShardAwareShuffle(n=1000, seed=1, shard_size=100, window_shards=2)


def _make(kind: str):
    if kind == "buffer":
        return sh.ResumableShuffleBuffer(n=1000, buffer_size=50, seed=3)
    return _positional(kind)


@pytest.mark.parametrize("kind", ["global", "shard"])
def test_an_edit_posing_as_an_unchecked_version_1_state_is_refused(kind):
    shuffle = _positional(kind)
    shuffle.position = 123
    record = shuffle.state_dict()
    forged = {**record["body"], "version": 1, "position": 124}   # edited, checksum dropped, "version": 1
    fresh = _positional(kind)
    with pytest.raises(StateError, match="no checksum") as info:
        fresh.load_state_dict(forged)
    assert "allow_unchecked=True" in str(info.value) and fresh.position == 0
    with pytest.raises(StateError, match="no checksum"):
        fresh.load_state_dict(json.dumps(forged))
    fresh.load_state_dict(forged, allow_unchecked=True)          # asked for explicitly: loads
    assert fresh.position == 124


def test_an_unchecked_state_file_is_refused_unless_asked(tmp_path):
    path = tmp_path / "state.json"
    path.write_text('{"algorithm":"global_feistel","epoch":1,"n":1000,"position":500,"seed":3,"version":1}')
    with pytest.raises(StateError, match="no checksum"):
        sh.load_state(path, _positional("global"))
    shuffle = _positional("global")
    sh.load_state(path, shuffle, allow_unchecked=True)
    assert shuffle.position == 500


@pytest.mark.parametrize("kind", ["buffer", "global", "shard"])
def test_a_float_seed_in_a_state_is_a_seed_error(kind):
    record = _make(kind).state_dict()
    edited = {**record, "body": {**record["body"], "seed": float(record["body"]["seed"])}}
    with pytest.raises(StateError, match="'seed' is 3.0|'seed' is 1.0") as info:
        _make(kind).load_state_dict(edited)
    assert "position" not in str(info.value) and "integer" in str(info.value)


@pytest.mark.parametrize("cls, kwargs", [
    (sh.GlobalShuffle, {"n": 10}), (sh.ResumableShuffleBuffer, {"n": 10, "buffer_size": 2}),
    (sh.ShardAwareShuffle, {"n": 10, "shard_size": 2, "window_shards": 1}),
])
def test_a_float_seed_argument_is_a_config_error_naming_seed(cls, kwargs):
    with pytest.raises(ConfigError, match=r"seed=1\.0 must be an integer"):
        cls(seed=1.0, **kwargs)
    assert list(cls(seed=np.int64(1), **kwargs)) == list(cls(seed=1, **kwargs))  # numpy ints are fine


@pytest.mark.parametrize("depth", [100_000])
def test_deeply_nested_state_json_is_a_state_error(depth):
    text = "[" * depth + "]" * depth
    with pytest.raises(StateError, match="nests deeper"):
        sh.load_state_json(text)
    with pytest.raises(StateError):
        sh.GlobalShuffle(n=10, seed=0).load_state_dict('{"kind": ' + text + "}")
    with pytest.raises(StateError):
        sh.GlobalShuffle(n=10, seed=0).load_state_dict('{"body": {"x": ' + "[" * depth + "]" * depth + "}}")


def test_list_of_a_huge_global_shuffle_near_its_end_yields_what_remains():
    shuffle = sh.GlobalShuffle(n=2**40, seed=0)
    shuffle.position = 2**40 - 5
    assert len(shuffle) == 5 == shuffle.remaining
    tail = list(shuffle)
    assert len(tail) == 5 and len(set(tail)) == 5 and all(0 <= i < 2**40 for i in tail)
    assert len(shuffle) == 0


def test_len_of_the_buffer_shuffle_is_what_remains():
    shuffle = sh.ResumableShuffleBuffer(n=100, buffer_size=10, seed=0)
    iterator = iter(shuffle)
    for _ in range(30):
        next(iterator)
    assert len(shuffle) == 70
    assert len(list(shuffle)) == 70


@pytest.mark.parametrize("kind", ["global", "shard"])
@pytest.mark.parametrize("start, stop", [(-5, 3), (2000, 3000), (5, -1)])
def test_indices_of_a_negative_or_outside_range_is_one_clear_error(kind, start, stop):
    with pytest.raises(NblibError, match=r"indices\(start=.*pass 0 <= start <= stop <= 1000"):
        _positional(kind).indices(start, stop)


def test_indices_of_an_empty_or_clipped_range_still_work():
    shuffle = _positional("global")
    assert shuffle.indices(5, 5).size == 0 and shuffle.indices(5, 3).size == 0
    assert shuffle.indices(990, 5000).size == 10


def test_a_shard_aware_shuffle_of_2_to_the_34_one_sample_shards_is_refused_with_numbers():
    with pytest.raises(ConfigError, match=r"17,179,869,184 shards.*GiB.*shard_size >= 512") as info:
        sh.ShardAwareShuffle(n=2**34, seed=0, shard_size=1, window_shards=4)
    assert "GlobalShuffle" in str(info.value)


def test_a_shard_aware_shuffle_of_2_to_the_34_samples_in_real_shards_works():
    shuffle = sh.ShardAwareShuffle(n=2**34, seed=0, shard_size=4096, window_shards=4)
    first = shuffle.indices(0, 10)
    assert len(set(first.tolist())) == 10 and all(0 <= i < 2**34 for i in first.tolist())


def test_the_torch_sampler_refuses_an_unchecked_state_unless_asked():
    pytest.importorskip("torch")
    shuffle = _positional("global")
    shuffle.position = 40
    unchecked = {**shuffle.state_dict()["body"], "version": 1}
    sampler = sh.ShuffleSampler(_positional("global"))
    with pytest.raises(StateError, match="no checksum"):
        sampler.load_state_dict(unchecked)
    sampler.load_state_dict(unchecked, allow_unchecked=True)
    assert list(sampler) == list(_positional("global"))[40:]
