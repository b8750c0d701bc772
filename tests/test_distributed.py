"""Encode over several processes: torchrun ranks (gloo on CPU), shards that share only a folder,
kills and world-size changes, all giving the single-process run's bytes with no part done twice.
Real caches, real `torchrun` launches, real SIGKILLs.
"""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from cli_runner import run_nblib

from conftest import small_cache, subprocess_env
from nblib import encode as enc
from nblib.atomic import sha256_file
from nblib.cache import ShardedImageCache
from nblib.config import preset
from nblib.encode import distributed as dist
from nblib.errors import ConfigError, StateError
from nblib.manifest import read_manifest
from nblib.units import fmt_duration_range

N_TEXTS = 128                    # 16 parts of 8 samples: enough parts to kill a launch mid-run
CONFIG = preset("smoke").replace(batch_size=8, checkpoint_every=1, consolidate_every=1)
N_PARTS = N_TEXTS // 8
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}   # same threads in every process: same bytes
OUTPUTS = ("sketches", "checksums", "children")


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread(one_torch_thread):
    """Every test of this module encodes with one torch thread."""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cache") / "c"
    texts = [f"#{i} ranks share nothing mutable " + "abc"[i % 3] * (i % 7) for i in range(N_TEXTS)]
    small_cache(folder, texts)
    return folder


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory) -> dict[str, str]:
    """sha256 of each consolidated output of one uninterrupted single-process run."""
    report = enc.encode(ShardedImageCache(cache_dir), tmp_path_factory.mktemp("ref"), CONFIG,
                        device="cpu", progress=False, preflight=False)
    return {name: sha256_file(path) for name, path in report.outputs.items()}


# ------------------------------------------------------------------------------ torchrun ranks


@pytest.mark.slow
def test_two_ranks_give_the_single_process_bytes_each_part_written_once(cache_dir, reference, tmp_path):
    out = tmp_path / "two"
    done = subprocess.run(_torchrun(2, cache_dir, out), env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _hashes(out) == reference
    assert dist.part_writes(out) == {f"part-{k:06d}": 1 for k in range(N_PARTS)}
    ranks = {(r["rank"], r["size"]) for r in dist.read_records(out)}
    assert ranks == {(0, 2), (1, 2)}
    assert done.stdout.count("encoded ") == 1, done.stdout          # rank 1 stays quiet
    assert not list((out / enc.PARTS_FOLDER).glob("**/.tmp*"))


@pytest.mark.slow
def test_one_rank_killed_mid_run_then_rerun_gives_identical_bytes(cache_dir, reference, tmp_path):
    out = tmp_path / "killed"
    _launch_and_kill(_torchrun(2, cache_dir, out), out, at_parts=3, ranks=(1,))
    before = _durable(out)
    records_before = _record_files(out)

    rerun = subprocess.run(_torchrun(2, cache_dir, out), env=_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _hashes(out) == reference
    _assert_resumed_without_repeats(out, before, records_before)


@pytest.mark.slow
@pytest.mark.parametrize(("first", "then"), [(2, 1), (1, 2)])
def test_world_size_change_redistributes_only_the_parts_not_yet_durable(cache_dir, reference, tmp_path, first, then):
    out = tmp_path / f"{first}-then-{then}"
    _launch_and_kill(_torchrun(first, cache_dir, out), out, at_parts=4, ranks=tuple(range(first)))
    before = _durable(out)
    records_before = _record_files(out)

    rerun = subprocess.run(_torchrun(then, cache_dir, out), env=_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _hashes(out) == reference
    written = _assert_resumed_without_repeats(out, before, records_before)
    sizes = {r["size"] for r in _records_since(out, records_before)}
    assert sizes == {then} and len(written) == N_PARTS - len(before)


@pytest.mark.slow
def test_a_rank_that_dies_makes_the_other_stop_with_a_message_not_a_hang(cache_dir, tmp_path):
    """Two ranks started by hand (the standard variables, no torchrun agent to stop the survivor)."""
    out = tmp_path / "plain-ranks"
    port = _free_port()
    procs = [subprocess.Popen(_cli(cache_dir, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                       NBLIB_DIST_TIMEOUT_S="60"))
             for r in (0, 1)]
    _wait_for(lambda: len(_durable(out)) >= 2 or any(p.poll() is not None for p in procs), 240)
    procs[1].send_signal(signal.SIGKILL)
    started = time.monotonic()
    _, err = procs[0].communicate(timeout=120)
    assert procs[0].returncode == 2, err[-3000:]
    assert "rank 0 of 2 gave up waiting for the other ranks" in err and "rerun the same command" in err
    assert "Traceback" not in err
    assert time.monotonic() - started < 90
    procs[1].wait(30)


# ------------------------------------------------------------------------------ shards


@pytest.mark.slow
def test_two_shards_as_plain_processes_then_consolidate_give_identical_bytes(cache_dir, reference, tmp_path):
    out = tmp_path / "shards"
    shards = [subprocess.Popen(_cli(cache_dir, out, "--shard", f"{i}/2"), env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    for shard in shards:
        _, err = shard.communicate(timeout=300)
        assert shard.returncode == 0, err[-3000:]
    assert not (out / enc.INDEX_NAME).exists()               # shards never consolidate
    merged = run_nblib(*_cli(cache_dir, out, "--consolidate")[3:], **THREADS)
    assert merged.returncode == 0, merged.stderr[-3000:]
    assert _hashes(out) == reference
    assert dist.part_writes(out) == {f"part-{k:06d}": 1 for k in range(N_PARTS)}
    blocks = {r["rank"]: r["assigned"] for r in dist.read_records(out)}
    assert blocks == {i: [f"part-{k:06d}" for k in range(8 * i, 8 * i + 8)] for i in (0, 1)}


def test_consolidate_with_a_shard_missing_refuses_naming_its_parts(cache_dir, tmp_path):
    out = tmp_path / "half"
    _encode(cache_dir, out, dist.join(shard="0/2"))
    with pytest.raises(StateError) as refused:
        _encode(cache_dir, out, dist.join(consolidate_only=True))
    message = str(refused.value)
    assert "8 of 16 parts are not durable yet (part-000008..part-000015)" in message
    assert "shard 1/2 owes part-000008..part-000015: never ran here" in message
    assert not (out / enc.INDEX_NAME).exists()

    _encode(cache_dir, out, dist.join(shard="1/2"))
    report = _encode(cache_dir, out, dist.join(consolidate_only=True))
    assert report.parts_encoded == 0 and set(report.outputs) == set(OUTPUTS)


def test_a_shard_stopped_part_way_is_named_with_what_it_wrote(cache_dir, tmp_path, caplog):
    out = tmp_path / "stopped"
    _encode(cache_dir, out, dist.join(shard="1/2"))
    (out / enc.PARTS_FOLDER / "part-000009" / "part.json").unlink()    # as if killed before its last write
    with pytest.raises(StateError, match=r"shard 0/2 owes part-000000\.\.part-000007: never ran here") as refused, \
            caplog.at_level(logging.WARNING, logger="nblib"):
        _encode(cache_dir, out, dist.join(consolidate_only=True))
    assert "part-000009" in caplog.text
    assert "shard 1/2 owes part-000009: ran on" in str(refused.value)
    assert "wrote all 8 of its parts, but these are missing or damaged now" in str(refused.value)


# ------------------------------------------------------------------------------ the split, the world


def test_split_is_deterministic_disjoint_complete_and_balanced():
    for n in (0, 1, 7, 16, 1000):
        for count in (1, 2, 3, 8):
            blocks = [dist.split(range(n), i, count) for i in range(count)]
            assert [k for b in blocks for k in b] == list(range(n))          # in order, each once
            assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
            assert blocks == [dist.split(list(range(n)), i, count) for i in range(count)]


def test_parse_shard_and_the_environment_refuse_what_cannot_be_a_rank():
    assert dist.parse_shard("1/2") == (1, 2)
    for bad in ("2/2", "1", "-1/2", "a/b", "0/0"):
        with pytest.raises(ConfigError, match="0 <= I < N"):
            dist.parse_shard(bad)
    assert dist.world_from_environment({}) is None
    with pytest.raises(ConfigError, match="MASTER_ADDR and MASTER_PORT not set"):
        dist.world_from_environment({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="RANK=2, WORLD_SIZE=2"):
        dist.world_from_environment({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    world = dist.world_from_environment({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                         "MASTER_ADDR": "h", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "j"})
    assert (world.role, world.rank, world.size, world.local_rank, world.local_size) == ("rank", 3, 4, 1, 2)
    assert world.launch == "j/h:29500" and not world.consolidates
    launched = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    with pytest.raises(ConfigError, match="under torchrun the ranks split the parts themselves"):
        dist.join(shard="0/2", environ=launched)
    with pytest.raises(ConfigError, match="two steps"):
        dist.join(shard="0/2", consolidate_only=True, environ={})
    with pytest.raises(ConfigError, match="NBLIB_DIST_TIMEOUT_S"):
        dist.join(environ={dist.TIMEOUT_ENV: "soon"})


def test_a_mirror_is_refused_when_several_processes_write(cache_dir, tmp_path):
    with pytest.raises(ConfigError, match="--mirror is for one process"):
        enc.encode(ShardedImageCache(cache_dir), tmp_path / "r", CONFIG, device="cpu", progress=False,
                   preflight=False, mirror_dir=tmp_path / "m", world=dist.join(shard="0/2"))
    assert not (tmp_path / "m").exists() and not (tmp_path / "r").exists()   # refused before writing anything


def test_rank_budget_keeps_per_rank_memory_shares_the_folder_and_divides_the_time():
    config = preset("t4")
    one, four = dist.rank_budget(config, "t4", 1), dist.rank_budget(config, "t4", 4, ranks_per_host=2)
    assert four.vram_per_rank == one.vram_per_rank and four.ram_per_rank == one.ram_per_rank
    assert four.host_ram == 2 * one.ram_per_rank
    assert four.seconds == pytest.approx(one.seconds / 4)
    assert four.drive_total == one.drive_total + 3 * four.part_bytes
    text = str(four)
    assert "4 ranks on t4 (2 per host)" in text and "VRAM per rank" in text and "/ 4 ranks" in text


# ------------------------------------------------------------------------------ helpers


def _cli(cache_dir: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nblib", *_encode_args(cache_dir, out), *extra]


def _torchrun(nproc: int, cache_dir: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "--max-restarts", "0", "-m", "nblib", *_encode_args(cache_dir, out)]


def _encode_args(cache_dir: Path, out: Path) -> list[str]:
    return ["encode", "--cache", str(cache_dir), "--out", str(out), "--profile", "smoke", "--batch-size", "8",
            "--checkpoint-every", "1", "--device", "cpu", "--no-progress", "--no-preflight"]


def _env(**extra: str) -> dict[str, str]:
    return subprocess_env(**THREADS, **extra)


def _encode(cache_dir: Path, out: Path, world: dist.World):
    return enc.encode(ShardedImageCache(cache_dir), out, CONFIG, device="cpu", progress=False, preflight=False,
                      world=world)


def _hashes(out: Path) -> dict[str, str]:
    return {name: sha256_file(out / f"{name}.npy") for name in OUTPUTS}


def _durable(out: Path) -> dict[str, bytes]:
    """part name -> its part.json bytes (they change whenever a part is written again)."""
    return {p.parent.name: p.read_bytes() for p in (out / enc.PARTS_FOLDER).glob("part-*/part.json")}


def _record_files(out: Path) -> set[Path]:
    return set((out / dist.RANKS_FOLDER).glob("*.json"))


def _records_since(out: Path, before: set[Path]) -> list[dict]:
    """The records of the processes started after `before` was taken (one file per process)."""
    return [read_manifest(path, dist.RECORD_KIND, versions=(dist.RECORD_VERSION,)).body
            for path in sorted(_record_files(out) - before)]


def _assert_resumed_without_repeats(out: Path, before: dict[str, bytes], records_before: set[Path]) -> list[str]:
    """Parts durable before the rerun are untouched; the rerun wrote each other part exactly once."""
    assert 0 < len(before) < N_PARTS, f"the kill landed outside the run ({len(before)} parts durable)"
    after = _durable(out)
    assert {name: after[name] for name in before} == before          # not one of them written again
    written = [name for r in _records_since(out, records_before) for name in r["written"]]
    assert sorted(written) == sorted(set(after) - set(before)) and len(written) == len(set(written))
    return written


def _launch_and_kill(cmd: list[str], out: Path, *, at_parts: int, ranks: tuple[int, ...]) -> None:
    """Start a torchrun launch, SIGKILL the given ranks once `at_parts` parts are durable, wait for its end."""
    launcher = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(_durable(out)) >= at_parts or launcher.poll() is not None, 240)
        workers = {int(p.environ().get("RANK", -1)): p for p in psutil.Process(launcher.pid).children(recursive=True)
                   if "RANK" in p.environ()}
        for rank in ranks:
            workers[rank].send_signal(signal.SIGKILL)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0, err[-3000:]
    assert not (out / enc.INDEX_NAME).exists(), "the launch finished before the kill"


def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_budget_time_reads_in_the_unit_of_a_small_run_not_zero():
    """A smoke run over 2 ranks takes well under a second per rank: its range keeps its digits (P10)."""
    config = preset("smoke")
    two = dist.rank_budget(config, "t4", 2)
    speed = two.single.speed
    assert speed is not None
    expected = fmt_duration_range(speed.hours.low * 1800, two.seconds, speed.hours.high * 1800)
    assert f"time              {expected} = " in str(two) and "0.0 s" not in str(two), str(two)
