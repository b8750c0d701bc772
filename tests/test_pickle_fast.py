"""The fast pickled-list reader (nblib/cache/pickle_fast.py, pickle_scan.c) against the pure one and the Python scan.

The C scan's plan is compared with the Python scanner's (nblib/cache/pickle_scan.py) over generated pickles:
each element's end and each memo slot's last read, as byte offsets, at every protocol, across the
1,000-item APPENDS batch, with frames and shared references; what the Python scan would not serve
element by element (another top object, an element reading its own list) the C scan does not plan.
Damaged files are scanned in a child process, which must not crash. The fast reader's records and
shape line are the pure reader's, and where it stops (an error, a global it does not take) the pure
reader reads the file again and says what is wrong in the same line.
"""
from __future__ import annotations

import collections
import os
import pickle
import pickletools
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pickle_differential import Point, records, same

import nblib.cache.pickle_fast as pickle_fast
from conftest import subprocess_env
from nblib.cache.pickle_globals import PickledObject
from nblib.cache.pickle_scan import PickleScanner
from nblib.cache.pickle_stream import pickle_records
from nblib.errors import InputError

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))


def _fields(value):
    """Records with each object read as state (a PickledObject) as (its class name, its fields), to compare."""
    if isinstance(value, PickledObject):
        return (type(value).__qualname__, _fields(value.fields()))
    if isinstance(value, dict):
        return {k: _fields(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fields(v) for v in value)
    return value


def _same_records(a: list, b: list) -> bool:
    return len(a) == len(b) and all(same(_fields(x), _fields(y)) for x, y in zip(a, b))


def _read(path, reader: str, monkeypatch, chunk: int | None = None):
    monkeypatch.setenv(pickle_fast.READER_ENV, reader)
    if chunk is not None:
        monkeypatch.setattr(pickle_fast, "CHUNK", chunk)
    report = {}
    try:
        got = list(pickle_records(path, report=report))
    except InputError as refused:
        return None, str(refused), report
    return got, None, report


def _lists():
    """Lists people pickle: records of arrays, scalars, shared arrays, objects; across the 1,000-item batch."""
    shared = np.arange(3, dtype=np.int16)

    def make(n):
        return [{"x": np.full(4, i, np.float32), "s": shared, "t": (np.float64(i), f"r{i}"), "p": Point(i, i)}
                if i % 3 else {"i": i, "v": np.array([i], ">i8")} for i in range(n)]
    return st.one_of(st.lists(records(), max_size=6), st.sampled_from([0, 1, 999, 1000, 1001, 2100]).map(make))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("n", [0, 1, 1000, 1001, 2500])
def test_the_fast_reader_reads_a_pickled_list_as_the_pure_reader_does(tmp_path, monkeypatch, protocol, n):
    shared = np.ones(2, np.float16)
    top = [{"x": np.arange(3, dtype="<f4") * i, "y": i, "id": f"r{i}", "shared": shared, "f": np.float32(i / 3),
            "pair": (np.int64(i), "a")} if i % 2 else Point(np.zeros((2, 2), ">f8"), i) for i in range(n)]
    path = tmp_path / "l.pkl"
    path.write_bytes(pickle.dumps(top, protocol=protocol))
    fast, fast_refusal, fast_report = _read(path, "fast", monkeypatch, chunk=700)
    pure, pure_refusal, pure_report = _read(path, "pure", monkeypatch)
    objects_0_1 = protocol < 2 and n > 0               # copyreg._reconstructor: left to the pure reader
    assert fast_report["reader"] == ("pure" if objects_0_1 else "fast") and pure_report["reader"] == "pure"
    assert fast_refusal is None is pure_refusal and fast_report["shape"] == pure_report["shape"]
    assert len(fast) == n and _same_records(fast, pure)


@SETTINGS
@given(top=_lists(), protocol=st.integers(0, pickle.HIGHEST_PROTOCOL), chunk=st.sampled_from([1, 300, 10**6]))
def test_the_fast_reader_gives_the_pure_readers_records_or_its_refusal(tmp_path_factory, top, protocol, chunk):
    path = tmp_path_factory.mktemp("l") / "l.pkl"
    path.write_bytes(pickle.dumps(top, protocol=protocol))
    with pytest.MonkeyPatch.context() as mp:
        fast, fast_refusal, fast_report = _read(path, "fast", mp, chunk=chunk)
        pure, pure_refusal, pure_report = _read(path, "pure", mp)
    assert fast_refusal == pure_refusal
    if pure is not None:
        assert fast_report["shape"] == pure_report["shape"]
        assert _same_records(fast, pure)


def _python_plan(data: bytes):
    """The Python scan's element ends and memo last reads, as byte offsets (None: it would not serve the elements)."""
    import io

    plan = PickleScanner(io.BytesIO(data), len(data)).scan(0)
    offsets = [pos for _, _, pos in pickletools.genops(data)]
    top = plan.top
    if top.kind != "list" or top.self_read or plan.end != len(data):
        return None
    ends = [offsets[e] for e in top.ends] if top.ends is not None else []
    return ends, [offsets[g] if g >= 0 else -1 for g in plan.last_get]


def _stream_pickles():
    one = st.lists(records(), max_size=3)
    return st.lists(one, min_size=2, max_size=3)


@SETTINGS
@given(top=st.one_of(_lists(), records(), st.tuples(_lists(), _lists()), st.lists(st.integers(), max_size=3)),
       protocol=st.integers(0, pickle.HIGHEST_PROTOCOL), loop=st.booleans())
def test_the_c_scan_plans_the_elements_and_memo_reads_the_python_scan_finds(top, protocol, loop):
    if loop and isinstance(top, list) and top and isinstance(top[0], dict):
        top[0]["all"] = top                            # an element that reads its own list: not planned
    data = pickle.dumps(top, protocol=protocol)
    want = _python_plan(data)
    plan, why = pickle_fast.scan_list(data)
    if want is None:
        assert plan is None, "planned what the Python scan builds whole"
        return
    assert plan is not None, why
    assert plan.ends.tolist() == want[0] and plan.last_read.tolist() == want[1]
    assert plan.end == len(data) and (plan.starts[1:] <= plan.ends[1:]).all()


@SETTINGS
@given(dumps=_stream_pickles(), protocol=st.integers(0, pickle.HIGHEST_PROTOCOL), one_pickler=st.booleans())
def test_a_stream_is_left_to_the_pure_reader_and_its_first_pickle_planned_to_its_stop(dumps, protocol, one_pickler):
    import io

    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=protocol)
    for obj in dumps:
        pickler.dump(obj) if one_pickler else pickle.dump(obj, buffer, protocol=protocol)
    data = buffer.getvalue()
    first = len(pickle.dumps(dumps[0], protocol=protocol)) if not one_pickler else None
    plan, why = pickle_fast.scan_list(data)
    assert plan is not None, why
    assert plan.end < len(data) and (first is None or plan.end == first)


FUZZ = """
import numpy as np, pickle, sys
import nblib.cache.pickle_fast as pf
from tests.pickle_damage import damaged
rng = np.random.default_rng(int(sys.argv[1]))
bases = [pickle.dumps([{"x": np.arange(5, dtype=np.float32) * i, "s": "ab" * i, "t": (i, None)} for i in range(n)],
                      protocol=p) for p in range(6) for n in (0, 3, 1001)]
planned = 0
for k in range(int(sys.argv[2])):
    data = damaged(bases[rng.integers(len(bases))], rng, rng.integers(1, 6))
    if k % 10 == 0:
        data = bytearray(rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes())
    plan, why = pf.scan_list(bytes(data))
    if plan is not None:
        planned += 1
        assert plan.end <= len(data) and (plan.ends <= len(data)).all() and (plan.starts >= 0).all()
print("ok", planned)
"""


def test_the_c_scan_never_crashes_on_damaged_or_random_bytes():
    done = subprocess.run([sys.executable, "-c", FUZZ, "48", "20000"], env=subprocess_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])       # no segfault, no traceback
    assert done.stdout.startswith("ok "), done.stdout


def test_where_the_fast_reader_stops_the_pure_reader_gives_the_same_records_and_line(tmp_path, monkeypatch):
    counter_build = pickle.dumps([{"i": i} for i in range(6)], protocol=4)
    assert counter_build[2:3] == pickle.FRAME
    counter_build = counter_build[:2] + counter_build[11:]        # its one frame left out: the splice keeps no length
    # element 4 is replaced by BUILD on the class collections.Counter (the red team's file): refused, in one line
    element = b"\x8c\x0bcollections\x8c\x07Counter\x93N}\x8c\x06update\x8c\x04junks\x86b"
    ops = list(pickletools.genops(counter_build))
    starts = [pos for op, _, pos in ops if op.name == "EMPTY_DICT"]
    data = counter_build[:starts[4]] + element + counter_build[starts[5]:]
    path = tmp_path / "c.pkl"
    path.write_bytes(data)
    fast, fast_refusal, _ = _read(path, "fast", monkeypatch, chunk=1)
    pure, pure_refusal, _ = _read(path, "pure", monkeypatch)
    assert fast_refusal == pure_refusal and "Counter" in pure_refusal and "\n" not in pure_refusal
    assert collections.Counter("aab") == {"a": 2, "b": 1}
    served = []
    monkeypatch.setenv(pickle_fast.READER_ENV, "fast")
    with pytest.raises(InputError):
        for record in pickle_records(path):
            served.append(record)
    assert served == [{"i": i} for i in range(4)]


def test_protocol_0_and_1_objects_go_to_the_pure_reader(tmp_path, monkeypatch):
    path = tmp_path / "o.pkl"
    path.write_bytes(pickle.dumps([Point(1, 2), Point(3, 4)], protocol=1))    # copyreg._reconstructor
    got, refusal, report = _read(path, "fast", monkeypatch)
    assert refusal is None and report["reader"] == "pure" and [r["y"] for r in got] == [2, 4]


def test_the_scanner_is_compiled_into_the_per_user_folder_only():
    lib = pickle_fast.scanner()
    maps = Path("/proc/self/maps").read_text()
    path = next(p for p in maps.split() if "nblib-pickle-scan" in p)
    assert lib is not None and os.path.dirname(path).endswith(os.path.join("nblib", "lib"))
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700


def test_without_a_c_compiler_the_pure_reader_reads_the_file_and_forcing_the_fast_one_says_why(tmp_path):
    path = tmp_path / "l.pkl"
    path.write_bytes(pickle.dumps([{"i": i} for i in range(3)], protocol=4))
    code = ("import sys\nfrom pathlib import Path\nfrom nblib.cache.pickle_stream import pickle_records\n"
            "from nblib.errors import NblibError\nreport = {}\n"
            "try:\n    print(len(list(pickle_records(Path(sys.argv[1]), report=report))), report.get('reader'))\n"
            "except NblibError as e:\n    print('REFUSED', e)\n")
    said = {}
    for reader in ("auto", "fast"):
        done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                              env=subprocess_env(CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path / "c"),
                                                 **{pickle_fast.READER_ENV: reader}))
        assert done.returncode == 0, done.stderr[-2000:]
        said[reader] = done.stdout.strip()
    assert said["auto"] == "3 pure"
    assert said["fast"].startswith("REFUSED ") and "did not compile" in said["fast"], said
