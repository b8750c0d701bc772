"""Any pickle of records, streamed, read without its class, and no code run that the allow-list does not name.

Real files and the real command: payloads that ran a shell command through numpy globals, a pickled
list of dataclass traces whose class the reading process cannot import, bf16 and 0-length tensors.
"""
from __future__ import annotations

import collections
import dataclasses
import importlib
import os
import pickle
import pickletools
import subprocess
import sys

import numpy as np
import pytest
from cli_runner import run_nblib
from record_traces import trace_records

from conftest import subprocess_env
from nblib.cache import RecordShards, record_source, write_records
from nblib.cache.pickle_stream import pickle_records
from nblib.errors import InputError

SMALL = {"hidden": 64, "experts": 8, "layers": 4, "tokens": (8, 40), "top_k": 2}
PEAK = ("import sys, runpy; sys.argv = ['nblib', *sys.argv[1:]]\n"   # python -m nblib, then its own VmHWM
        "try:\n    runpy.run_module('nblib', run_name='__main__')\nfinally:\n"
        "    print('VmHWM', open('/proc/self/status').read().split('VmHWM:')[1].split()[0], file=sys.stderr)")


class _Calls:
    """Pickles as a call of `func(*args)`: what a hostile pickle does."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _payloads(marker):
    from numpy.f2py.crackfortran import myeval
    from numpy.testing._private.utils import runstring

    touch = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    return {"numpy.f2py.crackfortran.myeval": _Calls(myeval, touch),
            "numpy.testing._private.utils.runstring": _Calls(runstring, touch, {})}


@pytest.mark.parametrize("name", ["numpy.f2py.crackfortran.myeval", "numpy.testing._private.utils.runstring"])
def test_no_global_outside_the_allow_list_runs_during_cache_records(tmp_path, name):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pkl"
    with open(path, "wb") as f:
        pickle.dump({"x": np.zeros(3), "layer_id": 1}, f)
        pickle.dump({"x": np.zeros(3), "layer_id": _payloads(marker)[name]}, f)
    result = run_nblib("cache", "--records", path, "--out", tmp_path / "out")
    assert not marker.exists(), f"{name} ran"
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert name in result.stderr and "--trust-pickle" in result.stderr


def _trace_module(folder, name: str):
    """A module defining Trace (a dataclass), NT (a namedtuple) and Slotted; importing it touches `imported`."""
    (folder / f"{name}.py").write_text(
        "import collections, dataclasses, pathlib\n"
        "pathlib.Path(__file__).with_name('imported').touch()\n"
        "@dataclasses.dataclass\nclass Trace:\n"
        "    hidden_states: object\n    target_routing: object\n    layer_id: int\n"
        "NT = collections.namedtuple('NT', 'hidden_states layer_id')\n"
        "class Slotted:\n    __slots__ = ('hidden_states', 'layer_id')\n"
        "    def __init__(self, h, i):\n        self.hidden_states, self.layer_id = h, i\n")
    sys.path.insert(0, str(folder))
    return importlib.import_module(name)


def _forget(folder, name: str) -> None:
    """The module is no longer imported nor importable (as in the process reading a collector's file)."""
    sys.path.remove(str(folder))
    sys.modules.pop(name)


def _torch_traces(module, n: int):
    import torch

    records = list(trace_records(n, **SMALL))
    return records, [module.Trace(torch.from_numpy(r["hidden_states"]), torch.from_numpy(r["target_routing"]),
                                  r["layer_id"]) for r in records]


def test_objects_of_a_class_never_imported_are_read_from_their_pickled_state(tmp_path):
    pytest.importorskip("torch")
    module = _trace_module(tmp_path, "collector_types_a")
    records, traces = _torch_traces(module, 1001)   # 1,001: a batch of 1,000 elements, then one alone
    objects = [module.NT(np.arange(3), 7), module.Slotted(np.ones(2, np.float16), 5)]
    for protocol in (2, 4, 5):
        (tmp_path / f"t{protocol}.pkl").write_bytes(pickle.dumps(traces, protocol=protocol))
        (tmp_path / f"o{protocol}.pkl").write_bytes(pickle.dumps(tuple(objects), protocol=protocol))
    _forget(tmp_path, "collector_types_a")
    (tmp_path / "imported").unlink()
    sys.path.insert(0, str(tmp_path))   # importable, and still not imported
    try:
        for protocol in (2, 4, 5):
            got = list(pickle_records(tmp_path / f"t{protocol}.pkl"))
            assert len(got) == 1001
            for want, have in zip(records, got):
                assert have["layer_id"] == want["layer_id"]
                for name in ("hidden_states", "target_routing"):
                    assert have[name].dtype == want[name].dtype and have[name].shape == want[name].shape
                    assert have[name].tobytes() == want[name].tobytes()
            named, slotted = pickle_records(tmp_path / f"o{protocol}.pkl")
            assert named["1"] == 7 and named["0"].tolist() == [0, 1, 2]   # a namedtuple's pickle has no names
            assert slotted["layer_id"] == 5 and slotted["hidden_states"].dtype == np.float16
    finally:
        sys.path.remove(str(tmp_path))
    assert not (tmp_path / "imported").exists(), "the records' module was imported"


def test_a_pickled_list_of_traces_whose_class_is_missing_shards_bit_exact_in_ram_of_about_one_record(tmp_path):
    """The guide's file in small: 20 MB, one pickled list, the command with no other flag, a cold process."""
    pytest.importorskip("torch")
    module = _trace_module(tmp_path, "collector_types_b")
    records, traces = _torch_traces(module, 50)
    per_record = len(pickle.dumps(traces, protocol=4)) / 50
    records, traces = _torch_traces(module, int(20e6 // per_record))
    (tmp_path / "traces.pkl").write_bytes(pickle.dumps(traces, protocol=4))
    (tmp_path / "tiny.pkl").write_bytes(pickle.dumps(traces[:4], protocol=4))
    del traces
    _forget(tmp_path, "collector_types_b")
    size = (tmp_path / "traces.pkl").stat().st_size
    peaks = {}
    for name in ("tiny", "traces"):
        done = subprocess.run([sys.executable, "-c", PEAK, "cache", "--records", tmp_path / f"{name}.pkl", "--out",
                               tmp_path / name, "--shard-size-mb", "256", "--group-by", "layer_id"],
                              env=subprocess_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        peaks[name] = int(done.stderr.split("VmHWM")[-1].split()[0]) * 1024
    # the fast reader's plan (docs/formats.md): at most 32 bytes a memo slot (its last read, the scan's string
    # refs, the C unpickler's memo table, each up to twice its size as it grows) and 24 an element
    ops = collections.Counter(op.name for op, _, _ in pickletools.genops((tmp_path / "traces.pkl").read_bytes()))
    plan = 32 * sum(ops[name] for name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT")) + 24 * len(records)
    assert size > 19e6 and peaks["traces"] - peaks["tiny"] < 0.25 * size + plan, (peaks, size, plan)
    shards = RecordShards(tmp_path / "traces")
    got = sorted(shards.iter_records(), key=lambda r: (r["layer_id"], r["hidden_states"].tobytes()))
    want = sorted(records, key=lambda r: (r["layer_id"], r["hidden_states"].tobytes()))
    assert len(got) == len(want)
    for a, b in zip(want, got):
        assert a["layer_id"] == b["layer_id"] and sorted(b) == ["hidden_states", "layer_id", "target_routing"]
        assert all(a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in ("hidden_states",
                                                                                           "target_routing"))


def test_bf16_and_zero_length_tensors_round_trip_bit_exact_through_every_records_path(tmp_path):
    torch = pytest.importorskip("torch")
    from nblib.cache.record_torch import RecordDataset

    generator = torch.Generator().manual_seed(0)
    records = [{"x": torch.randn(i % 4, 3, generator=generator).to(torch.bfloat16),
                "empty": torch.zeros(0, 5, dtype=torch.float16), "layer_id": i % 2} for i in range(12)]
    Record = collections.namedtuple("Record", "x empty layer_id")   # an iterable of namedtuples
    with open(tmp_path / "stream.pkl", "wb") as f:
        for record in records:
            pickle.dump(record, f)
    (tmp_path / "list.pkl").write_bytes(pickle.dumps(records))
    torch.save(records, tmp_path / "r.pt")
    sources = {"iterable": [Record(**r) for r in records], "stream": record_source(tmp_path / "stream.pkl"),
               "list": record_source(tmp_path / "list.pkl"), "pt": record_source(tmp_path / "r.pt")}
    bits = sorted(r["x"].view(torch.int16).numpy().tobytes() for r in records)
    for name, source in sources.items():
        write_records(source, tmp_path / name, shard_mb=0.001, group_by="layer_id")
        dataset = RecordDataset(tmp_path / name)
        items = [dataset[i] for i in range(len(dataset))]
        assert all(item["x"].dtype == torch.bfloat16 and item["empty"].shape == (0, 5) for item in items), name
        assert sorted(item["x"].view(torch.int16).numpy().tobytes() for item in items) == bits, name
        numpy_side = RecordShards(tmp_path / name)[0]["x"]
        assert numpy_side.dtype.name == "bfloat16", name


def test_every_shard_is_at_most_shard_size_mb_on_disk_header_and_tables_included(tmp_path):
    records = [{"x": np.full(1000, i, np.uint8)} for i in range(6)]
    write_records(records[:2], tmp_path / "two", shard_mb=1, codec="raw")
    two = (tmp_path / "two" / "shard-00000.rec").stat().st_size
    write_records(records, tmp_path / "tight", shard_mb=(two - 1) / 1e6, codec="raw")
    files = sorted((tmp_path / "tight").glob("shard-*.rec"))
    assert files and all(f.stat().st_size <= two - 1 for f in files), [f.stat().st_size for f in files]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_fifo_passed_to_records_is_called_a_named_pipe(tmp_path):
    fifo = tmp_path / "records.fifo"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="is a named pipe") as refused:
        record_source(fifo)
    assert "folder" not in str(refused.value)


@dataclasses.dataclass
class _Local:
    x: np.ndarray
    layer_id: int


def test_trust_pickle_reads_the_same_objects_through_their_class_or_as_state_where_it_is_missing(tmp_path):
    path = tmp_path / "local.pkl"
    path.write_bytes(pickle.dumps([_Local(np.arange(4, dtype=np.int64), 3)] * 2))
    module = _trace_module(tmp_path, "collector_types_c")
    (tmp_path / "missing.pkl").write_bytes(pickle.dumps([module.Trace(np.ones(2), np.zeros(1), 5)]))
    _forget(tmp_path, "collector_types_c")
    for trust in (False, True):
        got = list(record_source(path, trust=trust))
        assert [r["layer_id"] for r in got] == [3, 3] and got[1]["x"].tolist() == [0, 1, 2, 3]
        assert [r["layer_id"] for r in record_source(tmp_path / "missing.pkl", trust=trust)] == [5]
