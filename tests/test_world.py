"""Each role of an encode run is its own small type: what it encodes, writes, merges and reports."""
from __future__ import annotations

import inspect

import pytest

from nblib.encode import distributed as dist
from nblib.errors import ConfigError


def test_the_registry_holds_one_type_per_role():
    assert set(dist.ROLES) == {"single", "rank", "shard", "consolidate"}
    assert all(issubclass(cls, dist.World) and cls.role == name for name, cls in dist.ROLES.items())


def test_each_role_takes_its_share_of_the_pending_parts_without_a_store():
    assert "store" not in inspect.signature(dist.World.assign).parameters
    pending = [1, 2, 5, 6, 7]
    assert dist.Single().assign(pending, 8) == pending
    assert dist.Consolidator().assign(pending, 8) == []
    assert dist.Shard(0, 2).assign(pending, 8) == [1, 2]         # block 0 of all parts is 0..3
    assert dist.Shard(1, 2).assign(pending, 8) == [5, 6, 7]
    assert dist.Rank(0, 1).assign(pending, 8) == pending          # one rank: no group to agree with


def test_only_a_single_process_writes_the_manifest_and_one_process_merges():
    roles = {"single": dist.Single(), "shard": dist.Shard(1, 2), "consolidate": dist.Consolidator(),
             "rank 0": dist.Rank(0, 2), "rank 1": dist.Rank(1, 2)}
    assert {n for n, w in roles.items() if w.writes_manifest} == {"single"}
    assert {n for n, w in roles.items() if w.consolidates} == {"single", "consolidate", "rank 0"}
    assert {n for n, w in roles.items() if w.reports} == {"single", "consolidate", "rank 0", "shard"}
    assert {n for n, w in roles.items() if w.distributed} == set(roles) - {"single"}


def test_shards_of_one_split_share_a_launch_and_a_mirror_is_refused_for_all_but_single():
    assert dist.Shard(0, 3).lock_environ == dist.Shard(2, 3).lock_environ != dist.Shard(0, 2).lock_environ
    dist.Single().refuse_mirror()
    for world in (dist.Shard(0, 2), dist.Consolidator(), dist.Rank(1, 2)):
        with pytest.raises(ConfigError, match="--mirror is for one process"):
            world.refuse_mirror()
