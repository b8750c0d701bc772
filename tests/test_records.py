"""Record shards: records of tensors in, grouped size-bounded shards out, read one shard at a time.

Real files and real processes: a pickle stream larger than the address-space cap its sharding
process runs under, SIGKILLs mid-run resumed to identical bytes, damaged shards rebuilt from the source.
"""
from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from cli_runner import run_nblib
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from record_traces import trace_records, write_trace_pickle
from shard_budget import shard_size_for_ram

from conftest import cache_folder_bytes, subprocess_env
from nblib.cache import (
    RecordShards,
    RecordShardShuffle,
    record_source,
    verify_records,
    write_records,
)
from nblib.cache.record_format import read_record_manifest
from nblib.errors import BudgetExceeded, CacheError, InputError, StateError

SMALL = {"hidden": 64, "experts": 8, "layers": 4, "tokens": (8, 40)}


def same_record(a: dict, b: dict) -> bool:
    if sorted(a) != sorted(b):
        return False
    for name, value in a.items():
        other = b[name]
        if isinstance(value, np.ndarray):
            if not (isinstance(other, np.ndarray) and value.dtype == other.dtype and np.array_equal(value, other)):
                return False
        elif type(value) is not type(other) or value != other:
            return False
    return True


def mixed_records(n: int):
    rng = np.random.default_rng(0)
    for i in range(n):
        yield {"x": rng.standard_normal((i % 7 + 1, 3)).astype(np.float32), "ids": np.arange(i % 5, dtype=np.int64),
               "layer_id": i % 3, "weight": i / 3, "name": f"r{i}", "flag": i % 2 == 0, "note": None}


@pytest.mark.parametrize("codec", ["zstd", "raw"])
def test_records_of_any_shapes_and_scalars_come_back_identical(tmp_path, codec):
    records = list(mixed_records(50))
    summary = write_records(records, tmp_path / "out", shard_mb=0.001, codec=codec)
    shards = RecordShards(tmp_path / "out")
    assert summary.n_records == len(shards) == 50 and summary.n_shards > 3
    assert all(same_record(a, shards[i]) for i, a in enumerate(records))
    shards[3]["x"][0, 0] = 99.0  # served arrays are writable copies: the next read is unchanged
    assert shards[3]["x"][0, 0] == records[3]["x"][0, 0]
    assert same_record(pickle.loads(pickle.dumps(shards))[7], records[7])  # spawn-started workers get a copy


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bits=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=8))
def test_a_scalar_float_keeps_every_bit_nan_payloads_and_signs_too(tmp_path_factory, bits):
    """Scalar fields against struct's own bytes: any 8 bytes, NaNs with payloads and signs half the time."""
    nans = [b | 0x7FF0000000000001 if i % 2 else b for i, b in enumerate(bits)]        # exponent all ones: a NaN
    floats = [struct.unpack(">d", b.to_bytes(8, "big"))[0] for b in nans]
    out = tmp_path_factory.mktemp("bits") / "out"
    write_records([{"v": v, "x": np.zeros(1)} for v in floats], out, codec="raw")
    shards = RecordShards(out)
    assert [struct.pack(">d", shards[i]["v"]) for i in range(len(floats))] == [struct.pack(">d", v) for v in floats]


def test_group_by_keeps_one_key_per_shard_in_input_order_within_the_size_bound(tmp_path):
    records = list(trace_records(200, **SMALL))
    write_records(records, tmp_path / "out", shard_mb=0.05, group_by="layer_id")
    manifest = read_record_manifest(tmp_path / "out")
    shards = RecordShards(tmp_path / "out")
    per_key = {}
    for k, entry in enumerate(manifest["shards"]):
        served = shards.shard_records(k)
        assert {r["layer_id"] for r in served} == {entry["key"]} and len(served) == entry["count"]
        assert entry["bytes"] <= 0.05e6 + 200  # the bound on stored records, plus header and trailer
        per_key.setdefault(entry["key"], []).extend(r["step"] for r in served)
    assert sorted(per_key) == [0, 1, 2, 3]
    assert all(steps == list(range(50)) for steps in per_key.values())  # each key: every record, in input order
    assert all(shards.keys.count(key) >= 2 for key in per_key)     # a key larger than a shard spans several


def test_a_record_of_another_dtype_or_without_the_group_key_is_refused_by_index(tmp_path):
    records = list(mixed_records(5))
    records[3]["x"] = records[3]["x"].astype(np.float64)
    with pytest.raises(InputError, match=r"record 3 field 'x' is float64"):
        write_records(records, tmp_path / "a", shard_mb=1)
    assert not [p.name for p in (tmp_path / "a").iterdir() if p.name.startswith(".tmp-")]  # no open shard left
    with pytest.raises(InputError, match=r"record 0 has no field 'layer'"):
        write_records(mixed_records(3), tmp_path / "b", shard_mb=1, group_by="layer")


# ------------------------------------------------------------------------------ inputs


CHILD = """
import os, resource, sys, pickle
import numpy as np, zstandard, xxhash
from nblib.cache import record_source, write_records
cap = int(sys.argv[3])
vm = int(next(l for l in open('/proc/self/status') if l.startswith('VmSize')).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + cap, vm + cap))
if sys.argv[1] == 'whole':
    try:
        with open(sys.argv[2], 'rb') as f:
            everything = [pickle.load(f) for _ in range(10**9)]
    except MemoryError:
        print('MemoryError'); sys.exit(0)
    except EOFError:
        print('loaded'); sys.exit(0)
print(write_records(record_source(sys.argv[2]), sys.argv[4], shard_mb=2, group_by='layer_id'))
"""


def run_capped(mode: str, path, cap: int, out=""):
    env = subprocess_env(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="1")
    return subprocess.run([sys.executable, "-c", CHILD, mode, str(path), str(cap), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_pickle_stream_larger_than_the_address_space_cap_is_sharded_as_a_stream(tmp_path):
    stream = tmp_path / "trace.pkl"
    write_trace_pickle(stream, target_bytes=48_000_000, **SMALL)
    size = stream.stat().st_size
    cap = 32_000_000  # the process may grow by 32 MB past its imports: less than the file
    assert size > cap
    control = run_capped("whole", stream, cap)  # the cap bites: holding the records whole fails
    assert control.stdout.strip() == "MemoryError", control.stdout + control.stderr
    done = run_capped("stream", stream, cap, tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    shards = RecordShards(tmp_path / "out")
    with open(stream, "rb") as f:
        first = pickle.load(f)
    assert len(shards) == read_record_manifest(tmp_path / "out")["n_records"] and same_record(first, shards[0])


def test_a_truncated_stream_names_the_record_and_the_byte_where_it_breaks(tmp_path):
    stream = tmp_path / "trace.pkl"
    write_trace_pickle(stream, n_records=10, **SMALL)
    with open(stream, "rb") as f:
        for _ in range(6):
            pickle.load(f)
        cut = f.tell()
    stream.write_bytes(stream.read_bytes()[:cut + 100])
    with pytest.raises(InputError, match=rf"record 6 \(at byte {cut:,} of"):
        write_records(record_source(stream), tmp_path / "out", shard_mb=1)


def test_a_pickle_naming_other_code_is_refused_unless_trusted(tmp_path):
    path = tmp_path / "evil.pkl"
    with open(path, "wb") as f:
        pickle.dump({"x": np.zeros(3), "when": __import__("datetime").date(2020, 1, 1)}, f)
    with pytest.raises(InputError, match="datetime.date"):
        write_records(record_source(path), tmp_path / "out", shard_mb=1)


def test_npz_and_pt_files_of_records_round_trip(tmp_path):
    torch = pytest.importorskip("torch")
    states = np.random.default_rng(1).standard_normal((12, 5, 4)).astype(np.float16)
    np.savez(tmp_path / "r.npz", hidden_states=states, layer_id=np.arange(12) % 3)
    write_records(record_source(tmp_path / "r.npz"), tmp_path / "npz", shard_mb=1, group_by="layer_id")
    shards = RecordShards(tmp_path / "npz")
    got = sorted((r["layer_id"], r["hidden_states"].tobytes()) for r in shards.iter_records())
    assert got == sorted((i % 3, states[i].tobytes()) for i in range(12))
    records = list(trace_records(9, **SMALL))
    torch.save([{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in r.items()} for r in records],
               tmp_path / "r.pt")
    write_records(record_source(tmp_path / "r.pt"), tmp_path / "pt", shard_mb=1)
    assert all(same_record(records[i], RecordShards(tmp_path / "pt")[i]) for i in range(9))


# ------------------------------------------------------------------------------ durability


def records_cmd(*args):
    return [sys.executable, "-m", "nblib", "cache", *map(str, args)]


def run_records_cli(*args):
    return run_nblib("cache", *args)


def kill_after(args, folder, shards: int) -> None:
    process = subprocess.Popen(records_cmd(*args), env=subprocess_env(), start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and process.poll() is None:
            if len(list(folder.glob("shard-*.rec"))) >= shards:
                break
            time.sleep(0.002)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL, "the run ended on its own before the kill"


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_gives_the_bytes_of_an_uninterrupted_run(tmp_path):
    stream = tmp_path / "trace.pkl"
    write_trace_pickle(stream, target_bytes=6_000_000, **SMALL)
    args = lambda out: ("--records", stream, "--out", out, "--shard-size-mb", 0.1, "--group-by", "layer_id")
    reference = tmp_path / "reference"
    done = run_records_cli(*args(reference))
    assert done.returncode == 0, done.stderr
    total = len(read_record_manifest(reference)["shards"])
    assert total >= 40
    killed = tmp_path / "killed"
    for at in (3, total // 2):
        kill_after(args(killed), killed, at)
    listed = len(read_record_manifest(killed)["shards"])
    assert 0 < listed < total
    assert run_records_cli("--verify", killed).returncode == 1  # incomplete
    resumed = run_records_cli(*args(killed))
    assert resumed.returncode == 0, resumed.stderr
    assert f"reused {listed}" in resumed.stdout
    assert cache_folder_bytes(killed) == cache_folder_bytes(reference)
    assert run_records_cli("--verify", killed).returncode == 0


def test_a_damaged_shard_is_refused_on_read_found_by_verify_and_rebuilt_from_the_source(tmp_path):
    stream = tmp_path / "trace.pkl"
    write_trace_pickle(stream, n_records=120, **SMALL)
    out = tmp_path / "out"
    write_records(record_source(stream), out, shard_mb=0.05, group_by="layer_id")
    before = cache_folder_bytes(out)
    shard = sorted(out.glob("shard-*.rec"))[2]
    data = bytearray(shard.read_bytes())
    data[200] ^= 0xFF
    stat = shard.stat()
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # size and mtime kept: only a hash sees it
    reader = RecordShards(out)
    with pytest.raises(CacheError, match=r"is corrupt: its bytes do not match"):
        reader.shard_records(2)
    (out / "shard-00005.rec").unlink()
    report = verify_records(out)
    assert not report.ok and report.corrupt == (shard.name,) and report.missing == ("shard-00005.rec",)
    repaired = verify_records(out, repair=True)
    assert repaired.ok and set(repaired.repaired) == {shard.name, "shard-00005.rec"}
    assert cache_folder_bytes(out) == before


def test_resuming_with_other_records_is_refused(tmp_path):
    records = list(trace_records(60, **SMALL))
    write_records(records, tmp_path / "out", shard_mb=0.05)
    records[10]["layer_id"] = 3 - records[10]["layer_id"]
    with pytest.raises(CacheError, match="not the one .* was written from"):
        write_records(records, tmp_path / "out", shard_mb=0.05)
    assert verify_records(tmp_path / "out").ok


# ------------------------------------------------------------------------------ reading


def test_the_shuffle_is_a_permutation_reading_one_shard_at_a_time_and_resumes_at_every_cut(tmp_path):
    write_records(trace_records(90, **SMALL), tmp_path / "out", shard_mb=0.03, group_by="layer_id")
    shards = RecordShards(tmp_path / "out")
    order = shards.shuffle(seed=7).indices()
    assert sorted(order.tolist()) == list(range(len(shards)))
    visited = [shards.locate(i)[0] for i in order]
    switches = sum(1 for a, b in zip(visited, visited[1:]) if a != b)
    assert switches == len(shards.shards) - 1  # window 1: each shard is served whole, then never again
    assert not np.array_equal(order, shards.shuffle(seed=7, epoch=1).indices())
    for cut in range(len(shards) + 1):
        first = shards.shuffle(seed=7)
        head = [next(iter(first)) for _ in range(cut)] if cut else []
        resumed = shards.shuffle(seed=7)
        resumed.load_state_dict(first.state_dict())
        assert head + list(resumed) == order.tolist()
    other = RecordShardShuffle(counts=[5, 5], seed=7)
    with pytest.raises(StateError, match="'n'|'layout'"):
        other.load_state_dict(shards.shuffle(seed=7).state_dict())


def test_reading_holds_about_one_shard_whatever_the_folder_size(tmp_path):
    write_records(trace_records(600, hidden=256, layers=2, tokens=(64, 64)), tmp_path / "out",
                  shard_mb=1, codec="raw", group_by="layer_id")
    folder_bytes = sum(p.stat().st_size for p in (tmp_path / "out").glob("*.rec"))
    code = ("import sys; from nblib.cache import RecordShards; r = RecordShards(sys.argv[1]); "
            "n = sum(1 for x in r.iter_records(r.shuffle(seed=1)) if x['hidden_states'].size) "
            "if sys.argv[2] == 'read' else len(list(r.iter_records())) if sys.argv[2] == 'hold' else 0; "
            # VmHWM: this process's own peak (ru_maxrss also holds the parent's)
            "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])")
    peaks = [int(subprocess.run([sys.executable, "-c", code, str(tmp_path / "out"), mode], env=subprocess_env(),
                                capture_output=True, text=True, check=True).stdout) * 1024
             for mode in ("read", "idle", "hold")]
    assert folder_bytes > 18e6
    assert peaks[0] - peaks[1] < 4e6, peaks  # one 1 MB shard mapped + a record, not the 19 MB folder
    assert peaks[2] - peaks[1] > 0.8 * folder_bytes, peaks  # the control: holding every record shows


def test_torch_datasets_map_keys_and_the_iterable_one_resumes_exactly_with_workers(tmp_path):
    torch = pytest.importorskip("torch")
    from nblib.cache.record_torch import RecordDataset, RecordIterableDataset, pad_collate

    write_records(trace_records(40, **SMALL), tmp_path / "out", shard_mb=0.02, group_by="layer_id")
    mapped = RecordDataset(tmp_path / "out", inputs="hidden_states", target="target_routing")
    inputs, target = mapped[3]
    assert inputs.dtype == torch.float16 and target.shape == (inputs.shape[0], 8)
    batch = pad_collate([mapped[i] for i in range(4)])
    assert batch[0].shape[0] == 4 and batch[0].shape[1] == max(mapped[i][0].shape[0] for i in range(4))

    def steps(dataset):
        loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=lambda b: b)
        return [int(item["step"]) * 4 + int(item["layer_id"]) for chunk in loader for item in chunk]

    make = lambda: RecordIterableDataset(tmp_path / "out", seed=3, batch_size=4)
    everything = steps(make())
    assert sorted(everything) == list(range(40))
    first = make()
    state = first.state_dict(consumed=12)
    resumed = make()
    resumed.load_state_dict(state)
    assert everything[:12] + steps(resumed) == everything


# ------------------------------------------------------------------------------ budget


def test_the_shard_budget_fills_the_ram_and_one_byte_more_does_not_fit():
    fit = shard_size_for_ram(12_700_000_000, workers=2, resident_shards=2, decoded_per_stored=1.1,
                             largest_record_bytes=2_000_000)
    assert fit.peak <= 12_700_000_000 * 0.9 < fit.peak + 3 * 2 * (1 + 1.1) * 2  # two more bytes per shard overflow
    assert "decoded shard" in str(fit)
    with pytest.raises(BudgetExceeded, match="no shard size fits"):
        shard_size_for_ram(500_000_000, workers=4)


def test_the_cli_refuses_records_without_out_in_one_line(tmp_path):
    stream = tmp_path / "t.pkl"
    write_trace_pickle(stream, n_records=3, **SMALL)
    result = run_records_cli("--records", stream)
    assert result.returncode == 2 and result.stderr.strip().startswith("error: --records FILE needs --out")
    assert len(result.stderr.strip().splitlines()) == 1
    result = run_records_cli("--records", stream, "--out", tmp_path / "o", "--codec", "png")
    assert result.returncode == 2 and "not one for records" in result.stderr


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_every_pickle_protocol_is_told_apart_as_stream_or_list_and_reads_back(tmp_path, protocol):
    records = list(trace_records(6, **SMALL))
    stream, whole = tmp_path / "stream.pkl", tmp_path / "list.pkl"
    with open(stream, "wb") as f:
        for record in records:
            pickle.dump(record, f, protocol=protocol)
    with open(whole, "wb") as f:
        pickle.dump(records, f, protocol=protocol)
    assert (record_source(stream).kind, record_source(whole).kind) == ("pickle-stream", "pickle-list")
    for source in (stream, whole):
        served = list(record_source(source))
        assert len(served) == 6 and all(same_record(a, b) for a, b in zip(records, served))


def test_a_map_style_loader_with_the_shuffle_sampler_resumes_at_a_consumed_count(tmp_path):
    torch = pytest.importorskip("torch")
    from nblib.cache.record_torch import RecordDataset
    from nblib.shuffle import ShuffleSampler

    write_records(trace_records(30, **SMALL), tmp_path / "out", shard_mb=0.02, group_by="layer_id")
    dataset = RecordDataset(tmp_path / "out", inputs=("layer_id", "token_ids"), target="step")

    def targets(sampler):
        loader = torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=1, num_workers=2)
        return [int(step) * 4 + int(inputs[0]) for inputs, step in loader]

    make = lambda: ShuffleSampler(dataset.shards.shuffle(seed=5))
    everything = targets(make())
    state = make().state_dict(consumed=11)
    resumed = make()
    resumed.load_state_dict(state)
    assert everything[:11] + targets(resumed) == everything
    assert sorted(everything) == list(range(30))
