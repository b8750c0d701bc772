"""nblib.shuffle: exact resume at any cut, bijections, bad states refused, tiny states, quality.

tf.data is compared in a subprocess (TF and torch stay out of one process).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import subprocess_env
from nblib import shuffle as sh
from nblib.errors import ConfigError, NblibError, StateError
from nblib.shuffle.state import state_crc32

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _make(kind: str, n: int, seed: int, size: int):
    """One shuffle of each algorithm, `size` being its buffer / shard knob."""
    if kind == "buffer":
        return sh.ResumableShuffleBuffer(n=n, buffer_size=size, seed=seed)
    if kind == "global":
        return sh.GlobalShuffle(n=n, seed=seed, epoch=size % 3)
    return sh.ShardAwareShuffle(n=n, seed=seed, epoch=1, shard_size=size, window_shards=1 + size % 4)


def _resumed_order(kind: str, n: int, seed: int, size: int, cuts: list[int]) -> list[int]:
    """Iterate with a save -> JSON -> fresh object -> load at every cut point."""
    out: list[int] = []
    state = None
    for stop in [*sorted(cuts), n]:
        shuffle = _make(kind, n, seed, size)
        if state is not None:
            shuffle.load_state_dict(json.loads(json.dumps(state)))
        iterator = iter(shuffle)
        while len(out) < stop:
            out.append(next(iterator))
        state = shuffle.state_dict()
    return out


# ------------------------------------------------------------------ exact resume (properties)


@pytest.mark.parametrize("kind", ["buffer", "global", "shard"])
@FAST
@given(data=st.data(), n=st.integers(1, 300), seed=st.integers(-2**40, 2**40), size=st.integers(1, 400))
def test_resume_at_random_cut_points_gives_the_uninterrupted_order(kind, data, n, seed, size):
    cuts = data.draw(st.lists(st.integers(0, n), max_size=4))
    uninterrupted = list(_make(kind, n, seed, size))
    assert _resumed_order(kind, n, seed, size, cuts) == uninterrupted


@pytest.mark.parametrize("kind", ["buffer", "global", "shard"])
@FAST
@given(n=st.integers(1, 500), seed=st.integers(0, 2**63), size=st.integers(1, 600))
def test_every_shuffle_yields_each_source_index_exactly_once(kind, n, seed, size):
    order = list(_make(kind, n, seed, size))
    assert sorted(order) == list(range(n))
    assert all(type(i) is int for i in order)


def test_same_arguments_give_the_same_order_and_other_seeds_or_epochs_another():
    def order(**kw):
        return list(sh.GlobalShuffle(n=1000, **kw))

    assert order(seed=1, epoch=0) == order(seed=1, epoch=0)
    assert order(seed=1, epoch=0) != order(seed=2, epoch=0)
    assert order(seed=1, epoch=0) != order(seed=1, epoch=1)
    buffers = [list(sh.ResumableShuffleBuffer(n=1000, buffer_size=50, seed=s)) for s in (1, 1, 2)]
    assert buffers[0] == buffers[1] != buffers[2]


# ------------------------------------------------------------------ the buffer algorithm


def test_buffer_of_one_keeps_the_source_order_and_buffer_of_n_can_emit_anything_first():
    assert list(sh.ResumableShuffleBuffer(n=50, buffer_size=1, seed=3)) == list(range(50))
    firsts = {next(iter(sh.ResumableShuffleBuffer(n=8, buffer_size=8, seed=s))) for s in range(200)}
    assert firsts == set(range(8))


@FAST
@given(n=st.integers(1, 400), seed=st.integers(0, 2**32), size=st.integers(1, 100))
def test_buffer_never_emits_an_index_before_it_could_have_entered_the_buffer(n, seed, size):
    order = np.array(list(sh.ResumableShuffleBuffer(n=n, buffer_size=size, seed=seed)))
    # output p is drawn from a buffer filled with source indices < p + size
    assert np.all(order < np.arange(n) + size)


def test_first_output_is_uniform_over_the_first_buffer():
    counts = np.bincount([next(iter(sh.ResumableShuffleBuffer(n=100, buffer_size=10, seed=s)))
                          for s in range(3000)], minlength=10)
    assert counts.size == 10
    chi2 = float(((counts - 300.0) ** 2 / 300.0).sum())
    assert chi2 < 27.9  # chi-square, 9 degrees of freedom, p = 0.001


TF_ORDER_SCRIPT = textwrap.dedent("""
    import json, sys
    import tensorflow as tf
    n, buffer_size, seeds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    orders = []
    for seed in range(seeds):
        ds = tf.data.Dataset.range(n).shuffle(buffer_size, seed=seed).batch(n)
        orders.append(next(iter(ds)).numpy().tolist())
    print(json.dumps(orders))
""")


@pytest.mark.slow
def test_buffer_matches_tf_data_shuffle_statistically():
    """Same algorithm, different RNG: displacement and rank statistics agree with tf.data's."""
    pytest.importorskip("tensorflow")
    n, buffer_size, seeds = 4000, 64, 8
    result = subprocess.run([sys.executable, "-c", TF_ORDER_SCRIPT, str(n), str(buffer_size), str(seeds)],
                            capture_output=True, text=True, timeout=300, env=subprocess_env(),
                            check=True)
    tf_orders = np.array(json.loads(result.stdout.strip().splitlines()[-1]))
    ours = np.array([list(sh.ResumableShuffleBuffer(n=n, buffer_size=buffer_size, seed=s))
                     for s in range(100, 100 + seeds)])
    tf_moves = np.concatenate([sh.displacements(o) for o in tf_orders])
    our_moves = np.concatenate([sh.displacements(o) for o in ours])
    # both algorithms never emit an index before it could enter the buffer
    assert np.all(tf_orders < np.arange(n) + buffer_size)
    assert abs(our_moves.mean() / tf_moves.mean() - 1) < 0.05
    for q in (50, 90, 99):
        assert abs(np.percentile(our_moves, q) / np.percentile(tf_moves, q) - 1) < 0.1
    # the whole displacement distributions agree (two-sample KS statistic)
    grid = np.arange(0, max(tf_moves.max(), our_moves.max()) + 1)
    cdf = [np.searchsorted(np.sort(m), grid, side="right") / m.size for m in (tf_moves, our_moves)]
    assert float(np.max(np.abs(cdf[0] - cdf[1]))) < 0.03


# ------------------------------------------------------------------ Feistel bijection


AWKWARD_N = [1, 2, 3, 4, 5, 7, 13, 97, 251, 8191, 65521, 127, 128, 129, 1023, 1024, 1025,
             2**16 - 1, 2**16, 2**16 + 1, 2**17 + 1, 10**6]


@pytest.mark.parametrize("n", AWKWARD_N)
def test_global_shuffle_is_a_bijection_for_awkward_n(n):
    shuffle = sh.GlobalShuffle(n=n, seed=12345, epoch=2)
    perm = shuffle.indices()
    assert perm.shape == (n,)
    assert np.array_equal(np.sort(perm), np.arange(n))
    probe = np.unique(np.linspace(0, n - 1, num=min(n, 64)).astype(int))
    assert [shuffle.index_at(int(p)) for p in probe] == perm[probe].tolist()  # scalar == vector path
    if n > 100:
        assert sh.spearman(perm) < 0.2  # and it is actually shuffled


@pytest.mark.parametrize("n", [1, 2, 3, 97, 1025, 65537])
def test_shard_aware_shuffle_is_a_bijection_with_random_access(n):
    shuffle = sh.ShardAwareShuffle(n=n, seed=5, epoch=0, shard_size=100, window_shards=3)
    perm = shuffle.indices()
    assert np.array_equal(np.sort(perm), np.arange(n))
    probe = np.unique(np.linspace(0, n - 1, num=min(n, 50)).astype(int))
    assert [shuffle[int(p)] for p in probe] == perm[probe].tolist()


def test_shard_aware_window_only_touches_window_shards_shards():
    shuffle = sh.ShardAwareShuffle(n=10_000, seed=9, shard_size=100, window_shards=4)
    order = shuffle.indices()
    for start in range(0, 10_000, 400):  # each window = 4 full shards = 400 outputs
        assert len(np.unique(order[start:start + 400] // 100)) == 4


def test_global_shuffle_position_out_of_range_is_an_index_error():
    with pytest.raises(IndexError, match="outside"):
        sh.GlobalShuffle(n=10, seed=0).index_at(10)


# ------------------------------------------------------------------ bad and corrupt states


def _buffer_state_mid_epoch(**kw):
    shuffle = sh.ResumableShuffleBuffer(**{"n": 100, "buffer_size": 10, "seed": 1, **kw})
    iterator = iter(shuffle)
    for _ in range(17):
        next(iterator)
    return shuffle.state_dict()


def _edited(state: dict, **fields) -> dict:
    """A copy of a state record with body fields changed ("version" is the record's own field)."""
    version = fields.pop("version", state["version"])
    return {**state, "version": version, "body": {**state["body"], **fields}}


def _version_2(state: dict) -> dict:
    """The flat, crc32-sealed layout nblib wrote before states became manifest records (version 2)."""
    flat = {**state["body"], "version": 2}
    return {**flat, "state_crc32": state_crc32(flat)}


@pytest.mark.parametrize("field, other", [
    ("n", {"n": 101}), ("seed", {"seed": 2}), ("buffer_size", {"buffer_size": 11}), ("epoch", {"epoch": 1}),
])
def test_buffer_state_from_another_shuffle_is_refused_naming_the_field(field, other):
    state = _buffer_state_mid_epoch(**other)
    with pytest.raises(StateError, match=f"'{field}'"):
        sh.ResumableShuffleBuffer(n=100, buffer_size=10, seed=1).load_state_dict(state)


@pytest.mark.parametrize("field, value", [
    ("n", 11), ("seed", 8), ("epoch", 3), ("algorithm", "shuffle_buffer"), ("version", 99),
])
def test_global_state_with_a_foreign_field_is_refused_naming_it(field, value):
    state = _edited(sh.GlobalShuffle(n=10, seed=7).state_dict(), **{field: value})
    with pytest.raises(StateError, match=f"'{field}'") as info:
        sh.GlobalShuffle(n=10, seed=7).load_state_dict(state)
    assert isinstance(info.value, NblibError) and repr(value) in str(info.value)


@pytest.mark.parametrize("field, value", [("shard_size", 50), ("window_shards", 5), ("algorithm", "global_feistel")])
def test_shard_aware_state_with_another_layout_is_refused(field, value):
    make = lambda: sh.ShardAwareShuffle(n=1000, seed=1, shard_size=100, window_shards=2)  # noqa: E731
    with pytest.raises(StateError, match=f"'{field}'"):
        make().load_state_dict(_edited(make().state_dict(), **{field: value}))


def test_global_state_cannot_be_loaded_into_a_buffer():
    state = sh.GlobalShuffle(n=100, seed=1).state_dict()
    with pytest.raises(StateError, match="'algorithm'"):
        sh.ResumableShuffleBuffer(n=100, buffer_size=10, seed=1).load_state_dict(state)


@pytest.mark.parametrize("text", ['{"version": 1, "algorithm": "glo', "", "[1, 2]", "null", "\x00\x01garbage"])
def test_corrupt_json_is_a_clear_state_error(text):
    with pytest.raises(StateError, match="JSON"):
        sh.GlobalShuffle(n=100, seed=1).load_state_dict(text)
    with pytest.raises(StateError, match="JSON"):
        sh.load_state_json(text)


def test_truncated_state_file_is_refused(tmp_path):
    shuffle = sh.ResumableShuffleBuffer(n=1000, buffer_size=100, seed=0)
    next(iter(shuffle))
    path = sh.save_state(tmp_path / "shuffle.json", shuffle)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(StateError, match="not valid JSON"):
        sh.load_state(path, sh.ResumableShuffleBuffer(n=1000, buffer_size=100, seed=0))


def test_flipped_byte_in_the_buffer_fails_its_checksum():
    state = _buffer_state_mid_epoch()
    raw = bytearray(base64.b64decode(state["body"]["buffer"]))
    raw[3] ^= 0x01
    with pytest.raises(StateError, match="checksum"):
        sh.ResumableShuffleBuffer(n=100, buffer_size=10, seed=1).load_state_dict(
            _edited(state, buffer=base64.b64encode(bytes(raw)).decode()))


@pytest.mark.parametrize("change, field", [
    ({"cursor": 50}, "cursor"), ({"emitted": -1}, "emitted"), ({"emitted": "17"}, "emitted"),
    ({"buffer": "!!notbase64"}, "buffer"), ({"buffer_dtype": "uint8"}, "buffer_dtype"),
])
def test_inconsistent_buffer_state_is_refused_naming_the_field(change, field):
    with pytest.raises(StateError, match=f"'{field}'"):
        sh.ResumableShuffleBuffer(n=100, buffer_size=10, seed=1).load_state_dict(
            _edited(_buffer_state_mid_epoch(), **change))


def test_missing_field_is_named():
    state = sh.GlobalShuffle(n=10, seed=7).state_dict()
    del state["body"]["seed"]
    with pytest.raises(StateError, match="no field 'seed'"):
        sh.GlobalShuffle(n=10, seed=7).load_state_dict(state)


def test_bad_constructor_arguments_are_config_errors():
    with pytest.raises(ConfigError, match="buffer_size=0"):
        sh.ResumableShuffleBuffer(n=10, buffer_size=0, seed=0)
    with pytest.raises(ConfigError, match="n=0"):
        sh.GlobalShuffle(n=0, seed=0)
    with pytest.raises(ConfigError, match="window_shards=0"):
        sh.ShardAwareShuffle(n=10, seed=0, shard_size=2, window_shards=0)


# ------------------------------------------------------------------ orders and states pinned to the pre-split code

# sha256 of each order as little-endian int64 bytes, computed from the single-module nblib/shuffle.py
# (`git show 7a3c5a4:nblib/shuffle.py` loaded as a temporary module) before it became the nblib/shuffle/
# package: the split, and any later refactor, must keep every order byte-identical.
PINNED_ORDERS = {
    "buffer n=10000 b=500 seed=42": (
        lambda: list(sh.ResumableShuffleBuffer(n=10_000, buffer_size=500, seed=42)),
        "681b48a12e978d2860747707225ef3ec085fdaa13a75c0deb0cacda8017d1b98"),
    "buffer n=1000 b=1000 seed=-7 epoch=3": (
        lambda: list(sh.ResumableShuffleBuffer(n=1000, buffer_size=1000, seed=-7, epoch=3)),
        "c1ba8c60c8d8bc92f517f12c3f9c13b47ac46473283a6e37f9f82162915f0e1f"),
    "global n=100003 seed=42 epoch=1 (iterated)": (
        lambda: list(sh.GlobalShuffle(n=100_003, seed=42, epoch=1)),
        "1c2b64ae98c13d540e95252d2671124730d8fab84e7fa18687b25ece1a0285cd"),
    "global n=2^20 seed=0 (vectorized)": (
        lambda: sh.GlobalShuffle(n=2**20, seed=0).indices(),
        "e50b887f2ce4d964a701786bd3900001cad302bac7021e806b300c8bbd02998c"),
    "global n=10^12 seed=5: first 1000 and the last": (
        lambda: [*sh.GlobalShuffle(n=10**12, seed=5).indices(0, 1000).tolist(),
                 sh.GlobalShuffle(n=10**12, seed=5).index_at(10**12 - 1)],
        "12fecb36de2f0db955bb19486880e94e35b971490e413588553fa0eedfe1cbbb"),
    "shard n=54321 seed=9 epoch=2 shard=1000 window=4": (
        lambda: list(sh.ShardAwareShuffle(n=54_321, seed=9, epoch=2, shard_size=1000, window_shards=4)),
        "ed60d5e112e3906e17c1bbae3f118a564d2f65cb4733f483adb817fa23de3ebc"),
    "shard n=999 seed=1 shard=10 window=1": (
        lambda: sh.ShardAwareShuffle(n=999, seed=1, shard_size=10, window_shards=1).indices(),
        "31042b2e25545a45c814819e548635cf53840fade329bac15517dc7cd11ece72"),
}

# States saved mid-epoch by that same pre-split code (version 1, no 'state_crc32') and the sha256 of
# the order each continues with.
VERSION_1_STATES = [
    (lambda: sh.GlobalShuffle(n=1000, seed=3, epoch=1),
     '{"algorithm":"global_feistel","epoch":1,"n":1000,"position":123,"seed":3,"version":1}',
     "686e63dd5cee9d84eb809ca988f5baa8587372384f45dd14d4b190277d411c64"),
    (lambda: sh.ResumableShuffleBuffer(n=100, buffer_size=10, seed=1),
     '{"algorithm":"shuffle_buffer","buffer":"EQAAAAgAAAADAAAAFAAAABUAAAAQAAAADAAAABgAAAAZAAAA",'
     '"buffer_crc32":1125051555,"buffer_dtype":"uint32","buffer_size":10,"cursor":26,"emitted":17,'
     '"epoch":0,"n":100,"seed":1,"version":1}',
     "94762f493d07ffb79100585ca0d90c6f1f6554f73e1ad017c7b2a587a49fb01f"),
    (lambda: sh.ShardAwareShuffle(n=1000, seed=1, shard_size=100, window_shards=2),
     '{"algorithm":"shard_window_feistel","epoch":0,"n":1000,"position":456,"seed":1,"shard_size":100,'
     '"version":1,"window_shards":2}',
     "cfc3d4da2d4e35c98a8da438cba3a7099ec24bb7fe64b58428c1fdf69b59e6af"),
]


def _sha256_of_order(order) -> str:
    return hashlib.sha256(np.asarray(order, dtype="<i8").tobytes()).hexdigest()


@pytest.mark.parametrize("name", list(PINNED_ORDERS))
def test_orders_are_byte_identical_to_the_pre_split_module(name):
    make_order, expected = PINNED_ORDERS[name]
    assert _sha256_of_order(make_order()) == expected


@pytest.mark.parametrize("make, text, expected", VERSION_1_STATES)
def test_version_1_states_from_the_pre_split_module_still_resume_exactly(make, text, expected):
    # Version 1 has no checksum: since issue 20 (item 7) it loads only when the caller asks for it.
    with pytest.raises(StateError, match="no checksum.*allow_unchecked=True"):
        make().load_state_dict(text)
    shuffle = make()
    shuffle.load_state_dict(text, allow_unchecked=True)
    assert _sha256_of_order(list(shuffle)) == expected


@pytest.mark.parametrize("make, text, expected", VERSION_1_STATES)
def test_version_2_flat_states_still_load_checked(make, text, expected):
    flat = {**json.loads(text), "version": 2}
    shuffle = make()
    shuffle.load_state_dict({**flat, "state_crc32": state_crc32(flat)})
    assert _sha256_of_order(list(shuffle)) == expected


# ------------------------------------------------------------------ checksummed states (issue #10)


def _positional(kind: str):
    if kind == "global":
        return sh.GlobalShuffle(n=1000, seed=3, epoch=1)
    return sh.ShardAwareShuffle(n=1000, seed=1, shard_size=100, window_shards=2)


@pytest.mark.parametrize("kind", ["global", "shard"])
def test_an_edited_position_is_refused_naming_the_field(kind):
    shuffle = _positional(kind)
    shuffle.position = 123
    state = json.loads(sh.state_to_json(shuffle.state_dict()))
    assert state["kind"] == "nblib.shuffle.state" and state["version"] == sh.STATE_VERSION == 3 and "sha256" in state
    fresh = _positional(kind)
    with pytest.raises(StateError, match=r"'position'=124 does not match the state's checksum") as info:
        fresh.load_state_dict(_edited(state, position=124))  # in range: without the checksum, one sample is skipped
    assert "start the epoch afresh" in str(info.value)
    assert fresh.position == 0  # nothing changed on the refusal
    fresh.load_state_dict(state)
    assert fresh.position == 123


def test_an_edited_identity_field_is_refused_even_when_the_shuffle_is_built_to_match():
    state = _edited(sh.GlobalShuffle(n=1000, seed=3).state_dict(), seed=4)
    with pytest.raises(StateError, match="checksum"):
        sh.GlobalShuffle(n=1000, seed=4).load_state_dict(state)


def test_a_consistently_edited_buffer_is_refused_by_the_state_checksum():
    state = _buffer_state_mid_epoch()
    raw = bytearray(base64.b64decode(state["body"]["buffer"]))
    raw[0:4], raw[4:8] = raw[4:8], raw[0:4]  # swap two buffered indices and fix up the buffer's own crc32
    edited = _edited(state, buffer=base64.b64encode(bytes(raw)).decode(), buffer_crc32=zlib.crc32(raw))
    with pytest.raises(StateError, match="'buffer_crc32'=.* does not match the state's checksum"):
        sh.ResumableShuffleBuffer(n=100, buffer_size=10, seed=1).load_state_dict(edited)


@pytest.mark.parametrize("kind", ["buffer", "global", "shard"])
def test_a_state_without_its_checksum_is_refused(kind):
    # Since states became nblib.manifest records (version 3) the checksum is the record's sha256.
    state = _make(kind, 300, 1, 20).state_dict()
    del state["sha256"]
    with pytest.raises(StateError, match="does not match the state's checksum"):
        _make(kind, 300, 1, 20).load_state_dict(state)
    legacy = _version_2(_make(kind, 300, 1, 20).state_dict())
    del legacy["state_crc32"]
    with pytest.raises(StateError, match="no field 'state_crc32'"):
        _make(kind, 300, 1, 20).load_state_dict(legacy)


def test_a_missing_state_file_is_a_state_error_naming_the_path(tmp_path):
    path = tmp_path / "never-saved" / "shuffle.json"
    with pytest.raises(StateError, match="no shuffle state at .*never-saved.*start the epoch afresh") as info:
        sh.load_state(path, sh.GlobalShuffle(n=10, seed=0))
    assert not isinstance(info.value, FileNotFoundError) and str(path) in str(info.value)


# ------------------------------------------------------------------ state size and files


@pytest.mark.parametrize("buffer_size", [100, 1_000, 10_000, 250_000])
def test_buffer_state_is_at_most_8_bytes_per_buffered_element_plus_4_kb(buffer_size):
    shuffle = sh.ResumableShuffleBuffer(n=2_000_000, buffer_size=buffer_size, seed=0)
    next(iter(shuffle))  # buffer is now full (buffer_size - 1 waiting)
    size = sh.state_bytes(shuffle)
    assert len(shuffle.buffered_indices()) == buffer_size - 1
    assert size <= 8 * buffer_size + 4096
    assert size >= 5 * (buffer_size - 1)  # it really holds the buffer (5.33 bytes per index)


def test_permutation_states_are_constant_size():
    # Bounds raised by 64 bytes when states became nblib.manifest records (a sha256 where a crc32 was).
    assert sh.state_bytes(sh.GlobalShuffle(n=10**12, seed=1)) < 264
    assert sh.state_bytes(sh.ShardAwareShuffle(n=10**9, seed=1, shard_size=10**6, window_shards=8)) < 314
    assert sh.state_bytes(sh.GlobalShuffle(n=10**12, seed=1)) == sh.state_bytes(sh.GlobalShuffle(n=10**3, seed=1)) + 9


KILL_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from nblib import shuffle as sh
    folder = Path(sys.argv[1]); out = folder / "order.txt"; state_path = folder / "state.json"
    shuffle = sh.ResumableShuffleBuffer(n=3000, buffer_size=200, seed=11)
    done = 0
    if state_path.exists():
        sh.load_state(state_path, shuffle)
        done = shuffle.emitted
    lines = out.read_text().splitlines()[:done] if out.exists() else []
    out.write_text("".join(f"{x}\\n" for x in lines))
    with out.open("a") as f:
        for index in shuffle:
            f.write(f"{index}\\n")
            if shuffle.emitted % 50 == 0:
                f.flush(); os.fsync(f.fileno())
                sh.save_state(state_path, shuffle)
                if os.environ.get("SLOW"):
                    time.sleep(0.05)
    print("done")
""")


@pytest.mark.slow
def test_resume_after_a_real_sigkill_gives_the_uninterrupted_order(tmp_path):
    run = [sys.executable, "-c", KILL_SCRIPT, str(tmp_path)]
    victim = subprocess.Popen(run, env=subprocess_env(SLOW="1"), stdout=subprocess.PIPE)
    deadline = time.time() + 60
    while not (tmp_path / "state.json").exists() or \
            json.loads((tmp_path / "state.json").read_text())["body"]["emitted"] < 500:
        assert time.time() < deadline and victim.poll() is None
        time.sleep(0.02)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    killed_at = json.loads((tmp_path / "state.json").read_text())["body"]["emitted"]
    assert 0 < killed_at < 3000
    subprocess.run(run, env=subprocess_env(), check=True, capture_output=True, timeout=60)
    resumed = [int(x) for x in (tmp_path / "order.txt").read_text().split()]
    assert resumed == list(sh.ResumableShuffleBuffer(n=3000, buffer_size=200, seed=11))


# ------------------------------------------------------------------ quality metrics


def test_quality_of_the_identity_and_the_reversal():
    identity = sh.shuffle_quality(np.arange(1000), episode_len=10)
    assert identity["displacement_mean"] == 0 and identity["spearman"] == pytest.approx(1.0)
    assert identity["same_episode_share"] == pytest.approx(900 / 999)
    reversed_ = sh.shuffle_quality(np.arange(1000)[::-1])
    assert reversed_["spearman"] == pytest.approx(-1.0)
    assert sh.displacements([2, 0, 1]).tolist() == [2, 1, 1]


def test_global_shuffle_quality_is_that_of_a_random_permutation():
    quality = sh.shuffle_quality(sh.GlobalShuffle(n=100_000, seed=3).indices(), episode_len=10)
    assert abs(quality["spearman"]) < 0.02
    assert quality["displacement_mean_vs_random"] == pytest.approx(1.0, abs=0.02)
    assert quality["same_episode_share"] == pytest.approx(quality["same_episode_share_random"], abs=5e-4)


def test_larger_buffers_shuffle_better_and_a_full_buffer_is_random():
    rows = [sh.shuffle_quality(sh.full_order(sh.ResumableShuffleBuffer(n=20_000, buffer_size=b, seed=0)), 20)
            for b in (10, 100, 1000, 20_000)]
    spearmans = [row["spearman"] for row in rows]
    shares = [row["same_episode_share"] for row in rows]
    assert spearmans == sorted(spearmans, reverse=True) and shares == sorted(shares, reverse=True)
    assert abs(rows[-1]["spearman"]) < 0.05 and rows[0]["spearman"] > 0.99
    assert rows[-1]["displacement_mean_vs_random"] == pytest.approx(1.0, abs=0.05)


def test_shard_aware_trades_neighbour_locality_for_sequential_reads():
    n, shard = 20_000, 100
    narrow = sh.shuffle_quality(sh.ShardAwareShuffle(n=n, seed=1, shard_size=shard, window_shards=2).indices(),
                                episode_len=shard)
    wide = sh.shuffle_quality(sh.ShardAwareShuffle(n=n, seed=1, shard_size=shard, window_shards=50).indices(),
                              episode_len=shard)
    assert narrow["same_episode_share"] == pytest.approx(0.5, abs=0.05)  # 1 / window_shards
    assert wide["same_episode_share"] == pytest.approx(0.02, abs=0.01)
    assert abs(narrow["spearman"]) < 0.2  # the shard order is still fully shuffled


def test_importing_nblib_shuffle_imports_neither_torch_nor_tensorflow():
    code = "import sys, nblib.shuffle; print(sorted(m for m in ('torch', 'tensorflow') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env=subprocess_env())
    assert result.stdout.strip() == "[]"
